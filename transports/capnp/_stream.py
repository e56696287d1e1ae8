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

Reading can be held from above (:meth:`GatheringTransport.hold_reading`, how a
node back-pressures a connection with too many calls in flight): pycapnp asks
for data read by read (``resume_reading``, then ``pause_reading`` once it has
some); while held, such a request is remembered and honoured on release.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import capnp

__all__ = ["GatheringTransport", "WireStats", "connect_stream", "serve_streams", "wire_stats"]

_DIRECT = 1 << 16  # pieces this large go out at once, after what is gathered


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
        self._wants_read = False  # pycapnp asked for data (resume_reading)

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
        self._wants_read = False
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._wants_read = True
        if not self._held:
            self._transport.resume_reading()

    def hold_reading(self, held: bool) -> None:
        """Stop reading the socket (True) whatever pycapnp asks, or let it read
        again (False): the peer's writes then wait in TCP and in its process."""
        self._held = held
        if held:
            self._transport.pause_reading()
        elif self._wants_read and not self._transport.is_closing():
            self._transport.resume_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)


def _count(nbytes: int) -> None:
    _STATS.frames += 1
    _STATS.bytes += nbytes


def _gathering(on_stream: Callable[[Any, GatheringTransport], Any]) -> Any:
    """A pycapnp stream protocol whose transport is wrapped once connected;
    ``on_stream(stream, wrapper)`` is called then."""
    protocol: Any = None

    def connected(stream: Any) -> Any:
        wire = GatheringTransport(protocol.transport)
        protocol.transport = wire
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
