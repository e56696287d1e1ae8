"""The Cap'n Proto transport: serve an actor system over TCP, connect to one.

Use it inside :func:`capnp_runtime` (asyncio only: pycapnp's RPC runs on
asyncio). Every connection starts at a ``Gate``: the client must log in with
the cluster token before it gets any capability; a wrong token, or no login
within ``login_timeout`` seconds, closes the connection.

Addresses look like ``capnp://127.0.0.1:7000``; serving on port 0 picks a free
port, and the listener's ``address`` tells which. The default host is
127.0.0.1: nothing listens beyond this machine unless asked to.

A served connection may have at most ``max_calls`` calls not answered yet
(beyond that the node stops reading its socket until some are), and as many
answers its client has not taken yet (beyond that further calls are refused
with ``MailboxFull``): ``ATOLL_CONNECTION_CALLS``, default 4096, 0 for no
bound. See ``_peer``'s docstring.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import capnp

from ...kernel import ActorRef, ActorSystem, NodeActor, TransportError
from ...kernel.config import launched, settings
from .. import oneway
from ..dataplane import bulk, lane
from ._peer import GateServer, Peer, heartbeat
from ._schema import schema
from ._stream import GatheringTransport, connect_stream, serve_streams

__all__ = [
    "CapnpConnection",
    "CapnpListener",
    "CapnpTransport",
    "capnp_runtime",
    "default_token",
    "parse_address",
]

_in_runtime: contextvars.ContextVar[bool] = contextvars.ContextVar("atoll_capnp", default=False)
_nodes = itertools.count()
MAX_CALLS = 4096  # calls (or answers not taken) one connection may have at a node


@asynccontextmanager
async def capnp_runtime() -> AsyncIterator[None]:
    """Run capnp's event loop on this asyncio loop for the block (re-entrant).

    Close every connection and listener before the block ends: capnp objects
    must not outlive the loop that made them. The loop's bulk-stream listener
    (``atoll.transports.dataplane.bulk``) and its push lanes (``atoll.transports.dataplane.lane``),
    if any were started, close with the block.
    """
    if _in_runtime.get():
        yield
        return
    async with capnp.kj_loop():
        token = _in_runtime.set(True)
        try:
            yield
        finally:
            _in_runtime.reset(token)
            await bulk.aclose()
            await lane.aclose()
            await oneway.aclose()


def _require_runtime() -> None:
    if not _in_runtime.get():
        raise TransportError(
            "the capnp transport needs `async with atoll.transports.capnp.capnp_runtime():` "
            "around it (asyncio only; trio apps go through atoll's bridge)"
        )


def parse_address(address: str) -> tuple[str, int]:
    """``capnp://host:port`` (or ``host:port``) to ``(host, port)``."""
    rest = address.removeprefix("capnp://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransportError(f"bad capnp address {address!r}: expected capnp://HOST:PORT")
    return host.strip("[]"), int(port)


def default_max_calls() -> int | None:
    """The settings' ``connection_calls`` (``ATOLL_CONNECTION_CALLS``; 0: no
    bound), else :data:`MAX_CALLS`."""
    calls = settings().connection_calls
    return MAX_CALLS if calls is None else calls or None


def default_token() -> bytes:
    """The cluster token from ``ATOLL_TOKEN`` (hex), or a fresh random one."""
    text: str = launched("token")
    return bytes.fromhex(text) if text else secrets.token_bytes(32)


class CapnpListener:
    """A served actor system; ``address`` and ``token`` are what clients need."""

    def __init__(
        self, address: str, token: bytes, node: ActorRef[NodeActor], max_calls: int | None = None
    ) -> None:
        self.address = address
        self.token = token
        self.node = node
        self.max_calls = max_calls
        self.server: asyncio.base_events.Server | None = None
        self._streams: dict[Peer, Any] = {}

    @property
    def peers(self) -> list[Peer]:
        """The connections served now (their ``calls_in`` and ``holds`` tell the load)."""
        return list(self._streams)

    async def aclose(self) -> None:
        """Stop accepting, drop every connection, stop the node actor."""
        if self.server is not None:
            self.server.close()
            self.server = None
        for peer, stream in list(self._streams.items()):
            peer.close("server closed")
            stream.close()
        self._streams.clear()
        await self.node.stop(grace=0)

    async def _on_connection(
        self, stream: Any, wire: GatheringTransport, login_timeout: float
    ) -> None:
        peer = Peer(f"client of {self.address}", self.max_calls)
        peer.hold_reading = wire.hold_reading
        loop = asyncio.get_running_loop()

        def refuse(_: str) -> None:
            # the refusal ("wrong cluster token") must reach the client before
            # the connection goes, or all it sees is "Connection reset by peer"
            loop.call_later(_REFUSED_LINGER_S, stream.close)

        gate = GateServer(self.token, self.node, peer, refuse)
        peer.abort = stream.close  # a heartbeat that gives the link up (Peer.watch)
        server = capnp.TwoPartyServer(stream, bootstrap=gate)
        self._streams[peer] = stream
        try:
            gone = asyncio.ensure_future(server.on_disconnect())
            login = asyncio.ensure_future(gate.logged_in.wait())
            await asyncio.wait(
                {gone, login}, timeout=login_timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if not login.done():
                login.cancel()
                stream.close()
            await gone
        finally:
            peer.close("peer disconnected")
            self._streams.pop(peer, None)


class CapnpConnection:
    """A logged-in link to a served actor system; ``node`` is its node actor.

    A heartbeat pings the node every ``heartbeat_s``; if no answer comes within
    ``heartbeat_timeout_s`` the link counts as lost even though TCP did not say
    so (a frozen host, a cut cable), and pending calls fail with ``HostLost``.
    """

    def __init__(
        self,
        node: ActorRef[NodeActor],
        peer: Peer,
        client: Any,
        heartbeat_s: float = 2.0,
        heartbeat_timeout_s: float = 6.0,
    ) -> None:
        self.node = node
        self.peer = peer
        self._client = client
        self._watch = asyncio.ensure_future(self._watch_disconnect())
        self._beat = asyncio.ensure_future(self._heartbeat(heartbeat_s, heartbeat_timeout_s))

    async def _watch_disconnect(self) -> None:
        with suppress(Exception):
            await self._client.on_disconnect()
        self._lose("disconnected")

    async def _heartbeat(self, every: float, timeout: float) -> None:
        await heartbeat(self.peer, self.node, every, timeout, self._lose)

    def _lose(self, reason: str) -> None:
        self.peer.close(reason)
        if self._client is not None:
            self._client.close()
            self._client = None

    async def aclose(self) -> None:
        """Fail pending calls with ``HostLost`` and close the socket."""
        self._watch.cancel()
        self._beat.cancel()
        self._lose("connection closed by this side")


class CapnpTransport:
    """Registered as ``capnp``. One instance holds one cluster token."""

    scheme = "capnp"

    def __init__(
        self,
        token: bytes | None = None,
        login_timeout: float = 10.0,
        heartbeat_s: float = 2.0,
        heartbeat_timeout_s: float = 6.0,
        max_calls: int | None = -1,
    ) -> None:
        """``max_calls``: the per-connection bound of the connections this
        transport serves (None or 0: no bound; -1, the default:
        ``ATOLL_CONNECTION_CALLS``, read when serving, else 4096)."""
        self.token = token if token is not None else default_token()
        self.login_timeout = login_timeout
        self.heartbeat = (heartbeat_s, heartbeat_timeout_s)
        self.max_calls = max_calls

    async def serve(self, system: ActorSystem, address: str | None = None) -> CapnpListener:
        _require_runtime()
        host, port = parse_address(address or "capnp://127.0.0.1:0")
        node = system.spawn(NodeActor, f"{host}:{port}", name=f"capnp-node-{next(_nodes)}")
        bound = default_max_calls() if self.max_calls == -1 else (self.max_calls or None)
        listener = CapnpListener("", self.token, node, bound)

        async def handler(stream: Any, wire: GatheringTransport) -> None:
            await listener._on_connection(stream, wire, self.login_timeout)

        try:
            server = await serve_streams(handler, host, port)
        except OSError as exc:
            await node.stop(grace=0)
            raise TransportError(f"cannot listen on {host}:{port}: {exc}") from None
        bound = server.sockets[0].getsockname()
        listener.server = server
        listener.address = f"capnp://{host}:{bound[1]}"
        return listener

    async def connect(
        self, address: str, system: ActorSystem | None = None, token: bytes | None = None
    ) -> CapnpConnection:
        """Connect and log in; raises ``TransportError`` if either fails."""
        _require_runtime()
        host, port = parse_address(address)
        try:
            stream = await connect_stream(host, port)
        except OSError as exc:
            raise TransportError(f"cannot reach {address}: {exc}") from None
        client = capnp.TwoPartyClient(stream)
        peer = Peer(address)
        gate = client.bootstrap().cast_as(schema.Gate)
        try:
            response = await gate.login(token=token if token is not None else self.token)
            node = peer.remote_ref(response.node)
        except capnp.KjException as exc:
            peer.close("login refused")
            client.close()
            raise TransportError(f"login to {address} refused: {_why(exc)}") from None
        del gate, response
        return CapnpConnection(node, peer, client, *self.heartbeat)


_REFUSED_LINGER_S = 1.0  # how long a refused connection stays open for its answer


def _why(exc: Any) -> str:
    """Why a login failed, in words a user can act on."""
    text = str(exc.description)
    if "wrong cluster token" in text:
        return (
            "wrong cluster token (take it from the cluster file `atoll up` wrote, "
            "or set ATOLL_TOKEN to the cluster's)"
        )
    return text
