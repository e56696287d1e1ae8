"""Compiled plans: a program's run costs one message per device, not per gang.

In one process compiling is off by default (as pushing is), so these tests
turn both on; host-process clusters compile by default, which the last test
checks over real processes. Every in-process case is checked against what
per-gang dispatch gives: the same results, the same modelled time, the same
pushes, and stores left empty.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
import pytest

import atoll
from atoll.benchmarks import dispatch as bench
from atoll.devices import Aval, Computation, CostModel
from atoll.kernel import VirtualClock
from atoll.runtime import GraphBuilder
from atoll.schedulers import Dispatch, Event, Instruction, Submit, register_scheduler

pytestmark = pytest.mark.anyio

COST = CostModel(flops_per_s=1e12, link_bytes_per_s=1e9, link_latency_s=50e-6)
HOP = 50e-6 + 4 / 1e9  # one float32 between hosts


class _OneDeep:
    """Gang FIFO that keeps every device one gang deep: a gang whose devices
    are busy waits in the policy until they finished (a policy that holds
    runs back, as the share policy does while clients share the island)."""

    def __init__(self) -> None:
        self._seq = 0
        self._queue: deque[Submit] = deque()
        self._left: dict[str, set[int]] = {}
        self._busy: set[int] = set()

    def handle(self, event: Event) -> list[Instruction]:
        if isinstance(event, Submit):
            self._queue.append(event)
        else:
            left = self._left[event.gang_id]
            left.discard(event.device)
            self._busy.discard(event.device)
            if not left:
                del self._left[event.gang_id]
        out: list[Instruction] = []
        while self._queue and self._busy.isdisjoint(self._queue[0].devices):
            gang = self._queue.popleft()
            devices = sorted(set(gang.devices))
            self._left[gang.gang_id] = set(devices)
            self._busy.update(devices)
            out += [Dispatch(event.event_id, gang.gang_id, d, self._seq) for d in devices]
            self._seq += 1
        return out

    def validate(self) -> None:
        assert all(self._left.values())

    def clients(self) -> dict[str, dict[str, float]]:
        return {}


register_scheduler("test-one-deep", _OneDeep)


def _total(v: np.ndarray) -> np.ndarray:
    return np.asarray(v.sum(keepdims=True), np.float32)


@asynccontextmanager
async def compiled_cluster(*shape: int, **options: Any) -> AsyncIterator[atoll.Cluster]:
    async with atoll.local_cluster(*shape, cost=COST, push=True, **options) as cluster:
        assert await cluster.controller.set_compile(True)
        yield cluster


async def island_load(cluster: atoll.Cluster) -> dict[str, Any]:
    """Island 0's own counters (``IslandScheduler.load``)."""
    rows: list[dict[str, Any]] = await cluster.controller.islands_load()
    return rows[0]


async def empty_stores(cluster: atoll.Cluster) -> None:
    usage = await cluster.store_usage()
    assert sum(u["buffers"] for u in usage) == 0
    assert sum(u["arrivals"] for u in usage) == 0


async def emptied_stores(cluster: atoll.Cluster) -> None:
    """The stores empty once the frees sent last land: those are notices
    (nothing answers them), from the client and from the controller, which
    frees outputs read in place once the whole run is over, after the client
    had its answer. Each look is a round trip to every host; 5 s at most."""
    with anyio.fail_after(5):
        while True:
            usage = await cluster.store_usage()
            if not sum(u["buffers"] + u["arrivals"] for u in usage):
                return
            await anyio.sleep(0.01)


async def test_a_chain_runs_compiled_with_per_gang_results_and_time() -> None:
    clock = VirtualClock()
    async with compiled_cluster(1, 4, 1, clock=clock) as cluster:
        slices = [await cluster.devices(1) for _ in range(4)]
        graph = bench.chain_graph(slices, bench.step(0.002))
        x = await cluster.put(np.zeros(1, np.float32), 0)
        for run in range(1, 3):
            start = clock.now()
            [out] = cluster.run_graph(graph, [x])
            assert (await cluster.fetch(out))[0] == 4
            assert clock.now() - start == pytest.approx(4 * 0.002 + 3 * HOP)
            await cluster.free(out)
            stats = await cluster.controller.plan_stats()
            assert (stats["compiled"], stats["compiled_runs"]) == (1, run)
        usage = await cluster.store_usage()
        assert [u["pushes_in"] for u in usage] == [0, 2, 2, 2]
        await cluster.free(x)
        await empty_stores(cluster)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "per-gang"])
