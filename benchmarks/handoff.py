"""W5 over real host processes: a 64 MiB array made on host A, read on host B.

``atoll bench handoff [--json] [--quick] [--reps N]`` starts a controller here
and two host processes (``local_cluster(1, 2, 1, transport="capnp")``), and
measures, as ``shared/peers`` defines W5:

* ``w5_end_to_end``: produce on A and consume on B, submitted together, the
  client waiting for B's (tiny) result (MiB/s of the 64 MiB);
* ``w5_handoff``: A's output already made, then B consumes it (MiB/s).

B reads one float per 4 KiB page. The simulated devices model no link time
(the cost model's links are infinitely fast), so what is measured is the real
data plane and control path. ``--stream`` sets ``ATOLL_MACHINE_ID=per-process``
in the environment, which makes every process a machine of its own: the bulk
stream then carries the bytes instead of shared memory.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np

from atoll.benchmarks._common import Row, emit, system_column, table, track, unit_column
from atoll.devices import Computation, CostModel
from atoll.runtime import local_cluster

__all__ = ["consume", "main", "produce", "run"]

NBYTES = 64 << 20
MIB = NBYTES / 2**20


def produce(seed: np.ndarray) -> np.ndarray:
    """64 MiB of float32 (runs on host A)."""
    return np.full(NBYTES // 4, seed[0], dtype=np.float32)


def consume(x: np.ndarray) -> np.ndarray:
    """One float per 4 KiB page, summed (runs on host B)."""
    return np.asarray([x[::1024].sum(dtype=np.float64), x.nbytes])


PRODUCE = Computation("produce", produce, 1e6)
CONSUME = Computation("consume", consume, 1e6)
FREE_LINKS = CostModel(link_bytes_per_s=float("inf"), link_latency_s=0.0)


async def _measure(reps: int) -> tuple[list[float], list[float]]:
    """Seconds of each end-to-end and each hand-off run (after one warm-up)."""
    end_to_end: list[float] = []
    handoff: list[float] = []
    async with local_cluster(1, 2, 1, transport="capnp", cost=FREE_LINKS) as cluster:
        seed = await cluster.put(np.ones(1, np.float32), 0)
        for rep in track(range(reps + 1), "hand-offs"):
            started = time.perf_counter()
            a = cluster.run(PRODUCE, 0, [seed])
            b = cluster.run(CONSUME, 1, [a])
            result = await cluster.fetch(b)
            took = time.perf_counter() - started
            assert result[1] == NBYTES
            for done in (a, b):
                await cluster.free(done)
            a = cluster.run(PRODUCE, 0, [seed])
            await a
            started = time.perf_counter()
            b = cluster.run(CONSUME, 1, [a])
            await cluster.fetch(b)
            if rep:
                end_to_end.append(took)
                handoff.append(time.perf_counter() - started)
            for done in (a, b):
                await cluster.free(done)
    return end_to_end, handoff


def run(reps: int = 10, stream: bool = False) -> list[Row]:
    """Measure; returns MiB/s rows (system ``atoll`` or ``atoll-stream``)."""
    if stream:
        os.environ["ATOLL_MACHINE_ID"] = "per-process"  # every process a machine of its own
    system = "atoll-stream" if stream else "atoll"
    end_to_end, handoff = asyncio.run(_measure(reps))
    return [
        Row(
            "handoff",
            "w5_end_to_end",
            system,
            round(MIB / statistics.median(end_to_end), 1),
            "MiB/s",
        ),
        Row("handoff", "w5_handoff", system, round(MIB / statistics.median(handoff), 1), "MiB/s"),
        Row("handoff", "w5_handoff_ms", system, round(statistics.median(handoff) * 1e3, 2), "ms"),
    ]


def _table(rows: Sequence[Row]) -> str:
    systems = sorted({row.system for row in rows})
    columns = [*(system_column(s, 14) for s in systems), unit_column(7)]
    return table(rows, columns, case_width=16)


def main(argv: Sequence[str] | None = None) -> int:
    """``atoll bench handoff [--json] [--quick] [--reps N] [--stream]``."""
    parser = argparse.ArgumentParser(prog="atoll bench handoff", description=__doc__)
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--quick", action="store_true", help="3 repetitions")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--stream", action="store_true", help="force the cross-machine path")
    args = parser.parse_args(argv)
    emit(run(3 if args.quick else args.reps, args.stream), args.json, _table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
