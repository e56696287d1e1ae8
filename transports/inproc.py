"""The in-process transport: actor systems of one event loop talking directly.

A call goes straight into the target's mailbox: no serialization, no copy.
numpy arrays travel as read-only views of the sender's memory, so a receiver
can no more scribble on the sender's data than it could over a socket (where it
gets a read-only view of the received bytes). Semantics otherwise match the
network transports: ordering, promise pipelining, boxed errors, cancellation,
stop and bounded mailboxes are the kernel's own.

Addresses look like ``inproc://name`` and are unique per process.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..kernel import ActorRef, ActorSystem, NodeActor, TransportError
from ..kernel.lowlevel import share_arguments_with
from ._base import register_transport

__all__ = ["InprocTransport", "read_only", "share_read_only"]


def read_only(array: np.ndarray) -> np.ndarray:
    """``array`` itself if it is read-only, else a read-only view of it (no copy)."""
    if not array.flags.writeable:
        return array
    view = array.view()
    view.flags.writeable = False
    return view


def share_read_only(value: Any) -> Any:
    """A call argument as an actor of this process receives it: numpy arrays
    (also inside lists, tuples and dicts) as read-only views, no copy."""
    kind = type(value)
    if kind in _AS_IS:  # the common arguments, at the cost of one look-up
        return value
    if kind is list:
        return list(map(share_read_only, value))
    if kind is tuple:
        return tuple(map(share_read_only, value))
    if kind is dict:
        return {k: share_read_only(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return read_only(value)
    if isinstance(value, tuple):
        return tuple(share_read_only(v) for v in value)
    if isinstance(value, list):
        return [share_read_only(v) for v in value]
    if isinstance(value, dict):
        return {k: share_read_only(v) for k, v in value.items()}
    _AS_IS.add(kind)  # no array, and no container of them: its kind never is
    return value


# kinds passed as they are: the plain ones, and each kind found to be none
# of the above (a promise, a handle, a plan...), so it costs one look-up next time
_AS_IS: set[type] = {str, int, float, bool, type(None), bytes}


share_arguments_with(share_read_only)  # every local call of this process, from now on

_SERVED: dict[str, ActorRef[NodeActor]] = {}
_names = itertools.count()


@dataclass
class _InprocListener:
    address: str
    node: ActorRef[NodeActor]
    closed: bool = field(default=False)

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            _SERVED.pop(self.address, None)
            await self.node.stop(grace=0)


@dataclass
class _InprocConnection:
    node: ActorRef[NodeActor]

    async def aclose(self) -> None:
        """Nothing to tear down: in-process references stay valid."""


class InprocTransport:
    """Registered as ``inproc``."""

    scheme = "inproc"

    async def serve(self, system: ActorSystem, address: str | None = None) -> _InprocListener:
        address = address or f"inproc://node-{next(_names)}"
        if not address.startswith("inproc://"):
            raise TransportError(f"not an inproc address: {address!r}")
        if address in _SERVED:
            raise TransportError(f"{address} is already served")
        node_name = address.removeprefix("inproc://")
        node = system.spawn(NodeActor, node_name, name=f"node:{node_name}")
        _SERVED[address] = node
        return _InprocListener(address, node)

    async def connect(self, address: str, system: ActorSystem) -> _InprocConnection:
        node = _SERVED.get(address)
        if node is None:
            raise TransportError(f"nothing is served at {address!r}")
        return _InprocConnection(node)


register_transport("inproc", InprocTransport)