async def test_gangs_over_every_device_compile_and_take_the_same_time(compiled: bool) -> None:
    """The dispatch microbenchmark's shape: a chain of gangs over all devices
    of two hosts (their inputs resident), compiled or not."""
    clock = VirtualClock()
    async with compiled_cluster(1, 2, 4, clock=clock) as cluster:
        await cluster.controller.set_compile(compiled)
        everything = await cluster.devices(8)
        graph = bench.chain_graph([everything] * 6, bench.step(0.001))
        x = await cluster.put(np.zeros(1, np.float32), 0)
        start = clock.now()
        [out] = cluster.run_graph(graph, [x])
        assert (await cluster.fetch(out))[0] == 6
        assert clock.now() - start == pytest.approx(6 * 0.001)
        stats = await cluster.controller.plan_stats()
        assert stats["compiled"] == int(compiled)
        for handle in (out, x):
            await cluster.free(handle)
        await empty_stores(cluster)


async def test_a_declined_push_is_read_in_place_and_freed_after_the_run() -> None:
    big = Aval((1024,), "float32")
    async with compiled_cluster(1, 2, 1, store_bytes=9 * 1024) as cluster:
        first, second = await cluster.devices(1), await cluster.devices(1)
        filler = [await cluster.put(np.zeros(1024, np.float32), 1) for _ in range(2)]
        builder = GraphBuilder()
        x = builder.input(big)
        [y] = builder.add(Computation("inc", lambda v: v + 1, 1e6), first, [x], [big])
        [z] = builder.add(Computation("sum", _total, 1e6), second, [y], [bench.SCALAR])
        graph = builder.build([z])
        x0 = await cluster.put(np.zeros(1024, np.float32), 0)
        [out] = cluster.run_graph(graph, [x0])
        assert (await cluster.fetch(out))[0] == 1024
        assert (await cluster.store_usage())[1]["pushes_declined"] == 1
        assert (await cluster.controller.plan_stats())["compiled_runs"] == 1
        await cluster.free(out)
        for handle in (x0, *filler):
            await cluster.free(handle)
        await empty_stores(cluster)


async def test_a_failing_gang_fails_its_readers_everywhere_without_hanging() -> None:
    def boom(v: np.ndarray) -> np.ndarray:
        raise ValueError("boom in the middle")

    async with compiled_cluster(1, 4, 1) as cluster:
        slices = [await cluster.devices(1) for _ in range(4)]
        step = bench.step(0.001)
        builder = GraphBuilder()
        x = builder.input(bench.SCALAR)
        [y] = builder.add(step, slices[0], [x], [bench.SCALAR])
        [y] = builder.add(Computation("boom", boom, 1e6), slices[1], [y], [bench.SCALAR])
        [z] = builder.add(step, slices[2], [y], [bench.SCALAR])
        [w] = builder.add(step, slices[3], [z], [bench.SCALAR])
        [side] = builder.add(step, slices[3], [x], [bench.SCALAR])
        graph = builder.build([w, side])
        x0 = await cluster.put(np.zeros(1, np.float32), 0)
        w_out, side_out = cluster.run_graph(graph, [x0])
        with pytest.raises(atoll.AtollError, match="boom in the middle"):
            await cluster.fetch(w_out)
        assert (await cluster.fetch(side_out))[0] == 1  # did not depend on it
        assert (await cluster.controller.plan_stats())["compiled_runs"] == 1
        await cluster.free(side_out)
        await cluster.free(x0)
        await empty_stores(cluster)


