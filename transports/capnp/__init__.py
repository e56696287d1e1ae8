"""The Cap'n Proto RPC transport (pycapnp, asyncio).

``atoll.capnp`` beside this file is the wire contract. Use
:class:`CapnpTransport` inside :func:`capnp_runtime`.
"""

from ...kernel import HostLost as HostLost
from . import directory as directory
from ._peer import Peer as Peer
from ._peer import peer_of as peer_of
from ._process import stop_on_signals as stop_on_signals
from ._schema import SCHEMA_PATH as SCHEMA_PATH
from ._transport import CapnpConnection as CapnpConnection
from ._transport import CapnpListener as CapnpListener
from ._transport import CapnpTransport as CapnpTransport
from ._transport import capnp_runtime as capnp_runtime
from ._transport import default_token as default_token
from ._transport import parse_address as parse_address
from .clusterfile import ClusterFile as ClusterFile

__all__ = [
    "SCHEMA_PATH",
    "CapnpConnection",
    "CapnpListener",
    "CapnpTransport",
    "ClusterFile",
    "HostLost",
    "Peer",
    "capnp_runtime",
    "default_token",
    "directory",
    "parse_address",
    "peer_of",
    "stop_on_signals",
]
