"""A host's inboxes as a pure state machine: notices in, instructions out.

A reader of a value made on another device waits on an *inbox key* in its
host's store. Several parties send notices about a key, in any order and
sometimes twice: the push lands (by call, by lane, or both when a lane is
resent by call); the producer's device says the push was declined, so the
reader reads the producer's own handle (redirect); a controller, an island
or the producer's device says the producer failed; the reader takes what
came, or gives up (its own gang failed). :class:`Inboxes` is the one owner
of what these notices mean: :meth:`Inboxes.handle` takes one event and
returns the instructions that carry it out, and keeps a log of the events
it saw (their kinds and keys). It touches no promise and no buffer: the store (``_store.py``)
carries out the instructions, and the tests drive it with no actor at all.

The rules, per key:

* the first notice that settles a key wins; later ones are ignored, and a
  later landing is dropped at once (a second copy, or after a redirect or a
  failure);
* a key taken or given up on is closed: every later notice is ignored, and
  a landing is dropped (bounded: the last :data:`SETTLED_KEPT` keys are
  remembered);
* a reader that gives up before anything came leaves the key *abandoned*:
  the next notice closes it (and a landing is dropped).

Nothing here is asynchronous.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SETTLED_KEPT",
    "Abandoned",
    "Drop",
    "Failed",
    "Forget",
    "InboxEvent",
    "Inboxes",
    "Instruction",
    "Landed",
    "Redirected",
    "Reject",
    "Settle",
    "Taken",
]

SETTLED_KEPT = 4096  # keys remembered as done with, to drop late notices for them
LOG_KEPT = 1024  # events kept in the log


# -- events: what a notice says --------------------------------------------------
@dataclass(frozen=True)
class Landed:
    """A push landed under ``key`` as one reference to ``buffer_id``; the
    reader gets ``value``."""

    key: str
    buffer_id: str
    value: Any


@dataclass(frozen=True)
class Redirected:
    """Nothing will land under ``key``: the reader takes ``value`` instead
    (the producer's own handle; no buffer here is involved)."""

    key: str
    value: Any


@dataclass(frozen=True)
class Failed:
    """Nothing will land under ``key``: its producer failed with ``error``."""

    key: str
    error: BaseException


@dataclass(frozen=True)
class Taken:
    """The reader took what settled ``key``: it owns what landed, if anything."""

    key: str


@dataclass(frozen=True)
class Abandoned:
    """The reader gave up on ``key``: what landed, or lands later, is freed."""

    key: str


InboxEvent = Landed | Redirected | Failed | Taken | Abandoned


# -- instructions: what the store does ---------------------------------------
@dataclass(frozen=True)
class Settle:
    """Resolve the reader's promise for ``key`` with ``value``."""

    key: str
    value: Any


@dataclass(frozen=True)
class Reject:
    """Fail the reader's promise for ``key`` with ``error``."""

    key: str
    error: BaseException


@dataclass(frozen=True)
class Drop:
    """Drop one reference to ``buffer_id`` (a landing no one will read)."""

    buffer_id: str


@dataclass(frozen=True)
class Forget:
    """Let go of the reader's promise for ``key`` (it is done with it)."""

    key: str


Instruction = Settle | Reject | Drop | Forget


class Inboxes:
    """The inbox keys of one host; see the module docstring."""

    def __init__(self, settled_kept: int = SETTLED_KEPT, log_kept: int = LOG_KEPT) -> None:
        self._landed: dict[str, str] = {}  # key -> buffer id, landed, not taken
        self._answered: set[str] = set()  # redirected or failed, not taken
        self._abandoned: set[str] = set()  # given up on before anything came
        self._settled: dict[str, None] = {}  # done with, oldest first
        self._settled_kept = settled_kept
        # the latest events, as (kind, key): not the events, whose errors
        # would keep their tracebacks' frames alive
        self.log: deque[tuple[str, str]] = deque(maxlen=log_kept)

    def handle(self, event: InboxEvent) -> list[Instruction]:
        """Take one event; the instructions that carry it out, in order."""
        self.log.append((type(event).__name__, event.key))
        if isinstance(event, Landed):
            return self._landing(event)
        if isinstance(event, (Redirected, Failed)):
            return self._answer(event)
        if isinstance(event, Taken):
            return self._take(event.key)
        return self._abandon(event.key)

    @property
    def abandoned(self) -> int:
        """Keys given up on that no notice has closed yet."""
        return len(self._abandoned)

    def landed(self, key: str) -> str | None:
        """The buffer that landed under ``key`` and was not taken, if any."""
        return self._landed.get(key)

    def _landing(self, event: Landed) -> list[Instruction]:
        key = event.key
        if self._closed(key) or key in self._landed or key in self._answered:
            return [Drop(event.buffer_id)]  # a second copy, or too late
        self._landed[key] = event.buffer_id
        return [Settle(key, event.value)]

    def _answer(self, event: Redirected | Failed) -> list[Instruction]:
        key = event.key
        if self._closed(key) or key in self._landed or key in self._answered:
            return []  # it landed after all, or was answered already
        self._answered.add(key)
        if isinstance(event, Redirected):
            return [Settle(key, event.value)]
        return [Reject(key, event.error)]

    def _take(self, key: str) -> list[Instruction]:
        self._landed.pop(key, None)
        self._answered.discard(key)
        self._settle(key)
        return [Forget(key)]

    def _abandon(self, key: str) -> list[Instruction]:
        buffer_id = self._landed.pop(key, None)
        answered = key in self._answered
        self._answered.discard(key)
        if buffer_id is not None or answered:
            self._settle(key)  # something came: nothing more will
        else:
            self._abandoned.add(key)  # the next notice closes it
        dropped: list[Instruction] = [Drop(buffer_id)] if buffer_id is not None else []
        return [Forget(key), *dropped]

    def _settle(self, key: str) -> None:
        """Remember ``key`` as done with (bounded: the oldest go first)."""
        self._settled[key] = None
        if len(self._settled) > self._settled_kept:
            del self._settled[next(iter(self._settled))]

    def _closed(self, key: str) -> bool:
        """Whether ``key``'s reader is done with it; an abandoned key is
        closed for good by the first notice that follows."""
        if key in self._abandoned:
            self._abandoned.discard(key)
            self._settle(key)
            return True
        return key in self._settled
