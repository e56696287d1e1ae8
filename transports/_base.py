"""The transport interface and its registry.

A transport moves actor calls between processes (or, in-process, between
actor systems). It has two jobs:

* :meth:`Transport.serve` exposes an :class:`~atoll.kernel.ActorSystem` at an
  address, through its :class:`~atoll.kernel.NodeActor`;
* :meth:`Transport.connect` reaches such an address and hands back a
  :class:`Connection` whose ``node`` is a reference to the remote node actor.

Every transport must give calls the same semantics, which
``atoll.transports.conformance`` checks: per-sender ordering, promise
arguments and pipelining, boxed remote errors, cancellation, stop, and bounded
mailboxes. Transports are found by URL scheme (``inproc://``, ``capnp://``)
in a registry. The built-in ones register themselves in code; third parties
extend it through the ``atoll.transports`` entry-point group.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, Protocol

from ..kernel import ActorRef, ActorSystem, AtollError, NodeActor

__all__ = [
    "Connection",
    "Listener",
    "Transport",
    "UnknownTransport",
    "get_transport",
    "register_transport",
    "transport_names",
]


class Listener(Protocol):
    """A served address; closing it stops accepting new peers."""

    @property
    def address(self) -> str: ...
    async def aclose(self) -> None: ...


class Connection(Protocol):
    """A link to a peer; ``node`` is that peer's node actor."""

    @property
    def node(self) -> ActorRef[NodeActor]: ...
    async def aclose(self) -> None: ...


class Transport(Protocol):
    """How calls travel; see the module docstring."""

    scheme: str

    async def serve(self, system: ActorSystem, address: str | None = None) -> Listener: ...
    async def connect(self, address: str, system: ActorSystem) -> Connection: ...


class UnknownTransport(AtollError, KeyError):
    """No transport is registered for that scheme (built in or by entry point)."""

    def __str__(self) -> str:  # KeyError's own would quote the message
        return str(self.args[0]) if self.args else "unknown transport"


_REGISTRY: dict[str, Callable[[], Transport]] = {}


def register_transport(scheme: str, factory: Callable[[], Transport]) -> None:
    """Make ``scheme://`` addresses use transports built by ``factory``."""
    _REGISTRY[scheme] = factory


def _load_entry_points() -> None:
    for ep in entry_points(group="atoll.transports"):
        if ep.name not in _REGISTRY:
            factory: Any = ep.load()
            _REGISTRY[ep.name] = factory


def transport_names() -> list[str]:
    """Schemes known here, built-in and from entry points."""
    _load_entry_points()
    return sorted(_REGISTRY)


def get_transport(scheme_or_address: str) -> Transport:
    """A transport for ``"inproc"`` or for an address like ``"inproc://x"``."""
    scheme = scheme_or_address.split("://", 1)[0]
    if scheme not in _REGISTRY:
        _load_entry_points()
    try:
        factory = _REGISTRY[scheme]
    except KeyError:
        known = ", ".join(transport_names())
        raise UnknownTransport(f"no transport for {scheme!r}; known: {known}") from None
    return factory()


def by_value(obj: Any) -> bool:
    """Whether the function or class ``obj`` cannot be found by reference in
    another process: defined in ``__main__`` (or nowhere), a lambda, or local
    to a function (a closure). Such a one travels by value, by Cap'n Proto."""
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", "")
    return module is None or module == "__main__" or "<lambda>" in name or "<locals>" in name
