"""Faults injected into a cluster of real processes (``benchmarks/faults.py``).

A short, seeded run of ``atoll bench faults`` (every kind of fault at least
once), and some kinds on their own, where what they must do is checked
exactly: a host stopped with SIGSTOP is given up by the controller's
heartbeat within its bound, and the calls pending on it fail with
``HostLost``; a bulk transfer cut midway ends in the right value; a full
store fails work with ``StoreFull`` within its bound, and is emptied when
its filler leaves; a host killed with ``kill -9`` is replaced by a new
``atoll host --join`` process, which later programs use.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from atoll.benchmarks._testbed import (
    HEARTBEAT,
    STORE_WAIT_S,
    Relay,
    rejoin_host,
    until_lost,
    up_cluster,
)
from atoll.benchmarks.faults import BIG, FAULT_KINDS, STEP, expected, run_faults
from atoll.devices import BufferHandle
from atoll.examples.demo import affine
from atoll.kernel import AtollError, Promise
from atoll.runtime.client.connect import connect
from atoll.transports.capnp import HostLost, capnp_runtime

pytestmark = pytest.mark.anyio


@pytest.mark.slow
@pytest.mark.timeout(240)  # past the harness's own bound: 60 s, then 4 x 30 s per client to end
async def test_random_faults_lose_nothing_and_leave_nothing_behind() -> None:
    report = await run_faults(seconds=60, seed=3, hosts=4, clients=2, bound=30)
    assert report.ok(), report  # no hang, wrong result, independent failure, leak or orphan
    assert set(report.faults) == set(FAULT_KINDS), report  # each kind at least once
    assert report.correct > 0 and report.survived > 0, report


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_a_frozen_host_is_given_up_within_the_heartbeat_bound(tmp_path: Path) -> None:
    bound = sum(HEARTBEAT)
    async with (
        capnp_runtime(),
        up_cluster(2, tmp_path, "5a" * 16) as cluster,
        connect(cluster.cluster_file) as client,
    ):
        handle = await client.cluster("frozen")
        never: Promise[BufferHandle] = Promise("never")
        stuck = handle.run(STEP, 1, [never])  # waits on host 1 for ever
        await client.node.ping()
        os.kill(cluster.host_pids[1], signal.SIGSTOP)
        began = time.monotonic()
        try:
            with pytest.raises(HostLost), anyio.fail_after(bound + 10):
                await handle.fetch(stuck)
            assert time.monotonic() - began < bound + 3
            ones = np.ones(4, dtype=np.float32)  # the other host still works
            result = handle.run(STEP, 0, [handle.put(ones, 0)])
            np.testing.assert_array_equal(await handle.fetch(result), affine(ones))
        finally:
            os.kill(cluster.host_pids[1], signal.SIGCONT)


def test_a_fault_survives_only_with_a_correct_result_before_the_next() -> None:
    from atoll.benchmarks.faults import _survived

    assert _survived([10.0, 20.0, 30.0], [15.0, 35.0]) == 2  # the second fault: none before 30
    assert _survived([10.0], []) == 0
    assert _survived([], [5.0]) == 0


def test_a_rejoin_survives_only_with_a_correct_result_on_the_host_that_joined() -> None:
    from atoll.benchmarks.faults import _survived_each

    hosts = [[0], [1, 2]]  # the hosts each correct result ran on
    assert _survived_each([10.0, 20.0], [15.0, 25.0], [1, None], hosts) == [False, True]
    assert _survived_each([10.0, 20.0], [15.0, 25.0], [None, 2], hosts) == [True, True]


@pytest.mark.timeout(90)
async def test_a_bulk_transfer_cut_midway_still_gives_the_right_value(tmp_path: Path) -> None:
    relay = Relay()
    await relay.start()
    try:
        async with (
            capnp_runtime(),
            up_cluster(2, tmp_path, "6c" * 16, relay=relay.address) as cluster,
            connect(cluster.cluster_file) as client,
        ):
            handle = await client.cluster("bulk")
            big = np.full(BIG, 3.0, dtype=np.float32)
            first = handle.put(big, 0)
            await first  # host 0 read it from this process, through the relay
            streams = relay.streams
            cut = relay.arm()  # the next transfer through the relay is cut midway:
            result = handle.run(STEP, 1, [handle.run(STEP, 0, [first])])
            with anyio.fail_after(30):
                value = await handle.fetch(result)  # (this process reads it directly)
            assert cut.is_set() and relay.streams > streams  # host 0 to host 1, reset ...
            np.testing.assert_array_equal(value, expected(3.0, 2, BIG))  # ... and it is right
            assert (await handle.store_usage())[1]["chunks_in"] >= 1  # read again, in chunks
    finally:
        await relay.aclose()


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_a_full_store_fails_work_in_its_bound_and_empties_when_its_filler_leaves(
    tmp_path: Path,
) -> None:
    from atoll.benchmarks.faults import _fill_until_full, _owner_bytes, _store_full

    async with capnp_runtime(), up_cluster(2, tmp_path, "6d" * 16, store_bytes=8 << 20) as cluster:
        async with connect(cluster.cluster_file) as filler:
            full = await filler.cluster("filler")
            held: list[Any] = []  # what fills the store, held by its client
            assert await _fill_until_full(full, 1, 30, held)
            async with connect(cluster.cluster_file) as client:
                handle = await client.cluster("worker")
                big = np.full(BIG, 1.0, dtype=np.float32)
                began = time.monotonic()
                with pytest.raises(AtollError) as failed, anyio.fail_after(STORE_WAIT_S + 10):
                    await handle.fetch(handle.run(STEP, 1, [handle.put(big, 0)]))
                assert _store_full(failed.value), failed.value
                assert time.monotonic() - began >= STORE_WAIT_S - 0.5  # it waited for room
        assert await _owner_bytes(cluster, 1, full.owner) == 0  # freed with its session
        async with connect(cluster.cluster_file) as client:
            handle = await client.cluster("after")
            value = await handle.fetch(handle.run(STEP, 1, [handle.put(big, 0)]))
            np.testing.assert_array_equal(value, expected(1.0, 1, BIG))


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_a_killed_host_is_replaced_by_one_that_joins(tmp_path: Path) -> None:
    async with (
        capnp_runtime(),
        up_cluster(2, tmp_path, "6e" * 16) as cluster,
        connect(cluster.cluster_file) as client,
    ):
        before = await client.cluster("before")
        os.kill(cluster.host_pids[1], signal.SIGKILL)
        await until_lost(cluster, 1)
        ones = np.ones(4, dtype=np.float32)
        with pytest.raises(HostLost):
            await before.fetch(before.run(STEP, 1, [ones]))
        joiner, host = await rejoin_host(cluster)
        try:
            assert host == 1
            with pytest.raises(RuntimeError):  # no other place free: "the cluster is full"
                await rejoin_host(cluster)
            after = await client.cluster("after")
            result = after.run(STEP, 0, [after.run(STEP, 1, [after.put(ones, 1)])])
            np.testing.assert_array_equal(await after.fetch(result), expected(1.0, 2, 4))
            rows = {r["host"]: r for r in await client.status() if r["kind"] == "host"}
            assert rows[1]["alive"] and rows[1]["pid"] == joiner.pid
        finally:
            joiner.terminate()
            joiner.wait(30)
            assert joiner.stdout is not None
            joiner.stdout.close()
