"""Clocks: real time for running, virtual time for testing.

Simulated devices "spend" device time by sleeping on a :class:`Clock`, and
every timeout in atoll (a store's wait for room and its holds, bulk tickets,
lane acknowledgements, a connection's hold and heartbeats) is a timer on
one. With :class:`WallClock` that is real time (a sleep uses no host CPU).
With :class:`VirtualClock` nothing really sleeps: time jumps to the next
deadline as soon as every task of the event loop is blocked, the way trio's
autojump clock does, but on asyncio too; or, with ``autojump=False``, only
when a test calls :meth:`VirtualClock.advance`, as trio's ``MockClock``
without autojump. Tests therefore run instantly and give the same timings on
every run and every machine.

Which clock a component reads: the one it is given, else
:func:`current_clock`, the one :func:`use_clock` set for this context (tasks
started inside inherit it), else the process's wall clock. An
``ActorSystem`` defaults to :func:`current_clock` for its simulated device
time; the timeouts read :func:`current_clock`, not a system's own clock.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import anyio
import sniffio

from ._alarm import call_at, running_asyncio_loop, wake_at

__all__ = [
    "Clock",
    "Timer",
    "VirtualClock",
    "WallClock",
    "current_clock",
    "fail_after",
    "move_on_after",
    "use_clock",
]

_log = logging.getLogger("atoll.kernel.clock")


class Timer(Protocol):
    """A callback set for later by :meth:`Clock.call_later`."""

    def cancel(self) -> None:
        """Do not call it (nothing happens if it already ran)."""
        ...


class Clock(Protocol):
    """Where device time and every timeout's time come from."""

    def now(self) -> float:
        """Seconds since an arbitrary, fixed origin."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Let ``seconds`` of this clock's time pass."""
        ...

    def call_later(self, seconds: float, callback: Callable[[], object]) -> Timer:
        """Call ``callback()`` on this event loop's thread once ``seconds``
        of this clock's time have passed, unless cancelled first. Called
        from the event loop's thread (a task or a loop callback); not
        asynchronous itself. A callback that raises is logged."""
        ...


class WallClock:
    """Real monotonic time; ``sleep`` is a real sleep, precise to ~0.1 ms.

    Event loops wake from timers in whole milliseconds (epoll's timeout
    unit, rounded up), which would add up to a millisecond to a simulated
    kernel of 2.3 ms. On asyncio (on Linux) a sleep therefore waits on a
    ``timerfd`` that the loop watches (``kernel/_alarm.py``), set 80 µs
    ahead of the deadline, and a busy wait ends it on time: no CPU is spent
    meanwhile. In its last ``spin_s`` it passes the loop's turns instead
    while the loop has other work ready (cheap: the loop runs anyway, and a
    saturated one reaches the deadline sooner). Elsewhere (trio) it waits
    on a timer that ends half a millisecond before the last whole
    millisecond it holds and spends the rest, at most ``spin_s``, yielding
    to the loop until the deadline: precise, at the price of host CPU in
    that window. (Spinning, a simulated host once spent as much CPU as its
    devices spent device time.) ``spin_s=0`` is never more precise than
    the loop: no alarm, no spin.
    """

    def __init__(self, spin_s: float = 0.0015) -> None:
        self._origin = time.monotonic()
        self.spin_s = spin_s

    def now(self) -> float:
        return time.monotonic() - self._origin

    async def sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + max(0.0, seconds)
        loop = running_asyncio_loop() if self.spin_s > 0 else None
        if loop is not None and await _until(loop, deadline, self.spin_s):
            return
        # elsewhere (trio), the timer ends half a millisecond before the last whole one: alone,
        # epoll rounds its wait up to that millisecond (no spin); woken early
        # by I/O, the rest rounds up to at most the deadline's millisecond
        whole_ms = math.floor(seconds * 1e3) * 1e-3 - 0.5e-3
        coarse = max(seconds - self.spin_s, whole_ms) if self.spin_s > 0 else seconds
        if coarse > 0:
            await anyio.sleep(coarse)
        while time.monotonic() < deadline:
            await anyio.lowlevel.checkpoint()

    def call_later(self, seconds: float, callback: Callable[[], object]) -> Timer:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio: trio (from a task or a loop callback)
            if not _in_trio():
                raise RuntimeError("call_later needs this thread's event loop") from None
            return _TrioTimer(seconds, callback)
        return loop.call_later(max(0.0, seconds), _logged, callback)


