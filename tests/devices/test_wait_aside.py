"""A gang whose input is not there yet waits aside (``Device.run_plan``).

Two chains cross two hosts in opposite directions. In the island's order
each device's second gang is the other chain's first step, so a device that
kept that order strictly would sit idle behind a push that comes only after
its own next gang: the whole takes four steps' time. A gang that waits aside
lets the ready one go first, and both chains end after two steps (and a
push). Under a :class:`VirtualClock` those figures are exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import atoll
from atoll.devices import Computation, CostModel
from atoll.kernel import VirtualClock, config
from atoll.runtime import GraphBuilder

pytestmark = pytest.mark.anyio

COST = CostModel(flops_per_s=1e12, link_bytes_per_s=1e9, link_latency_s=50e-6)
HOP = 50e-6 + 4 / 1e9  # one float32 between hosts (a push, or a fetch from another host)
STEP_S = 1.0


def _plus_one(x: np.ndarray) -> np.ndarray:
    return x + 1


STEP = Computation("plus_one", _plus_one, STEP_S * 1e12)
SCALAR = atoll.devices.Aval((1,), "float32")


async def _crossed_chains(cluster: Any) -> tuple[Any, list[Any]]:
    """Chain 0 runs on device 0 then 1, chain 1 on device 1 then 0, in that
    order of calls: their input, and their outputs."""
    x = await cluster.put(np.zeros(1, np.float32), 0)
    outs = []
    for first, second in ((0, 1), (1, 0)):
        y = cluster.run(STEP, first, [x])
        outs.append(cluster.run(STEP, second, [y]))
    return x, outs


def _took(clock: VirtualClock, start: float, steps: int) -> bool:
    """Whether ``steps`` steps in a row took the time since ``start``, with
    the links' few hops (a push, a fetch)."""
    return steps * STEP_S < clock.now() - start < steps * STEP_S + 3 * HOP


@pytest.mark.parametrize("batched", [True, False], ids=["one-program", "run-by-run"])
async def test_a_gang_waiting_for_a_push_lets_ready_work_go_first(batched: bool) -> None:
    clock = VirtualClock()
    with config.overridden(batch_runs=batched):
        async with atoll.local_cluster(1, 2, 1, clock=clock, cost=COST) as cluster:
            start = clock.now()
            x, outs = await _crossed_chains(cluster)
            for out in outs:
                assert (await cluster.fetch(out))[0] == 2
            assert _took(clock, start, 2)  # in the island's order strictly: 4
            stats = await cluster.device_stats()
            for handle in [*outs, x]:
                await cluster.free(handle)
            usage = await cluster.store_usage()
    assert [s.busy_s for s in stats] == pytest.approx([2 * STEP_S, 2 * STEP_S])
    assert sum(u["buffers"] for u in usage) == 0
    assert sum(u["arrivals"] for u in usage) == 0


async def test_a_full_store_keeps_the_islands_order() -> None:
    """Over half of its store in use, a device runs its gangs in order:
    values made out of order would stay alive longer."""
    clock = VirtualClock()
    async with atoll.local_cluster(1, 2, 1, clock=clock, cost=COST, store_bytes=64) as cluster:
        ballast = [await cluster.put(np.zeros(5, np.float32), d) for d in (0, 0, 1, 1)]
        start = clock.now()
        x, outs = await _crossed_chains(cluster)
        for out in outs:
            assert (await cluster.fetch(out))[0] == 2
        assert _took(clock, start, 4)
        for handle in [*outs, *ballast, x]:
            await cluster.free(handle)


async def test_a_collective_after_a_gang_waiting_aside_keeps_its_order() -> None:
    """Device 1 has a gang waiting for a push when a gang over devices 0 and
    1 comes: the collective waits until that gang went, on both devices (no
    deadlock), and every value is right."""
    clock = VirtualClock()
    allreduce = Computation("allreduce", _plus_one, STEP_S * 1e12, collective=True)
    async with atoll.local_cluster(1, 2, 1, clock=clock, cost=COST) as cluster:
        both = await cluster.devices(2)
        builder = GraphBuilder()
        x = builder.input(SCALAR)
        [reduced] = builder.add(allreduce, both, [x], [SCALAR])
        collective = builder.build([reduced])
        x0 = await cluster.put(np.zeros(1, np.float32), 0)
        y = cluster.run(STEP, 0, [x0])
        z = cluster.run(STEP, 1, [y])  # waits aside for y's push
        [w] = cluster.run_graph(collective, [x0])
        v = cluster.run(STEP, 1, [x0])  # ready at once
        outs: list[Any] = [z, w, v]
        assert [(await cluster.fetch(out))[0] for out in outs] == [2, 1, 1]
        for handle in [*outs, y, x0]:
            await cluster.free(handle)
        assert sum(u["buffers"] for u in await cluster.store_usage()) == 0


async def test_a_later_run_reads_the_output_of_a_gang_waiting_aside() -> None:
    """Run-by-run, the second step on device 1 reads the output of the first,
    which waits aside for a push: it waits for that gang, and reads it."""
    clock = VirtualClock()
    with config.overridden(batch_runs=False):
        async with atoll.local_cluster(1, 2, 1, clock=clock, cost=COST) as cluster:
            x = await cluster.put(np.zeros(1, np.float32), 0)
            y = cluster.run(STEP, 0, [x])
            z = cluster.run(STEP, 1, [y])
            w = cluster.run(STEP, 1, [z])
            assert (await cluster.fetch(w))[0] == 3
            assert _took(clock, 0.0, 3)


