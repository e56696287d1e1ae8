"""Cap'n Proto streams whose writes are gathered per event-loop turn.

pycapnp hands each RPC message to the asyncio transport as soon as it is
built, one ``write`` (and so usually one ``send`` system call) per piece of
every message: a call, its return, the ``Finish`` that follows and each
capability ``Release`` each cost a system call, and a wake-up of the peer.
:class:`GatheringTransport` sits between pycapnp's protocol and the real
transport: it keeps what is written during one turn of the event loop and
hands it over in one ``writelines`` at the end of the turn (a ``call_soon``
callback), so a burst of messages leaves in one system call.

Ordering is kept: every write goes through the same buffer, and closing
flushes it first. Flow control stays the real transport's: when it asks the
protocol to pause, pycapnp stops writing as before. Everything here runs on
the event loop's thread.

Reading: pycapnp asks for data read by read (``resume_reading``, then
``pause_reading`` once it has some). Passing each request to the socket would
take it out of the selector and put it back for every message (two
``epoll_ctl`` calls, and an extra pass of the loop), so the socket stays
registered and a :class:`_ReadAhead` stands between it and pycapnp: bytes that
arrive while pycapnp has no read pending are kept (up to ``_KEPT_MAX``; past
that the socket is paused) and handed over, in order, as soon as it asks
again. An end of file waits behind them: pycapnp must see it only while a read
of its is pending (it mishandles one that arrives between reads).

Reading can also be held from above (:meth:`GatheringTransport.hold_reading`,
how a node back-pressures a connection with too many calls in flight): the
socket is paused then, and pycapnp's requests are honoured on release.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import capnp

from ...kernel.lowlevel import counts

__all__ = ["GatheringTransport", "WireStats", "connect_stream", "serve_streams", "wire_stats"]

_DIRECT = 1 << 16  # pieces this large go out at once, after what is gathered
_KEPT_MAX = 1 << 20  # bytes read ahead of pycapnp before the socket is paused
_CHUNK = 1 << 16  # the read-ahead buffer's size


@dataclass
class WireStats:
    """What this process's Cap'n Proto streams handed to their sockets.

    ``frames``: socket writes (each gathered burst is one); ``bytes``: their
    total size. Tests pin how many frames an operation costs.
    """

    frames: int = 0
    bytes: int = 0


_STATS = WireStats()


def wire_stats() -> WireStats:
    """A copy of this process's wire counters (subtract two to measure)."""
    return WireStats(_STATS.frames, _STATS.bytes)


class GatheringTransport:
    """A write-gathering stand-in for an asyncio transport (see the module docstring)."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()
        self._held = False  # reading held from above (hold_reading)
        self.ahead: _ReadAhead | None = None  # set by _ReadAhead when it takes over

    def write(self, data: bytes) -> None:
        if len(data) >= _DIRECT:  # bulk: no copy into a joined buffer
            self.flush()
            _count(len(data))
            self._transport.write(data)
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def flush(self) -> None:
        """Hand everything written so far to the real transport, in order."""
        if self._pending and not self._transport.is_closing():
            _count(sum(map(len, self._pending)))
            self._transport.writelines(self._pending)
        self._pending = []

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return bool(self._transport.can_write_eof())

    def is_closing(self) -> bool:
        return bool(self._transport.is_closing())

    def pause_reading(self) -> None:
        """pycapnp has the bytes it asked for: the socket stays registered."""
        if self.ahead is not None:
            self.ahead.wants = False

    def resume_reading(self) -> None:
        """pycapnp asks for bytes: what was read ahead goes first."""
        if self.ahead is not None:
            self.ahead.wants = True
            self.ahead.feed()

    @property
    def held(self) -> bool:
        """Reading is held from above (:meth:`hold_reading`)."""
        return self._held

    def hold_reading(self, held: bool) -> None:
        """Stop reading the socket (True) whatever pycapnp asks, or let it read
        again (False): the peer's writes then wait in TCP and in its process."""
        self._held = held
        self.reading_changed()
        if not held and self.ahead is not None:
            self.ahead.feed()

    def reading_changed(self) -> None:
        """Pause the socket while held or while too much is read ahead."""
        if self._transport.is_closing():
            return
        full = self.ahead is not None and self.ahead.kept_bytes >= _KEPT_MAX
        if self._held or full:
            self._transport.pause_reading()
        else:
            self._transport.resume_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)


