"""One-way framed links: the control plane's hot path between processes.

A Cap'n Proto call is a round trip: its ``Return`` (and the ``Finish``
after it) is a message, and a wake-up of the far process, whatever the
caller needs of it. The messages that every run sends (an island's part of a
run to a device, the device's report back) need nothing of the kind: each
side only sends. A :class:`Link` is a plain TCP connection that carries
length-prefixed messages (bytes the layer above encoded) in both
directions, with no answer of its own. What one loop turn sends on a link
leaves in one write: a burst of runs, or of reports, is one system call and
one wake-up of the far side.

* **Who may use it.** The dialling side first writes a magic and the
  cluster token; the listener compares it in constant time and closes a
  connection whose token is wrong, or that has not shown it within
  ``HELLO_TIMEOUT_S``, before it reads anything else.
* **Nothing is resent.** A link that closes calls ``on_lost`` once; the
  layer above fails what it was waiting for (its peer's process is gone, or
  cut off).

Everything runs on the event loop of the process's Cap'n Proto runtime
(asyncio); :meth:`Link.send` is synchronous. A caller that is itself the
end of a loop turn's batch (a client's runs, sent once the turn is over)
sends inside :func:`writes_together`: its writes leave as it ends, not a
pass of the loop later.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..kernel.lowlevel import counts

__all__ = [
    "HELLO_TIMEOUT_S",
    "MAX_MESSAGE",
    "Link",
    "aclose",
    "connect",
    "hello",
    "serve",
    "take_hello",
    "writes_together",
]

MAGIC = b"AOW1"
MAX_MESSAGE = 1 << 26
HELLO_TIMEOUT_S = 5.0
_HELLO = struct.Struct("!4sH")  # magic, token length
_SIZE = struct.Struct("!I")  # a message's size

_log = logging.getLogger(__name__)

Receive = Callable[["Link", list[bytes]], None]


class _Together(threading.local):
    links: list[Link] | None = None  # sent to inside writes_together, to flush at its end


_together = _Together()  # (per thread: a loop's sends only, never another thread's)


@contextmanager
def writes_together() -> Iterator[None]:
    """What is sent inside leaves when it ends, one write per link (as at
    the end of a loop turn), not on the loop's next pass: for a caller that
    runs at the end of a turn already, and sends all it has at once."""
    if _together.links is not None:  # (inside one already: its end writes)
        yield
        return
    _together.links = []
    try:
        yield
    finally:
        links, _together.links = _together.links, None
        for link in links:
            link.flush()


class Link(asyncio.Protocol):
    """One end of a one-way link (either side: both send and receive).

    ``on_messages(link, messages)`` gets what one read brought, in order;
    ``on_lost(link)`` is called once, when the connection is gone.
    """

    def __init__(
        self,
        on_messages: Receive,
        on_lost: Callable[[Link], None],
        token: bytes | None = None,
    ) -> None:
        self.on_messages = on_messages
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._token = token  # the listener's: a dialler must show it first
        self._trusted = token is None
        self._in = bytearray()
        self._out: list[bytes] = []
        self._deadline: asyncio.TimerHandle | None = None
        self.dialled: set[Link] = set()  # the dialled links of its loop, if it was dialled

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self._trusted:
            loop = asyncio.get_running_loop()
            self._deadline = loop.call_later(HELLO_TIMEOUT_S, self._too_slow)

    def send(self, message: bytes) -> None:
        """Queue ``message``; what a loop turn queued leaves in one write."""
        if self.closed:
            return
        if not self._out:
            together = _together.links
            if together is not None:
                together.append(self)
            else:
                asyncio.get_running_loop().call_soon(self.flush)
        self._out.append(_SIZE.pack(len(message)))
        self._out.append(message)
        counts["lane_messages_out"] += 1

    def flush(self) -> None:
        """Write what was queued (called at the end of the loop turn)."""
        out, self._out = self._out, []
        if out and self.transport is not None and not self.transport.is_closing():
            data = b"".join(out)
            counts["socket_writes"] += 1
            counts["bytes_out"] += len(data)
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self._in += data
        if not self._trusted and not self._hello():
            return
        messages: list[bytes] = []
        buffer, at = self._in, 0
        while len(buffer) - at >= _SIZE.size:
            (size,) = _SIZE.unpack_from(buffer, at)
            if size > MAX_MESSAGE:
                _log.warning("a one-way link closed: a message of %d bytes", size)
                self.close()
                return
            if len(buffer) - at - _SIZE.size < size:
                break
            start = at + _SIZE.size
            messages.append(bytes(buffer[start : start + size]))
            at = start + size
        del buffer[:at]
        if messages:
            counts["lane_messages_in"] += len(messages)
            self.on_messages(self, messages)

    def _hello(self) -> bool:
        shown = take_hello(self._in, MAGIC, self._token or b"")
        if shown is False:
            _log.warning("a one-way link refused: wrong cluster token")
            self.close()
        if not shown:
            return False
        self._trusted = True
        if self._deadline is not None:
            self._deadline.cancel()
        return True

    def _too_slow(self) -> None:
        if not self._trusted:
            _log.warning("a one-way link closed: no token within %.1f s", HELLO_TIMEOUT_S)
            self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close at once, unsent bytes dropped (a peer that stopped reading
        would hold a plain close for ever)."""
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._out = []
        self.dialled.discard(self)  # (its own loop's set: another loop's may be changing)
        if not self.closed:
            self.closed = True
            self.on_lost(self)


