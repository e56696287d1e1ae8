"""Who may talk to atoll's ports, and what bad input does (``docs/security.md``).

* Every Cap'n Proto port (the controller, a host's direct port, a node)
  hands out nothing before a login with the cluster token, and compares the
  token in constant time.
* A wire fuzzer (hypothesis) against a real node process: random and
  mutated frames before login; after login, structurally valid calls with
  hostile values (wrong kinds, absurd sizes, bad capability indexes,
  truncated pickles, huge offsets). The node survives, a steady client is not
  disturbed, and every bad call is answered. ``ATOLL_FUZZ_EXAMPLES`` sets the
  number of inputs per fuzzer (the long run: 10,000).
"""

from __future__ import annotations

import asyncio
import hmac
import io
import os
import pickle
import socket
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import capnp
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from atoll.benchmarks._testbed import up_cluster
from atoll.kernel import ActorRef, ActorSystem, NodeActor, TransportError
from atoll.kernel.lowlevel import channel_of
from atoll.runtime.client.connect import connect
from atoll.transports.capnp import CapnpTransport, ClusterFile, capnp_runtime, parse_address
from atoll.transports.capnp._schema import schema
from atoll.transports.conformance import Task
from atoll.transports.dataplane import shm
from atoll.transports.testing import NodeProcess

pytestmark = pytest.mark.anyio
TOKEN = b"security-token-0123456789abcdef"
EXAMPLES = int(os.environ.get("ATOLL_FUZZ_EXAMPLES", "150"))
T = TypeVar("T")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # Cap'n Proto paths


# -- every port asks for the token ----------------------------------------------------------
async def _refused_then_admitted(address: str, token: bytes) -> None:
    """A wrong token gets nothing; the right one gets a node that answers."""
    async with capnp_runtime(), ActorSystem("probe") as system:
        for wrong in (b"", b"wrong", token[:-1], token + b"x"):
            with pytest.raises(TransportError, match="refused"):
                await CapnpTransport(wrong).connect(address, system)
        connection = await CapnpTransport(token).connect(address, system)
        try:
            assert await connection.node.ping()
        finally:
            await connection.aclose()


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("port", ["controller", "host"])
async def test_a_cluster_port_requires_the_token(tmp_path: Path, port: str) -> None:
    token = "7e" * 16
    async with capnp_runtime(), up_cluster(1, tmp_path, token) as cluster:
        address = ClusterFile.read(cluster.cluster_file).address
        if port == "host":  # the host's direct port (host-to-host links)
            async with connect(cluster.cluster_file) as client:
                rows = await client.status()
            (address,) = [row["address"] for row in rows if row["kind"] == "host"]
        await _refused_then_admitted(address, bytes.fromhex(token))


async def test_a_node_port_requires_the_token() -> None:
    node = NodeProcess(TOKEN)
    try:
        await _refused_then_admitted(node.address, TOKEN)
    finally:
        assert node.stop() == 0


