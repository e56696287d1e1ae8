"""Producers push outputs straight to their readers' hosts (parallel dispatch).

Pushing is on by default (compiled plans need it); these tests say so with
``push=True``; ``test_up``-style process clusters push too, which
``test_chain_over_host_processes_pushes`` checks.
Store usage is read after the results: frees and pushes reach a host before
the ``store_usage`` call that follows them on the same link.
"""

from __future__ import annotations

import time

import anyio
import numpy as np
import pytest

import atoll
from atoll.benchmarks import dispatch as bench
from atoll.devices import Aval, BufferHandle, Computation, CostModel
from atoll.devices._plan import DeviceProgram, PlannedGang
from atoll.kernel import Promise, VirtualClock
from atoll.runtime import GraphBuilder

pytestmark = pytest.mark.anyio

COST = CostModel(flops_per_s=1e12, link_bytes_per_s=1e9, link_latency_s=50e-6)
HOP = 50e-6 + 4 / 1e9  # one float32 between hosts


async def test_pushed_chain_matches_and_frees_every_copy() -> None:
    clock = VirtualClock()
    async with atoll.local_cluster(1, 4, 1, clock=clock, cost=COST, push=True) as cluster:
        slices = [await cluster.devices(1) for _ in range(4)]
        graph = bench.chain_graph(slices, bench.step(0.002))
        x = await cluster.put(np.zeros(1, np.float32), 0)
        [out] = cluster.run_graph(graph, [x])
        assert (await cluster.fetch(out))[0] == 4
        # device and modelled link time are the same as without pushing
        assert clock.now() == pytest.approx(4 * 0.002 + 3 * HOP)
        usage = await cluster.store_usage()
        assert [u["pushes_in"] for u in usage] == [0, 1, 1, 1]
        await cluster.free(out)
        await cluster.free(x)
        usage = await cluster.store_usage()
        assert sum(u["buffers"] for u in usage) == 0
        assert sum(u["arrivals"] for u in usage) == 0


@pytest.mark.parametrize("compiled", [False, True], ids=["per-gang", "compiled"])
async def test_one_output_read_twice_on_a_host_travels_once(compiled: bool) -> None:
    """A value read by two gangs on another host is pushed there once; it is
    an output of the program too. Gang by gang (one plan per gang), readers
    take their inputs' handles from the controller instead, and nothing is
    pushed."""
    async with atoll.local_cluster(1, 2, 2, cost=COST, push=True) as cluster:
        assert await cluster.controller.set_compile(compiled) is compiled
        a = await cluster.devices(1)  # device 0, host 0
        b = await cluster.devices(1)  # device 1, host 0
        c = await cluster.devices(1)  # device 2, host 1
        d = await cluster.devices(1)  # device 3, host 1
        step = bench.step(0.001)
        builder = GraphBuilder()
        x = builder.input(bench.SCALAR)
        [y] = builder.add(step, a, [x], [bench.SCALAR])
        [y] = builder.add(step, b, [y], [bench.SCALAR])
        [u] = builder.add(step, c, [y], [bench.SCALAR])
        [v] = builder.add(Computation("add", np.add, 1e9), d, [y, u], [bench.SCALAR])
        graph = builder.build([v, y])
        x0 = await cluster.put(np.zeros(1, np.float32), 0)
        out, mid = cluster.run_graph(graph, [x0])
        assert (await cluster.fetch(out))[0] == 2 + 3
        assert (await cluster.fetch(mid))[0] == 2
        usage = await cluster.store_usage()
        assert usage[1]["pushes_in"] == int(compiled)  # y once (for two readers); u is local
        assert (await cluster.controller.plan_stats())["compiled_runs"] == (1 if compiled else 4)
        for handle in (out, mid, x0):
            await cluster.free(handle)
        usage = await cluster.store_usage()
        assert sum(u["buffers"] for u in usage) == 0
        assert sum(u["arrivals"] for u in usage) == 0


async def test_a_full_store_declines_the_push_and_the_reader_fetches() -> None:
    big = Aval((1024,), "float32")
    async with atoll.local_cluster(1, 2, 1, cost=COST, push=True, store_bytes=9 * 1024) as cluster:
        first, second = await cluster.devices(1), await cluster.devices(1)
        builder = GraphBuilder()
        x = builder.input(big)
        [y] = builder.add(Computation("inc", lambda a: a + 1, 1e9), first, [x], [big])
        [z] = builder.add(
            Computation("sum", lambda a: a.sum(keepdims=True), 1e9), second, [y], [bench.SCALAR]
        )
        graph = builder.build([z])
        filler = await cluster.put(np.zeros(1536, np.float32), 1)  # host 1: 6 KiB of 9
        x0 = await cluster.put(np.zeros(1024, np.float32), 0)
        [out] = cluster.run_graph(graph, [x0])
        assert (await cluster.fetch(out))[0] == 1024
        usage = await cluster.store_usage()
        assert usage[1]["pushes_declined"] == 1 and usage[1]["pushes_in"] == 0
        for each in (out, x0, filler):
            await cluster.free(each)
        assert sum(u["buffers"] for u in await cluster.store_usage()) == 0