async def test_a_run_the_policy_holds_back_goes_when_it_is_dispatched() -> None:
    """Two runs over the same devices: the second waits in the policy until
    the first finished, then goes as one compiled run, one message per device."""
    async with compiled_cluster(1, 2, 1, scheduler="test-one-deep") as cluster:
        slices = [await cluster.devices(1) for _ in range(2)]
        graph = bench.chain_graph(slices, bench.step(0.001))
        x = await cluster.put(np.zeros(1, np.float32), 0)
        [first] = cluster.run_graph(graph, [x])
        cluster.flush()
        [second] = cluster.run_graph(graph, [x])
        assert (await cluster.fetch(first))[0] == 2 and (await cluster.fetch(second))[0] == 2
        assert (await cluster.controller.plan_stats())["compiled_runs"] == 2
        assert (await island_load(cluster))["compiled_held_back"] >= 1
        for handle in (first, second, x):
            await cluster.free(handle)
        await empty_stores(cluster)


async def test_a_run_held_back_is_not_overtaken_by_one_that_reads_it() -> None:
    """The second run reads the first's output; both wait their turn in the
    policy, and each device gets them in that order."""
    async with compiled_cluster(1, 2, 1, scheduler="test-one-deep") as cluster:
        slices = [await cluster.devices(1) for _ in range(2)]
        graph = bench.chain_graph(slices, bench.step(0.001))
        x = await cluster.put(np.zeros(1, np.float32), 0)
        [y] = cluster.run_graph(graph, [x])
        cluster.flush()
        [z] = cluster.run_graph(graph, [y])
        assert (await cluster.fetch(z))[0] == 4
        assert (await island_load(cluster))["compiled_held_back"] >= 1
        for handle in (z, y, x):
            await cluster.free(handle)
        await empty_stores(cluster)


async def test_releasing_a_slice_drops_the_compiled_plan() -> None:
    async with compiled_cluster(1, 2, 1) as cluster:
        slices = [await cluster.devices(1) for _ in range(2)]
        graph = bench.chain_graph(slices, bench.step(0.001))
        x = await cluster.put(np.zeros(1, np.float32), 0)
        [out] = cluster.run_graph(graph, [x])
        await cluster.fetch(out)
        assert (await cluster.controller.plan_stats())["compiled"] == 1
        await cluster.release(slices[1])
        assert (await cluster.controller.plan_stats())["compiled"] == 0
        [late] = cluster.run_graph(graph, [x])
        with pytest.raises(atoll.AtollError, match="released"):
            await cluster.fetch(late)
        await cluster.free(out)
        await cluster.free(x)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_program_over_host_processes_runs_compiled() -> None:
    async with atoll.local_cluster(1, 4, 1, transport="capnp") as cluster:
        slices = [await cluster.devices(1) for _ in range(4)]
        graph = bench.chain_graph(slices * 4, bench.step(0.0))
        for _ in range(3):
            [out] = cluster.run_graph(graph, [np.zeros(1, np.float32)])
            assert (await cluster.fetch(out))[0] == 16
            await cluster.free(out)
        stats = await cluster.controller.plan_stats()
        assert (stats["compiled"], stats["compiled_runs"]) == (1, 3)
        assert (await island_load(cluster))["compiled_held_back"] == 0
        usage = await cluster.store_usage()
        assert [u["lane_in"] for u in usage] == [9, 12, 12, 12]  # every hop, by lane
        await empty_stores(cluster)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_over_host_processes_a_declined_push_is_read_in_place() -> None:
    """A 2 MiB push that host 1 has no room for: its reader reads the value
    where it was made, which the producer keeps until the whole run is over."""
    big = Aval((512 * 1024,), "float32")
    async with atoll.local_cluster(
        1, 2, 1, transport="capnp", cost=COST, store_bytes=5 << 20
    ) as cluster:
        first, second = await cluster.devices(1), await cluster.devices(1)
        builder = GraphBuilder()
        x = builder.input(big)
        [y] = builder.add(Computation("inc", lambda v: v + 1, 1e6), first, [x], [big])
        [z] = builder.add(Computation("sum", _total, 1e6), second, [y], [bench.SCALAR])
        graph = builder.build([z])
        filler = await cluster.put(np.zeros(1 << 20, np.float32), 1)  # host 1: 4 MiB of 5
        for _ in range(3):
            [out] = cluster.run_graph(graph, [np.zeros(512 * 1024, np.float32)])
            assert (await cluster.fetch(out))[0] == 512 * 1024
            await cluster.free(out)
        assert (await cluster.controller.plan_stats())["compiled_runs"] == 3
        assert (await cluster.store_usage())[1]["pushes_declined"] == 3
        await cluster.free(filler)
        await emptied_stores(cluster)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "per-gang"])
