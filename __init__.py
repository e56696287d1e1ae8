"""atoll: a Pathways-style orchestration layer for ML accelerators.

An asyncio/trio actor microkernel (:mod:`atoll.kernel`), transports that give
actor calls the same semantics in-process and across processes
(:mod:`atoll.transports`), island schedulers (:mod:`atoll.schedulers`) and
device actors (:mod:`atoll.devices`). :func:`local_cluster` starts a whole
cluster in one process, which is the embedded default.
"""

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

__version__ = "0.1.0"

__all__ = [
    "Actor",
    "ActorRef",
    "ActorStopped",
    "ActorSystem",
    "AtollError",
    "Cluster",
    "Directive",
    "Promise",
    "RemoteActorError",
    "VirtualClock",
    "WallClock",
    "__version__",
    "endpoint",
    "local_cluster",
]
