"""Island schedulers: pure state machines behind a small protocol.

Pick one per island by name (``"fifo"`` is the default); add your own with
:func:`register_scheduler` or the ``atoll.schedulers`` entry-point group.
"""

from ._fifo import FifoScheduler as FifoScheduler
from ._protocol import Completed as Completed
from ._protocol import Dispatch as Dispatch
from ._protocol import Event as Event
from ._protocol import Instruction as Instruction
from ._protocol import Scheduler as Scheduler
from ._protocol import Submit as Submit
from ._protocol import get_scheduler as get_scheduler
from ._protocol import register_scheduler as register_scheduler
from ._protocol import scheduler_names as scheduler_names

__all__ = [
    "Completed",
    "Dispatch",
    "Event",
    "FifoScheduler",
    "Instruction",
    "Scheduler",
    "Submit",
    "get_scheduler",
    "register_scheduler",
    "scheduler_names",
]
