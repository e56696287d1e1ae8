"""Clocks: real time for running, virtual time for testing.

Simulated devices "spend" device time by sleeping on a :class:`Clock`. With
:class:`WallClock` that is a real sleep (no host CPU used). With
:class:`VirtualClock` nothing really sleeps: time jumps to the next deadline as
soon as every task of the event loop is blocked, the way trio's autojump clock
does, but on asyncio too. Tests therefore run instantly and give the same
timings on every run and every machine.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from typing import Protocol

import anyio
import sniffio

__all__ = ["Clock", "VirtualClock", "WallClock"]


class Clock(Protocol):
    """Where device time comes from."""

    def now(self) -> float:
        """Seconds since an arbitrary, fixed origin."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Let ``seconds`` of this clock's time pass."""
        ...


class WallClock:
    """Real monotonic time; ``sleep`` is a real sleep, precise to ~0.1 ms.

    Event loops wake from timers in whole milliseconds (epoll's timeout
    unit, rounded up), which would add up to a millisecond to a simulated
    kernel of 2.3 ms. So a sleep waits on a timer that ends half a
    millisecond before the last whole millisecond it holds (an idle loop's
    wait rounds up to that millisecond; one woken early by I/O is not pushed
    past it) and spends the rest, at most ``spin_s``, yielding to the loop
    until the deadline: precise, at the price of host CPU in that window
    only. (An idle 2 ms sleep spins for nothing; spinning its last 1.5 ms,
    as this clock once did, cost a simulated host three quarters of a
    core.) ``spin_s=0`` never spins.
    """

    def __init__(self, spin_s: float = 0.0015) -> None:
        self._origin = time.monotonic()
        self.spin_s = spin_s

    def now(self) -> float:
        return time.monotonic() - self._origin

    async def sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + max(0.0, seconds)
        # the timer ends half a millisecond before the last whole one: alone,
        # epoll rounds its wait up to that millisecond (no spin); woken early
        # by I/O, the rest rounds up to at most the deadline's millisecond
        whole_ms = math.floor(seconds * 1e3) * 1e-3 - 0.5e-3
        coarse = max(seconds - self.spin_s, whole_ms) if self.spin_s > 0 else seconds
        if coarse > 0:
            await anyio.sleep(coarse)
        while time.monotonic() < deadline:
            await anyio.lowlevel.checkpoint()


class VirtualClock:
    """Deterministic time that jumps whenever the event loop is idle.

    Start :meth:`run` in a task group (an :class:`ActorSystem` does it for
    you). Sleepers wake in deadline order; ties wake together, in the
    backend's order (trio deliberately shuffles it).
    Caveat: a task blocked on real I/O also counts as idle, so use this clock
    for in-process simulation, not across real sockets.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._seq = itertools.count()
        self._sleepers: list[tuple[float, int, anyio.Event]] = []
        self._wakeup: anyio.Event | None = None
        self.jumps = 0

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await anyio.lowlevel.checkpoint()
            return
        event = anyio.Event()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), event))
        if self._wakeup is not None:
            self._wakeup.set()
        await event.wait()

    async def run(self) -> None:
        """Drive the clock forever (until cancelled)."""
        while True:
            if not self._sleepers:
                self._wakeup = anyio.Event()
                await self._wakeup.wait()
                self._wakeup = None
            await wait_idle()
            if self._sleepers:
                self._advance()

    def _advance(self) -> None:
        deadline = self._sleepers[0][0]
        self._now = max(self._now, deadline)
        self.jumps += 1
        while self._sleepers and self._sleepers[0][0] <= self._now:
            heapq.heappop(self._sleepers)[2].set()


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
