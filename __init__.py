"""atoll: a Pathways-style orchestration layer for ML accelerators.

An asyncio/trio actor microkernel (:mod:`atoll.kernel`), transports that give
actor calls the same semantics in-process and across processes
(:mod:`atoll.transports`), device actors (:mod:`atoll.devices`), island
scheduling policies (:mod:`atoll.schedulers`) and the control plane built on
them (:mod:`atoll.runtime`); beside them, the multi-chip partitioner
(:mod:`atoll.partition`). :func:`local_cluster` starts a whole cluster in
one process, which is the embedded default. This module is only a facade: it
re-exports the names most programs need.
"""

import importlib
import os
from typing import Any

from .kernel import Actor as Actor
from .kernel import ActorRef as ActorRef
from .kernel import ActorStopped as ActorStopped
from .kernel import ActorSystem as ActorSystem
from .kernel import AtollError as AtollError
from .kernel import Directive as Directive
from .kernel import Promise as Promise
from .kernel import RemoteActorError as RemoteActorError
from .kernel import VirtualClock as VirtualClock
from .kernel import WallClock as WallClock
from .kernel import endpoint as endpoint
from .runtime import ArrayRef as ArrayRef
from .runtime import Cluster as Cluster
from .runtime import Outputs as Outputs
from .runtime import Program as Program
from .runtime import ShardedRef as ShardedRef
from .runtime import VirtualSlice as VirtualSlice
from .runtime import colocated as colocated
from .runtime import local_cluster as local_cluster
from .runtime import program as program

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``atoll.partition`` on first use (it pulls in the solver's imports)."""
    if name == "partition":
        return importlib.import_module(f"{__name__}.partition")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names only (not this module's own imports)."""
    return sorted([*__all__, "partition"])


def connect(target: str | os.PathLike[str] | None = None, *, token: bytes | None = None) -> Any:
    """Connect to a node or cluster: ``async with atoll.connect(...) as client``.

    ``target`` is ``capnp://HOST:PORT`` or a cluster file written by ``atoll
    up``; without it, the cluster ``atoll up`` started last on this machine.
    (Imported on first use, so ``import atoll`` does not load pycapnp.)
    """
    from .runtime.client.connect import connect as _connect

    return _connect(target, token=token)


__all__ = [
    "Actor",
    "ActorRef",
    "ActorStopped",
    "ActorSystem",
    "ArrayRef",
    "AtollError",
    "Cluster",
    "Directive",
    "Outputs",
    "Program",
    "Promise",
    "RemoteActorError",
    "ShardedRef",
    "VirtualClock",
    "VirtualSlice",
    "WallClock",
    "__version__",
    "colocated",
    "connect",
    "endpoint",
    "local_cluster",
    "program",
]