class _ReadAhead(asyncio.BufferedProtocol):
    """The socket's protocol in place of pycapnp's (see the module docstring):
    bytes go straight into pycapnp's buffer while it has a read pending, and
    are kept for it otherwise; an end of file waits until it was given all
    of them and asks for more."""

    def __init__(self, capnp_protocol: Any, transport: Any, wire: GatheringTransport) -> None:
        self._inner = capnp_protocol
        self._transport = transport
        self._wire = wire
        self.wants = False  # pycapnp has a read pending
        self._kept: list[memoryview] = []
        self.kept_bytes = 0
        self._chunk = bytearray(_CHUNK)
        self._into_inner = False  # the buffer handed out is pycapnp's
        self._eof = False  # an end of file is waiting behind the kept bytes
        wire.ahead = self
        transport.set_protocol(self)
        transport.resume_reading()  # registered from now on, unless paused

    def get_buffer(self, sizehint: int) -> Any:
        self._into_inner = self.wants and not self._kept and not self._wire.held
        return self._inner.get_buffer(sizehint) if self._into_inner else self._chunk

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_inner:
            self._inner.buffer_updated(nbytes)
            return
        self._kept.append(memoryview(bytes(memoryview(self._chunk)[:nbytes])))
        self.kept_bytes += nbytes
        if self.kept_bytes >= _KEPT_MAX:
            self._wire.reading_changed()
        self.feed()

    def feed(self) -> None:
        """Give pycapnp what was kept while it asks for bytes; then the end
        of file, if one came."""
        was = self.kept_bytes
        while self.wants and self._kept and not self._wire.held:
            piece = self._kept[0]
            into = self._inner.get_buffer(len(piece))
            n = min(len(into), len(piece))
            into[:n] = piece[:n]
            self._kept[0] = piece[n:]
            if n == len(piece):
                self._kept.pop(0)
            self.kept_bytes -= n
            self._inner.buffer_updated(n)
        if was >= _KEPT_MAX > self.kept_bytes:
            self._wire.reading_changed()
        if self._eof and self.wants and not self._kept and not self._wire.held:
            self._eof = False
            if not self._inner.eof_received():
                self._transport.close()

    def eof_received(self) -> bool:
        self._eof = True
        self.feed()
        return True  # the socket stays open until pycapnp has seen the end

    def connection_made(self, transport: Any) -> None:  # pragma: no cover - set after
        self._transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


def _count(nbytes: int) -> None:
    counts["socket_writes"] += 1
    counts["bytes_out"] += nbytes
    _STATS.frames += 1
    _STATS.bytes += nbytes


def _gathering(on_stream: Callable[[Any, GatheringTransport], Any]) -> Any:
    """A pycapnp stream protocol whose transport is wrapped once connected;
    ``on_stream(stream, wrapper)`` is called then."""
    protocol: Any = None

    def connected(stream: Any) -> Any:
        real = protocol.transport
        wire = GatheringTransport(real)
        protocol.transport = wire
        _ReadAhead(protocol, real, wire)
        return on_stream(stream, wire)

    protocol = capnp.AsyncIoStream._connect(connected)
    return protocol


async def connect_stream(host: str, port: int) -> Any:
    """A client stream to ``host:port`` (raises ``OSError`` if unreachable)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[Any] = loop.create_future()
    await loop.create_connection(
        lambda: _gathering(lambda stream, _: ready.set_result(stream)), host, port
    )
    return await ready


async def serve_streams(
    handler: Callable[[Any, GatheringTransport], Awaitable[None]], host: str, port: int
) -> asyncio.Server:
    """Serve ``host:port``; ``handler(stream, wire)`` runs as a task per
    connection (``wire``: its :class:`GatheringTransport`)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _gathering(handler), host, port)