async def _until(loop: asyncio.AbstractEventLoop, deadline: float, spin_s: float) -> bool:
    """Wait until ``deadline`` on asyncio: on the ``timerfd`` alarm, set
    ``_EARLY_S`` ahead of it (a wake-up comes tens of microseconds late, and
    a simulated device of 0.33 ms programs would lose a tenth of its time to
    that), then a busy wait for what is left (no pass of the loop: each
    would cost a poll of the selector); and in the last ``spin_s``, passes
    of the loop instead while it has other work ready (each costs one step
    of this task, less than the timer). False where there is no alarm."""
    while (left := deadline - time.monotonic()) > _EARLY_S:
        if left <= spin_s and getattr(loop, "_ready", None):  # busy: a pass comes soon
            await asyncio.sleep(0)
            continue
        alarm = wake_at(loop, deadline - (_EARLY_S if left <= spin_s else spin_s))
        if alarm is None:
            return False
        await alarm
    while time.monotonic() < deadline:  # at most _EARLY_S
        pass
    return True


_EARLY_S = 8e-5  # the alarm goes this far ahead of a deadline; a busy wait does the rest


def _in_trio() -> bool:
    if "trio" not in sys.modules:
        return False
    import trio

    try:
        trio.lowlevel.current_root_task()
    except RuntimeError:
        return False
    return True


def call_later_precisely(clock: Clock, seconds: float, callback: Callable[[], object]) -> Timer:
    """``clock.call_later``, to within tens of microseconds on a
    :class:`WallClock` under asyncio (on the loop's ``timerfd``, where an
    asyncio timer can fire up to a millisecond late: epoll waits whole
    milliseconds; called from that alarm's own read, in this context);
    elsewhere what ``clock.call_later`` gives."""
    loop = running_asyncio_loop() if isinstance(clock, WallClock) else None
    timer = None
    if loop is not None:
        deadline = time.monotonic() + max(0.0, seconds)
        timer = call_at(loop, deadline, functools.partial(_logged, callback))
    if timer is None:
        return clock.call_later(seconds, callback)
    return timer


def _logged(callback: Callable[[], object]) -> None:
    try:
        callback()
    except Exception:
        _log.exception("a timer's callback raised")


class _TrioTimer:
    """A wall-clock timer on trio: a system task that sleeps, then calls."""

    def __init__(self, seconds: float, callback: Callable[[], object]) -> None:
        import trio

        self._scope = trio.CancelScope()
        self._callback = callback
        trio.lowlevel.spawn_system_task(self._run, seconds, name="atoll-timer")

    async def _run(self, seconds: float) -> None:
        import trio

        with self._scope:
            await trio.sleep(max(0.0, seconds))
            _logged(self._callback)

    def cancel(self) -> None:
        self._scope.cancel()


class _VirtualTimer:
    __slots__ = ("callback", "clock")

    def __init__(self, callback: Callable[[], object], clock: VirtualClock | None) -> None:
        self.callback: Callable[[], object] | None = callback
        self.clock = clock

    def cancel(self) -> None:
        if self.callback is not None and self.clock is not None:
            self.clock._cancelled()
        self.callback = None