async def test_an_output_nothing_reads_is_freed(compiled: bool) -> None:
    """A node whose output no node reads and no result names: freed once made
    (on a virtual clock it is made, at 1.5 ms, before the result, at 2 ms)."""
    async with compiled_cluster(1, 2, 1, clock=VirtualClock()) as cluster:
        await cluster.controller.set_compile(compiled)
        a, b = await cluster.devices(1), await cluster.devices(1)
        step = bench.step(0.001)
        builder = GraphBuilder()
        x = builder.input(bench.SCALAR)
        [y] = builder.add(step, a, [x], [bench.SCALAR])
        builder.add(bench.step(0.0005), b, [y], [bench.SCALAR])  # its output goes nowhere
        [z] = builder.add(step, a, [y], [bench.SCALAR])
        x0 = await cluster.put(np.zeros(1, np.float32), 0)
        [out] = cluster.run_graph(builder.build([z]), [x0])
        assert (await cluster.fetch(out))[0] == 2
        for handle in (out, x0):
            await cluster.free(handle)
        await empty_stores(cluster)


async def test_a_sessions_compiled_runs_go_through_its_gang_quota() -> None:
    """A quota of one: the first run goes, the next 16 wait their turn (the
    stall), and the one after is refused; every run that went is right."""
    from atoll.devices import QuotaExceeded

    async with compiled_cluster(1, 2, 1) as cluster:
        await cluster.controller.set_tenant(cluster.owner, max_gangs=1)
        slices = [await cluster.devices(1) for _ in range(2)]
        graph = bench.chain_graph(slices, bench.step(0.001))
        x = await cluster.put(np.zeros(1, np.float32), 0)
        outs = [cluster.run_graph(graph, [x])[0] for _ in range(18)]
        with pytest.raises(QuotaExceeded):
            await cluster.fetch(outs[-1])
        for out in outs[:-1]:
            assert (await cluster.fetch(out))[0] == 2
            await cluster.free(out)
        assert (await cluster.controller.plan_stats())["compiled_runs"] == 18
        await cluster.free(x)
        await empty_stores(cluster)


def _double(v: np.ndarray) -> np.ndarray:
    return np.asarray(v * 2, np.float32)


def _slow_double(v: np.ndarray) -> np.ndarray:
    """Long enough that the run after it is sent while it runs."""
    time.sleep(0.2)
    return _double(v)


def _plus_one(v: np.ndarray) -> np.ndarray:
    return np.asarray(v + 1, np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(120)
async def test_an_input_still_on_its_way_reaches_every_reader_held_back() -> None:
    """A run reads the output of the one before it, still under way, on the
    device that made it and on another, in host processes, held back by the
    policy until the first finished:
    each reader gets its own kind of input (the maker takes it from what it
    kept, the other one the value)."""
    double, plus_one = Computation("double", _double), Computation("plus_one", _plus_one)
    slow = Computation("slow_double", _slow_double)
    async with atoll.local_cluster(
        1, 2, 1, transport="capnp", scheduler="test-one-deep"
    ) as cluster:
        a, b = [await cluster.devices(1) for _ in range(2)]
        builder = GraphBuilder()
        x = builder.input(Aval((1,), "float32"))
        [y] = builder.add(slow, a, [x], [Aval((1,), "float32")])
        first = builder.build([y])
        builder = GraphBuilder()
        y_in = builder.input(Aval((1,), "float32"))
        [on_b] = builder.add(plus_one, b, [y_in], [Aval((1,), "float32")])  # b's part first
        [on_a] = builder.add(double, a, [y_in], [Aval((1,), "float32")])
        second = builder.build([on_b, on_a])
        for _ in range(3):
            [made] = cluster.run_graph(first, [np.ones(1, np.float32)])
            for _ in range(3):  # sent on its own, not batched with the next
                await anyio.sleep(0)
            there, here = cluster.run_graph(second, [made])
            assert (await cluster.fetch(there))[0] == 3 and (await cluster.fetch(here))[0] == 4
        assert (await island_load(cluster))["compiled_held_back"] >= 3
