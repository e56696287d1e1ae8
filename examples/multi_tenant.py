"""Four clients share one island by weight: 1, 2, 4 and 8.

Each client keeps a stream of small programs (0.33 ms of device time each)
going on the same device, as fast as it can. The island's default policy,
``"share"`` (stride scheduling over gangs, ``atoll/schedulers/_share.py``),
gives each the device time its weight is due: 1/15, 2/15, 4/15 and 8/15.

Here the cluster runs in one process on a virtual clock, so the run is exact
and takes no real time: each client is another :class:`~atoll.Cluster`
handle with an owner label of its own, and its weight is given to the
controller directly. Clients in other processes get the same from
``atoll.connect(..., weight=4)``; ``atoll bench multitenant`` measures that.

Run it with ``atoll run multi_tenant``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import anyio
import numpy as np

import atoll
from atoll.devices import BufferHandle, Computation
from atoll.kernel import Promise, VirtualClock

__all__ = ["WEIGHTS", "Shares", "main", "run"]

WEIGHTS = (1, 2, 4, 8)
PROGRAM_S = 0.33e-3
IN_FLIGHT = 8  # programs each client keeps going


@dataclass(frozen=True)
class Shares:
    """What each client got: device seconds by weight, and the run's length."""

    device_s: dict[int, float]
    wall_s: float

    def share(self, weight: int) -> float:
        return self.device_s[weight] / sum(self.device_s.values())

    def due(self, weight: int) -> float:
        return weight / sum(self.device_s.keys())  # the keys are the weights

    @property
    def utilization(self) -> float:
        return sum(self.device_s.values()) / self.wall_s


async def run(seconds: float = 1.0, warmup: float = 0.05) -> Shares:
    """Run the four clients; their device time over ``seconds`` of (virtual)
    time, measured after ``warmup`` (the first programs go before the island
    knows it is shared)."""
    clock = VirtualClock()
    program = Computation("small", lambda: np.zeros(1, np.float32), PROGRAM_S * 1e12)
    async with atoll.local_cluster(1, 1, 1, clock=clock) as cluster:
        clients = {w: cluster.client(f"weight{w}") for w in WEIGHTS}
        for weight, client in clients.items():
            await cluster.controller.set_tenant(client.owner, weight)
        until = clock.now() + warmup + seconds
        async with anyio.create_task_group() as group:
            for client in clients.values():
                group.start_soon(_stream, client, program, until)
            await clock.sleep(warmup)
            before = await cluster.controller.tenant_usage()
            await clock.sleep(seconds)
            after = await cluster.controller.tenant_usage()
    used = {w: after[c.owner]["device_s"] - before[c.owner]["device_s"] for w, c in clients.items()}
    return Shares(used, seconds)


async def _stream(client: atoll.Cluster, program: Computation, until: float) -> None:
    """Keep ``IN_FLIGHT`` programs going on device 0 until ``until``."""
    pending: deque[Promise[BufferHandle]] = deque()
    while client.clock.now() < until:
        while len(pending) < IN_FLIGHT:
            pending.append(client.run(program, 0, []))
        await pending.popleft()
    for promise in pending:
        await promise


async def main() -> None:
    """Print each client's share of the device time beside its due share."""
    shares = await run()
    print("weight   device time   share   due")
    for weight in WEIGHTS:
        ms = shares.device_s[weight] * 1e3
        print(f"{weight:>6} {ms:>10.1f} ms {shares.share(weight):>7.1%} {shares.due(weight):>5.1%}")
    print(f"device utilization: {shares.utilization:.1%}")


if __name__ == "__main__":
    anyio.run(main)
