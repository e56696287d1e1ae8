"""Island policies: pure state machines behind a small protocol.

An :class:`IslandPolicy` decides the order in which one island's devices run
their gangs; the island's scheduler actor (:class:`atoll.runtime.IslandScheduler`)
runs it. Pick one per island by name: ``scheduler="share"``, the default, is
:class:`SharePolicy` (proportional shares between clients; plain gang FIFO
while one client alone uses the island), ``"fifo"`` is :class:`FifoPolicy`.
Add your own with :func:`register_scheduler`, or publish one from a package
through the ``atoll.schedulers`` entry-point group.
"""

from ._fifo import FifoPolicy as FifoPolicy
from ._protocol import Completed as Completed
from ._protocol import Dispatch as Dispatch
from ._protocol import Event as Event
from ._protocol import Instruction as Instruction
from ._protocol import IslandPolicy as IslandPolicy
from ._protocol import PolicyError as PolicyError
from ._protocol import Submit as Submit
from ._protocol import UnknownScheduler as UnknownScheduler
from ._protocol import check_scheduler as check_scheduler
from ._protocol import get_scheduler as get_scheduler
from ._protocol import leases_shared as leases_shared
from ._protocol import register_scheduler as register_scheduler
from ._protocol import scheduler_names as scheduler_names
from ._share import ClientShare as ClientShare
from ._share import SharePolicy as SharePolicy

DEFAULT_POLICY = "share"  # every island's policy unless one is named for it

__all__ = [
    "DEFAULT_POLICY",
    "ClientShare",
    "Completed",
    "Dispatch",
    "Event",
    "FifoPolicy",
    "Instruction",
    "IslandPolicy",
    "PolicyError",
    "SharePolicy",
    "Submit",
    "UnknownScheduler",
    "check_scheduler",
    "get_scheduler",
    "leases_shared",
    "register_scheduler",
    "scheduler_names",
]
