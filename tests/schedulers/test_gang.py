"""Gang scheduling: per-device FIFO can deadlock collectives; island-wide order cannot.

Two clients each run a program of gangs over overlapping devices. Every gang
is *collective*: its shards meet at a barrier before running, so a device
that entered a gang is stuck until all of that gang's devices entered it too.

Messages travel over :class:`Link` actors with random latency. A link is FIFO
(like a TCP stream), but two links to one device deliver in whatever order
their latencies give. With a naive per-device FIFO (each client sends its
shards straight to the devices) two devices can see two gangs in opposite
orders, and both wait forever. With gang scheduling every shard goes through
the island scheduler, whose single order reaches each device over its own
FIFO link: no interleaving of submissions, latencies or compute times can
deadlock it. Time is virtual, so each trial is exact and costs no real time.
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import numpy as np
import pytest

import atoll
from atoll.devices import BufferHandle, Computation, Device
from atoll.devices._gang import GangTask, Rendezvous
from atoll.kernel import Actor, ActorRef, Promise, VirtualClock, endpoint
from atoll.runtime import IslandScheduler
from atoll.schedulers import get_scheduler

pytestmark = pytest.mark.anyio

PROGRAMS: dict[str, list[tuple[int, ...]]] = {
    "a": [(0, 1), (1, 2), (0, 1, 2, 3), (2, 3)],
    "b": [(1, 2), (0, 1), (2, 3), (0, 3)],
}
TRIALS = 24  # naive: 149 of 200 seeds deadlock; gang FIFO: 0 of 200
GANG_TRIALS = 100


class Link(Actor):
    """A FIFO link with random latency in front of one device."""

    def __init__(self, device: ActorRef[Device], seed: int) -> None:
        self.device = device
        self.rng = random.Random(seed)

    @endpoint(resolve_args=False)
    async def run_gang(
        self, task: GangTask, inputs: list[Any], owner: str = ""
    ) -> Promise[list[BufferHandle]]:
        await self.ctx.clock.sleep(self.rng.uniform(10e-6, 500e-6))
        promise: Promise[list[BufferHandle]] = self.device.run_gang(task, inputs, owner)
        return promise


def gang(name: str, devices: tuple[int, ...], rng: random.Random) -> GangTask:
    work = Computation("allreduce", lambda: np.zeros(1), rng.uniform(1e8, 2e9), collective=True)
    return GangTask(name, work, devices, (len(devices),), ("x",))


async def trial(seed: int, policy: str | None) -> bool:
    """Run both programs once; True if every gang finished (no deadlock)."""
    rng = random.Random(seed)
    clock = VirtualClock()
    async with atoll.local_cluster(1, 2, 2, clock=clock) as cluster:
        system = cluster.system
        rendezvous = system.spawn(Rendezvous)
        results: list[Promise[list[BufferHandle]]] = []
        if policy is None:  # naive: each client sends its shards straight to the devices
            senders = {c: _links(cluster, rng) for c in PROGRAMS}
        else:
            links = _links(cluster, rng)
            scheduler = system.spawn(IslandScheduler, 0, policy, links)
        async with anyio.create_task_group() as tg:
            for client, gangs in PROGRAMS.items():
                tasks = [gang(f"{client}{i}", ds, rng) for i, ds in enumerate(gangs)]
                start = rng.uniform(0, 1e-3)
                if policy is None:
                    tasks = [_with(t, rendezvous) for t in tasks]
                    tg.start_soon(_send_direct, clock, start, senders[client], tasks, results)
                else:
                    tg.start_soon(_submit, clock, start, scheduler, tasks, results, client)
        await clock.sleep(10.0)  # far beyond any finishing time
        return all(p.done() and p.exception() is None for p in results)


def _links(cluster: atoll.Cluster, rng: random.Random) -> dict[int, ActorRef[Any]]:
    return {
        d: cluster.system.spawn(Link, cluster.device_ref(d), rng.randrange(2**32))
        for d in range(len(cluster.device_infos))
    }


def _with(task: GangTask, rendezvous: ActorRef[Rendezvous]) -> GangTask:
    from dataclasses import replace

    return replace(task, rendezvous=rendezvous)


async def _send_direct(
    clock: VirtualClock,
    start: float,
    links: dict[int, ActorRef[Any]],
    tasks: list[GangTask],
    results: list[Promise[list[BufferHandle]]],
) -> None:
    await clock.sleep(start)
    for task in tasks:
        for device in task.devices:
            results.append(links[device].run_gang(task, []))


async def _submit(
    clock: VirtualClock,
    start: float,
    scheduler: ActorRef[IslandScheduler],
    tasks: list[GangTask],
    results: list[Promise[list[BufferHandle]]],
    client: str,
) -> None:
    await clock.sleep(start)
    weight = {"a": 1.0, "b": 3.0}.get(client, 1.0)  # several clients, different weights
    for task in tasks:
        results.append(scheduler.submit_gang(task, [], client, weight))
        await clock.sleep(1e-4)


async def test_naive_per_device_fifo_deadlocks_collectives() -> None:
    finished = [await trial(seed, None) for seed in range(TRIALS)]
    assert not all(finished), "no interleaving deadlocked: the test shows nothing"
    assert any(finished)  # and it is the interleaving, not the programs, that decides


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fifo", "bounded-fifo", "share", "share-depth1"])
async def test_gang_scheduling_never_deadlocks(policy: str) -> None:
    import atoll.examples.custom_scheduler  # noqa: F401  (registers "bounded-fifo")
    from atoll.schedulers import SharePolicy, register_scheduler

    register_scheduler("share-depth1", lambda: SharePolicy(depth=1))  # holds gangs back most

    finished = [await trial(seed, policy) for seed in range(GANG_TRIALS)]
    assert all(finished)


def test_bounded_fifo_keeps_one_order_and_its_bound() -> None:
    from atoll.examples.custom_scheduler import BoundedFifo
    from atoll.schedulers import Completed, Submit

    policy = BoundedFifo(limit=1)
    first = policy.handle(Submit(1, "g0", (0, 1)))
    assert [(i.gang_id, i.device) for i in first] == [("g0", 0), ("g0", 1)]
    assert policy.handle(Submit(2, "g1", (1, 2))) == []  # device 1 is full: g1 waits
    assert policy.handle(Submit(3, "g2", (2,))) == []  # behind g1, though device 2 is free
    assert policy.handle(Completed(4, "g0", 0)) == []
    released = policy.handle(Completed(5, "g0", 1))
    assert [(i.gang_id, i.device, i.seq) for i in released] == [("g1", 1, 1), ("g1", 2, 1)]
    policy.validate()
    assert policy.peak == 1
    assert isinstance(get_scheduler("bounded-fifo"), BoundedFifo)


async def test_each_island_gets_the_scheduler_named_for_it() -> None:
    import atoll.examples.custom_scheduler  # registers "bounded-fifo"

    policies = {0: "fifo", 1: "bounded-fifo"}
    async with atoll.local_cluster(2, 1, 2, scheduler=policies) as cluster:
        for island, name in policies.items():
            assert await cluster.system.lookup(f"island{island}").scheduler_name() == name
        step = Computation("double", lambda x: 2 * x, 1e6)
        handle = cluster.put(np.ones(2), 0)
        for device in [0, 2, 1, 3, 2]:  # both islands, both policies
            handle = cluster.run(step, device, [handle])
        np.testing.assert_allclose(await cluster.fetch(handle), 32 * np.ones(2))
    with pytest.raises(KeyError, match="no scheduler named"):
        async with atoll.local_cluster(2, 1, 1, scheduler={1: "nope"}):
            pass
