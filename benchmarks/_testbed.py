"""The fault suite's test bed: ``atoll up`` with a fast heartbeat, a TCP
proxy whose links can be cut, a bulk relay that aborts a transfer, and
the helpers that lose and rejoin hosts. ``benchmarks/faults.py`` drives it
(``atoll bench faults``), and tests that need such a cluster take it from
here (``tests/processes/test_faults.py``, ``tests/runtime/test_lanes.py``,
``tests/transports/test_security.py``).

What is asynchronous about it: the cluster is an async context manager
(``atoll up`` starts and stops in a worker thread, so the loop keeps
serving); :class:`Proxy` and :class:`Relay` serve on the running asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from ..kernel.config import Settings, env_name
from ..runtime.client.connect import connect
from ..transports.capnp import ClusterFile
from ..transports.dataplane import bulk
from ..transports.processes import reap
from ..transports.testing import line_with

__all__ = [
    "HEARTBEAT",
    "STORE_WAIT_S",
    "Proxy",
    "Relay",
    "Testbed",
    "rejoin_host",
    "spawn_module",
    "stopped_hosts",
    "until_lost",
    "up_cluster",
    "wait_exit",
]

HEARTBEAT = (0.5, 2.0)  # the controller's host heartbeat in these runs: lost within 2.5 s
STORE_WAIT_S = 3.0  # how long work waits for room before StoreFull (ATOLL_STORE_WAIT_S)
CUT_AFTER = 1 << 20  # a cut bulk transfer is aborted after this many bytes reached its reader


# -- a TCP proxy whose links can be cut -------------------------------------------------
class Proxy:
    """Forwards TCP connections to ``target``; :meth:`cut` drops every live one."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self.writers |= {writer, up_writer}
        await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        self.writers -= {writer, up_writer}

    def cut(self) -> int:
        """Drop every link (an RST, as a cable pulled); returns how many."""
        cut = len(self.writers) // 2
        for writer in list(self.writers):
            writer.transport.abort()
        self.writers.clear()
        return cut

    async def aclose(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    writer.transport.abort()


class Relay:
    """The bulk relay the hosts read arrays through (``ATOLL_BULK_RELAY``, see
    ``transports/dataplane/bulk.py``); :meth:`cut_next` cuts the next transfer midway."""

    def __init__(self) -> None:
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.streams = 0  # transfers relayed
        self._armed: asyncio.Event | None = None  # set once the armed cut was made

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    def arm(self) -> asyncio.Event:
        """From now on, abort the next transfer after ``CUT_AFTER`` bytes
        reached its reader (both sockets reset); the event is set once done."""
        self._armed = asyncio.Event()
        return self._armed

    async def cut_next(self, timeout: float) -> bool:
        """:meth:`arm`, and wait for the cut; False if no transfer got that
        far within ``timeout`` (then disarmed)."""
        armed = self.arm()
        with anyio.move_on_after(timeout):
            await armed.wait()
        self._armed = None
        return armed.is_set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One transfer: the holder's address, then the stream both ways."""
        try:
            hello = await reader.readexactly(bulk.RELAY_HELLO.size)
            where = await reader.readexactly(bulk.RELAY_HELLO.unpack(hello)[0])
            host, _, port = where.decode().rpartition(":")
            up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
        except (OSError, ValueError, asyncio.IncompleteReadError):
            writer.transport.abort()
            return
        self.streams += 1
        await asyncio.gather(_pump(reader, up_writer), self._down(up_reader, writer, up_writer))

    async def _down(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: Any
    ) -> None:
        """Holder to reader, closed in order at its end, or reset midway when armed."""
        sent = 0
        with contextlib.suppress(OSError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
                sent += len(data)
                armed = self._armed
                if armed is not None and not armed.is_set() and sent >= CUT_AFTER:
                    armed.set()
                    writer.transport.abort()
                    upstream.transport.abort()
                    return
            writer.close()
            await writer.wait_closed()
        upstream.transport.abort()

    async def aclose(self) -> None:
        if self.server is not None:
            self.server.close()


# -- the cluster -----------------------------------------------------------------------------
def spawn_module(args: Sequence[str], env: dict[str, str], **popen: Any) -> subprocess.Popen[str]:
    """``python -m ARGS`` as a child (posix_spawn: no fork of this process)."""
    command = [sys.executable, "-m", *args]
    return subprocess.Popen(command, env=env, close_fds=False, text=True, **popen)


@dataclass
class Testbed:
    """An ``atoll up`` cluster, its host pids, and its files."""

    up: subprocess.Popen[str]
    cluster_file: Path
    proxied_file: Path
    host_pids: list[int]
    env: dict[str, str]  # for clients
    host_env: dict[str, str]  # for hosts


@contextlib.asynccontextmanager
async def up_cluster(
    hosts: int,
    workdir: Path,
    token: str,
    relay: str = "",
    store_bytes: int | None = None,
    scheduler: str = "share",
) -> AsyncIterator[Testbed]:
    """``atoll up --hosts HOSTS`` with a fast host heartbeat; stopped on the way out.

    ``relay``: the hosts are machines of their own to one another, and read
    arrays through this bulk relay. ``store_bytes``: each host's store limit
    (work waits ``STORE_WAIT_S`` for room). ``scheduler``: the islands' policy."""
    fast = Settings().replace(host_heartbeat=HEARTBEAT, store_wait_s=STORE_WAIT_S)
    env = dict(os.environ, **fast.to_env(), **{env_name("token"): token})
    cluster_file = workdir / "cluster.json"
    args = ["up", "--hosts", str(hosts), "--devices-per-host", "1", "--scheduler", scheduler]
    if store_bytes is not None:
        args += ["--store-bytes", str(store_bytes)]
    host_env = dict(env)
    if relay:
        host_env.update({env_name("machine_id"): "per-process", env_name("bulk_relay"): relay})
        env[env_name("machine_id")] = "per-process"  # clients too, without the relay
    up = spawn_module(
        ["atoll.cli", *args, "--cluster-file", str(cluster_file)], host_env, stdout=subprocess.PIPE
    )
    try:
        await anyio.to_thread.run_sync(line_with, up, "cluster up")
        async with connect(cluster_file) as client:
            rows = await client.status()
        pids = [row["pid"] for row in rows if row["kind"] == "host"]
        yield Testbed(up, cluster_file, workdir / "proxied.json", pids, env, host_env)
    finally:
        for pid in stopped_hosts:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        up.send_signal(signal.SIGTERM)
        await anyio.to_thread.run_sync(wait_exit, up, 60.0)


stopped_hosts: set[int] = set()  # hosts frozen now: woken before the cluster stops


async def rejoin_host(cluster: Testbed) -> tuple[subprocess.Popen[str], int]:
    """``atoll host --join`` of a new host process, which takes the place of
    a lost host (the cluster is full otherwise); it and the host id it got,
    once it has joined. Its stdout is a pipe, for ``_close`` to close."""
    address = ClusterFile.read(cluster.cluster_file).address
    args = ["atoll.cli", "host", "--join", address]
    joiner = spawn_module(args, cluster.host_env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        line = await anyio.to_thread.run_sync(line_with, joiner, " joined ")
    except BaseException:
        joiner.kill()
        await anyio.to_thread.run_sync(wait_exit, joiner, 10.0)
        raise
    return joiner, int(line.split()[2])  # "atoll host N joined ADDRESS, serving ..."


async def until_lost(cluster: Testbed, host_id: int, timeout: float = 15.0) -> None:
    """Wait until the controller counts host ``host_id`` as lost (``status``)."""
    async with connect(cluster.cluster_file) as client:
        with anyio.fail_after(timeout):
            while True:
                rows = await client.status()
                if any(
                    r["kind"] == "host" and r["host"] == host_id and not r["alive"] for r in rows
                ):
                    return
                await anyio.sleep(0.2)


def wait_exit(process: subprocess.Popen[Any], timeout: float) -> None:
    """Wait for a process that is leaving by itself; kill it after ``timeout`` s."""
    reap([process], time.monotonic() + timeout)
