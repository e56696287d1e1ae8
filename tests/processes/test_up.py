"""``atoll up``: a controller and host processes; clients reach it with connect."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import atoll
from atoll.devices import BufferHandle, Computation
from atoll.examples.demo import affine
from atoll.kernel import Promise
from atoll.runtime.client.connect import connect
from atoll.transports.capnp import HostLost
from atoll.transports.testing import line_with, pid_alive

from .clusters import atoll_child, atoll_up

pytestmark = pytest.mark.anyio
STEP = Computation("affine", affine, flops=1e6)


def make_big(x: np.ndarray) -> np.ndarray:
    """32 MiB made on a host (host processes import this module by name)."""
    return np.full(8 << 20, x[0], dtype=np.float32)


def total(x: np.ndarray) -> np.ndarray:
    return np.asarray([x.sum(dtype=np.float64)])


def _sent(pid: int) -> int:
    """Bytes sent so far on the TCP sockets of process ``pid`` (from ``ss``)."""
    ss = shutil.which("ss")
    assert ss is not None
    out = subprocess.run(  # close_fds=False: posix_spawn, no fork of this threaded process
        [ss, "-tinpOH"], capture_output=True, text=True, check=True, close_fds=False
    ).stdout
    total = 0
    for line in out.splitlines():
        if f"pid={pid}," in line:
            total += sum(int(f.split(":")[1]) for f in line.split() if f.startswith("bytes_sent:"))
    return total


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # trio: through the bridge
@pytest.mark.timeout(120)
async def test_up_runs_a_chain_across_host_processes_and_sees_a_host_die(tmp_path: Path) -> None:
    cluster_file = tmp_path / "cluster.json"
    host_pids: list[int] = []
    up_args = ["--hosts", "1", "--remote-hosts", "1", "--devices-per-host", "2"]
    with atoll_up(up_args, cluster_file, "42" * 16) as up:
        # the controller listens and has written its cluster file; then a host
        # "from another machine" joins with only the address and that file
        line = line_with(up, "listening at")
        address = line.split("listening at ")[1].split(";")[0]
        no_token = {k: v for k, v in os.environ.items() if k != "ATOLL_TOKEN"}
        joiner = atoll_child(
            ["host", "--join", address, "--cluster-file", str(cluster_file)],
            no_token,
            stdout=subprocess.DEVNULL,
        )
        line_with(up, "cluster up")
        async with connect(cluster_file) as client:
            cluster = await client.cluster()
            handle = cluster.put(np.arange(4, dtype=np.float32), 0)
            for device in [0, 2, 1, 3]:  # hosts 0, 1, 0, 1
                handle = cluster.run(STEP, device, [handle])
            expected = np.arange(4, dtype=np.float32)
            for _ in range(4):
                expected = affine(expected)
            np.testing.assert_allclose(await cluster.fetch(handle), expected, rtol=1e-6)

            status = [row for row in await client.status() if row["kind"] == "host"]
            host_pids = [h["pid"] for h in status]
            assert all(h["alive"] for h in status) and len(host_pids) == 2

            never: Promise[BufferHandle] = Promise("never")
            stuck = cluster.run(STEP, 2, [never])  # waits on host 1 forever
            await client.node.ping()
            os.kill(host_pids[1], signal.SIGKILL)
            with pytest.raises(HostLost):
                await cluster.fetch(stuck)
            status = [row for row in await client.status() if row["kind"] == "host"]
            assert [h["alive"] for h in status] == [True, False]
            assert status[1]["error"]  # why it is lost
    joiner.wait(30)  # it leaves when its controller goes
    assert not any(pid_alive(pid) for pid in host_pids)  # no orphans


@pytest.mark.timeout(120)
def test_up_keeps_its_cluster_file_in_a_private_directory_by_default(tmp_path: Path) -> None:
    expected = tmp_path / "atoll" / "cluster.json"
    with atoll_up(
        ["--hosts", "1", "--devices-per-host", "1"], None, "33" * 16, XDG_RUNTIME_DIR=str(tmp_path)
    ) as up:
        listening = line_with(up, "listening at")
        line_with(up, "cluster up")
        assert stat.S_IMODE(expected.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(expected.stat().st_mode) == 0o600
    assert f"cluster file {expected}" in listening  # it says where the token went
    assert not expected.exists()  # removed once the cluster stopped: connect() finds none


async def test_capnp_is_a_parameter_of_local_cluster() -> None:
    async with atoll.local_cluster(1, 2, 1, transport="capnp") as cluster:
        x = cluster.put(np.ones(3, dtype=np.float32), 0)
        y = cluster.run(STEP, 1, [cluster.run(STEP, 0, [x])])
        np.testing.assert_allclose(await cluster.fetch(y), affine(affine(np.ones(3, np.float32))))
        stats = await cluster.device_stats()
        assert [s.computations for s in stats] == [1, 1]


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_jax_devices_in_host_processes() -> None:
    from atoll.devices.jax import JaxDevice

    async with atoll.local_cluster(1, 2, 2, transport="capnp", device_cls=JaxDevice) as cluster:
        x = cluster.put(np.arange(6, dtype=np.float32), 1)  # host 0
        y = cluster.run(STEP, 3, [cluster.run(STEP, 2, [x])])  # host 1, then again
        expected = affine(affine(np.arange(6, dtype=np.float32)))
        np.testing.assert_allclose(await cluster.fetch(y), expected, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to count bytes")
@pytest.mark.timeout(120)
async def test_bulk_data_between_hosts_skips_the_controller(tmp_path: Path) -> None:
    cluster_file = tmp_path / "cluster.json"
    with atoll_up(["--hosts", "2", "--devices-per-host", "1"], cluster_file, "24" * 16) as up:
        line_with(up, "cluster up")
        async with connect(cluster_file) as client:
            cluster = await client.cluster()
            seed = cluster.put(np.full(4, 3.0, dtype=np.float32), 0)
            big = cluster.run(Computation("big", make_big, 1e6), 0, [seed])  # 32 MiB on host 0
            await big
            sent = _sent(up.pid)
            summed = await cluster.fetch(cluster.run(Computation("sum", total, 1e6), 1, [big]))
            assert summed[0] == pytest.approx(3.0 * (8 << 20))  # host 1 read all of it
            assert _sent(up.pid) - sent < (4 << 20), _sent(up.pid) - sent  # not via here


async def test_stopping_hosts_leaves_the_loop_free_and_kills_the_stubborn() -> None:
    from atoll.runtime.deploy.process import _stop_hosts

    ignore_int = "import signal as s; s.signal(s.SIGINT, s.SIG_IGN); print(flush=True); s.pause()"
    stubborn = subprocess.Popen(  # close_fds=False: posix_spawn, no fork of this process
        [sys.executable, "-c", ignore_int], stdout=subprocess.PIPE, close_fds=False
    )
    assert stubborn.stdout is not None
    stubborn.stdout.readline()  # SIGINT, the stop it gets, is ignored from now on
    stopping = asyncio.create_task(_stop_hosts([stubborn], grace=0.5))
    await asyncio.sleep(0)  # the stop begins (SIGINT) and waits off the loop: we run on
    assert not stopping.done()
    await stopping
    assert stubborn.returncode == -signal.SIGKILL
    stubborn.stdout.close()
