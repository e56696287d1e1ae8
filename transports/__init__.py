"""Transports: how actor calls travel between actor systems.

``inproc`` ships with the core; the conformance suite in
``atoll.transports.conformance`` holds every transport to the same semantics.
"""

from . import inproc as _inproc  # noqa: F401  (registers "inproc")
from ._base import Connection as Connection
from ._base import Listener as Listener
from ._base import Transport as Transport
from ._base import get_transport as get_transport
from ._base import register_transport as register_transport
from ._base import transport_names as transport_names
from .inproc import InprocTransport as InprocTransport

__all__ = [
    "Connection",
    "InprocTransport",
    "Listener",
    "Transport",
    "get_transport",
    "register_transport",
    "transport_names",
]
