"""Island policies (state machines), driven directly: no actors, no network."""

from __future__ import annotations

import pytest

from atoll.schedulers import (
    Completed,
    Dispatch,
    Event,
    FifoPolicy,
    Instruction,
    PolicyError,
    Submit,
    get_scheduler,
    register_scheduler,
    scheduler_names,
)


def test_fifo_gives_every_device_one_island_wide_order() -> None:
    fifo = FifoPolicy()
    out = fifo.handle(Submit(1, "a", (2, 0)))
    out += fifo.handle(Submit(2, "b", (0, 1)))
    assert out == [
        Dispatch(1, "a", 0, 0),
        Dispatch(1, "a", 2, 0),
        Dispatch(2, "b", 0, 1),
        Dispatch(2, "b", 1, 1),
    ]
    assert fifo.in_flight(0) == 2
    assert fifo.handle(Completed(3, "a", 0)) == []
    assert fifo.handle(Completed(4, "a", 2)) == []
    assert fifo.in_flight(0) == 1 and fifo.in_flight(2) == 0


def test_fifo_rejects_nonsense() -> None:
    fifo = FifoPolicy()
    with pytest.raises(PolicyError, match="no devices"):
        fifo.handle(Submit(1, "a", ()))
    fifo.handle(Submit(2, "a", (0,)))
    with pytest.raises(PolicyError, match="already submitted"):
        fifo.handle(Submit(3, "a", (1,)))
    with pytest.raises(ValueError, match="not running"):  # PolicyError is still a ValueError
        fifo.handle(Completed(4, "a", 5))


def test_custom_scheduler_plugs_in_by_name() -> None:
    class Reverse:
        def handle(self, event: Event) -> list[Instruction]:
            if isinstance(event, Submit):
                return [Dispatch(event.event_id, event.gang_id, d, 0) for d in event.devices]
            return []

        def validate(self) -> None:
            pass

        def clients(self) -> dict[str, dict[str, float]]:
            return {}

    register_scheduler("test-reverse", Reverse)
    assert "test-reverse" in scheduler_names() and "fifo" in scheduler_names()
    assert isinstance(get_scheduler("test-reverse"), Reverse)
    with pytest.raises(KeyError, match="no scheduler named"):
        get_scheduler("does-not-exist")