def broken(x: np.ndarray) -> np.ndarray:
    raise FloatingPointError("step 1 diverged")


async def test_a_failed_producer_fails_its_reader_and_leaks_nothing() -> None:
    async with atoll.local_cluster(1, 3, 1, cost=COST, push=True) as cluster:
        slices = [await cluster.devices(1) for _ in range(3)]
        builder = GraphBuilder()
        x = builder.input(bench.SCALAR)
        [y] = builder.add(bench.step(0.001), slices[0], [x], [bench.SCALAR])
        [y] = builder.add(Computation("broken", broken, 1e6), slices[1], [y], [bench.SCALAR])
        [y] = builder.add(bench.step(0.001), slices[2], [y], [bench.SCALAR])
        x0 = await cluster.put(np.zeros(1, np.float32), 0)
        [out] = cluster.run_graph(builder.build([y]), [x0])
        with pytest.raises(atoll.RemoteActorError) as info:
            await cluster.fetch(out)
        assert info.value.exc_type == "builtins.FloatingPointError"
        await cluster.free(x0)
        usage = await cluster.store_usage()
        assert sum(u["buffers"] for u in usage) == 0
        assert sum(u["arrivals"] for u in usage) == 0


async def test_non_leader_shards_do_not_wait_for_resident_inputs() -> None:
    """A shard whose part of the input is already on its device runs at once;
    the leader alone waits for the handle it must read."""
    async with atoll.local_cluster(1, 1, 2, cost=COST) as cluster:
        step = bench.step(0.001)
        never: Promise[BufferHandle] = Promise("never settles")
        entry = PlannedGang(
            0, step, (0, 1), (2,), ("x",), (bench.SCALAR,), (0,), (True,), (), (True,)
        )
        for device in (0, 1):
            await cluster.device_ref(device).install_plan(DeviceProgram(1, device, (entry,), (0,)))
        shard = await cluster.device_ref(1).run_plan(1, 1, [never])
        assert shard.outputs == {} and shard.errors == {}
        leader = cluster.device_ref(0).run_plan(1, 1, [never])
        never.set_exception(RuntimeError("producer failed"))
        assert "producer failed" in str((await leader).errors[0])


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(120)
async def test_chain_over_host_processes_pushes() -> None:
    """Across real processes, readers get their inputs pushed, not via the controller."""
    async with atoll.local_cluster(1, 3, 1, transport="capnp", cost=COST) as cluster:
        slices = [await cluster.devices(1) for _ in range(3)]
        graph = bench.chain_graph(slices, bench.step(0.001))
        x = await cluster.put(np.zeros(1, np.float32), 0)
        [out] = cluster.run_graph(graph, [x])
        assert (await cluster.fetch(out))[0] == 3
        usage = await cluster.store_usage()
        assert [u["pushes_in"] for u in usage] == [0, 1, 1]
        await cluster.free(out)
        await cluster.free(x)
        usage = await cluster.store_usage()
        assert sum(u["buffers"] for u in usage) == 0
        assert sum(u["arrivals"] for u in usage) == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(120)
async def test_over_processes_a_failed_producer_fails_its_pushed_reader() -> None:
    """The reader's leader waits on its inbox only (no promise was sent to it):
    the controller fails that inbox with the producer's error."""

    def diverge(x: np.ndarray) -> np.ndarray:  # travels by value to the host
        raise FloatingPointError("step 1 diverged")

    async with atoll.local_cluster(1, 3, 1, transport="capnp", cost=COST) as cluster:
        slices = [await cluster.devices(1) for _ in range(3)]
        builder = GraphBuilder()
        x = builder.input(bench.SCALAR)
        [y] = builder.add(bench.step(0.001), slices[0], [x], [bench.SCALAR])
        [y] = builder.add(Computation("broken", diverge, 1e6), slices[1], [y], [bench.SCALAR])
        [y] = builder.add(bench.step(0.001), slices[2], [y], [bench.SCALAR])
        [out] = cluster.run_graph(builder.build([y]), [np.zeros(1, np.float32)])
        with pytest.raises(atoll.RemoteActorError) as info:
            await cluster.fetch(out)
        assert info.value.exc_type == "builtins.FloatingPointError"
        usage = await cluster.store_usage()
        assert sum(u["buffers"] for u in usage) == 0
        assert sum(u["arrivals"] for u in usage) == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(120)
