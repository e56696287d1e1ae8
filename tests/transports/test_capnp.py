"""The Cap'n Proto transport between real processes: pipelining, safety, loss."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import struct
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import numpy as np
import pytest

from atoll.kernel import ActorRef, ActorSystem, NodeActor, RemoteActorError, TransportError
from atoll.transports.capnp import CapnpTransport, HostLost, capnp_runtime, parse_address
from atoll.transports.testing import NodeProcess

pytestmark = pytest.mark.anyio
CONF = "atoll.transports.conformance"
TOKEN = b"test-token-123"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # pycapnp is asyncio-only; trio goes through the bridge


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    process = NodeProcess(TOKEN)
    yield process
    assert process.stop() == 0, process.stderr()


@asynccontextmanager
async def connected(
    address: str, token: bytes = TOKEN, heartbeat: tuple[float, float] = (2.0, 6.0)
) -> AsyncIterator[ActorRef[NodeActor]]:
    transport = CapnpTransport(token, heartbeat_s=heartbeat[0], heartbeat_timeout_s=heartbeat[1])
    async with capnp_runtime(), ActorSystem("client") as system:
        connection = await transport.connect(address, system)
        try:
            yield connection.node
        finally:
            await connection.aclose()


class DelayProxy:
    """Forwards TCP bytes both ways, each chunk held back ``delay`` seconds."""

    def __init__(self, target: tuple[str, int], delay: float) -> None:
        self.target, self.delay = target, delay
        self.server: asyncio.Server | None = None
        self.frozen = asyncio.Event()  # once set, bytes stop flowing (a cut cable)

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"capnp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
            )
        finally:
            writer.close()
            up_writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if self.frozen.is_set():
                    await asyncio.Event().wait()
                if not chunk:
                    writer.close()
                    return
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                chunk = await reader.read(1 << 16)
                await queue.put((time.monotonic() + self.delay, chunk))
                if not chunk:
                    break
            await sender
        finally:
            sender.cancel()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.mark.slow
async def test_pipelined_chain_costs_one_round_trip(node: NodeProcess) -> None:
    delay = 0.05  # one way: a round trip is 100 ms
    proxy = DelayProxy(parse_address(node.address), delay)
    address = await proxy.start()
    try:
        async with connected(address) as remote:
            await remote.ping()  # connection warm
            started = time.monotonic()
            chain = remote.spawn(f"{CONF}:Chain")
            for _ in range(10):
                chain = chain.next()
            assert await chain.get_depth() == 10
            pipelined = time.monotonic() - started

            started = time.monotonic()
            ref = await remote.spawn(f"{CONF}:Chain")
            for _ in range(10):
                ref = await ref.next()
            assert await ref.get_depth() == 10
            awaited = time.monotonic() - started
    finally:
        await proxy.close()
    round_trip = 2 * delay
    assert pipelined < 2.5 * round_trip, (pipelined, awaited)
    assert awaited >= 12 * round_trip * 0.95, (pipelined, awaited)


async def test_promise_arguments_pipeline_too(node: NodeProcess) -> None:
    delay = 0.05
    proxy = DelayProxy(parse_address(node.address), delay)
    address = await proxy.start()
    try:
        async with connected(address) as remote:
            echo = await remote.spawn(f"{CONF}:Echo")
            started = time.monotonic()
            value = echo.echo(1)
            for _ in range(10):
                value = echo.echo(value)  # each argument is the previous promise
            assert await value == 1
            elapsed = time.monotonic() - started
    finally:
        await proxy.close()
    assert elapsed < 2.5 * 2 * delay


async def test_large_arrays_cross_processes_intact(node: NodeProcess) -> None:
    async with connected(node.address) as remote:
        echo = await remote.spawn(f"{CONF}:Echo")
        rng = np.random.default_rng(1)
        array = rng.standard_normal((4096, 4096), dtype=np.float32)  # 64 MiB
        back = await echo.echo(array)
        assert back.dtype == array.dtype and back.shape == array.shape
        assert back.tobytes() == array.tobytes()


async def test_wrong_token_gets_nothing(node: NodeProcess) -> None:
    with pytest.raises(TransportError, match="refused"):
        async with connected(node.address, token=b"wrong"):
            pass
    async with connected(node.address) as remote:  # the node is fine
        assert await remote.ping()


def _raw(address: str) -> socket.socket:
    return socket.create_connection(parse_address(address), timeout=10)


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        while True:
            if not sock.recv(1 << 16):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


async def test_silent_peer_is_dropped_after_login_timeout() -> None:
    quick = NodeProcess(TOKEN, extra_args=["--login-timeout", "0.5"])
    try:
        sock = _raw(quick.address)
        assert _closed_by_peer(sock)  # it never logged in: closed, given nothing
        sock.close()
    finally:
        assert quick.stop() == 0


def test_a_node_process_that_never_gets_ready_times_out() -> None:
    # half a ready line, then silence: a blocking readline() would wait forever
    hang = "import signal, sys; sys.stdout.write('ATOLL-NODE'); sys.stdout.flush(); signal.pause()"
    started = time.monotonic()
    with pytest.raises(TransportError, match=r"not ready within 0\.5 s"):
        NodeProcess(TOKEN, timeout=0.5, command=[sys.executable, "-c", hang])
    assert time.monotonic() - started < 30


def test_a_node_process_that_exits_early_reports_its_stderr() -> None:
    with pytest.raises(TransportError, match="no such luck"):
        NodeProcess(TOKEN, command=[sys.executable, "-c", "raise SystemExit('no such luck')"])


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(os.urandom(4096), id="garbage"),
        pytest.param(struct.pack("<II", 0, 1000) + b"\0" * 64, id="truncated-frame"),
        pytest.param(struct.pack("<II", 0, 0x3FFFFFFF) + b"\0" * 64, id="oversized-frame"),
        pytest.param(struct.pack("<II", 0xFFFFFFF, 1), id="absurd-segment-count"),
    ],
)
async def test_bad_bytes_close_only_that_connection(node: NodeProcess, payload: bytes) -> None:
    async with connected(node.address) as remote:
        echo = await remote.spawn(f"{CONF}:Echo")
        sock = _raw(node.address)
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        assert _closed_by_peer(sock)
        sock.close()
        assert await echo.echo("still here") == "still here"
        assert node.alive()


async def test_abrupt_disconnect_leaves_others_alone(node: NodeProcess) -> None:
    async with connected(node.address) as steady:
        counter = await steady.spawn(f"{CONF}:Counter")
        async with connected(node.address) as doomed:
            latch = await doomed.spawn(f"{CONF}:Latch")
            pending = latch.wait()
            await doomed.ping()
        # leaving the block closed that connection with a call still pending
        with pytest.raises(HostLost):
            await pending
        assert await counter.add(2) == 2
        assert node.alive()


async def test_killed_host_fails_pending_calls_with_host_lost() -> None:
    victim = NodeProcess(TOKEN)
    try:
        async with connected(victim.address) as remote:
            latch = await remote.spawn(f"{CONF}:Latch")
            worker = await remote.spawn(f"{CONF}:Worker")
            pending = worker.block(latch)
            await remote.ping()
            victim.kill()
            started = time.monotonic()
            with pytest.raises(HostLost):
                await pending
            assert time.monotonic() - started < 5
            with pytest.raises(HostLost):
                await remote.ping()
    finally:
        victim.kill()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_trio_app_uses_the_cluster_through_the_bridge(node: NodeProcess) -> None:
    from atoll.transports.capnp.bridge import CapnpBridge

    async with CapnpBridge.connect(node.address, TOKEN) as remote:
        counter = await remote.spawn(f"{CONF}:Counter")
        assert [await counter.add(i) for i in (1, 2, 3)] == [1, 3, 6]
        depth = await remote.chain(("spawn", (f"{CONF}:Chain",)), ("next", ()), ("get_depth", ()))
        assert depth == 1
        array = np.arange(12.0).reshape(3, 4)
        echo = await remote.spawn(f"{CONF}:Echo")
        assert np.array_equal(await echo.echo(array), array)
        with pytest.raises(RemoteActorError):
            await (await remote.spawn(f"{CONF}:Failer")).boom("from trio")


async def test_silent_link_loss_is_detected_by_heartbeat(node: NodeProcess) -> None:
    proxy = DelayProxy(parse_address(node.address), 0.0)
    address = await proxy.start()
    try:
        async with connected(address, heartbeat=(0.1, 0.5)) as remote:
            latch = await remote.spawn(f"{CONF}:Latch")
            pending = latch.wait()
            await remote.ping()
            proxy.frozen.set()  # no FIN, no RST: the bytes just stop
            started = time.monotonic()
            with pytest.raises(HostLost, match="heartbeat"):
                await pending
            assert time.monotonic() - started < 5
    finally:
        await proxy.close()


@dataclasses.dataclass
class _Batch:
    """A user value that is neither an array nor a plain container."""

    name: str
    weights: np.ndarray
    small: np.ndarray


async def test_user_values_with_big_arrays_travel_intact(node: NodeProcess) -> None:
    batch = _Batch("b", np.arange(1 << 19, dtype=np.float64), np.ones(3))  # 4 MiB inside
    async with connected(node.address) as remote:
        echo = await remote.spawn(f"{CONF}:Echo")
        back = await echo.echo(batch)
    assert back.name == "b" and np.array_equal(back.weights, batch.weights)
    assert np.array_equal(back.small, batch.small)


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_one_gib_array_does_not_crash_anything(node: NodeProcess) -> None:
    array = np.full(1 << 30, 7, dtype=np.uint8)
    async with connected(node.address) as remote:
        echo = await remote.spawn(f"{CONF}:Echo")
        shape, dtype, total = await echo.describe(array)
    assert (tuple(shape), dtype, total) == ((1 << 30,), "uint8", 7.0 * (1 << 30))
    assert node.alive()
