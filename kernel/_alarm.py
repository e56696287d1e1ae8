"""Precise wake-ups for asyncio sleeps, with no spinning and no thread.

An asyncio loop wakes from its timers in whole milliseconds: epoll's
timeout is rounded up to the next millisecond, so a 0.5 ms sleep takes 1
ms. A simulated device that sleeps its device time (``WallClock.sleep``)
needs better than that. Spinning the loop until the deadline, as the clock
once did for the last stretch, costs the host a core's worth of CPU while a
device "computes", which a real accelerator does not; a timer thread needs
the GIL to wake the loop, and waits up to the switch interval (5 ms) for
it while the loop is busy.

On Linux, :func:`wake_at` arms a ``timerfd`` (one per loop, made through
libc) at the earliest deadline the loop waits for, and the loop watches it
like any socket: epoll returns when the kernel's timer fires, to within
tens of microseconds, and the process spends no CPU meanwhile. What is
asynchronous about it: the future it returns settles on the loop's thread,
when the loop next runs its ready callbacks; a sleeper that is cancelled
cancels its future, and nothing else is needed. :func:`call_at` puts a
callback on the same alarm instead, which the alarm's read of its
``timerfd`` calls itself (no future, whose callbacks would wait for the
loop's next pass). Where no ``timerfd`` can be had, both return None and
the caller falls back.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import heapq
import itertools
import os
import sys
import weakref
from collections.abc import Callable
from time import monotonic as _monotonic

import sniffio

__all__ = ["call_at", "running_asyncio_loop", "wake_at"]

_CLOCK_MONOTONIC = 1  # the clock of time.monotonic() on Linux
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = 0o2000000
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


class _Itimerspec(ctypes.Structure):
    _fields_ = (("it_interval", _Timespec), ("it_value", _Timespec))


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.timerfd_create.restype = ctypes.c_int
        libc.timerfd_settime.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


class _Precise:
    """A callback due at a deadline (:func:`call_at`): run by the alarm's
    own read of its ``timerfd``, in the context it was set from, with no
    future between (whose callbacks would wait a pass of the loop)."""

    __slots__ = ("_callback", "_context", "_done")

    def __init__(self, callback: Callable[[], object]) -> None:
        self._callback = callback
        self._context = contextvars.copy_context()
        self._done = False

    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        self._done = True

    def fire(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._context.run(self._callback)
        except Exception as exc:
            message = f"a precise timer's callback {self._callback!r} raised"
            loop.call_exception_handler({"message": message, "exception": exc})


class _LoopAlarm:
    """One loop's ``timerfd`` and the deadlines its sleepers wait for."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self._fd = fd  # (the loop is not kept: it is this alarm's weak key)
        self._heap: list[tuple[float, int, asyncio.Future[None] | _Precise]] = []
        self._order = itertools.count()
        self._armed = float("inf")  # the deadline the timer is set for
        self._value = _Itimerspec()  # (reused: only its it_value changes)
        loop.add_reader(fd, self._fired)

    def wake_at(self, loop: asyncio.AbstractEventLoop, deadline: float) -> asyncio.Future[None]:
        future: asyncio.Future[None] = loop.create_future()
        self._push(deadline, future)
        return future

    def call_at(self, deadline: float, callback: Callable[[], object]) -> _Precise:
        precise = _Precise(callback)
        self._push(deadline, precise)
        return precise

    def _push(self, deadline: float, entry: asyncio.Future[None] | _Precise) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), entry))
        if deadline < self._armed:
            self._arm(deadline)

    def _arm(self, deadline: float) -> None:
        assert _LIBC is not None
        self._armed = deadline
        seconds = max(deadline, 1e-9)  # an absolute time of 0 would disarm it
        value = self._value.it_value
        value.tv_sec, value.tv_nsec = int(seconds), int(seconds % 1 * 1e9)
        if _LIBC.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._value), None):
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))

    def _fired(self) -> None:
        with contextlib.suppress(BlockingIOError):  # re-armed since it fired
            os.read(self._fd, 8)
        loop = asyncio.get_running_loop()
        self._armed = float("inf")
        now = _monotonic()
        heap = self._heap
        try:
            while heap and heap[0][0] <= now:
                entry = heapq.heappop(heap)[2]
                if isinstance(entry, _Precise):  # (it may set the next deadline: see _push)
                    entry.fire(loop)
                elif not entry.done():  # a cancelled sleeper cancelled it
                    entry.set_result(None)
        finally:  # (a callback that raised past Exception leaves the others due)
            while heap and heap[0][2].done():  # cancelled: no need to wake for them
                heapq.heappop(heap)
            if heap and heap[0][0] < self._armed:
                self._arm(heap[0][0])


_ALARMS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopAlarm | None] = (
    weakref.WeakKeyDictionary()
)


def _alarm(loop: asyncio.AbstractEventLoop) -> _LoopAlarm | None:
    if loop in _ALARMS:
        return _ALARMS[loop]
    alarm = None
    if _LIBC is not None:
        fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd >= 0:
            try:
                alarm = _LoopAlarm(loop, fd)
            except (NotImplementedError, RuntimeError):  # a loop that watches no fds
                os.close(fd)
            else:
                weakref.finalize(loop, os.close, fd)
    _ALARMS[loop] = alarm
    return alarm


def wake_at(loop: asyncio.AbstractEventLoop, deadline: float) -> asyncio.Future[None] | None:
    """A future of ``loop`` (the running one), settled at ``deadline``
    (``time.monotonic()`` seconds) to within tens of microseconds; None
    where this loop cannot have a ``timerfd``."""
    alarm = _alarm(loop)
    return None if alarm is None else alarm.wake_at(loop, deadline)


def call_at(
    loop: asyncio.AbstractEventLoop, deadline: float, callback: Callable[[], object]
) -> _Precise | None:
    """Call ``callback()`` (in this context) at ``deadline``
    (``time.monotonic()`` seconds), to within tens of microseconds, from
    ``loop``'s read of its ``timerfd``; ``.cancel()`` on what it returns
    drops it. None where this loop cannot have a ``timerfd``."""
    alarm = _alarm(loop)
    return None if alarm is None else alarm.call_at(deadline, callback)


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The asyncio loop this thread runs, unless the task is trio's (or
    trio-asyncio's trio side): sniffio's own test, without the costly
    ``current_task`` it falls back on (``anyio.Event`` made one per wait)."""
    name = sniffio.thread_local.name or sniffio.current_async_library_cvar.get()
    if name is not None and name != "asyncio":
        return None
    return asyncio._get_running_loop()
