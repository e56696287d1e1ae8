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
cancels its future, and nothing else is needed. Where no ``timerfd`` can be
had, :func:`wake_at` returns None and the caller falls back.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import heapq
import itertools
import os
import sys
import weakref
from time import monotonic as _monotonic

import sniffio

__all__ = ["running_asyncio_loop", "wake_at"]

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


class _LoopAlarm:
    """One loop's ``timerfd`` and the deadlines its sleepers wait for."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self._fd = fd  # (the loop is not kept: it is this alarm's weak key)
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._armed = float("inf")  # the deadline the timer is set for
        loop.add_reader(fd, self._fired)

    def wake_at(self, loop: asyncio.AbstractEventLoop, deadline: float) -> asyncio.Future[None]:
        future: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._heap, (deadline, next(self._order), future))
        if deadline < self._armed:
            self._arm(deadline)
        return future

    def _arm(self, deadline: float) -> None:
        assert _LIBC is not None
        self._armed = deadline
        seconds = max(deadline, 1e-9)  # an absolute time of 0 would disarm it
        value = _Itimerspec(_Timespec(0, 0), _Timespec(int(seconds), int(seconds % 1 * 1e9)))
        if _LIBC.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(value), None) != 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))

    def _fired(self) -> None:
        with contextlib.suppress(BlockingIOError):  # re-armed since it fired
            os.read(self._fd, 8)
        self._armed = float("inf")
        now = _monotonic()
        heap = self._heap
        while heap and heap[0][0] <= now:
            future = heapq.heappop(heap)[2]
            if not future.done():  # a cancelled sleeper cancelled it
                future.set_result(None)
        while heap and heap[0][2].done():  # cancelled: no need to wake for them
            heapq.heappop(heap)
        if heap:
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


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The asyncio loop this thread runs, unless the task is trio's (or
    trio-asyncio's trio side): sniffio's own test, without the costly
    ``current_task`` it falls back on (``anyio.Event`` made one per wait)."""
    name = sniffio.thread_local.name or sniffio.current_async_library_cvar.get()
    if name is not None and name != "asyncio":
        return None
    return asyncio._get_running_loop()
