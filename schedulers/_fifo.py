"""Gang FIFO, an island policy (registered as ``"fifo"``; the default,
``"share"``, orders gangs the same way while one client alone uses the island).

Every gang gets one position (``seq``) in a single island-wide order, in the
order gangs were submitted, and every device is sent its shards in that order.
Because each device runs its work in arrival order, no two devices can ever
disagree on the order of two gangs they share, which is what keeps collectives
from deadlocking.
"""

from __future__ import annotations

from ._protocol import (
    Completed,
    Dispatch,
    Event,
    Instruction,
    PolicyError,
    Submit,
    register_scheduler,
)

__all__ = ["FifoPolicy"]


class FifoPolicy:
    """Gang FIFO, an :class:`~atoll.schedulers.IslandPolicy`; see the module docstring."""

    dispatches_on_submit = True  # every Submit is answered with all its shards

    def __init__(self) -> None:
        self._next_seq = 0
        self._left: dict[str, set[int]] = {}  # gang -> its devices not yet done

    def handle(self, event: Event) -> list[Instruction]:
        if isinstance(event, Submit):
            return self._submit(event)
        self._complete(event)
        return []

    def _submit(self, event: Submit) -> list[Instruction]:
        if not event.devices:
            raise PolicyError(f"gang {event.gang_id!r} has no devices")
        if event.gang_id in self._left:
            raise PolicyError(f"gang {event.gang_id!r} was already submitted")
        seq = self._next_seq
        self._next_seq += 1
        devices = set(event.devices)
        self._left[event.gang_id] = devices
        return [Dispatch(event.event_id, event.gang_id, d, seq) for d in sorted(devices)]

    def _complete(self, event: Completed) -> None:
        left = self._left.get(event.gang_id, set())
        if event.device not in left:
            raise PolicyError(f"{event.gang_id!r} was not running on device {event.device}")
        left.discard(event.device)
        if not left:
            del self._left[event.gang_id]

    def in_flight(self, device: int) -> int:
        """Shards sent to ``device`` and not yet reported complete (for tests)."""
        return sum(device in left for left in self._left.values())

    def validate(self) -> None:
        assert all(self._left.values()), "a finished gang is still tracked"

    def clients(self) -> dict[str, dict[str, float]]:
        """None tracked: gang FIFO keeps no sessions."""
        return {}


register_scheduler("fifo", FifoPolicy)
