"""An island policy published as a plugin: the heaviest session's gang first.

Gangs wait in the policy; whenever every device of a waiting gang has fewer
than ``depth`` gangs queued, the policy may send it. Among the gangs that
may go, the one whose session has the largest ``weight`` goes first (ties:
the one that came first). Every device of a gang is dispatched in the same
answer, and gangs are numbered (``seq``) in the order they go, so all
devices run them in one island-wide order: collectives cannot deadlock.

It follows the contract of ``docs/schedulers.md``: a pure state machine,
``handle(event) -> list[Dispatch]``, no I/O, each ``Dispatch`` naming the
event being handled as its cause.
"""

from __future__ import annotations

from collections import Counter

from atoll.schedulers import Completed, Dispatch, Event, PolicyError, Submit

__all__ = ["PriorityPolicy", "deep"]


class PriorityPolicy:
    """Weight first, then arrival; at most ``depth`` gangs queued per device."""

    def __init__(self, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.depth = depth
        self._seq = 0
        self._arrivals = 0
        self._waiting: dict[str, tuple[float, int, Submit]] = {}  # gang -> (-weight, arrival)
        self._left: dict[str, set[int]] = {}  # gang sent -> its devices not done yet
        self._queued: Counter[int] = Counter()  # device -> gangs sent and not done there

    def handle(self, event: Event) -> list[Dispatch]:
        if isinstance(event, Submit):
            if not event.devices or event.gang_id in self._waiting or event.gang_id in self._left:
                raise PolicyError(f"gang {event.gang_id!r}: no devices, or submitted twice")
            self._waiting[event.gang_id] = (-event.weight, self._arrivals, event)
            self._arrivals += 1
        elif isinstance(event, Completed):
            left = self._left.get(event.gang_id)
            if left is None or event.device not in left:
                raise PolicyError(f"{event.gang_id!r} was not running on device {event.device}")
            left.discard(event.device)
            self._queued[event.device] -= 1
            if not left:
                del self._left[event.gang_id]
        return self._fill(event.event_id)

    def _fill(self, cause: int) -> list[Dispatch]:
        """Send every waiting gang that may go now, best first."""
        out: list[Dispatch] = []
        for key in sorted(self._waiting.values(), key=lambda entry: entry[:2]):
            submit = key[2]
            devices = sorted(set(submit.devices))
            if all(self._queued[d] < self.depth for d in devices):
                del self._waiting[submit.gang_id]
                self._left[submit.gang_id] = set(devices)
                self._queued.update(devices)
                out += [Dispatch(cause, submit.gang_id, d, self._seq) for d in devices]
                self._seq += 1
        return out

    def clients(self) -> dict[str, dict[str, float]]:
        """Per session: its gangs waiting here; its weight as last submitted."""
        out: dict[str, dict[str, float]] = {}
        for neg_weight, _, submit in self._waiting.values():
            row = out.setdefault(submit.client, {"weight": -neg_weight, "queued": 0.0})
            row["queued"] += 1
        return out

    def validate(self) -> None:
        """The bound holds, and every device's count matches the gangs sent."""
        counted: Counter[int] = Counter()
        for left in self._left.values():
            counted.update(left)
        assert all(self._queued[d] == counted[d] for d in set(counted) | set(self._queued))
        assert all(n <= self.depth for n in self._queued.values())


def deep() -> PriorityPolicy:
    """The entry point ``priority-deep``: a factory, since an entry point is
    called with no arguments (8 gangs deep per device)."""
    return PriorityPolicy(depth=8)
