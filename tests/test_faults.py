"""Faults injected into a cluster of real processes (``benchmarks/faults.py``).

A short, seeded run of ``atoll bench faults`` (every kind of fault at least
once), and the frozen host on its own: a host stopped with SIGSTOP is given
up by the controller's heartbeat within its bound, and the calls pending on
it fail with ``HostLost``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

from atoll.benchmarks.faults import FAULT_KINDS, HEARTBEAT, STEP, run_faults, up_cluster
from atoll.devices import BufferHandle
from atoll.examples.demo import affine
from atoll.kernel import Promise
from atoll.runtime.connect import connect
from atoll.transports.capnp import HostLost, capnp_runtime

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # Cap'n Proto paths


@pytest.mark.timeout(150)
async def test_random_faults_lose_nothing_and_leave_nothing_behind() -> None:
    report = await run_faults(seconds=45, seed=3, hosts=4, clients=2, bound=30)
    assert report.ok(), report  # no hang, wrong result, independent failure, leak or orphan
    assert set(report.faults) == set(FAULT_KINDS), report  # each kind at least once
    assert report.correct > 0 and report.survived > 0, report


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
