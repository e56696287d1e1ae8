"""Simulated devices: real results, modelled timing.

A :class:`SimDevice` computes each computation's value with numpy (keep the
arrays small) and then spends the device time its cost model gives, by
sleeping on the system clock. No host CPU is used for that time, so thousands
of simulated devices fit in one process; under a :class:`VirtualClock` the
sleeps take no real time at all and timings are exact and repeatable.
"""

from __future__ import annotations

import numpy as np

from ._device import Device
from ._values import Computation

__all__ = ["SimDevice"]


class SimDevice(Device):
    """A device whose time comes from ``CostModel.compute_time(flops)``."""

    async def execute(self, computation: Computation, inputs: list[np.ndarray]) -> np.ndarray:
        out = np.asarray(computation.fn(*inputs))
        await self.spend(computation)
        return out

    async def spend(self, computation: Computation) -> None:
        """Sleep the cost model's device time for ``computation`` (no CPU used)."""
        seconds = self.cost.compute_time(computation.flops)
        await self.clock.sleep(seconds)
        self.busy_s += seconds
