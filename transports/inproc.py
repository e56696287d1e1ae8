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

from ..kernel import ActorRef, ActorSystem, NodeActor, TransportError
from ._base import register_transport

__all__ = ["InprocTransport"]

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
