"""Client sessions: a client whose connection ends has what it owned freed.

The controller (a ``ClusterBuilder`` with one host) is served from this test
process; the host runs in-process on the controller's node, so its store is
inspected directly. Clients connect over Cap'n Proto, from here or from a
separate process that the test kills with SIGKILL.

Run as a script (``python test_sessions.py CLUSTER_FILE``), this file is that
separate client: it connects, takes a slice, puts a buffer, prints ``ready``
and waits to be killed.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from atoll.kernel import AtollError
from atoll.runtime.client.anchor import SessionAnchor
from atoll.runtime.client.connect import connect
from atoll.runtime.deploy.process import ClusterInfo
from atoll.transports.capnp import ClusterFile
from atoll.transports.capnp._peer import Peer
from atoll.transports.testing import eventually

from .clusters import REPOSITORY, served_cluster

pytestmark = pytest.mark.anyio
TOKEN = b"session-test-token"
DEVICES = 2


async def buffers(info: ClusterInfo) -> int:
    usage: dict[str, int] = await info.hosts[0].store_usage()
    return usage["buffers"]


async def test_a_killed_client_frees_its_buffers_and_slices_not_anothers(tmp_path: Path) -> None:
    cluster_file = tmp_path / "cluster.json"
    async with served_cluster(TOKEN, DEVICES) as (address, info, _):
        ClusterFile(address, TOKEN).write(cluster_file)
        async with connect(cluster_file) as alice:
            mine = await alice.cluster("alice")
            kept = await mine.put(np.arange(4, dtype=np.float32), 0)
            process = _start_client(cluster_file)
            try:
                doomed = await _ready(process)
                assert doomed != mine.owner and doomed.startswith("doomed#")
                assert await buffers(info) == 2
                with pytest.raises(AtollError, match="not free"):
                    await mine.devices(DEVICES)  # the other client holds one
                process.send_signal(signal.SIGKILL)
                assert process.wait(30) == -signal.SIGKILL
            finally:
                _reap(process)

            async def freed() -> bool:
                return await buffers(info) == 1

            await eventually(freed, "the killed client's buffer is freed")
            assert await info.sessions.sessions() == {1: mine.owner}
            await mine.devices(DEVICES)  # its slice is back too
            np.testing.assert_array_equal(await mine.fetch(kept), np.arange(4))


async def test_a_reconnecting_client_gets_a_fresh_owner_and_keeps_new_buffers() -> None:
    async with served_cluster(TOKEN, DEVICES) as (address, info, _):
        async with connect(address, token=TOKEN) as first:
            before = await first.cluster("bob")
            held = [await before.put(np.ones(8, dtype=np.float32), d) for d in (0, 1)]
            await before.devices(1)
            assert len(held) == 2  # held until the connection goes
        async with connect(address, token=TOKEN) as second:
            after = await second.cluster("bob")
            assert after.owner != before.owner
            handle = await after.put(np.full(3, 7.0, dtype=np.float32), 1)

            async def first_freed() -> bool:
                return await buffers(info) == 1

            await eventually(first_freed, "the first connection's buffers are freed")
            assert await info.sessions.sessions() == {2: after.owner}
            np.testing.assert_array_equal(await after.fetch(handle), np.full(3, 7.0))
            await after.devices(DEVICES)  # the first one's slice is back
        await eventually(_empty(info), "the second connection's buffer is freed")


async def test_a_dropped_tcp_link_frees_what_the_client_owned() -> None:
    async with served_cluster(TOKEN, DEVICES) as (address, info, _):
        proxy = await _CuttableProxy.start(address)
        try:
            async with connect(proxy.address, token=TOKEN) as client:
                cluster = await client.cluster()
                assert cluster.owner.startswith("client#")
                held = await cluster.put(np.zeros(16, dtype=np.float32), 0)
                assert await buffers(info) == 1 and held.nbytes == 64
                proxy.cut()  # the client process lives on; its link is gone
                await eventually(_empty(info), "the cut-off client's buffer is freed")
        finally:
            proxy.close()


async def test_an_in_process_session_ends_only_when_asked() -> None:
    async with served_cluster(TOKEN, DEVICES) as (_, info, system):
        anchor = system.spawn(SessionAnchor)
        owner = await info.sessions.open(anchor, "local")
        await info.devices[0].put(np.ones(2, dtype=np.float32), owner)
        assert await info.sessions.sessions() == {1: owner}
        assert await info.sessions.end(1) == 1
        assert await info.sessions.end(1) == 0  # ending twice frees nothing more
        assert await buffers(info) == 0


def test_peer_close_callbacks_run_once_and_can_be_withdrawn() -> None:
    peer = Peer("test")
    seen: list[str] = []
    peer.on_close(seen.append)
    withdrawn = peer.on_close(lambda reason: seen.append("withdrawn " + reason))
    withdrawn()
    peer.close("gone")
    peer.close("again")
    assert seen == ["gone"]
    peer.on_close(seen.append)()  # already closed: called at once
    assert seen == ["gone", "gone"]


def _empty(info: ClusterInfo) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await buffers(info) == 0

    return check


# -- the client in another process ------------------------------------------------
def _start_client(cluster_file: Path) -> subprocess.Popen[str]:
    """This module as a script: a client that connects, holds things, and waits."""
    command = [sys.executable, "-m", __name__, str(cluster_file)]
    # close_fds=False: posix_spawn, no fork of this (threaded) process
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, close_fds=False, cwd=REPOSITORY
    )


async def _ready(process: subprocess.Popen[str]) -> str:
    """The owner label the client prints once it holds a slice and a buffer."""
    assert process.stdout is not None
    with anyio.fail_after(30):  # read in a thread: this loop serves the controller
        line = await anyio.to_thread.run_sync(process.stdout.readline, abandon_on_cancel=True)
    assert line.startswith("ready "), line
    return line.split()[1]


def _reap(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(30)
    if process.stdout is not None:
        process.stdout.close()


async def _client_main(cluster_file: str) -> None:
    async with connect(cluster_file) as client:
        cluster = await client.cluster("doomed")
        await cluster.devices(1)
        held = await cluster.put(np.ones(1024, dtype=np.float32), 1)
        print(f"ready {cluster.owner}", flush=True)
        await asyncio.Event().wait()  # until killed
        assert held


# -- a TCP link that can be cut ---------------------------------------------------
class _CuttableProxy:
    """Forwards one TCP connection's bytes both ways until ``cut``."""

    def __init__(self, target: tuple[str, int], server: asyncio.Server) -> None:
        self.target = target
        self.server = server
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task[Any]] = set()

    @classmethod
    async def start(cls, address: str) -> _CuttableProxy:
        host, _, port = address.removeprefix("capnp://").rpartition(":")
        proxy: _CuttableProxy

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await proxy._serve(reader, writer)

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        proxy = cls((host, int(port)), server)
        return proxy

    @property
    def address(self) -> str:
        return f"capnp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.writers += [writer, up_writer]
        for source, sink in [(reader, up_writer), (up_reader, writer)]:
            task = asyncio.ensure_future(_pipe(source, sink))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def cut(self) -> None:
        for writer in self.writers:
            writer.close()

    def close(self) -> None:
        self.cut()
        for task in list(self.tasks):
            task.cancel()
        self.server.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(1 << 16):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


if __name__ == "__main__":
    asyncio.run(_client_main(sys.argv[1]))


async def test_a_connected_client_runs_a_program_in_parallel() -> None:
    """Over a connection, promises that settled before they were sent arrive as
    values; parallel dispatch must take them as they come."""
    from atoll.benchmarks import dispatch as bench

    async with (
        served_cluster(TOKEN, DEVICES) as (address, _, _),
        connect(address, token=TOKEN) as client,
    ):
        cluster = await client.cluster()
        slices = [await cluster.devices(1) for _ in range(DEVICES)]
        graph = bench.chain_graph(slices, bench.step(0.0))
        x = await cluster.put(np.zeros(1, np.float32), 0)
        for _ in range(3):
            [out] = cluster.run_graph(graph, [x])
            assert (await cluster.fetch(out))[0] == DEVICES
            await cluster.free(out)