async def test_over_processes_a_declined_push_is_redirected_to_the_producer() -> None:
    big = Aval((1024,), "float32")
    total = Computation("sum", lambda a: a.sum(keepdims=True), 1e9)
    async with atoll.local_cluster(
        1, 2, 1, transport="capnp", cost=COST, store_bytes=9 * 1024
    ) as cluster:
        first, second = await cluster.devices(1), await cluster.devices(1)
        builder = GraphBuilder()
        x = builder.input(big)
        [y] = builder.add(Computation("inc", lambda a: a + 1, 1e9), first, [x], [big])
        [z] = builder.add(total, second, [y], [bench.SCALAR])
        filler = await cluster.put(np.zeros(1536, np.float32), 1)  # host 1: 6 KiB of 9
        [out] = cluster.run_graph(builder.build([z]), [np.zeros(1024, np.float32)])
        assert (await cluster.fetch(out))[0] == 1024
        usage = await cluster.store_usage()
        assert usage[1]["pushes_declined"] == 1 and usage[1]["pushes_in"] == 0
        for each in (out, filler):
            await cluster.free(each)
        usage = await cluster.store_usage()
        assert sum(u["buffers"] for u in usage) == 0
        assert sum(u["arrivals"] for u in usage) == 0


async def test_a_failed_resident_input_does_not_strand_a_collective_gang() -> None:
    """The leader fails on its input; the shards that went ahead to the barrier
    must not wait there for ever (the devices answer afterwards)."""
    collective = Computation("allreduce", lambda a: a, 1e9, collective=True)
    async with atoll.local_cluster(1, 1, 2, cost=COST) as cluster:
        both = await cluster.devices(2)
        builder = GraphBuilder()
        x = builder.input(bench.SCALAR)
        [y] = builder.add(Computation("broken", broken, 1e6), both, [x], [bench.SCALAR])
        [y] = builder.add(collective, both, [y], [bench.SCALAR])
        x0 = await cluster.put(np.zeros(1, np.float32), 0)
        [out] = cluster.run_graph(builder.build([y]), [x0])
        with pytest.raises(atoll.RemoteActorError):
            await cluster.fetch(out)
        for device in (0, 1):
            handle = await cluster.put(np.ones(1, np.float32), device)
            await cluster.free(handle)
        await cluster.free(x0)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(120)
async def test_readers_done_before_their_producer_reports_free_its_output() -> None:
    """Zero-cost readers fed by pushes can finish before the controller hears
    of the producer; the producer's output must still be freed."""
    async with atoll.local_cluster(1, 3, 1, transport="capnp", cost=COST) as cluster:
        a, b, c = [await cluster.devices(1) for _ in range(3)]
        builder = GraphBuilder()
        x = builder.input(bench.SCALAR)
        [y] = builder.add(bench.step(0.0), a, [x], [bench.SCALAR])
        [u] = builder.add(bench.step(0.0), b, [y], [bench.SCALAR])
        [v] = builder.add(bench.step(0.0), c, [y], [bench.SCALAR])
        graph = builder.build([u, v])
        x0 = await cluster.put(np.zeros(1, np.float32), 0)
        for _ in range(5):
            outs = cluster.run_graph(graph, [x0])
            for out in outs:
                assert (await cluster.fetch(out))[0] == 2
                await cluster.free(out)
        await cluster.free(x0)
        # the last run's intermediate is freed when the controller hears of its
        # producer, which may be after this client saw the results: wait for it
        deadline = time.monotonic() + 10
        while sum(u["buffers"] for u in await cluster.store_usage()) and (
            time.monotonic() < deadline
        ):
            await anyio.sleep(0.02)
        usage = await cluster.store_usage()
        assert [u["buffers"] for u in usage] == [0, 0, 0]
        assert sum(u["arrivals"] for u in usage) == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(120)
