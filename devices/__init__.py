"""Device actors: the protocol, hosts with their object stores, gangs, simulated devices.

Also the plain data devices work on: :class:`Aval` (an array before it
exists), :class:`JaxKernel` (what a JAX gang runs) and the host's
:class:`ObjectStore`.

JAX devices live in :mod:`atoll.devices.jax_device` (imported on demand, as it
imports JAX).
"""

from ._aval import Aval as Aval
from ._device import Device as Device
from ._errors import DeviceError as DeviceError
from ._errors import UnsupportedKernel as UnsupportedKernel
from ._gang import GangTask as GangTask
from ._gang import PushTarget as PushTarget
from ._gang import Rendezvous as Rendezvous
from ._host import Host as Host
from ._jax_kernel import JaxKernel as JaxKernel
from ._ledger import NotYours as NotYours
from ._ledger import OwnerLedger as OwnerLedger
from ._ledger import QuotaExceeded as QuotaExceeded
from ._ledger import SessionEnded as SessionEnded
from ._plan import MADE_HERE as MADE_HERE
from ._plan import PUSHED_IN as PUSHED_IN
from ._plan import DeviceProgram as DeviceProgram
from ._plan import Earlier as Earlier
from ._plan import PlannedGang as PlannedGang
from ._plan import RunReport as RunReport
from ._plan import portable as portable
from ._plan import run_key as run_key
from ._plane import IN_PROCESS as IN_PROCESS
from ._plane import DataPlane as DataPlane
from ._plane import ProcessPlane as ProcessPlane
from ._plane import use_plane as use_plane
from ._store import BufferMissing as BufferMissing
from ._store import ObjectStore as ObjectStore
from ._store import StoredBuffer as StoredBuffer
from ._store import StoreFull as StoreFull
from ._values import INLINE_VALUE_BYTES as INLINE_VALUE_BYTES
from ._values import BufferHandle as BufferHandle
from ._values import Computation as Computation
from ._values import CostModel as CostModel
from ._values import DeviceStats as DeviceStats
from .sim import SimDevice as SimDevice

__all__ = [
    "INLINE_VALUE_BYTES",
    "IN_PROCESS",
    "MADE_HERE",
    "PUSHED_IN",
    "Aval",
    "BufferHandle",
    "BufferMissing",
    "Computation",
    "CostModel",
    "DataPlane",
    "Device",
    "DeviceError",
    "DeviceProgram",
    "DeviceStats",
    "Earlier",
    "GangTask",
    "Host",
    "JaxKernel",
    "NotYours",
    "ObjectStore",
    "OwnerLedger",
    "PlannedGang",
    "ProcessPlane",
    "PushTarget",
    "QuotaExceeded",
    "Rendezvous",
    "RunReport",
    "SessionEnded",
    "SimDevice",
    "StoreFull",
    "StoredBuffer",
    "UnsupportedKernel",
    "portable",
    "run_key",
    "use_plane",
]
