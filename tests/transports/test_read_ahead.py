"""Reading ahead of pycapnp (``transports/capnp/_stream.py``, issue 34).

The socket stays registered between pycapnp's reads: bytes that come while
it has no read pending are kept and handed over in order when it asks
again, an end of file waits behind them, and a hold from above (the peer's
back-pressure) or too much kept pauses the socket. Driven here with a
stand-in for pycapnp's protocol that asks for a fixed number of bytes per
read, as Cap'n Proto's message reader does, and a stand-in socket.
"""

from __future__ import annotations

from typing import Any

import pytest

from atoll.transports.capnp import _stream
from atoll.transports.capnp._stream import GatheringTransport, _ReadAhead

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the stream lives on the loop that runs Cap'n Proto


class Socket:
    """What the read-ahead sees of an asyncio socket transport."""

    def __init__(self) -> None:
        self.protocol: Any = None
        self.reading = False
        self.switches = 0  # pause/resume calls that changed anything
        self.closed = False

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol

    def pause_reading(self) -> None:
        self.switches += self.reading
        self.reading = False

    def resume_reading(self) -> None:
        self.switches += not self.reading
        self.reading = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def arrive(self, data: bytes) -> None:
        """Bytes from the network, as the selector transport hands them over."""
        while data:
            into = self.protocol.get_buffer(-1)
            n = min(len(into), len(data))
            into[:n] = data[:n]
            self.protocol.buffer_updated(n)
            data = data[n:]


class Reader:
    """pycapnp's protocol as the read-ahead drives it: one read of ``size``
    bytes at a time, asked for with ``ask``."""

    def __init__(self) -> None:
        self.transport: GatheringTransport | None = None
        self.got = bytearray()
        self.eof_at: int | None = None
        self._buffer: bytearray | None = None
        self._filled = 0

    def ask(self, size: int) -> None:
        assert self.transport is not None
        self._buffer, self._filled = bytearray(size), 0
        self.transport.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        assert self._buffer is not None, "pycapnp was given bytes it did not ask for"
        return memoryview(self._buffer)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        assert self._buffer is not None and self.transport is not None
        self._filled += nbytes
        if self._filled == len(self._buffer):
            self.got += self._buffer
            self._buffer = None
            self.transport.pause_reading()

    def eof_received(self) -> None:
        assert self._buffer is not None, "an end of file while no read was pending"
        self.eof_at = len(self.got)

    def connection_lost(self, exc: Exception | None) -> None:
        pass


async def _wired() -> tuple[Socket, Reader, GatheringTransport]:
    socket, reader = Socket(), Reader()
    wire = GatheringTransport(socket)
    reader.transport = wire
    _ReadAhead(reader, socket, wire)
    return socket, reader, wire


async def test_bytes_between_reads_are_kept_and_handed_over_in_order() -> None:
    socket, reader, _ = await _wired()
    socket.arrive(b"abcdef")  # no read pending: kept
    assert reader.got == b""
    reader.ask(4)
    assert reader.got == b"abcd"
    socket.arrive(b"ghij")  # behind the kept "ef"
    reader.ask(3)
    reader.ask(3)
    assert reader.got == b"abcdefghij"
    reader.ask(2)
    socket.arrive(b"kl")  # a read pending, nothing kept: straight in
    assert reader.got == b"abcdefghijkl"
    assert socket.reading and socket.switches == 1  # registered once, never paused


async def test_an_end_of_file_waits_behind_the_kept_bytes() -> None:
    socket, reader, _ = await _wired()
    socket.arrive(b"last words")
    assert socket.protocol.eof_received() is True  # kept open until pycapnp saw it
    assert reader.eof_at is None and not socket.closed
    reader.ask(4)
    reader.ask(6)
    assert reader.eof_at is None  # every byte taken, but no read pending yet
    reader.ask(8)
    assert reader.eof_at == 10 and reader.got == b"last words"
    assert socket.closed  # pycapnp did not keep it open, so the socket closes


async def test_a_hold_pauses_the_socket_and_what_was_kept() -> None:
    socket, reader, wire = await _wired()
    socket.arrive(b"xyz")
    wire.hold_reading(True)
    assert not socket.reading
    reader.ask(3)
    assert reader.got == b""  # held: not even what was read already
    wire.hold_reading(False)
    assert socket.reading and reader.got == b"xyz"


async def test_too_much_kept_pauses_the_socket_until_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_stream, "_KEPT_MAX", 8)
    socket, reader, _ = await _wired()
    socket.arrive(b"0123456789")
    assert not socket.reading
    reader.ask(5)
    assert socket.reading and reader.got == b"01234"