def _add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    total: np.ndarray = np.asarray(a) + np.asarray(b)
    return total


def _broken(x: np.ndarray) -> np.ndarray:
    raise ValueError("broken on purpose")


async def _two_slices(cluster: Any) -> tuple[Any, Any]:
    return await cluster.devices(1), await cluster.devices(1)


async def _zeros(cluster: Any) -> list[Any]:
    return [await cluster.put(np.zeros(1, np.float32), d) for d in (0, 1)]


async def _values_then_empty(cluster: Any, graph: Any, expected: list[int]) -> None:
    """Run ``graph`` on zeros on devices 0 and 1: its outputs' values are
    ``expected``, and once they and the inputs are freed, nothing is left."""
    zeros = await _zeros(cluster)
    outs = cluster.run_graph(graph, zeros)
    assert [(await cluster.fetch(out))[0] for out in outs] == expected
    for handle in [*outs, *zeros]:
        await cluster.free(handle)
    await _empty(cluster)


async def _empty(cluster: Any) -> None:
    usage = await cluster.store_usage()
    assert sum(u["buffers"] for u in usage) == 0
    assert sum(u["arrivals"] for u in usage) == 0


async def test_a_value_a_gang_waiting_aside_reads_outlives_its_later_readers() -> None:
    """x is read by a gang that waits aside (for a push) and by a later gang
    that goes first: the later one's release does not free x under the
    first."""
    async with atoll.local_cluster(1, 2, 1, clock=VirtualClock(), cost=COST) as cluster:
        first, second = await _two_slices(cluster)
        builder = GraphBuilder()
        a, b = builder.input(SCALAR), builder.input(SCALAR)
        [x] = builder.add(Computation("plus_one", _plus_one, 0.1e12), first, [a], [SCALAR])
        [p] = builder.add(STEP, second, [b], [SCALAR])  # pushed to device 0 after 1 s
        [waits] = builder.add(Computation("add", _add, 0.1e12), first, [x, p], [SCALAR])
        [goes] = builder.add(Computation("plus_one", _plus_one, 0.1e12), first, [x], [SCALAR])
        await _values_then_empty(cluster, builder.build([waits, goes]), [2, 2])


async def test_a_run_reports_every_gang_when_one_waiting_aside_fails() -> None:
    """x (1 s) is an output of the run; the gang after it waits aside for a
    push that fails: the run's report still has x, and the failure."""
    async with atoll.local_cluster(1, 2, 1, clock=VirtualClock(), cost=COST) as cluster:
        first, second = await _two_slices(cluster)
        builder = GraphBuilder()
        a, b = builder.input(SCALAR), builder.input(SCALAR)
        [x] = builder.add(STEP, first, [a], [SCALAR])
        broken = Computation("broken", _broken, 0.1e12)
        [q] = builder.add(broken, second, [b], [SCALAR])
        [y] = builder.add(Computation("add", _add, 0.1e12), first, [x, q], [SCALAR])
        zeros = await _zeros(cluster)
        out_x, out_y = cluster.run_graph(builder.build([x, y]), zeros)
        with pytest.raises(atoll.RemoteActorError, match="broken on purpose"):
            await cluster.fetch(out_y)
        assert (await cluster.fetch(out_x))[0] == 1
        for handle in [out_x, *zeros]:
            await cluster.free(handle)
        await _empty(cluster)


async def test_a_run_reports_a_gang_that_settles_after_the_one_waiting_aside() -> None:
    """x (1 s, pushed to device 1, an output) settles after y, a gang of no
    device time that waited aside for a push and read x: the report waits
    for x too."""
    async with atoll.local_cluster(1, 2, 1, clock=VirtualClock(), cost=COST) as cluster:
        first, second = await _two_slices(cluster)
        builder = GraphBuilder()
        a, b = builder.input(SCALAR), builder.input(SCALAR)
        [x] = builder.add(STEP, first, [a], [SCALAR])
        [q] = builder.add(Computation("plus_one", _plus_one, 0.1e12), second, [b], [SCALAR])
        [r] = builder.add(Computation("plus_one", _plus_one, 0.1e12), second, [x], [SCALAR])
        [y] = builder.add(Computation("add", _add, 0), first, [x, q], [SCALAR])
        await _values_then_empty(cluster, builder.build([x, y, r]), [1, 2, 2])


async def test_a_value_made_aside_outlives_a_later_reader_that_goes_first() -> None:
    """x waits aside (for q's push); w waits aside for x and for p (1 s); g
    reads x only, goes as soon as x went, and is x's last reader: x is still
    there when w reads it."""
    short = Computation("plus_one", _plus_one, 0.1e12)
    add = Computation("add", _add, 0.1e12)
    async with atoll.local_cluster(1, 2, 1, clock=VirtualClock(), cost=COST) as cluster:
        first, second = await _two_slices(cluster)
        builder = GraphBuilder()
        a, b = builder.input(SCALAR), builder.input(SCALAR)
        [q] = builder.add(short, second, [b], [SCALAR])
        [p] = builder.add(STEP, second, [q], [SCALAR])
        [x] = builder.add(add, first, [a, q], [SCALAR])
        [w] = builder.add(add, first, [x, p], [SCALAR])
        [g] = builder.add(short, first, [x], [SCALAR])
        await _values_then_empty(cluster, builder.build([w, g]), [3, 2])