async def test_a_producer_error_that_does_not_pickle_still_fails_its_reader() -> None:
    """The inbox notice carries the error boxed, so any error type reaches the
    reader (some atoll errors cannot be rebuilt from a pickle)."""

    def cancelled(x: np.ndarray) -> np.ndarray:
        raise atoll.kernel.CallCancelled("somewhere", "step", "gave up")

    async with atoll.local_cluster(1, 2, 1, transport="capnp", cost=COST) as cluster:
        first, second = await cluster.devices(1), await cluster.devices(1)
        builder = GraphBuilder()
        x = builder.input(bench.SCALAR)
        [y] = builder.add(Computation("cancelled", cancelled, 1e6), first, [x], [bench.SCALAR])
        [z] = builder.add(bench.step(0.001), second, [y], [bench.SCALAR])
        [out] = cluster.run_graph(builder.build([z]), [np.zeros(1, np.float32)])
        with anyio.fail_after(20), pytest.raises(atoll.AtollError, match="gave up"):
            await cluster.fetch(out)
        usage = await cluster.store_usage()
        assert sum(u["arrivals"] for u in usage) == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(120)
async def test_a_cluster_run_chain_over_processes_pushes_host_to_host() -> None:
    """Each ``cluster.run`` reading the pending output of a ``run`` on another
    host has that output pushed to it; nothing is left behind."""
    add1 = Computation("add1", lambda a: a + 1, 1e6)
    async with atoll.local_cluster(1, 2, 1, transport="capnp", cost=COST) as cluster:
        handle = cluster.run(add1, 0, [np.zeros(1, np.float32)])
        for i in range(1, 8):
            handle = cluster.run(add1, i % 2, [handle])
        assert (await cluster.fetch(handle))[0] == 8
        usage = await cluster.store_usage()
        assert sum(u["pushes_in"] for u in usage) == 7  # every hop, host to host
        assert sum(u["arrivals"] for u in usage) == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(120)
async def test_a_failed_link_of_a_cluster_run_chain_fails_what_follows() -> None:
    def diverge(x: np.ndarray) -> np.ndarray:
        raise FloatingPointError("diverged")

    add1 = Computation("add1", lambda a: a + 1, 1e6)
    async with atoll.local_cluster(1, 2, 1, transport="capnp", cost=COST) as cluster:
        handle = cluster.run(add1, 0, [np.zeros(1, np.float32)])
        handle = cluster.run(Computation("broken", diverge, 1e6), 1, [handle])
        handle = cluster.run(add1, 0, [handle])
        with anyio.fail_after(20), pytest.raises(atoll.RemoteActorError) as info:
            await cluster.fetch(handle)
        assert info.value.exc_type == "builtins.FloatingPointError"
        usage = await cluster.store_usage()
        assert sum(u["arrivals"] for u in usage) == 0


async def test_an_in_process_cluster_run_chain_pushes_when_asked() -> None:
    async with atoll.local_cluster(1, 2, 1, cost=COST, push=True) as cluster:
        handle = cluster.run(bench.step(0.001), 0, [np.zeros(1, np.float32)])
        for i in range(1, 6):
            handle = cluster.run(bench.step(0.001), i % 2, [handle])
        assert (await cluster.fetch(handle))[0] == 6
        usage = await cluster.store_usage()
        assert sum(u["pushes_in"] for u in usage) == 5
        assert sum(u["arrivals"] for u in usage) == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(120)
async def test_one_output_read_by_two_later_calls_and_one_read_long_after() -> None:
    """Two readers ask for the same output; and a reader whose producer's
    device ran many gangs in between, so it no longer remembers the output,
    is pointed at the output by the controller instead."""
    add1 = Computation("add1", lambda a: a + 1, 1e6)
    async with atoll.local_cluster(1, 3, 1, transport="capnp", cost=COST) as cluster:
        made = cluster.run(add1, 0, [np.zeros(1, np.float32)])
        first, second = cluster.run(add1, 1, [made]), cluster.run(add1, 2, [made])
        assert [(await cluster.fetch(h))[0] for h in (first, second)] == [2, 2]
        made = cluster.run(add1, 0, [np.zeros(1, np.float32)])
        busy = [cluster.run(add1, 0, [np.zeros(1, np.float32)]) for _ in range(70)]
        late = cluster.run(add1, 1, [made])
        assert (await cluster.fetch(late))[0] == 2
        assert [(await cluster.fetch(h))[0] for h in busy] == [1] * 70
        usage = await cluster.store_usage()
        assert sum(u["arrivals"] for u in usage) == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(120)
async def test_two_handles_of_one_owner_never_get_each_others_pushes() -> None:
    add = Computation("add", lambda a: a + 1, 1e6)
    async with atoll.local_cluster(1, 2, 1, transport="capnp", cost=COST) as cluster:
        one, two = cluster.client("worker"), cluster.client("worker")
        mine = one.run(add, 0, [np.zeros(1, np.float32)])
        theirs = two.run(add, 0, [np.full(1, 99, np.float32)])
        read = one.run(add, 1, [mine])
        assert (await one.fetch(read))[0] == 2
        assert (await two.fetch(theirs))[0] == 100
