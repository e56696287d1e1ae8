"""Benchmarks show progress bars on a terminal, and draw nothing elsewhere."""

from __future__ import annotations

import anyio
import pytest

from atoll.benchmarks import _common

pytestmark = pytest.mark.anyio


async def step() -> None:
    await anyio.sleep(0)


@pytest.mark.parametrize("enabled", [True, False])
async def test_timings_inside_progress_bars(enabled: bool) -> None:
    with _common.progress_bars(enabled=enabled):
        if enabled:
            bars = _common._bars[-1]
            samples = await _common.timings(step, 5)
            assert not bars.tasks  # its bar was removed once done
        else:
            assert not _common._bars
            samples = await _common.timings(step, 5)
    assert len(samples) == 5 and not _common._bars


def test_track_yields_every_item_with_or_without_bars() -> None:
    with _common.progress_bars(enabled=True):
        assert list(_common.track(range(4), "items")) == [0, 1, 2, 3]
        assert not _common._bars[-1].tasks
    assert list(_common.track([5, 6], "items")) == [5, 6]
