"""The controller's work per computation as the cluster grows (``atoll bench scale``).

Pathways' point is that one controller keeps up with thousands of devices.
What must stay flat is the *control plane's* CPU per computation: the
controller and the island scheduler, which run in one process whatever the
cluster's size. Device work happens on each host's own CPU in a real
cluster, so it is left out here.

The workload is the paper's dispatch microbenchmark: a chain of computations,
each a gang over *every* device of the cluster (4 devices per host), with no
device time. The cluster runs in this process (simulated hosts and devices),
so the control plane's CPU is measured by thread CPU time spent inside its
own entry points: the controller's ``run_graph`` and the callbacks it
registers, the island's ``submit_gang``, ``run_plan`` and ``completed``.
Two forms, in the same run:

* ``compiled``: the chain's plan is installed on the devices once; a run is
  one ``run_plan`` message per device, and the island does not consult a
  gang-FIFO policy per gang (see ``IslandScheduler.run_plan``);
* ``per gang``: every gang goes through the policy and to every device.

After start-up the cluster's objects are frozen out of the garbage
collector's scans (``gc.freeze()``), as ``atoll up`` does in its controller
process: otherwise the collector's pauses, which grow with the heap, land in
whatever code runs (at 512 devices, 1,040 µs per computation instead of 265).

Rows, per computation:

* the control plane's CPU (µs);
* each host's CPU: the rest of this thread's CPU (client, devices, stores,
  in-process messages), shared equally among the hosts, as if each host ran
  on a CPU of its own, as it does in a real cluster (µs);
* the parity point's estimate: the larger of the two, the device time per
  computation below which the single controller, or a host, cannot keep up;
  a multi-controller system's own floor is the host's part (ms);
* the wall time with every simulated host in this one process, which grows
  with the hosts' work, serialized here (ms).
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import anyio
import numpy as np

from atoll.benchmarks._common import Row, emit, system_column, table, unit_column
from atoll.benchmarks.dispatch import DEVICES_PER_HOST, chain_graph, step
from atoll.devices import CostModel
from atoll.kernel import WallClock
from atoll.runtime import Controller, IslandScheduler, local_cluster

__all__ = ["control_cpu", "main", "measure", "run"]

HOSTS = (4, 16, 64, 128, 512)
QUICK_HOSTS = (4, 16, 64)
CONTROL_PLANE: dict[type[Any], tuple[str, ...]] = {
    Controller: ("run_graph", "_send_run", "_compiled_sent", "_reported", "_free_held"),
    IslandScheduler: ("submit_gang", "run_plan", "completed", "_report", "_gang_ran"),
}


class CpuMeter:
    """Thread CPU seconds spent inside the wrapped methods (not nested twice)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0

    def wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            started = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.thread_time() - started

        return timed


@contextmanager
def control_cpu() -> Iterator[CpuMeter]:
    """Meter the control plane's entry points (all synchronous) while inside."""
    meter = CpuMeter()
    saved = [
        (cls, name, getattr(cls, name)) for cls, names in CONTROL_PLANE.items() for name in names
    ]
    for cls, name, method in saved:
        setattr(cls, name, meter.wrap(method))
    try:
        yield meter
    finally:
        for cls, name, method in saved:
            setattr(cls, name, method)


async def measure(hosts: int, nodes: int, runs: int, compiled: bool) -> list[Row]:
    """One cluster size and form: control-plane µs and wall ms per computation."""
    devices = hosts * DEVICES_PER_HOST
    form = "compiled" if compiled else "per gang"
    cost = CostModel(flops_per_s=1e12, link_latency_s=0.0, link_bytes_per_s=float("inf"))
    async with local_cluster(
        1, hosts, DEVICES_PER_HOST, clock=WallClock(0.0), cost=cost, push=True
    ) as cluster:
        await cluster.controller.set_compile(compiled)
        everything = await cluster.devices(devices)
        graph = chain_graph([everything] * nodes, step(0.0))
        x = await cluster.put(np.zeros(1, np.float32), 0)

        async def once() -> None:
            [out] = cluster.run_graph(graph, [x])
            await cluster.fetch(out)
            await cluster.free(out)

        await once()  # plans (and installs) once
        gc.freeze()  # the cluster's own objects out of the collector's scans, as `atoll up` does
        with control_cpu() as meter:
            started, cpu = time.perf_counter(), time.thread_time()
            for _ in range(runs):
                await once()
            wall, cpu = time.perf_counter() - started, time.thread_time() - cpu
        gc.unfreeze()
    n = runs * nodes
    control, host = meter.seconds / n, (cpu - meter.seconds) / hosts / n
    sized = functools.partial(Row, "scale", system=form, devices=devices, hosts=hosts)
    return [
        sized("control plane CPU per computation", value=control * 1e6, unit="us"),
        sized("each host's CPU per computation", value=host * 1e6, unit="us"),
        sized("parity point (estimate)", value=max(control, host) * 1e3, unit="ms"),
        sized("wall per computation, one process", value=wall / n * 1e3, unit="ms"),
    ]


async def run(sizes: Sequence[int], nodes: int, progress: Callable[[str], None]) -> list[Row]:
    """Both forms at every size; the largest sizes run fewer times."""
    rows: list[Row] = []
    for hosts in sizes:
        runs = 5 if hosts <= 16 else 2
        for compiled in (True, False):
            progress(f"scale: {hosts} hosts, {'compiled' if compiled else 'per gang'}")
            rows += await measure(hosts, nodes, runs, compiled)
    return rows


def format_table(rows: Sequence[Row]) -> str:
    def figure(value: float) -> str:
        return f"{value:,.3g}" if value < 100 else f"{value:,.0f}"

    columns = [
        system_column("compiled", 10, figure),
        system_column("per gang", 10, figure),
        unit_column(6),
    ]

    def key(row: Row) -> tuple[str, int | None]:
        return (row.case, row.devices)

    text = table(rows, columns, case_width=36, key=key)
    lines = text.splitlines()
    keyed = list(dict.fromkeys(key(r) for r in rows))
    header = lines[0][:36] + f" {'devices':>8}" + lines[0][36:]
    body = [line[:36] + f" {k[1]:>8}" + line[36:] for line, k in zip(lines[1:], keyed, strict=True)]
    return "\n".join([header, *body])


def main(argv: Sequence[str] | None = None) -> int:
    """``atoll bench scale [--quick] [--json] [--nodes N]``."""
    parser = argparse.ArgumentParser(prog="atoll bench scale", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"hosts {QUICK_HOSTS} only")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--nodes", type=int, default=32, help="computations per program")
    args = parser.parse_args(argv)
    sizes = QUICK_HOSTS if args.quick else HOSTS

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    rows = anyio.run(run, sizes, args.nodes, progress)
    emit(rows, args.json, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
