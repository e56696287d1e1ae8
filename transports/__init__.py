"""Transports: how actor calls travel between actor systems.

``inproc`` ships with the core and ``capnp`` is registered here too, but its
package (and pycapnp) is imported only when a ``capnp`` transport is first
asked for. The conformance suite in ``atoll.transports.conformance`` holds
every transport to the same semantics. How array bytes travel beside the
calls (shared memory, the bulk byte stream, push lanes) is the data plane,
``atoll.transports.dataplane``.
"""

from . import inproc as _inproc  # noqa: F401  (registers "inproc")
from ._base import Connection as Connection
from ._base import Listener as Listener
from ._base import Transport as Transport
from ._base import UnknownTransport as UnknownTransport
from ._base import get_transport as get_transport
from ._base import register_transport as register_transport
from ._base import transport_names as transport_names
from .inproc import InprocTransport as InprocTransport


def _capnp_transport() -> Transport:
    """A Cap'n Proto transport; its package is imported here, on first use."""
    from .capnp import CapnpTransport

    return CapnpTransport()


register_transport("capnp", _capnp_transport)

__all__ = [
    "Connection",
    "InprocTransport",
    "Listener",
    "Transport",
    "UnknownTransport",
    "get_transport",
    "register_transport",
    "transport_names",
]
