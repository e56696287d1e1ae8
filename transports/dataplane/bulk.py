"""A bulk byte stream beside Cap'n Proto, for large arrays between machines.

A Cap'n Proto capability authorizes each transfer: the ``Buffer`` of an
array (see ``atoll.capnp``) answers ``open`` by registering the array here
under a fresh ticket (:func:`offer`) and returning this process's bulk
address with that ticket. The reader connects to the address, sends the
ticket, and gets an 8-byte length and then exactly that many bytes, received
straight into the array it returns (:func:`receive`). The writer sends from
a memoryview of the stored array: no copy in Python, and the kernel's socket
buffers (autotuned, up to tens of MiB) keep several chunks in flight, so the
stream never waits for a round trip.

Each process runs one plain TCP listener per event loop, started on first
use, on the host of its Cap'n Proto listener (:func:`serve_on`; 127.0.0.1
until one is announced). Tickets are single-use, bound to one array, and
expire after :data:`TICKET_TTL_S`; a connection with an unknown ticket is
closed, and only that connection. A ticket's time is the
:func:`~atoll.kernel.current_clock` of the context that offered it.

A reader whose environment names a relay (``ATOLL_BULK_RELAY=HOST:PORT``)
connects there instead, and sends the holder's address first
(:data:`RELAY_HELLO`, then the address in UTF-8): the relay forwards the
stream. The fault-injection suite (``benchmarks/faults.py``) cuts transfers
there mid-stream; a network that reaches holders only through a relay could
use it too.

``counts`` says how large arrays reached this process (``shm_in``,
``stream_in``, ``chunks_in``), how many left by stream (``stream_out``), and
how many tickets were refused. Everything runs on the asyncio event loop:
:func:`offer` is synchronous, :func:`receive` and :func:`aclose` are coroutines.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import struct
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...kernel import Timer, TransportError, current_clock
from ...kernel.config import settings
from ...kernel.lowlevel import counts as process_counts

__all__ = [
    "RELAY_ENV",
    "RELAY_HELLO",
    "TICKET_BYTES",
    "TICKET_TTL_S",
    "BulkServer",
    "StreamRefused",
    "aclose",
    "counts",
    "offer",
    "receive",
    "serve_on",
]

TICKET_BYTES = 16
TICKET_TTL_S = 30.0
IDLE_S = 30.0  # a transfer that makes no progress this long fails
_HEADER = struct.Struct("!Q")
RELAY_ENV = "ATOLL_BULK_RELAY"  # HOST:PORT of a relay readers go through ("" : none)
RELAY_HELLO = struct.Struct("!H")  # to a relay: the holder's address's length, then it

counts: Counter[str] = Counter()
_log = logging.getLogger("atoll.transports.dataplane.bulk")


class StreamRefused(TransportError):
    """The holder closed the stream before sending anything (a bad ticket)."""


@dataclass
class _Offer:
    data: memoryview
    expiry: Timer


class BulkServer:
    """One process's bulk listener on the running loop; see the module docstring."""

    def __init__(self, host: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = socket.socket(_family(host), socket.SOCK_STREAM)
        try:
            self._sock.bind((host, 0))
            self._sock.listen(64)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise
        port = self._sock.getsockname()[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._tickets: dict[bytes, _Offer] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._spawn(self._accept())

    def offer(self, data: memoryview) -> bytes:
        """A fresh single-use ticket for ``data``, valid for :data:`TICKET_TTL_S`
        of the :func:`~atoll.kernel.current_clock`."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        expiry = current_clock().call_later(TICKET_TTL_S, lambda: self._tickets.pop(ticket, None))
        self._tickets[ticket] = _Offer(data, expiry)
        return ticket

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self) -> None:
        while True:
            try:
                connection, _ = await self._loop.sock_accept(self._sock)
            except OSError as exc:  # e.g. out of file descriptors: try again soon
                _log.warning("bulk listener %s: accept failed: %s", self.address, exc)
                await asyncio.sleep(0.1)
                continue
            connection.setblocking(False)
            self._spawn(self._serve(connection))

    async def _serve(self, connection: socket.socket) -> None:
        """Read a ticket; send its bytes, or close at once if it is unknown."""
        with connection:
            try:
                async with asyncio.timeout(IDLE_S):
                    ticket = await _recv_exactly(self._loop, connection, TICKET_BYTES)
                offer = self._tickets.pop(ticket, None)
                if offer is None:
                    counts["tickets_refused"] += 1
                    return
                offer.expiry.cancel()
                await self._send(connection, offer.data)
            except (OSError, TimeoutError, EOFError):
                return  # the reader went away: it falls back or fails on its side

    async def _send(self, connection: socket.socket, data: memoryview) -> None:
        async with asyncio.timeout(IDLE_S + data.nbytes / 10e6):  # at least 10 MB/s
            await self._loop.sock_sendall(connection, _HEADER.pack(data.nbytes))
            await self._loop.sock_sendall(connection, data)
        counts["stream_out"] += 1
        counts["stream_out_bytes"] += data.nbytes
        process_counts["bytes_out"] += _HEADER.size + data.nbytes

    async def aclose(self) -> None:
        """Stop listening, drop every ticket, end the transfers under way."""
        for offer in self._tickets.values():
            offer.expiry.cancel()
        self._tickets.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._sock.close()


_servers: dict[asyncio.AbstractEventLoop, BulkServer] = {}
_bind = ["127.0.0.1"]


def serve_on(host: str) -> None:
    """Listen on ``host`` (that of this process's capnp listener) from now on."""
    _bind[0] = host


def offer(data: memoryview) -> tuple[str, bytes]:
    """Offer ``data`` to one reader: this loop's bulk address and a ticket.

    Starts the listener on first use; raises ``OSError`` if it cannot.
    """
    loop = asyncio.get_running_loop()
    server = _servers.get(loop)
    if server is None:
        server = _servers[loop] = BulkServer(_bind[0])
    return server.address, server.offer(data)


async def aclose() -> None:
    """Close the running loop's bulk listener, if it has one (before the loop ends)."""
    server = _servers.pop(asyncio.get_running_loop(), None)
    if server is not None:
        await server.aclose()


async def receive(address: str, ticket: bytes, nbytes: int) -> np.ndarray:
    """The ``nbytes`` that ``ticket`` stands for at ``address``, as a uint8 array.

    Raises :class:`StreamRefused` if the holder refuses the ticket,
    ``TransportError`` if it sends a different length or stops early,
    ``OSError`` if it cannot be reached, ``TimeoutError`` if it stalls.
    """
    loop = asyncio.get_running_loop()
    relay = settings().bulk_relay
    host, port = _split(relay or address)
    out = np.empty(nbytes, dtype=np.uint8)
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        async with asyncio.timeout(IDLE_S) as deadline:
            await loop.sock_connect(sock, (host, port))
            if relay:
                where = address.encode()
                await loop.sock_sendall(sock, RELAY_HELLO.pack(len(where)) + where)
            await loop.sock_sendall(sock, ticket)
            try:
                header = await _recv_exactly(loop, sock, _HEADER.size)
            except (EOFError, ConnectionResetError):
                raise StreamRefused(f"bulk stream at {address} refused the ticket") from None
            if _HEADER.unpack(header)[0] != nbytes:
                raise TransportError(f"bulk stream at {address}: not {nbytes} bytes")
            await _recv_into(loop, sock, out.data, deadline)
    counts["stream_in"] += 1
    counts["stream_in_bytes"] += nbytes
    return out


async def _recv_into(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    view: memoryview,
    deadline: asyncio.Timeout,
) -> None:
    """Fill ``view`` from ``sock``; each bit of progress pushes ``deadline`` back."""
    got, total = 0, view.nbytes
    while got < total:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise TransportError(f"bulk stream ended after {got} of {total} bytes")
        got += n
        deadline.reschedule(loop.time() + IDLE_S)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise EOFError("connection closed")
        got += k
    return bytes(data)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise TransportError(f"bad bulk address {address!r}")
    return host.strip("[]"), int(port)
