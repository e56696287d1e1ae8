"""atoll: a Pathways-style orchestration layer for ML accelerators.

An asyncio/trio actor microkernel (:mod:`atoll.kernel`), transports that give
actor calls the same semantics in-process and across processes
(:mod:`atoll.transports`), island schedulers (:mod:`atoll.schedulers`) and
device actors (:mod:`atoll.devices`). :func:`local_cluster` starts a whole
cluster in one process, which is the embedded default.
"""

import os
from typing import Any

from ._client import ArrayRef as ArrayRef
from ._client import Outputs as Outputs
from ._cluster import Cluster as Cluster
from ._cluster import local_cluster as local_cluster
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
from .kernel._program import Program as Program
from .kernel._program import VirtualSlice as VirtualSlice
from .kernel._program import program as program

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``atoll.partition`` on first use (it pulls in the solver's imports)."""
    if name == "partition":
        import importlib

        return importlib.import_module(f"{__name__}.partition")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def connect(target: str | os.PathLike[str], *, token: bytes | None = None) -> Any:
    """Connect to a node or cluster: ``async with atoll.connect(...) as client``.

    ``target`` is ``capnp://HOST:PORT`` or a cluster file written by ``atoll
    up``. (Imported on first use, so ``import atoll`` does not load pycapnp.)
    """
    from ._connect import connect as _connect

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
    "VirtualClock",
    "VirtualSlice",
    "WallClock",
    "__version__",
    "connect",
    "endpoint",
    "local_cluster",
    "program",
]
