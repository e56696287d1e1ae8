"""A bounded FIFO mailbox with two ways in.

* :meth:`Mailbox.put` (async) waits while the mailbox holds ``capacity``
  messages: the sender is blocked until the actor drains one. This is the
  back-pressured way in (``await ref.f.send(...)``).
* :meth:`Mailbox.put_nowait` (sync) admits a message while fewer than
  ``capacity + slack`` are queued, and raises :class:`MailboxFull` beyond that.
  Synchronous calls (``ref.f(...)``) cannot wait, so the slack bounds how far
  they can run ahead; memory stays bounded either way.

Both append to one queue, so messages from one sender keep their order.
Closing the mailbox hands back whatever was still queued, so the owner can fail
those calls with a clear error instead of leaving them pending.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

import anyio

from ._alarm import running_asyncio_loop
from ._errors import ActorStopped, BadMailbox, MailboxFull

__all__ = ["Mailbox"]

M = TypeVar("M")


class Mailbox(Generic[M]):
    """Bounded FIFO queue of messages for one actor; see the module docstring."""

    def __init__(self, owner: str, capacity: int = 1024, slack: int = 65536) -> None:
        if capacity < 1 or slack < 0:
            raise BadMailbox(f"bad mailbox bounds: capacity={capacity}, slack={slack}")
        self.owner = owner
        self.capacity = capacity
        self.slack = slack
        self._queue: deque[M] = deque()
        self._closed: str | None = None
        # what the actor waits on while empty: a future on asyncio (no
        # anyio.Event, which asks sniffio which library runs on every wait)
        self._not_empty: asyncio.Future[None] | anyio.Event | None = None
        self._room: deque[_Waiter] = deque()
        self.blocked_puts = 0  # how many times a sender had to wait for room

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def put_nowait(self, message: M) -> None:
        """Admit at once, or raise ``MailboxFull`` / ``ActorStopped``."""
        self._check_open()
        if len(self._queue) >= self.capacity + self.slack:
            raise MailboxFull(self.owner, self.capacity + self.slack)
        self._append(message)

    async def put(self, message: M) -> None:
        """Admit, waiting (in FIFO order with other waiters) for room."""
        self._check_open()
        if len(self._queue) >= self.capacity or self._room:
            self.blocked_puts += 1
            waiter = _Waiter()
            self._room.append(waiter)
            try:
                while not (self._room[0] is waiter and len(self._queue) < self.capacity):
                    waiter.event = anyio.Event()
                    await waiter.event.wait()
                    self._check_open()
            finally:
                self._room.remove(waiter)
                self._wake_one_sender()
        self._append(message)

    async def get(self) -> M:
        """Take the oldest message, waiting for one; ``ActorStopped`` once closed."""
        while not self._queue:
            self._check_open()
            loop = running_asyncio_loop()
            if loop is not None:
                future = self._not_empty = loop.create_future()
                await future
            else:
                event = self._not_empty
                if not isinstance(event, anyio.Event):
                    event = self._not_empty = anyio.Event()
                await event.wait()
        message = self._queue.popleft()
        self._wake_one_sender()
        return message

    def close(self, reason: str) -> list[M]:
        """Refuse new messages; return the ones still queued (for failing)."""
        if self._closed is None:
            self._closed = reason
        leftovers = list(self._queue)
        self._queue.clear()
        self._wake_reader()
        for waiter in self._room:
            waiter.wake()
        return leftovers

    def _append(self, message: M) -> None:
        self._queue.append(message)
        self._wake_reader()

    def _wake_reader(self) -> None:
        waiting, self._not_empty = self._not_empty, None
        if isinstance(waiting, asyncio.Future):
            if not waiting.done():
                waiting.set_result(None)
        elif waiting is not None:
            waiting.set()

    def _wake_one_sender(self) -> None:
        if self._room and len(self._queue) < self.capacity:
            self._room[0].wake()

    def _check_open(self) -> None:
        if self._closed is not None:
            raise ActorStopped(self.owner, self._closed)


class _Waiter:
    """One sender blocked in :meth:`Mailbox.put`."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event: anyio.Event | None = None

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()
