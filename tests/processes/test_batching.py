"""Implicit batching: ``cluster.run`` calls made in one loop turn go as one
graph when some read others (``runtime/client/batching.py``); here over host processes.

Each test checks the values, what ran compiled (the controller's
``plan_stats``), and what the hosts' stores hold afterwards: only what the
caller can still reach.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

import atoll
from atoll.devices import BufferHandle, Computation
from atoll.kernel import Promise
from atoll.transports.capnp._stream import wire_stats

ADD1 = Computation("add1", functools.partial(np.add, np.float32(1)))


pytestmark = pytest.mark.anyio


def chain(cluster: atoll.Cluster, devices: list[int], x: Any) -> Promise[BufferHandle]:
    """``x + len(devices)``, one ``run`` per device, each reading the one before."""
    handle = cluster.run(ADD1, devices[0], [x])
    for device in devices[1:]:
        handle = cluster.run(ADD1, device, [handle])
    return handle


async def buffers(cluster: atoll.Cluster) -> list[int]:
    return [usage["buffers"] for usage in await cluster.store_usage()]


async def test_a_chain_runs_compiled_planned_once_and_frees_its_links() -> None:
    async with atoll.local_cluster(1, 4, 1, transport="capnp") as cluster:
        devices = [i % 4 for i in range(32)]
        for _ in range(2):
            assert float(await cluster.fetch(chain(cluster, devices, np.float32(0)))) == 32.0
        before = wire_stats()
        tail = chain(cluster, devices, np.float32(1))
        assert float(await cluster.fetch(tail)) == 33.0
        frames = wire_stats().frames - before.frames
        stats = await cluster.controller.plan_stats()
        assert stats["compiled_runs"] == 3 and stats["plans"] == 1 and stats["hits"] == 2
        assert frames <= 4 * 4  # a run_plan and a report per host, not a call per link
        # only the tail the caller holds: the two before went with their last references
        assert await buffers(cluster) == [0, 0, 0, 1]
        assert await cluster.free(tail)
        assert await buffers(cluster) == [0, 0, 0, 0]


async def test_a_link_the_caller_keeps_is_kept_and_the_others_freed() -> None:
    async with atoll.local_cluster(1, 4, 1, transport="capnp") as cluster:
        first = cluster.run(ADD1, 0, [np.float32(0)])
        last = cluster.run(ADD1, 2, [cluster.run(ADD1, 1, [first])])
        assert float(await cluster.fetch(last)) == 3.0
        assert float(await cluster.fetch(first)) == 1.0
        assert await buffers(cluster) == [1, 0, 1, 0]  # the middle one was dropped: freed
        assert (await cluster.controller.plan_stats())["compiled_runs"] == 1
        assert await cluster.free(first) and await cluster.free(last)
        assert await buffers(cluster) == [0, 0, 0, 0]


async def test_a_failing_link_fails_only_what_reads_it() -> None:
    def fail(a: np.ndarray) -> np.ndarray:
        raise ValueError(f"made to fail on {a}")

    async with atoll.local_cluster(1, 4, 1, transport="capnp") as cluster:
        ok = cluster.run(ADD1, 0, [np.float32(0)])
        after = cluster.run(ADD1, 2, [cluster.run(Computation("fail", fail), 1, [ok])])
        beside = cluster.run(ADD1, 3, [ok])
        assert float(await cluster.fetch(beside)) == 2.0
        with pytest.raises(Exception, match=r"made to fail on 1\.0"):
            await cluster.fetch(after)
        assert float(await cluster.fetch(ok)) == 1.0
        assert await cluster.free(ok) and await cluster.free(beside)
        assert await buffers(cluster) == [0, 0, 0, 0]


async def test_calls_that_read_no_other_call_go_one_by_one() -> None:
    """Independent calls stay runs of their own (the session's quota and
    share count them one by one), even when made in one turn: one compiled
    one-node run each, all of one plan per device."""
    async with atoll.local_cluster(1, 4, 1, transport="capnp") as cluster:
        outs = [cluster.run(ADD1, d, [np.float32(d)]) for d in range(4)]
        assert [float(await cluster.fetch(out)) for out in outs] == [1.0, 2.0, 3.0, 4.0]
        more = [cluster.run(ADD1, d, [np.float32(d)]) for d in range(4)]
        assert [float(await cluster.fetch(out)) for out in more] == [1.0, 2.0, 3.0, 4.0]
        stats = await cluster.controller.plan_stats()
        assert stats["compiled_runs"] == 8 and stats["plans"] == 4


async def test_a_large_input_put_for_a_chain_is_freed_after_it() -> None:
    big = np.ones(1 << 16, np.float32)  # 256 KiB: put on its device, not inside the call
    async with atoll.local_cluster(1, 4, 1, transport="capnp") as cluster:
        tail = chain(cluster, [0, 1, 2], big)
        np.testing.assert_array_equal(await cluster.fetch(tail), big + 3)
        assert await buffers(cluster) == [0, 0, 1, 0]
        assert (await cluster.controller.plan_stats())["compiled_runs"] == 1


async def test_batching_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATOLL_BATCH_RUNS", "0")
    async with atoll.local_cluster(1, 4, 1, transport="capnp") as cluster:
        assert float(await cluster.fetch(chain(cluster, [0, 1, 2, 3], np.float32(0)))) == 4.0
        # unbatched: each call went on its own, as a run of one node
        assert (await cluster.controller.plan_stats())["compiled_runs"] == 4