class VirtualClock:
    """Deterministic time that jumps whenever the event loop is idle.

    Start :meth:`run` in a task group (an :class:`ActorSystem` does it for
    you). Sleepers and timers wake in deadline order; sleepers that tie wake
    together, in the backend's order (trio deliberately shuffles it).
    Caveat: a task blocked on real I/O also counts as idle, so use autojump
    for in-process simulation, not across real sockets. With
    ``autojump=False`` time moves only by :meth:`advance`: that one suits
    timeouts of real connections (a test sets the clock with
    :func:`use_clock`, does its I/O, then advances past the timeout).
    """

    def __init__(self, start: float = 0.0, *, autojump: bool = True) -> None:
        self._now = start
        self.autojump = autojump
        self._seq = itertools.count()
        self._sleepers: list[tuple[float, int, anyio.Event | _VirtualTimer]] = []
        self._wakeup: anyio.Event | None = None
        self._dead = 0  # cancelled timers still queued (at most)
        self.jumps = 0

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await anyio.lowlevel.checkpoint()
            return
        if seconds == math.inf:
            await anyio.sleep_forever()
        event = anyio.Event()
        self._push(seconds, event)
        await event.wait()

    def call_later(self, seconds: float, callback: Callable[[], object]) -> Timer:
        if seconds == math.inf:
            return _VirtualTimer(callback, None)  # never due: not queued
        timer = _VirtualTimer(callback, self)
        self._push(max(0.0, seconds), timer)
        return timer

    def _cancelled(self) -> None:
        """A queued timer was cancelled: past half the queue, sweep them out."""
        self._dead += 1
        if self._dead > 64 and 2 * self._dead > len(self._sleepers):
            self._sleepers = [entry for entry in self._sleepers if not _cancelled(entry[2])]
            heapq.heapify(self._sleepers)
            self._dead = 0

    def _push(self, seconds: float, waker: anyio.Event | _VirtualTimer) -> None:
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), waker))
        if self._wakeup is not None:
            self._wakeup.set()

    def advance(self, seconds: float) -> None:
        """Move time on by ``seconds`` now, waking every sleeper and calling
        every timer due by then, in deadline order. Synchronous: woken
        tasks run at the caller's next checkpoint."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        until = self._now + seconds
        while self._sleepers and self._sleepers[0][0] <= until:
            deadline, _, waker = heapq.heappop(self._sleepers)
            self._now = max(self._now, deadline)
            _wake(waker)
        self._now = until

    async def run(self) -> None:
        """Drive the clock forever (until cancelled); with ``autojump=False``
        it only waits (time moves by :meth:`advance`)."""
        if not self.autojump:
            await anyio.sleep_forever()
        while True:
            if not self._sleepers:
                self._wakeup = anyio.Event()
                await self._wakeup.wait()
                self._wakeup = None
            await wait_idle()
            if self._sleepers:
                self._advance()

    def _advance(self) -> None:
        while self._sleepers and _cancelled(self._sleepers[0][2]):
            heapq.heappop(self._sleepers)
        if not self._sleepers:
            return
        deadline = self._sleepers[0][0]
        self._now = max(self._now, deadline)
        self.jumps += 1
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _wake(heapq.heappop(self._sleepers)[2])


def _cancelled(waker: anyio.Event | _VirtualTimer) -> bool:
    return isinstance(waker, _VirtualTimer) and waker.callback is None


def _wake(waker: anyio.Event | _VirtualTimer) -> None:
    if isinstance(waker, _VirtualTimer):
        callback, waker.callback = waker.callback, None
        if callback is not None:
            _logged(callback)
    else:
        waker.set()


_WALL = WallClock()
_current: ContextVar[Clock | None] = ContextVar("atoll_clock", default=None)


def current_clock() -> Clock:
    """The clock :func:`use_clock` set for this context, else the wall clock."""
    clock = _current.get()
    return clock if clock is not None else _WALL


@contextmanager
def use_clock(clock: Clock) -> Iterator[Clock]:
    """Make ``clock`` this context's :func:`current_clock` inside the block
    (and in tasks and connections started there): the timeouts of stores,
    transports and the data plane read it, as trio's clock covers every
    timeout of a trio run."""
    token = _current.set(clock)
    try:
        yield clock
    finally:
        _current.reset(token)


@contextmanager
def move_on_after(clock: Clock, seconds: float) -> Iterator[anyio.CancelScope]:
    """``anyio.move_on_after`` on ``clock``'s time: the block is cancelled
    once ``seconds`` of it have passed (``scope.cancelled_caught`` says so)."""
    if isinstance(clock, WallClock) or seconds == math.inf:
        with anyio.move_on_after(seconds) as scope:
            yield scope
        return
    with anyio.CancelScope() as scope:
        timer = clock.call_later(seconds, scope.cancel)
        try:
            yield scope
        finally:
            timer.cancel()


@contextmanager
def fail_after(clock: Clock, seconds: float) -> Iterator[anyio.CancelScope]:
    """``anyio.fail_after`` on ``clock``'s time: ``TimeoutError`` once
    ``seconds`` of it have passed."""
    with move_on_after(clock, seconds) as scope:
        yield scope
    if scope.cancelled_caught:
        raise TimeoutError(f"{seconds} s passed")


async def wait_idle() -> None:
    """Return once every other task of this event loop is blocked."""
    if sniffio.current_async_library() == "trio":
        import trio.testing

        await trio.testing.wait_all_tasks_blocked()
        return
    await _asyncio_wait_idle()


async def _asyncio_wait_idle() -> None:
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    calm = 0
    while calm < 2:
        await asyncio.sleep(0)
        ready = len(loop._ready)  # type: ignore[attr-defined]
        busy = ready > 0 or any(
            _runnable(task) for task in asyncio.all_tasks(loop) if task is not me
        )
        calm = 0 if busy else calm + 1


def _runnable(task: asyncio.Task[object]) -> bool:
    waiter = task._fut_waiter  # type: ignore[attr-defined]
    return waiter is None or bool(waiter.done())
