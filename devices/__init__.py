"""Device actors: the protocol, hosts with their object stores, gangs, simulated devices.

JAX devices live in :mod:`atoll.devices.jax_device` (imported on demand, as it
imports JAX).
"""

from ._base import BufferHandle as BufferHandle
from ._base import Computation as Computation
from ._base import CostModel as CostModel
from ._base import Device as Device
from ._base import DeviceStats as DeviceStats
from ._base import Host as Host
from ._gang import GangTask as GangTask
from ._gang import Rendezvous as Rendezvous
from .sim import SimDevice as SimDevice

__all__ = [
    "BufferHandle",
    "Computation",
    "CostModel",
    "Device",
    "DeviceStats",
    "GangTask",
    "Host",
    "Rendezvous",
    "SimDevice",
]
