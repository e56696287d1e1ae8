"""The default island scheduler: gang FIFO.

Every gang gets one position (``seq``) in a single island-wide order, in the
order gangs were submitted, and every device is sent its shards in that order.
Because each device runs its work in arrival order, no two devices can ever
disagree on the order of two gangs they share, which is what keeps collectives
from deadlocking.
"""

from __future__ import annotations

from collections import Counter

from ._protocol import Completed, Dispatch, Event, Instruction, Submit, register_scheduler

__all__ = ["FifoScheduler"]


class FifoScheduler:
    """Gang FIFO; see the module docstring."""

    def __init__(self) -> None:
        self._next_seq = 0
        self._gangs: dict[str, tuple[int, set[int]]] = {}  # gang -> (seq, devices left)
        self._in_flight: Counter[int] = Counter()

    def handle(self, event: Event) -> list[Instruction]:
        if isinstance(event, Submit):
            return self._submit(event)
        self._complete(event)
        return []

    def _submit(self, event: Submit) -> list[Instruction]:
        if not event.devices:
            raise ValueError(f"gang {event.gang_id!r} has no devices")
        if event.gang_id in self._gangs:
            raise ValueError(f"gang {event.gang_id!r} was already submitted")
        seq = self._next_seq
        self._next_seq += 1
        self._gangs[event.gang_id] = (seq, set(event.devices))
        out: list[Instruction] = []
        for device in sorted(set(event.devices)):
            self._in_flight[device] += 1
            out.append(Dispatch(event.event_id, event.gang_id, device, seq))
        return out

    def _complete(self, event: Completed) -> None:
        _, left = self._gangs.get(event.gang_id, (-1, set()))
        if event.device not in left:
            raise ValueError(f"{event.gang_id!r} was not running on device {event.device}")
        left.discard(event.device)
        self._in_flight[event.device] -= 1
        if not left:
            del self._gangs[event.gang_id]

    def in_flight(self, device: int) -> int:
        """Shards sent to ``device`` and not yet reported complete."""
        return self._in_flight[device]

    def validate(self) -> None:
        assert all(count >= 0 for count in self._in_flight.values())
        pending = Counter(d for _, devices in self._gangs.values() for d in devices)
        assert +pending == +self._in_flight, (pending, self._in_flight)


register_scheduler("fifo", FifoScheduler)
