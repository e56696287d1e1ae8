"""Waiting without spinning: promise waits and precise sleeps (issue 34).

A promise's waiters each get a future of their own on asyncio (an anyio
event on trio), so a waiter that is cancelled leaves the others waiting; a
wall-clock sleep on asyncio waits on a ``timerfd`` that its loop watches
(``kernel/_alarm.py``), woken in deadline order, never early.
"""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest

from atoll.kernel import Promise, WallClock

pytestmark = pytest.mark.anyio


async def test_a_cancelled_waiter_leaves_the_others_waiting() -> None:
    promise: Promise[int] = Promise("shared")
    got: list[int] = []

    async def wait() -> None:
        got.append(await promise)

    async with anyio.create_task_group() as group:
        group.start_soon(wait)
        with anyio.move_on_after(0.01):
            await promise  # this waiter gives up
        group.start_soon(wait)
        await anyio.sleep(0.01)
        promise.set_result(7)
    assert got == [7, 7]


async def test_a_settled_promise_is_awaited_without_waiting() -> None:
    promise: Promise[str] = Promise("done")
    promise.set_result("now")
    assert await promise == "now"
    assert await promise == "now"


async def test_wall_clock_sleeps_end_in_order_and_never_early(anyio_backend: str) -> None:
    """Never early on both; in deadline order on asyncio, whose sleeps share
    one timer heap. On trio each sleep checks its own deadline in its last
    part, and trio runs ready tasks in an order of its choosing, so a busy
    machine may end overlapping sleeps in another order."""
    clock = WallClock()
    ends: list[tuple[float, float]] = []  # (deadline, woke)

    async def sleep(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        await clock.sleep(seconds)
        ends.append((deadline, time.monotonic()))

    async with anyio.create_task_group() as group:
        for seconds in (0.004, 0.0005, 0.002, 0.001):
            group.start_soon(sleep, seconds)
    if anyio_backend == "asyncio":
        assert [deadline for deadline, _ in ends] == sorted(d for d, _ in ends)
    assert all(woke >= deadline for deadline, woke in ends)


async def test_a_cancelled_sleep_does_not_stop_the_next() -> None:
    clock = WallClock()
    with anyio.move_on_after(0.001):
        await clock.sleep(0.05)
    began = time.monotonic()
    await clock.sleep(0.002)
    assert time.monotonic() - began >= 0.002


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_alarm_wakes_a_loop_that_waits_for_nothing_else() -> None:
    from atoll.kernel._alarm import wake_at

    future = wake_at(asyncio.get_running_loop(), time.monotonic() + 0.0005)
    if future is None:
        pytest.skip("no timerfd on this platform")
    await asyncio.wait_for(future, 1.0)
    assert future.done()
