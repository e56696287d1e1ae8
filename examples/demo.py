"""The main demo: a chain of computations hopping across hosts and islands.

Each step runs on a device of a different host than the step before, and its
input is the previous step's *promise*: the whole chain is dispatched before
the first step has run, and data moves device to device. At the end the demo
prints the result (checked against plain numpy) and how busy each device was.
"""

from __future__ import annotations

import time
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..devices import BufferHandle, Computation, CostModel, DeviceStats
from ..kernel import Clock, Promise, VirtualClock, WallClock
from ..runtime import Cluster, local_cluster

__all__ = ["DemoResult", "affine", "chain_devices", "run_demo"]

FLOPS_PER_S = 1e12


def affine(x: np.ndarray) -> np.ndarray:
    """One demo step: a cheap stand-in for a compiled kernel."""
    return x * np.float32(1.01) + np.float32(1.0)


def chain_devices(steps: int, hosts: int, devices_per_host: int) -> list[int]:
    """Device of each step: a different host every step, every device in turn."""
    return [(s % hosts) * devices_per_host + (s // hosts) % devices_per_host for s in range(steps)]


@dataclass
class DemoResult:
    result: np.ndarray
    expected: np.ndarray
    devices: list[int]
    stats: list[DeviceStats]
    dispatch_s: float
    device_elapsed_s: float
    wall_s: float


async def run_demo(
    islands: int = 2,
    hosts_per_island: int = 2,
    devices_per_host: int = 2,
    steps: int = 16,
    step_ms: float = 2.0,
    *,
    virtual: bool = False,
    timeline: str | None = None,
    elements: int = 8,
) -> DemoResult:
    """Run the chain on a fresh in-process cluster; returns what it measured.

    With ``timeline``, the cluster's timeline is written there (Chrome trace
    event JSON, see ``docs/observability.md``). ``elements``: the size of
    the array that travels (above 4096 float32 it no longer rides in its
    handle, and each hop is a transfer of its own)."""
    clock: Clock = VirtualClock() if virtual else WallClock()
    cost = CostModel(flops_per_s=FLOPS_PER_S)
    step = Computation("affine", affine, flops=step_ms * 1e-3 * FLOPS_PER_S)
    hosts = islands * hosts_per_island
    plan = chain_devices(steps, hosts, devices_per_host)
    x0 = np.arange(elements, dtype=np.float32)
    async with local_cluster(
        islands, hosts_per_island, devices_per_host, clock=clock, cost=cost
    ) as cluster:
        async with _recording(cluster, timeline):
            started, t0 = time.perf_counter(), clock.now()
            handle = _dispatch(cluster, step, plan, x0)
            dispatch_s = time.perf_counter() - started
            result = await cluster.fetch(handle)
            wall_s = time.perf_counter() - started
        device_elapsed = clock.now() - t0
        stats = await cluster.device_stats()
    expected = x0
    for _ in plan:
        expected = affine(expected)
    return DemoResult(result, expected, plan, stats, dispatch_s, device_elapsed, wall_s)


def _recording(cluster: Cluster, path: str | None) -> AbstractAsyncContextManager[Any]:
    return cluster.recording(path) if path else nullcontext()


def _dispatch(
    cluster: Cluster, step: Computation, plan: list[int], x0: np.ndarray
) -> Promise[BufferHandle]:
    handle = cluster.put(x0, device=plan[0])
    for device in plan:
        handle = cluster.run(step, device, [handle])  # the input is still a promise
    return handle


def format_demo(result: DemoResult, step_ms: float) -> str:
    """The demo's report as text."""
    ok = np.allclose(result.result, result.expected)
    lines = [
        f"chain of {len(result.devices)} steps over devices {result.devices}",
        f"result: {np.array2string(result.result, precision=3)}",
        f"matches plain numpy: {'yes' if ok else 'NO'}",
        f"dispatch of the whole chain took {result.dispatch_s * 1e3:.2f} ms (before any data)",
        f"device time elapsed {result.device_elapsed_s * 1e3:.1f} ms "
        f"(floor {len(result.devices) * step_ms:.1f} ms); wall {result.wall_s * 1e3:.1f} ms",
        "",
        f"{'device':>6} {'host':>4} {'island':>6} {'runs':>4} {'busy ms':>8} {'busy %':>7}",
    ]
    for s in result.stats:
        lines.append(
            f"{s.device_id:>6} {s.host_id:>4} {s.island:>6} {s.computations:>4} "
            f"{s.busy_s * 1e3:>8.2f} {100 * s.busy_fraction:>6.1f}%"
        )
    return "\n".join(lines)
