"""Push lanes: one-way messages for small pushed values between host processes.

A push over Cap'n Proto is a call, its answer and capnp's ``Finish``: three
messages, three wake-ups and the codec on both sides, for a value of a few
bytes. On a pipeline's critical path only the first one matters. A *lane* is
a plain TCP connection from one host process to another that carries just
that: one frame per pushed value, and nothing back but a cumulative count of
frames delivered, written ``lane_ack_s`` (``ATOLL_LANE_ACK_S``) after the first frame it counts (or
at once after ``ACK_EVERY`` frames): on a pipeline's critical path every
acknowledgement written wakes the sender's process, so several frames share
one (``ATOLL_LANE_ACK_S`` sets the delay; 0: at the end of the loop turn).

* **Who may use it.** The first bytes on a new connection are a magic, then
  the cluster token; the listener compares it in constant time and closes a
  connection whose token is wrong before reading anything else, or that has
  not shown it within ``HELLO_TIMEOUT_S`` (an idle stranger holds no socket).
* **A frame** is ``!IQ`` (header and body sizes), a pickled header (target
  host, inbox keys, owner, island, dtype, shape) and the array's bytes.
  Values travel pickled, as they do over Cap'n Proto: a token holder is
  trusted (see ``docs/security.md``).
* **Nothing is lost silently.** The sender keeps each message until its
  count is acknowledged; if the connection goes first, every message not
  acknowledged is handed back to its ``fallback`` (the sender then pushes it
  the ordinary way), and the receiving store ignores a copy it already has.
* **Delivery** calls the sink registered for the target host
  (:func:`register`), synchronously, on the receiving loop; the sink never
  blocks (a host's store waits for room in a task of its own).

Everything runs on one asyncio event loop per process, the one that runs
Cap'n Proto. :func:`send` is synchronous once :func:`connect` made the link.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...kernel import Clock, Timer, current_clock
from ...kernel.config import settings
from ...kernel.lowlevel import counts as process_counts
from ..dtypes import dtype_from_wire, raw_bytes, wire_dtype
from ..oneway import hello, take_hello

__all__ = [
    "MAX_BODY",
    "LaneMessage",
    "aclose",
    "connect",
    "fits",
    "register",
    "send",
    "serve",
    "stats",
]

MAGIC = b"ALN1"
MAX_HEADER = 1 << 16
MAX_BODY = 1 << 14  # lanes are for small values; larger ones take the data plane
HELLO_TIMEOUT_S = 5.0  # a connection that has not shown the token by then is closed
ACK_EVERY = 256  # frames delivered that are acknowledged at once, whatever the delay
_FRAME = struct.Struct("!IQ")  # header bytes, body bytes
_ACK = struct.Struct("!Q")  # frames delivered so far on this connection

_log = logging.getLogger("atoll.transports.dataplane.lane")


@dataclass(frozen=True)
class LaneMessage:
    """One pushed value: for ``keys`` on host ``host``, owned by ``owner``,
    made on island ``island``."""

    host: int
    keys: tuple[str, ...]
    owner: str
    island: int
    array: np.ndarray


Sink = Callable[[LaneMessage], None]
Fallback = Callable[[LaneMessage], None]

_sinks: dict[int, Sink] = {}
_servers: dict[asyncio.AbstractEventLoop, asyncio.Server] = {}
_addresses: dict[asyncio.AbstractEventLoop, str] = {}
_links: dict[str, _Link] = {}
stats = {
    "sent": 0,
    "delivered": 0,
    "refused": 0,
    "fell_back": 0,
    "accepted": 0,
    "sent_bytes": 0,
    "delivered_bytes": 0,
}


def register(host: int, sink: Sink | None) -> None:
    """Deliver frames for host ``host`` to ``sink`` (None: stop)."""
    if sink is None:
        if _sinks.pop(host, None) is not None:
            _stopped.add(host)
    else:
        _sinks[host] = sink
        _stopped.discard(host)


_stopped: set[int] = set()  # hosts that took frames here and stopped


async def serve(host: str, token: bytes, clock: Clock | None = None) -> str:
    """Listen on ``host`` for lanes (once per loop); returns ``"host:port"``.
    The hello deadline and acknowledgement delay of its connections run on
    ``clock`` (default: :func:`~atoll.kernel.current_clock` here)."""
    loop = asyncio.get_running_loop()
    if loop not in _servers:
        timers = clock if clock is not None else current_clock()
        server = await loop.create_server(lambda: _Receiver(token, timers), host, 0)
        port = server.sockets[0].getsockname()[1]
        _servers[loop], _addresses[loop] = server, f"{host}:{port}"
    return _addresses[loop]


async def connect(address: str, token: bytes) -> bool:
    """Open the lane to ``address`` unless it is open; False if it cannot be."""
    link = _links.get(address)
    if link is not None and not link.closed:
        return True
    host, _, port = address.rpartition(":")
    loop = asyncio.get_running_loop()
    try:
        _, protocol = await loop.create_connection(lambda: _Link(address), host, int(port))
    except OSError as exc:
        _log.info("no lane to %s: %s", address, exc)
        return False
    protocol.hello(token)
    _links[address] = protocol
    return True


def send(address: str, message: LaneMessage, fallback: Fallback) -> bool:
    """Send ``message`` down the open lane to ``address``; False if there is none.

    ``fallback`` gets the message back if the lane closes before the
    receiver acknowledged it.
    """
    link = _links.get(address)
    if link is None or link.closed or not fits(message.array):
        return False
    link.send(message, fallback)
    return True


def is_open(address: str) -> bool:
    """Whether a lane to ``address`` is open now (:func:`send` would take a
    frame at once)."""
    link = _links.get(address)
    return link is not None and not link.closed


def fits(array: np.ndarray) -> bool:
    """Whether ``array`` can take a lane: small, and its bytes are all of it
    (numbers, bools, dates, bfloat16 and the other ml_dtypes; not records or
    objects)."""
    return array.nbytes <= MAX_BODY and raw_bytes(array.dtype)


async def aclose() -> None:
    """Close this loop's listener and every lane (before the loop ends);
    frames not acknowledged by then are not sent again."""
    loop = asyncio.get_running_loop()
    server = _servers.pop(loop, None)
    _addresses.pop(loop, None)
    for link in list(_links.values()):
        link.unacked.clear()  # going down: nothing is sent again
        link.close()
    _links.clear()
    if server is not None:
        server.close()
        await server.wait_closed()


class _Link(asyncio.Protocol):
    """The sending end: frames out, acknowledgements in."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.sent = 0
        self.unacked: deque[tuple[int, LaneMessage, Fallback]] = deque()
        self._acks = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def hello(self, token: bytes) -> None:
        if self.transport is not None:
            self.transport.write(hello(MAGIC, token))

    def send(self, message: LaneMessage, fallback: Fallback) -> None:
        array = message.array  # tobytes() gives C order; 0-d stays 0-d
        fields = (message.host, message.keys, message.owner, message.island)
        header = pickle.dumps((*fields, wire_dtype(array.dtype), array.shape))
        body = array.tobytes()
        assert self.transport is not None
        self.transport.write(_FRAME.pack(len(header), len(body)) + header + body)
        self.sent += 1
        self.unacked.append((self.sent, message, fallback))
        stats["sent"] += 1
        stats["sent_bytes"] += len(body)
        process_counts["array_bytes_out"] += len(body)

    def data_received(self, data: bytes) -> None:
        self._acks += data
        count = None
        while len(self._acks) >= _ACK.size:
            (count,) = _ACK.unpack_from(self._acks)
            del self._acks[: _ACK.size]
        while count is not None and self.unacked and self.unacked[0][0] <= count:
            self.unacked.popleft()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if _links.get(self.address) is self:
            del _links[self.address]
        pending, self.unacked = self.unacked, deque()
        for _, message, fallback in pending:
            stats["fell_back"] += 1
            fallback(message)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _Receiver(asyncio.Protocol):
    """The receiving end: checks the token, then delivers frames to the sinks."""

    def __init__(self, token: bytes, clock: Clock) -> None:
        self.token = token
        self.clock = clock  # the listener's: hello and acknowledgement timers
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.trusted = False
        self.delivered = 0
        self.acked = 0  # the count last written back
        self._ack_timer: Timer | None = None
        self._deadline: Timer | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        stats["accepted"] += 1
        self._deadline = self.clock.call_later(HELLO_TIMEOUT_S, self._too_slow)

    def _too_slow(self) -> None:
        if not self.trusted:
            stats["refused"] += 1
            _log.warning("lane closed: no token within %.1f s", HELLO_TIMEOUT_S)
            self._drop()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.trusted and not self._hello():
            return
        while self._frame():
            pass

    def _hello(self) -> bool:
        shown = take_hello(self.buffer, MAGIC, self.token)
        if shown is False:
            stats["refused"] += 1
            _log.warning("lane refused: wrong cluster token")
            self._drop()
        if not shown:
            return False
        self.trusted = True
        if self._deadline is not None:
            self._deadline.cancel()
        return True

    def _frame(self) -> bool:
        if len(self.buffer) < _FRAME.size:
            return False
        head, body = _FRAME.unpack_from(self.buffer)
        if head > MAX_HEADER or body > MAX_BODY:
            _log.warning("lane closed: a frame of %d + %d bytes", head, body)
            self._drop()
            return False
        end = _FRAME.size + head + body
        if len(self.buffer) < end:
            return False
        header = bytes(self.buffer[_FRAME.size : _FRAME.size + head])
        data = bytes(self.buffer[_FRAME.size + head : end])
        del self.buffer[:end]
        self._deliver(header, data)
        return True

    def _deliver(self, header: bytes, data: bytes) -> None:
        try:
            host, keys, owner, island, dtype, shape = pickle.loads(header)
            array = np.frombuffer(data, dtype_from_wire(dtype)).reshape(shape)
        except Exception as exc:  # a peer holding the token sent garbage
            _log.warning("lane closed: a frame that does not decode: %s", exc)
            self._drop()
            return
        sink = _sinks.get(host)
        if sink is None:  # unacknowledged, so its sender pushes it some other way
            # (a host that stopped here: a push still on its way as a cluster stops)
            level = logging.INFO if host in _stopped else logging.WARNING
            _log.log(level, "lane closed: a frame for host %s, which is not here", host)
            self._drop()
            return
        try:
            sink(LaneMessage(host, tuple(keys), owner, island, array))
        except Exception:  # the sink's own failure: this lane and its other frames go on
            _log.exception("a lane frame for host %s could not be delivered", host)
        self.delivered += 1
        stats["delivered"] += 1
        stats["delivered_bytes"] += array.nbytes
        if self.delivered - self.acked >= ACK_EVERY:
            self._ack()
        elif self._ack_timer is None:  # set after this turn, off the readers' path
            self._ack_timer = asyncio.get_running_loop().call_soon(self._ack_later)

    def _ack_later(self) -> None:
        self._ack_timer = self.clock.call_later(settings().lane_ack_s, self._ack)

    def _ack(self) -> None:
        """Write back the count of frames delivered (once for all since the last)."""
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        self.acked = self.delivered
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_ACK.pack(self.delivered))

    def _drop(self) -> None:
        self.buffer.clear()
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        for timer in (self._deadline, self._ack_timer):
            if timer is not None:
                timer.cancel()
