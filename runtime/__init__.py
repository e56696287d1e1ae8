"""The control plane: graphs, tracing, planning, the controller and its clients.

This layer sits on top of the kernel, transports, devices and schedulers (see
``docs/architecture.md``). One concept per module:

* :mod:`~atoll.runtime.graph`: the dataflow graph and its builder;
* :mod:`~atoll.runtime.tracing`: ``@program`` tracing and virtual slices;
* :mod:`~atoll.runtime.resources`: the resource manager;
* :mod:`~atoll.runtime.topology`: devices, hosts and islands;
* :mod:`~atoll.runtime.latency`: the modelled RPC latency;
* :mod:`~atoll.runtime.planner`: the pure dispatch planner;
* :mod:`~atoll.runtime.island`: the island scheduler actor;
* :mod:`~atoll.runtime.controller`: the controller;
* :mod:`~atoll.runtime.sessions`: client sessions;
* :mod:`~atoll.runtime.tenancy`: sessions' weights, admission and slice ownership;
* :mod:`~atoll.runtime.client`: the client (``Cluster``, ``ArrayRef``, ``Outputs``);
* :mod:`~atoll.runtime.spec`: the one cluster spec every launcher reads;
* :mod:`~atoll.runtime.local`: ``local_cluster``;
* :mod:`~atoll.runtime.process`: the process cluster (``atoll up``, ``atoll host``);
* :mod:`~atoll.runtime.connect`: ``connect``.

The Cap'n Proto parts (sessions, process, connect) are imported on first use,
so ``import atoll`` does not load pycapnp.
"""

from typing import TYPE_CHECKING, Any

from .client import ArrayRef as ArrayRef
from .client import Cluster as Cluster
from .client import Outputs as Outputs
from .controller import Controller as Controller
from .graph import Graph as Graph
from .graph import GraphBuilder as GraphBuilder
from .graph import Node as Node
from .graph import SliceSpec as SliceSpec
from .graph import ValueRef as ValueRef
from .island import IslandScheduler as IslandScheduler
from .local import local_cluster as local_cluster
from .planner import Plan as Plan
from .planner import PlanCache as PlanCache
from .planner import plan as plan
from .resources import Allocation as Allocation
from .resources import ResourceManager as ResourceManager
from .spec import BadClusterSpec as BadClusterSpec
from .spec import ClusterSpec as ClusterSpec
from .tenancy import NotYourSlice as NotYourSlice
from .tenancy import Tenants as Tenants
from .topology import DeviceInfo as DeviceInfo
from .topology import Topology as Topology
from .tracing import NotAProgram as NotAProgram
from .tracing import PlacedFunction as PlacedFunction
from .tracing import Program as Program
from .tracing import VirtualSlice as VirtualSlice
from .tracing import program as program

if TYPE_CHECKING:
    from .connect import Client as Client
    from .connect import connect as connect
    from .process import ClusterInfo as ClusterInfo
    from .process import process_cluster as process_cluster

_LAZY = {
    "Client": "connect",
    "connect": "connect",
    "ClusterInfo": "process",
    "process_cluster": "process",
}


def __getattr__(name: str) -> Any:
    """The Cap'n Proto parts, imported on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "Allocation",
    "ArrayRef",
    "BadClusterSpec",
    "Client",
    "Cluster",
    "ClusterInfo",
    "ClusterSpec",
    "Controller",
    "DeviceInfo",
    "Graph",
    "GraphBuilder",
    "IslandScheduler",
    "Node",
    "NotAProgram",
    "NotYourSlice",
    "Outputs",
    "PlacedFunction",
    "Plan",
    "PlanCache",
    "Program",
    "ResourceManager",
    "SliceSpec",
    "Tenants",
    "Topology",
    "ValueRef",
    "VirtualSlice",
    "connect",
    "local_cluster",
    "plan",
    "process_cluster",
    "program",
]
