"""The control plane: graphs, tracing, planning, the controller and its clients.

This layer sits on top of the kernel, transports, devices and schedulers (see
``docs/architecture.md``). One concept per module:

* :mod:`~atoll.runtime.graph`: the dataflow graph and its builder;
* :mod:`~atoll.runtime.tracing`: ``@program`` tracing and virtual slices;
* :mod:`~atoll.runtime.control.resources`: the resource manager;
* :mod:`~atoll.runtime.topology`: devices, hosts and islands;
* :mod:`~atoll.runtime.latency`: the modelled RPC latency;
* :mod:`~atoll.runtime.control.planner`: the pure dispatch planner;
* :mod:`~atoll.runtime.control.island`: the island scheduler actor;
* :mod:`~atoll.runtime.control.controller`: the controller;
* :mod:`~atoll.runtime.control.sessions`: client sessions;
* :mod:`~atoll.runtime.control.tenancy`: sessions' weights, admission and slice ownership;
* :mod:`~atoll.runtime.client.client`: the client (``Cluster``, ``ArrayRef``, ``Outputs``);
* :mod:`~atoll.runtime.client.colocated`: ``@colocated`` functions on the hosts;
* :mod:`~atoll.runtime.deploy.spec`: the one cluster spec every launcher reads;
* :mod:`~atoll.runtime.deploy.local`: ``local_cluster``;
* :mod:`~atoll.runtime.deploy.process`: the process cluster (``atoll up``, ``atoll host``);
* :mod:`~atoll.runtime.client.connect`: ``connect``.

The Cap'n Proto parts (sessions, process, connect) are imported on first use,
so ``import atoll`` does not load pycapnp.
"""

from typing import TYPE_CHECKING, Any

from .client.client import ArrayRef as ArrayRef
from .client.client import Cluster as Cluster
from .client.client import Outputs as Outputs
from .client.client import ShardedRef as ShardedRef
from .client.colocated import ColocatedFunction as ColocatedFunction
from .client.colocated import colocated as colocated
from .control.controller import Controller as Controller
from .control.island import IslandScheduler as IslandScheduler
from .control.planner import Plan as Plan
from .control.planner import PlanCache as PlanCache
from .control.planner import plan as plan
from .control.resources import Allocation as Allocation
from .control.resources import ResourceManager as ResourceManager
from .control.tenancy import NotYourSlice as NotYourSlice
from .control.tenancy import Tenants as Tenants
from .deploy.local import local_cluster as local_cluster
from .deploy.spec import BadClusterSpec as BadClusterSpec
from .deploy.spec import ClusterSpec as ClusterSpec
from .graph import Graph as Graph
from .graph import GraphBuilder as GraphBuilder
from .graph import Node as Node
from .graph import SliceSpec as SliceSpec
from .graph import ValueRef as ValueRef
from .topology import DeviceInfo as DeviceInfo
from .topology import Topology as Topology
from .tracing import NotAProgram as NotAProgram
from .tracing import PlacedFunction as PlacedFunction
from .tracing import Program as Program
from .tracing import VirtualSlice as VirtualSlice
from .tracing import program as program

if TYPE_CHECKING:
    from .client.connect import Client as Client
    from .client.connect import connect as connect
    from .deploy.process import ClusterInfo as ClusterInfo
    from .deploy.process import process_cluster as process_cluster

_LAZY = {
    "Client": "client.connect",
    "connect": "client.connect",
    "ClusterInfo": "deploy.process",
    "process_cluster": "deploy.process",
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
    "ColocatedFunction",
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
    "ShardedRef",
    "SliceSpec",
    "Tenants",
    "Topology",
    "ValueRef",
    "VirtualSlice",
    "colocated",
    "connect",
    "local_cluster",
    "plan",
    "process_cluster",
    "program",
]
