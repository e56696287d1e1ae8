"""Device actors: the protocol, hosts with their object stores, gangs, simulated devices.

Also the plain data devices work on: :class:`Aval` (an array before it
exists), :class:`JaxKernel` (what a JAX gang runs) and the host's
:class:`ObjectStore`.

JAX devices live in :mod:`atoll.devices.jax` (imported on demand, as it
imports JAX). Only what a user of devices needs is here (who writes a device
class, a scheduler plugin, or reads a buffer's handle); the runtime takes the
rest (compiled plans, pushes, the data plane) from the private modules.
"""

from ._aval import Aval as Aval
from ._colocated import Shard as Shard
from ._device import Device as Device
from ._errors import DeviceError as DeviceError
from ._errors import UnsupportedKernel as UnsupportedKernel
from ._host import Host as Host
from ._jax_kernel import JaxKernel as JaxKernel
from ._ledger import NotYours as NotYours
from ._ledger import QuotaExceeded as QuotaExceeded
from ._ledger import SessionEnded as SessionEnded
from ._plan import RunReport as RunReport
from ._store import BufferMissing as BufferMissing
from ._store import ObjectStore as ObjectStore
from ._store import StoreFull as StoreFull
from ._values import BufferHandle as BufferHandle
from ._values import Computation as Computation
from ._values import CostModel as CostModel
from ._values import DeviceStats as DeviceStats
from .sim import SimDevice as SimDevice

__all__ = [
    "Aval",
    "BufferHandle",
    "BufferMissing",
    "Computation",
    "CostModel",
    "Device",
    "DeviceError",
    "DeviceStats",
    "Host",
    "JaxKernel",
    "NotYours",
    "ObjectStore",
    "QuotaExceeded",
    "RunReport",
    "SessionEnded",
    "Shard",
    "SimDevice",
    "StoreFull",
    "UnsupportedKernel",
]
