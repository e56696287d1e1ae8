"""Simulated devices run ahead of their host, as accelerators do (devices/sim.py).

Under a :class:`VirtualClock` the host's own work takes no time, so every
figure here is exact: device time is spent back to back on a device's
stream, whoever reads an output waits until it exists, and the stream never
holds more than ``WINDOW`` gangs.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

import atoll
from atoll.devices import Computation, CostModel
from atoll.devices._inflight import WINDOW
from atoll.kernel import VirtualClock

pytestmark = pytest.mark.anyio

COST = CostModel(flops_per_s=1e12)


def _plus_one(x: np.ndarray) -> np.ndarray:
    return x + 1


def _step(seconds: float) -> Computation:
    return Computation("plus_one", _plus_one, seconds * 1e12)


async def test_a_device_takes_runs_ahead_of_their_device_time() -> None:
    """Ten runs sent at once: the device takes them all before the first
    ends (its stream holds ten), spends them back to back, and each answer
    comes when its run ended."""
    clock = VirtualClock()
    async with atoll.local_cluster(1, 1, 1, clock=clock, cost=COST) as cluster:
        x = await cluster.put(np.zeros(4, np.float32), 0)
        start = clock.now()
        outs = [cluster.run(_step(1.0), 0, [x]) for _ in range(10)]
        first = await outs[0]
        assert clock.now() - start == pytest.approx(1.0)
        for out in outs:
            await out
        assert clock.now() - start == pytest.approx(10.0)
        np.testing.assert_array_equal(await cluster.fetch(first), np.ones(4, np.float32))
        [stats] = await cluster.device_stats()
    assert stats.busy_s == pytest.approx(10.0)
    assert stats.peak_in_flight == 10 and stats.in_flight == 0


async def test_readers_wait_for_what_they_read() -> None:
    """A chain over the two devices of one host, and a fetch of a run still
    under way: nobody sees a value before its device time is over."""
    clock = VirtualClock()
    async with atoll.local_cluster(1, 1, 2, clock=clock, cost=COST) as cluster:
        x = await cluster.put(np.zeros(2, np.float32), 0)
        start = clock.now()
        y: Any = x
        for device in (0, 1, 0, 1):
            y = cluster.run(_step(0.5), device, [y])
        np.testing.assert_array_equal(await cluster.fetch(y), np.full(2, 4, np.float32))
        assert clock.now() - start == pytest.approx(2.0)


async def test_a_device_keeps_at_most_a_window_in_flight() -> None:
    """Twice the window sent at once: the device stalls at ``WINDOW``, and
    every run is charged its device time once."""
    clock = VirtualClock()
    async with atoll.local_cluster(1, 1, 1, clock=clock, cost=COST) as cluster:
        x = await cluster.put(np.zeros(1, np.float32), 0)
        outs = [cluster.run(_step(0.01), 0, [x]) for _ in range(2 * WINDOW)]
        for out in outs:
            await out
        [stats] = await cluster.device_stats()
    assert stats.peak_in_flight == WINDOW
    assert stats.computations == 2 * WINDOW
    assert stats.busy_s == pytest.approx(2 * WINDOW * 0.01)


async def test_on_the_wall_clock_device_time_is_never_cut_short() -> None:
    """Runs of 2 ms in a row take at least their device time in all, and the
    device is charged exactly that."""
    async with atoll.local_cluster(1, 1, 1, cost=COST) as cluster:
        x = await cluster.put(np.zeros(1, np.float32), 0)
        began = time.monotonic()
        outs = [cluster.run(_step(0.002), 0, [x]) for _ in range(20)]
        for out in outs:
            await out
        took = time.monotonic() - began
        [stats] = await cluster.device_stats()
    assert took >= 20 * 0.002
    assert stats.busy_s == pytest.approx(20 * 0.002)


async def test_a_reader_on_another_device_of_the_host_goes_on_its_stream_at_once() -> None:
    """A step on device 1 that reads device 0's output, still under way, is
    on device 1's stream before that output exists (its host takes no turn
    between the two, as an accelerator's stream waits for another's event),
    and starts only once it exists."""
    clock = VirtualClock()
    async with atoll.local_cluster(1, 1, 2, clock=clock, cost=COST) as cluster:
        x = await cluster.put(np.zeros(2, np.float32), 0)
        start = clock.now()
        y = cluster.run(_step(1.0), 0, [x])
        z = cluster.run(_step(1.0), 1, [y])
        while (await cluster.device_stats())[1].in_flight == 0:
            assert clock.now() - start < 1.0
        assert clock.now() - start < 1.0 and not y.done()
        np.testing.assert_array_equal(await cluster.fetch(z), np.full(2, 2, np.float32))
        assert clock.now() - start == pytest.approx(2.0)
