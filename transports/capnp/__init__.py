"""The Cap'n Proto RPC transport (pycapnp, asyncio).

``atoll.capnp`` beside this file is the wire contract. Use
:class:`CapnpTransport` inside :func:`capnp_runtime`.
"""

from .._base import register_transport
from ._peer import HostLost as HostLost
from ._schema import SCHEMA_PATH as SCHEMA_PATH
from ._transport import CapnpConnection as CapnpConnection
from ._transport import CapnpListener as CapnpListener
from ._transport import CapnpTransport as CapnpTransport
from ._transport import capnp_runtime as capnp_runtime
from ._transport import default_token as default_token
from ._transport import parse_address as parse_address

register_transport("capnp", CapnpTransport)

__all__ = [
    "SCHEMA_PATH",
    "CapnpConnection",
    "CapnpListener",
    "CapnpTransport",
    "HostLost",
    "capnp_runtime",
    "default_token",
    "parse_address",
]
