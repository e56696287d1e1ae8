"""What an operation puts on the wire: frames (socket writes) counted, and pinned.

Each Cap'n Proto stream gathers what one event-loop turn writes into one
frame (``transports/capnp/_stream.py``), and counts frames and bytes per
process. These tests count the driver's side: the controller and the client
run here, the hosts in processes of their own. The pins are today's figures
with a little slack for a heartbeat; issue 10's target is lower (one message
each way per host per call or per run), and these pins are lowered as the
fast path gets there.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import atoll
from atoll.devices import Aval, Computation
from atoll.runtime import GraphBuilder
from atoll.transports.capnp._stream import wire_stats

ADD1 = Computation("add1", functools.partial(np.add, np.float32(1)))
SCALAR = Aval((), "float32")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # pycapnp is asyncio-only


pytestmark = pytest.mark.anyio


async def test_an_awaited_op_by_op_call_costs_three_frames_and_fetch_none() -> None:
    async with atoll.local_cluster(1, 1, 1, transport="capnp") as cluster:
        x = np.array(1.0, dtype=np.float32)
        for _ in range(5):  # warm up: connections, imports on the host
            x = await cluster.fetch(cluster.run(ADD1, 0, [cluster.put(x, 0)]))
        before, calls = wire_stats(), 50
        for _ in range(calls):
            x = await cluster.fetch(cluster.run(ADD1, 0, [cluster.put(x, 0)]))
        after = wire_stats()
        assert x.shape == () and float(x) == 56.0  # a 0-d array stays 0-d over the wire
        assert after.frames - before.frames <= 3 * calls + 2  # + a heartbeat or two
        handle = await cluster.run(ADD1, 0, [cluster.put(x, 0)])
        before = wire_stats()
        assert float(await cluster.fetch(handle)) == 57.0  # small: it came with the handle
        assert wire_stats().frames == before.frames


async def test_a_small_array_by_value_costs_three_frames_a_call() -> None:
    """The array rides in the call and the result in its handle: the call's
    frame, then the one that finishes the question (capnp's ``Finish``); and
    the free of the result the caller dropped (one ``free_many`` per turn)."""
    async with atoll.local_cluster(1, 1, 1, transport="capnp") as cluster:
        x = np.array(1.0, dtype=np.float32)
        for _ in range(5):
            x = await cluster.fetch(cluster.run(ADD1, 0, [x]))
        before, calls = wire_stats(), 50
        for _ in range(calls):
            x = await cluster.fetch(cluster.run(ADD1, 0, [x]))
        assert float(x) == 56.0
        assert wire_stats().frames - before.frames <= 3 * calls + 2


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "per-gang"])
async def test_a_128_node_program_over_four_hosts_stays_under_its_pin(compiled: bool) -> None:
    """Compiled (the default over host processes), a run costs the driver a
    few frames per host (``run_plan``, its report, capnp's bookkeeping),
    whatever the program's size; gang by gang (a plan per gang, each input
    the promise of its producer's output), under 4 frames per node. (Pushes
    between hosts are the hosts' frames, not counted here.)"""
    async with atoll.local_cluster(1, 4, 1, transport="capnp") as cluster:
        assert await cluster.controller.set_compile(compiled) is compiled
        slices = [await cluster.devices(1) for _ in range(4)]
        builder = GraphBuilder()
        value = builder.input(SCALAR)
        for i in range(128):
            (value,) = builder.add(ADD1, slices[i % 4], [value], [SCALAR])
        graph = builder.build([value])
        await cluster.fetch(cluster.run_graph(graph, [np.float32(0)])[0])
        before = wire_stats()
        out = await cluster.fetch(cluster.run_graph(graph, [np.float32(0)])[0])
        after = wire_stats()
        assert float(out) == 128.0
        frames, size = after.frames - before.frames, after.bytes - before.bytes
        if compiled:
            assert frames <= 4 * 4
            assert size <= 800 * 4
        else:
            assert frames <= 4 * 128
            assert size <= 1600 * 128
