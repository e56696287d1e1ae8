"""W4 over real processes: 16 steps of 2 ms, each on its own host process.

``python benchmarks/pipeline16_processes.py [--runs N]`` starts a controller
here and 16 host processes (``local_cluster(transport="capnp")``), builds the
16-node chain as one program, and times it three ways, interleaved, N runs
each (default 15):

* ``parallel``: parallel asynchronous dispatch, the default: every node is
  sent at once, and each producer pushes its output straight to the next
  host;
* ``parallel_no_push``: the same dispatch with pushing turned off, so each
  input reaches its reader through the controller's promise;
* ``sequential``: each node is sent after the one before it returned.

It prints the medians beyond the 32 ms floor, and the ratio of sequential to
parallel overhead. ``--json`` prints one object per line instead, in the
format of ``atoll bench dispatch --json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import numpy as np

import atoll
from atoll import _bench_dispatch as bench
from atoll.devices import CostModel

STAGES = 16
FLOOR_MS = STAGES * 2.0


async def measure(runs: int) -> dict[str, float]:
    """Median wall time beyond the floor (ms) of each mode, interleaved."""
    async with atoll.local_cluster(
        1, STAGES, 1, transport="capnp", cost=CostModel(flops_per_s=1e12)
    ) as c:
        slices = [await c.devices(1) for _ in range(STAGES)]
        graph = bench.chain_graph(slices, bench.step(0.002))
        x = await c.put(np.zeros(1, np.float32), 0)

        async def parallel() -> None:
            [out] = c.run_graph(graph, [x])
            await out.promise
            await c.free(out)

        async def sequential() -> None:
            [out] = await c.run_graph_sequential(graph, [x])
            await c.free(out)

        async def pushing(on: bool) -> None:
            await c.controller.set_push(on)

        modes: dict[str, tuple[bool, Callable[[], Awaitable[None]]]] = {
            "parallel": (True, parallel),
            "parallel_no_push": (False, parallel),
            "sequential": (False, sequential),
        }
        samples: dict[str, list[float]] = {name: [] for name in modes}
        for run in range(runs + 1):  # the first round warms up and is dropped
            for name, (push, job) in modes.items():
                await pushing(push)
                started = time.perf_counter()
                await job()
                if run:
                    samples[name].append((time.perf_counter() - started) * 1e3 - FLOOR_MS)
        return {name: statistics.median(xs) for name, xs in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    medians = asyncio.run(measure(args.runs))
    if args.json:
        for name, value in medians.items():
            case = f"pipeline16_{name}_overhead_processes"
            row = bench.Row("dispatch", case, "atoll", round(value, 2), "ms", STAGES, STAGES)
            print(row.json())
        return
    print(f"16 steps x 2 ms on 16 host processes, median of {args.runs} runs beyond 32 ms:")
    for name, value in medians.items():
        print(f"  {name:<18} {value:7.1f} ms")
    ratio = medians["sequential"] / max(medians["parallel"], 1e-9)
    print(f"  sequential / parallel overhead: {ratio:.1f}x")


if __name__ == "__main__":
    main()
