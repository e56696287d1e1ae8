"""atoll: a Pathways-style orchestration layer for ML accelerators.

An asyncio/trio actor microkernel (:mod:`atoll.kernel`), transports that give
actor calls the same semantics in-process and across processes
(:mod:`atoll.transports`), device actors (:mod:`atoll.devices`), island
scheduling policies (:mod:`atoll.schedulers`) and the control plane built on
them (:mod:`atoll.runtime`). :func:`local_cluster` starts a whole cluster in
one process, which is the embedded default. This module is only a facade: it
re-exports the names most programs need.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import types
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
from .runtime import VirtualSlice as VirtualSlice
from .runtime import local_cluster as local_cluster
from .runtime import program as program

__version__ = "0.1.0"


class _PartitionAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``atoll.partition`` is another name for :mod:`atoll.schedulers.partition`.

    ``import atoll.partition`` gives that very module object, imported on
    first use (it pulls in the solver's imports).
    """

    name = f"{__name__}.partition"
    target = f"{__name__}.schedulers.partition"

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # the import system has just stamped the alias's spec on the module:
        # give it back its own, and keep the module under both names
        module.__spec__ = self._own_spec
        sys.modules[self.name] = module


if not any(isinstance(finder, _PartitionAlias) for finder in sys.meta_path):
    sys.meta_path.append(_PartitionAlias())


def __getattr__(name: str) -> Any:
    """``atoll.partition`` on first use."""
    if name == "partition":
        return importlib.import_module(f"{__name__}.partition")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def connect(target: str | os.PathLike[str] | None = None, *, token: bytes | None = None) -> Any:
    """Connect to a node or cluster: ``async with atoll.connect(...) as client``.

    ``target`` is ``capnp://HOST:PORT`` or a cluster file written by ``atoll
    up``; without it, the cluster ``atoll up`` started last on this machine.
    (Imported on first use, so ``import atoll`` does not load pycapnp.)
    """
    from .runtime.connect import connect as _connect

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