async def test_the_token_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        compared.append((bytes(a), bytes(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    transport = CapnpTransport(TOKEN)
    async with capnp_runtime(), ActorSystem("server") as server, ActorSystem("c") as client:
        listener = await transport.serve(server)
        try:
            with pytest.raises(TransportError):
                await CapnpTransport(b"guess").connect(listener.address, client)
        finally:
            await listener.aclose()
    assert (b"guess", TOKEN) in compared


# -- the wire fuzzer --------------------------------------------------------------------------
@dataclass
class _Link:
    """A logged-in client on a loop thread of its own (hypothesis drives it
    from the test's thread; capnp objects never leave the loop's)."""

    node: NodeProcess
    loop: asyncio.AbstractEventLoop
    refs: dict[str, ActorRef[Any]]

    def run(self, make: Callable[[], Coroutine[Any, Any, T]], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(timeout)


@pytest.fixture(scope="module")
def link() -> Iterator[_Link]:
    node = NodeProcess(TOKEN)
    loop = asyncio.new_event_loop()
    ready: asyncio.Future[dict[str, ActorRef[Any]]] = loop.create_future()
    done = threading.Event()

    async def serve() -> None:
        async with capnp_runtime(), ActorSystem("fuzzer") as system:
            connection = await CapnpTransport(TOKEN).connect(node.address, system)
            remote: ActorRef[NodeActor] = connection.node
            conf = "atoll.transports.conformance"
            refs = {"node": remote, "echo": await remote.spawn(f"{conf}:Echo")}
            refs["runner"] = await remote.spawn(f"{conf}:Runner")
            ready.set_result(refs)
            while not done.is_set():
                await asyncio.sleep(0.05)
            await connection.aclose()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    refs = asyncio.run_coroutine_threadsafe(_wait(ready), loop).result(60)
    yield _Link(node, loop, refs)
    done.set()
    thread.join(30)
    loop.close()
    assert node.alive(), node.stderr()[-3000:]
    assert node.stop() == 0, node.stderr()[-3000:]


async def _wait(future: asyncio.Future[T]) -> T:
    return await future


def _frame(message: Any) -> bytes:
    data: bytes = message.to_bytes()
    return data


def _rpc_schema() -> Any:
    """Cap'n Proto's own RPC schema, as pycapnp ships it."""
    here = os.path.dirname(capnp.__file__)
    return capnp.load(os.path.join(here, "rpc.capnp"), imports=[os.path.dirname(here)])


def _valid_frames() -> list[bytes]:
    """Well-formed RPC frames of the kinds a client sends first: bootstrap,
    then a call to ``Gate.login`` on the bootstrap's answer (without a token)."""
    rpc = _rpc_schema()
    bootstrap = rpc.Message.new_message()
    bootstrap.init("bootstrap").questionId = 0
    login = rpc.Message.new_message()
    call = login.init("call")
    call.questionId, call.methodId = 1, 0
    call.interfaceId = schema.Gate.schema.node.id
    call.target.init("promisedAnswer").questionId = 0
    frames = [_frame(bootstrap), _frame(login)]
    return [*frames, frames[0] + frames[1]]


_frames = st.one_of(
    st.binary(max_size=4096),
    st.builds(
        lambda frame, cut, flips: _mutate(frame, cut, flips),
        st.sampled_from(_valid_frames()),
        st.integers(0, 512),
        st.lists(st.tuples(st.integers(0, 511), st.integers(0, 255)), max_size=8),
    ),
    st.builds(  # a frame header that promises more than comes, or absurd segment counts
        lambda count, size, tail: count.to_bytes(4, "little") + size.to_bytes(4, "little") + tail,
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**32 - 1),
        st.binary(max_size=64),
    ),
)


def _mutate(frame: bytes, cut: int, flips: list[tuple[int, int]]) -> bytes:
    data = bytearray(frame[: max(1, len(frame) - cut % len(frame))])
    for where, byte in flips:
        data[where % len(data)] = byte
    return bytes(data)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(payload=_frames)
def test_fuzz_before_login_closes_only_that_connection(link: _Link, payload: bytes) -> None:
    with socket.create_connection(parse_address(link.node.address), timeout=10) as sock:
        sock.sendall(payload)
    echo = link.refs["echo"]
    assert link.run(lambda: _echo(echo, "steady")) == "steady"  # others are not disturbed


async def _echo(echo: ActorRef[Any], value: Any) -> Any:
    return await echo.echo(value)


# hostile values, written straight into Value builders (not through atoll's encoder)
_dtypes = st.sampled_from(["<f4", "<i8", "|u1", "zz", "", "O", "V8", "<U3", "<f4" * 50, "|b1"])
_shapes = st.lists(st.integers(0, 2**64 - 1), max_size=5)


@dataclass
class _Hostile:
    kind: str
    dtype: str
    shape: list[int]
    nbytes: int
    data: bytes
    number: int
    depth: int


def _pickle_with_caps(caps: int) -> bytes:
    """A pickle that names capability ``caps`` (set aside by persistent id)."""

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return caps if obj == "cap" else None

    out = io.BytesIO()
    _Pickler(out, protocol=5).dump(Task("t", "cap", 1))  # type: ignore[arg-type]
    return out.getvalue()


_hostiles = st.builds(
    _Hostile,
    kind=st.sampled_from(
        ["array", "buffer", "shm", "pickled", "badcap", "truncated", "error", "nested", "map"]
    ),
    dtype=_dtypes,
    shape=_shapes,
    nbytes=st.integers(0, 2**64 - 1),
    data=st.binary(max_size=256),
    number=st.integers(0, 2**64 - 1),
    depth=st.integers(0, 40),
)


def _fill(builder: Any, hostile: _Hostile) -> None:
    kind = hostile.kind
    if kind == "array":
        array = builder.init("array")
        array.dtype, array.shape, array.data = hostile.dtype, hostile.shape, hostile.data
    elif kind in ("buffer", "shm"):
        ref = builder.init("buffer")
        ref.dtype, ref.shape, ref.nbytes = hostile.dtype, hostile.shape, hostile.nbytes
        if kind == "shm":  # claims shared memory on the node's machine
            ref.shm = f"{shm.PREFIX}{hostile.number % 99999}-x-{hostile.data[:8].hex()}"
            ref.shmOffset, ref.machine = hostile.number, shm.machine_id()
    elif kind == "pickled":
        builder.init("pickled").data = hostile.data
    elif kind == "badcap":  # a persistent id past the capabilities sent
        builder.init("pickled").data = _pickle_with_caps(hostile.number % 1000)
    elif kind == "truncated":
        whole = pickle.dumps(Task("t", None, list(range(50))))  # type: ignore[arg-type]
        builder.init("pickled").data = whole[: hostile.number % len(whole)]
    elif kind == "error":
        error = builder.init("error")
        error.kind, error.message = hostile.dtype, hostile.data.hex()
    elif kind == "nested":
        inner = builder
        for _ in range(hostile.depth):
            inner = inner.init("list", 1)[0]
        inner.text = "deep"
    else:
        entries = builder.init("map", 2)
        for entry in entries:  # duplicate, unhashable-looking keys
            entry.key.init("list", 1)[0].int = 1
            entry.value.float = float("nan")


async def _call_raw(target: ActorRef[Any], endpoint: str, hostile: _Hostile) -> str:
    """Send one hostile call; the kind of answer it got ("value" or "error")."""
    request = channel_of(target).cap.call_request()  # type: ignore[attr-defined]
    request.endpoint = endpoint
    request.callId = hostile.number
    _fill(request.init("args", 1)[0], hostile)
    try:
        response = await asyncio.wait_for(request.send(), 20)
    except capnp.KjException as exc:  # answered, as a capnp error
        return f"error: {exc.description[:60]}"
    which: str = response.result.which()
    return "error" if which == "error" else "value"


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    hostile=_hostiles,
    endpoint=st.sampled_from(["echo", "describe", "keep", "no_such", "", "_private"]),
)
# found by this fuzzer: a buffer whose size does not match its shape hung the call
@example(hostile=_Hostile("buffer", "<f4", [], 0, b"", 0, 0), endpoint="echo")
def test_fuzz_after_login_answers_every_hostile_call(
    link: _Link, hostile: _Hostile, endpoint: str
) -> None:
    target = link.refs["runner" if endpoint == "keep" else "echo"]
    answer = link.run(lambda: _call_raw(target, endpoint, hostile))  # unanswered: times out
    if endpoint in ("no_such", "", "_private"):  # not an endpoint: never a value
        assert answer.startswith("error"), answer
    assert link.run(lambda: _echo(link.refs["echo"], 42)) == 42  # the link still works