def hello(magic: bytes, token: bytes) -> bytes:
    """What a dialler writes first: ``magic``, then the cluster token."""
    return _HELLO.pack(magic, len(token)) + token


def take_hello(buffer: bytearray, magic: bytes, token: bytes) -> bool | None:
    """A dialler's hello (magic, token length, token) at the start of
    ``buffer``: True if it is whole and shows ``token`` (it is taken off the
    buffer), False if it is wrong, None while it is not all there. Tokens
    are compared in constant time; an empty ``token`` admits no one."""
    if len(buffer) < _HELLO.size:
        return None
    shown, size = _HELLO.unpack_from(buffer)
    if len(buffer) < _HELLO.size + size:
        return None
    offered = bytes(buffer[_HELLO.size : _HELLO.size + size])
    if shown != magic or not token or not hmac.compare_digest(offered, token):
        return False
    del buffer[: _HELLO.size + size]
    return True


_servers: dict[tuple[asyncio.AbstractEventLoop, str], tuple[asyncio.Server, str]] = {}
_dialled: dict[asyncio.AbstractEventLoop, set[Link]] = {}  # by the loop that dialled them


async def serve(
    name: str, host: str, token: bytes, on_messages: Receive, on_lost: Callable[[Link], None]
) -> str:
    """Listen on ``host`` (a free port) as ``name``, once per event loop;
    each connection is a :class:`Link` that must show ``token`` first.
    Returns ``"host:port"`` (the first listener's, for later calls)."""
    loop = asyncio.get_running_loop()
    found = _servers.get((loop, name))
    if found is None:
        server = await loop.create_server(lambda: Link(on_messages, on_lost, token), host, 0)
        port = server.sockets[0].getsockname()[1]
        found = _servers[loop, name] = (server, f"{host}:{port}")
    return found[1]


async def connect(
    address: str, token: bytes, on_messages: Receive, on_lost: Callable[[Link], None]
) -> Link:
    """Dial ``address`` (``"host:port"``) and show ``token``; raises
    ``OSError`` when it cannot be reached."""
    host, _, port = address.rpartition(":")
    loop = asyncio.get_running_loop()
    _, link = await loop.create_connection(lambda: Link(on_messages, on_lost), host, int(port))
    assert link.transport is not None
    link.transport.write(hello(MAGIC, token))
    link.dialled = _dialled.setdefault(loop, set())
    link.dialled.add(link)
    return link


async def aclose() -> None:
    """Close this loop's listeners and the links it dialled (before the loop ends)."""
    loop = asyncio.get_running_loop()
    for key in [key for key in _servers if key[0] is loop]:
        server, _ = _servers.pop(key)
        server.close()
        await server.wait_closed()
    for link in _dialled.pop(loop, set()):
        link.close()
