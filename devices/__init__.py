"""Device actors: the protocol, hosts with their object stores, and simulated devices."""

from ._base import BufferHandle as BufferHandle
from ._base import Computation as Computation
from ._base import CostModel as CostModel
from ._base import Device as Device
from ._base import DeviceStats as DeviceStats
from ._base import Host as Host
from .sim import SimDevice as SimDevice

__all__ = [
    "BufferHandle",
    "Computation",
    "CostModel",
    "Device",
    "DeviceStats",
    "Host",
    "SimDevice",
]
