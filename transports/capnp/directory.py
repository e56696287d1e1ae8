"""Direct links between host processes, so bulk data skips the controller.

A capability that reaches host B through the controller is, in Cap'n Proto
level 1, proxied by the controller: every byte B pulls from host A would cross
the controller process. To avoid that, a host process announces the address
it serves at (:func:`announce`); buffer handles made there carry it; and a
device that needs a buffer held elsewhere asks :func:`direct_actor` for a
reference over its *own* connection to that address, made on first use and
kept. In-process clusters announce nothing and keep using the references they
have.

All of this is per process and lives on the one thread that runs capnp.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from ...kernel import ActorRef, ActorSystem
from ..dataplane import bulk
from ._transport import CapnpConnection, CapnpTransport, parse_address

__all__ = ["announce", "close_all", "direct_actor", "local_address", "local_token"]


@dataclass
class _Directory:
    address: str = ""
    token: bytes = b""
    connections: dict[str, CapnpConnection] = field(default_factory=dict)
    refs: dict[tuple[str, str], ActorRef[Any]] = field(default_factory=dict)
    dialing: dict[str, asyncio.Lock] = field(default_factory=dict)
    unreachable: dict[str, float] = field(default_factory=dict)  # address -> dial again after


_here = _Directory()
REDIAL_AFTER_S = 1.0  # an address that could not be dialled is not tried again for this long


def announce(address: str, token: bytes) -> None:
    """This process serves at ``address``; peers open links with ``token``.

    Its bulk-stream listener (``atoll.transports.dataplane.bulk``) serves on the same host.
    """
    _here.address, _here.token = address, token
    bulk.serve_on(parse_address(address)[0])


def local_token() -> bytes:
    """The token this process announced with (empty when nothing was announced)."""
    return _here.token


def local_address() -> str:
    """The announced address of this process ('' when nothing was announced)."""
    return _here.address


async def direct_actor(address: str, name: str, system: ActorSystem) -> ActorRef[Any] | None:
    """A reference to actor ``name`` at ``address`` over a direct link.

    None when this process has no token to dial with (it announced nothing),
    when ``address`` is this process, or when the link cannot be made; the
    caller then uses the reference it already has.
    """
    if not _here.token or not address or address == _here.address:
        return None
    key = (address, name)
    ref = _here.refs.get(key)
    if ref is not None and _usable(_here.connections.get(address)):
        return ref
    if time.monotonic() < _here.unreachable.get(address, 0.0):
        return None  # it just failed: every gang of a chain would dial a dead host again
    try:
        connection = await _connection(address, system)
        ref = await _lookup(connection, name)
    except Exception:
        _here.unreachable[address] = time.monotonic() + REDIAL_AFTER_S
        return None
    _here.unreachable.pop(address, None)
    _here.refs[key] = ref
    return ref


async def _connection(address: str, system: ActorSystem) -> CapnpConnection:
    lock = _here.dialing.setdefault(address, asyncio.Lock())
    async with lock:  # devices asking at once share one link
        return await _dial(address, system)


async def _dial(address: str, system: ActorSystem) -> CapnpConnection:
    connection = _here.connections.get(address)
    if not _usable(connection):
        connection = await CapnpTransport(_here.token).connect(address, system)
        _here.connections[address] = connection
        for key in [k for k in _here.refs if k[0] == address]:
            del _here.refs[key]
    assert connection is not None
    return connection


async def _lookup(connection: CapnpConnection, name: str) -> ActorRef[Any]:
    found: ActorRef[Any] = await connection.node.lookup(name)
    return found


def _usable(connection: CapnpConnection | None) -> bool:
    return connection is not None and connection.peer.closed is None


async def close_all() -> None:
    """Close every direct link (before the capnp loop ends)."""
    connections = list(_here.connections.values())
    _here.connections.clear()
    _here.refs.clear()
    _here.dialing.clear()
    _here.unreachable.clear()
    for connection in connections:
        await connection.aclose()
