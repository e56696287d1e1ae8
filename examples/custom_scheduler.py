"""A custom island policy, plugged in by name: gang FIFO with a bounded queue.

``BoundedFifo`` keeps the island-wide gang order (so collectives cannot
deadlock) but lets at most ``limit`` gangs be queued on any device at once;
later gangs wait inside the policy and are released, in order, as
``Completed`` events come in. That bounds how much work (and how many input
buffers) sits in device mailboxes, at the price of one scheduler round trip
when the queue runs dry.

It is an :class:`~atoll.schedulers.IslandPolicy`, a pure state machine:
``handle(event) -> instructions``, no I/O. This module registers it in code
when imported (or run); select it per island by name::

    import atoll.examples.custom_scheduler  # registers "bounded-fifo"
    async with atoll.local_cluster(2, scheduler={0: "fifo", 1: "bounded-fifo"}) as c: ...

atoll itself does not publish it. A package that ships a policy for others to
use would declare it as a plugin in its own pyproject.toml::

    [project.entry-points."atoll.schedulers"]
    bounded-fifo = "mypackage.sched:BoundedFifo"

Run this file to see it order gangs on an in-process cluster.
"""

from __future__ import annotations

from collections import Counter, deque

import anyio
import numpy as np

from atoll.schedulers import (
    Completed,
    Dispatch,
    Event,
    Instruction,
    PolicyError,
    Submit,
    register_scheduler,
)

__all__ = ["BoundedFifo", "main"]


class BoundedFifo:
    """Gang FIFO with at most ``limit`` gangs queued per device."""

    def __init__(self, limit: int = 2) -> None:
        self.limit = limit
        self.peak = 0
        self._seq = 0
        self._waiting: deque[Submit] = deque()
        self._left: dict[str, set[int]] = {}
        self._clients: dict[str, str] = {}  # gang sent -> its session (for clients())
        self._queued: Counter[int] = Counter()

    def handle(self, event: Event) -> list[Instruction]:
        if isinstance(event, Submit):
            if not event.devices or event.gang_id in self._left:
                raise PolicyError(f"bad gang {event.gang_id!r}")
            self._waiting.append(event)
        elif isinstance(event, Completed):
            left = self._left.get(event.gang_id, set())
            if event.device not in left:
                raise PolicyError(f"{event.gang_id!r} was not running on device {event.device}")
            left.discard(event.device)
            self._queued[event.device] -= 1
            if not left:
                del self._left[event.gang_id]
                self._clients.pop(event.gang_id, None)
        return self._release(event)

    def _release(self, cause: Event) -> list[Instruction]:
        out: list[Instruction] = []
        while self._waiting:  # strictly in order: the head blocks the rest
            head = self._waiting[0]
            devices = sorted(set(head.devices))
            if any(self._queued[d] >= self.limit for d in devices):
                break
            self._waiting.popleft()
            self._left[head.gang_id] = set(devices)
            self._clients[head.gang_id] = head.client
            for device in devices:
                self._queued[device] += 1
                self.peak = max(self.peak, self._queued[device])
                out.append(Dispatch(cause.event_id, head.gang_id, device, self._seq))
            self._seq += 1
        return out

    def validate(self) -> None:
        pending = Counter(d for left in self._left.values() for d in left)
        assert +pending == +self._queued, (pending, self._queued)
        assert all(n <= self.limit for n in self._queued.values())

    def clients(self) -> dict[str, dict[str, float]]:
        """Per session: its gangs waiting in this policy and sent."""
        out: dict[str, dict[str, float]] = {}
        for submit in self._waiting:
            row = out.setdefault(submit.client, {"queued": 0.0, "running": 0.0})
            row["queued"] += 1
        for gang_id in self._left:
            client = self._clients.get(gang_id, "")
            row = out.setdefault(client, {"queued": 0.0, "running": 0.0})
            row["running"] += 1
        return out


register_scheduler("bounded-fifo", BoundedFifo)


async def main() -> None:
    """Run a chain on an island scheduled by ``bounded-fifo``; check it with numpy."""
    import atoll
    from atoll.devices import Computation

    step = Computation("affine", lambda x: 2 * x + 1, flops=1e9)
    async with atoll.local_cluster(1, 2, 2, scheduler="bounded-fifo") as cluster:
        handle = cluster.put(np.arange(4.0), 0)
        for device in [0, 2, 1, 3] * 4:
            handle = cluster.run(step, device, [handle])
        result = await cluster.fetch(handle)
    expected = np.arange(4.0)
    for _ in range(16):
        expected = 2 * expected + 1
    print("bounded-fifo result:", result, "matches numpy:", bool(np.allclose(result, expected)))


if __name__ == "__main__":
    anyio.run(main)
