"""W4 over real processes: 16 steps of 2 ms, each on its own host process.

``python benchmarks/pipeline16_processes.py`` starts a controller here and 16
host processes (``local_cluster(transport="capnp")``), then times the chain
dispatched in parallel (every step sent at once, inputs as promises) and
sequentially (each step sent after the previous one returned), 15 runs each,
and prints the medians beyond the 32 ms floor.
"""

import asyncio
import statistics
import time

import numpy as np

import atoll
from atoll.demo import affine
from atoll.devices import BufferHandle, Computation, CostModel
from atoll.kernel import Promise

STEP = Computation("affine", affine, flops=2e9)  # 2 ms at 1 TFLOP/s


async def main() -> None:
    async with atoll.local_cluster(
        1, 16, 1, transport="capnp", cost=CostModel(flops_per_s=1e12)
    ) as c:
        x0 = await c.put(np.ones(4, np.float32), 0)

        async def parallel() -> None:
            h: BufferHandle | Promise[BufferHandle] = x0
            for d in range(16):
                h = c.run(STEP, d, [h])  # sent at once; the input is still a promise
            await c.fetch(h)

        async def sequential() -> None:
            h: BufferHandle = x0
            for d in range(16):
                h = await c.run(STEP, d, [h])  # each step waits for the one before
            await c.fetch(h)

        for f in (parallel, sequential):
            await f()
        res = {}
        for name, f in (("parallel", parallel), ("sequential", sequential)):
            xs = []
            for _ in range(15):
                t = time.perf_counter()
                await f()
                xs.append((time.perf_counter() - t) * 1e3 - 32)
            res[name] = statistics.median(xs)
        print(
            {k: round(v, 1) for k, v in res.items()},
            "ms beyond the 32 ms floor (16 host processes)",
        )


if __name__ == "__main__":
    asyncio.run(main())
