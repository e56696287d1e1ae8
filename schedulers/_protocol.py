"""The island-policy protocol: a pure state machine, ``event -> instructions``.

An island policy decides in which order the devices of one island run the
gangs (sharded computations) sent to it. It does no I/O: the island's
scheduler *actor* (:class:`~atoll.runtime.IslandScheduler`) feeds it events
and carries out the instructions it returns. That keeps policies deterministic
and testable without any network, and lets users plug in their own by name
(the registry keeps the word "scheduler": ``scheduler="fifo"``).

Every event carries an ``event_id`` and every instruction names the event that
caused it, so a log of both can explain each decision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol

from ..kernel import AtollError, UsageError

__all__ = [
    "Completed",
    "Dispatch",
    "Event",
    "Instruction",
    "IslandPolicy",
    "PolicyError",
    "Submit",
    "UnknownScheduler",
    "check_scheduler",
    "get_scheduler",
    "leases_shared",
    "register_scheduler",
    "scheduler_names",
]


@dataclass(frozen=True)
class Submit:
    """A gang arrived: run ``gang_id`` on all of ``devices`` together.

    ``client`` is the owner label of the session that sent it, ``weight`` that
    session's proportional-share weight (the latest submit's wins) and
    ``cost`` the gang's expected device time per device, in any unit shared
    by the island (1.0: all gangs alike). Policies that keep no shares ignore
    all three.
    """

    event_id: int
    gang_id: str
    devices: tuple[int, ...]
    client: str = ""
    weight: float = 1.0
    cost: float = 1.0


@dataclass(frozen=True)
class Completed:
    """One device finished its shard of a gang. ``idle``: it had nothing
    else of this island's left to run then (a device that runs ahead of its
    host says so; others never do): it waits for its next dispatch."""

    event_id: int
    gang_id: str
    device: int
    idle: bool = False


Event = Submit | Completed


@dataclass(frozen=True)
class Dispatch:
    """Send gang ``gang_id`` to ``device``; ``seq`` is its island-wide position."""

    cause: int
    gang_id: str
    device: int
    seq: int


Instruction = Dispatch


class IslandPolicy(Protocol):
    """What an island policy must do, all that the island asks of it
    (``docs/schedulers.md`` has the rules an answer must keep).
    Implementations keep their own state."""

    def handle(self, event: Event) -> list[Instruction]:
        """Take one event; return what the actor must do now, in order."""
        ...

    def validate(self) -> None:
        """Raise AssertionError if internal invariants are broken (for tests)."""
        ...

    def clients(self) -> dict[str, dict[str, float]]:
        """Per client (session), what the policy tracks (weight, queued,
        running...), for ``atoll status``; ``{}`` for a policy that keeps
        none. A policy without this method shows none."""
        ...


def leases_shared(name: str) -> bool:
    """Whether the policy registered as ``name`` lets several sessions hold
    leases on one device at once (``runtime/control/leases.py``), their runs
    then ordered by the device's host by weighted stride, as
    :class:`SharePolicy` would order them on that device. A policy says so
    by a true class attribute ``leases_shared``; without it, a device is
    leased to one session at a time, and every other session's run goes
    through the policy."""
    return bool(getattr(check_scheduler(name), "leases_shared", False))


class PolicyError(UsageError):
    """An event the policy cannot take: a gang with no devices, submitted twice,
    or a completion from a device the gang was not running on."""


class UnknownScheduler(AtollError, KeyError):
    """No policy is registered under that name (in code or by entry point)."""

    def __str__(self) -> str:  # KeyError's own would quote the message
        return str(self.args[0]) if self.args else "unknown scheduler"


_REGISTRY: dict[str, Callable[[], IslandPolicy]] = {}


def register_scheduler(name: str, factory: Callable[[], IslandPolicy]) -> None:
    """Make the policies ``factory`` builds selectable by ``name`` (per island)."""
    _REGISTRY[name] = factory


def scheduler_names() -> list[str]:
    """Policy names registered in code or as ``atoll.schedulers`` entry points."""
    _load_entry_points()
    return sorted(_REGISTRY)


def get_scheduler(name: str) -> IslandPolicy:
    """A fresh policy instance by name (each island builds its own, once)."""
    return check_scheduler(name)()


def check_scheduler(name: str) -> Callable[[], IslandPolicy]:
    """The factory registered as ``name``, without building a policy;
    ``UnknownScheduler`` (naming the known ones) if there is none."""
    if name not in _REGISTRY:
        _load_entry_points()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(scheduler_names())
        raise UnknownScheduler(f"no scheduler named {name!r}; known: {known}") from None


def _load_entry_points() -> None:
    """Register the plugins' policies; a name registered in code wins."""
    for ep in entry_points(group="atoll.schedulers"):
        if ep.name not in _REGISTRY:
            factory: Any = ep.load()
            _REGISTRY[ep.name] = factory
