"""The island-scheduler protocol: a pure state machine, ``event -> instructions``.

An island scheduler decides in which order the devices of one island run the
gangs (sharded computations) sent to it. It does no I/O: the island's
scheduler *actor* feeds it events and carries out the instructions it returns.
That keeps schedulers deterministic and testable without any network, and lets
users plug in their own by name.

Every event carries an ``event_id`` and every instruction names the event that
caused it, so a trace can explain each decision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol

__all__ = [
    "Completed",
    "Dispatch",
    "Event",
    "Instruction",
    "Scheduler",
    "Submit",
    "get_scheduler",
    "register_scheduler",
    "scheduler_names",
]


@dataclass(frozen=True)
class Submit:
    """A gang arrived: run ``gang_id`` on all of ``devices`` together."""

    event_id: int
    gang_id: str
    devices: tuple[int, ...]
    client: str = ""


@dataclass(frozen=True)
class Completed:
    """One device finished its shard of a gang."""

    event_id: int
    gang_id: str
    device: int


Event = Submit | Completed


@dataclass(frozen=True)
class Dispatch:
    """Send gang ``gang_id`` to ``device``; ``seq`` is its island-wide position."""

    cause: int
    gang_id: str
    device: int
    seq: int


Instruction = Dispatch


class Scheduler(Protocol):
    """What an island scheduler must do. Implementations keep their own state."""

    def handle(self, event: Event) -> list[Instruction]:
        """Take one event; return what the actor must do now, in order."""
        ...

    def validate(self) -> None:
        """Raise AssertionError if internal invariants are broken (for tests)."""
        ...


_REGISTRY: dict[str, Callable[[], Scheduler]] = {}


def register_scheduler(name: str, factory: Callable[[], Scheduler]) -> None:
    """Make ``factory`` selectable by ``name`` (per island)."""
    _REGISTRY[name] = factory


def scheduler_names() -> list[str]:
    """Built-in and entry-point (``atoll.schedulers``) scheduler names."""
    _load_entry_points()
    return sorted(_REGISTRY)


def get_scheduler(name: str) -> Scheduler:
    """A fresh scheduler instance by name."""
    if name not in _REGISTRY:
        _load_entry_points()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        known = ", ".join(scheduler_names())
        raise KeyError(f"no scheduler named {name!r}; known: {known}") from None
    return factory()


def _load_entry_points() -> None:
    for ep in entry_points(group="atoll.schedulers"):
        if ep.name not in _REGISTRY:
            factory: Any = ep.load()
            _REGISTRY[ep.name] = factory
