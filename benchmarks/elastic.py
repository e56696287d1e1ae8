"""``atoll bench elastic``: moving, suspending and resuming slices between host processes.

Cases, each measured in this run, on a cluster of host processes
(``process_cluster``, simulated devices: the buffers are real bytes):

* ``move N MiB``: a slice holding one buffer of N MiB (1, 64, 512) moves
  between two hosts, back and forth; the median time of a move, against the
  median time of the data plane carrying the same buffer between the same
  two hosts (a one-node program on the other host reading it): the ratio
  is what a move costs beyond its bytes.
* ``suspend`` and ``resume``: parking the buffer in host memory and giving
  the device back, then resuming where it was (no copy) and on another host
  (a copy).
* ``other client during moves``: a second client's chain of small runs on a
  third host; its median and 99th-percentile latency per run with no move,
  and while the first client's 512 MiB slice moves back and forth.

``--machines per-process`` makes every process a machine of its own, so
bytes take the bulk stream instead of shared memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np

from atoll.devices import Aval, Computation
from atoll.runtime import Cluster, VirtualSlice
from atoll.runtime.deploy.process import process_cluster
from atoll.runtime.deploy.spec import ClusterSpec
from atoll.runtime.graph import Graph, GraphBuilder

from ._common import Row, emit, p99, system_column, table, unit_column

BENCH = "elastic"
MIB = 1 << 20
TINY = Aval((1,), "float32")


def _head(values: np.ndarray) -> np.ndarray:
    return np.asarray(values[:1], np.float32)


def _inc(value: np.ndarray) -> np.ndarray:
    return value + 1


def _one_node(slice_: VirtualSlice, fn: Any, name: str, inp: Aval, out: Aval) -> Graph:
    builder = GraphBuilder()
    x = builder.input(inp)
    [y] = builder.add(Computation(name, fn, 0.0), slice_, [x], [out])
    return builder.build([y])


async def _filled(cluster: Cluster, slice_: VirtualSlice, mib: int) -> Any:
    """A buffer of ``mib`` MiB made on ``slice_``'s device (it belongs to it)."""
    count = mib * MIB // 4
    fill = _FillN(count)
    graph = _one_node(slice_, fill, f"fill{mib}", TINY, Aval((count,), "float32"))
    [ref] = cluster.run_graph(graph, [np.ones(1, np.float32)])
    await cluster.ready(ref)
    return ref


class _FillN:
    """A vector of ``count`` copies of a seed (picklable by reference, unlike a closure)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __call__(self, seed: np.ndarray) -> np.ndarray:
        return np.full(self.count, seed[0], np.float32)


async def moves(cluster: Cluster, sizes: Sequence[int], repeats: int) -> list[Row]:
    rows = []
    for mib in sizes:
        slice_ = await cluster.devices(1)  # host 0
        reader = await cluster.devices(1)  # host 1: a plain transfer's reader
        buffer = await _filled(cluster, slice_, mib)
        head = _one_node(reader, _head, "head", Aval((mib * MIB // 4,), "float32"), TINY)
        transfer = []
        for _ in range(repeats):
            began = time.perf_counter()
            [out] = cluster.run_graph(head, [buffer])
            await cluster.fetch(out)
            transfer.append(time.perf_counter() - began)
        await cluster.release(reader)
        taken = []
        for i in range(repeats):
            report = await cluster.move(slice_, host=1 - i % 2)
            taken.append(report["seconds"])
        case = f"move {mib} MiB"
        move_s, transfer_s = statistics.median(taken), statistics.median(transfer)
        rows += [
            Row(BENCH, case, "move", move_s, "s", 1, 2),
            Row(BENCH, case, "data plane", transfer_s, "s", 1, 2),
            Row(BENCH, case, "ratio", move_s / transfer_s, "x", 1, 2),
            Row(BENCH, case, "GB/s", mib * MIB / move_s / 1e9, "GB/s", 1, 2),
        ]
        await cluster.free(buffer)
        await cluster.release(slice_)
    return rows


async def suspend_resume(cluster: Cluster, mib: int, repeats: int) -> list[Row]:
    slice_ = await cluster.devices(1)  # host 0
    buffer = await _filled(cluster, slice_, mib)
    other = cluster.client("borrower")
    times: dict[str, list[float]] = {"suspend": [], "resume here": [], "resume elsewhere": []}
    for i in range(repeats):
        times["suspend"].append((await cluster.suspend(slice_))["seconds"])
        elsewhere = i % 2 == 1
        borrowed = await other.devices(1) if elsewhere else None  # takes its device
        name = "resume elsewhere" if elsewhere else "resume here"
        times[name].append((await cluster.resume(slice_))["seconds"])
        if borrowed is not None:
            await other.release(borrowed)
    value = await cluster.fetch(buffer)
    if value[0] != 1 or value.nbytes != mib * MIB:
        raise RuntimeError("the suspended and resumed buffer came back wrong")
    await cluster.free(buffer)
    await cluster.release(slice_)
    case = f"suspend and resume {mib} MiB"
    return [Row(BENCH, case, k, statistics.median(v), "s", 1) for k, v in times.items() if v]


async def other_client(cluster: Cluster, mib: int, runs: int) -> list[Row]:
    """A second client's latency per run, alone and while a slice moves."""
    other = cluster.client("other")
    theirs = await other.devices(1)  # the first free host
    step = _one_node(theirs, _inc, "inc", TINY, TINY)

    async def chain(count: int) -> list[float]:
        latencies, x = [], np.zeros(1, np.float32)
        for _ in range(count):
            began = time.perf_counter()
            [ref] = other.run_graph(step, [x])
            x = await other.fetch(ref)
            latencies.append(time.perf_counter() - began)
        return latencies

    quiet = await chain(runs)
    mine = await cluster.devices(1)
    buffer = await _filled(cluster, mine, mib)
    busy: list[float] = []
    moving = True

    async def keep_moving() -> None:
        i = 0
        while moving:
            await cluster.move(mine)
            i += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(keep_moving)
        busy = await chain(runs)
        moving = False
    await cluster.free(buffer)
    case = f"other client during {mib} MiB moves"
    return [
        Row(BENCH, case, "median alone", statistics.median(quiet), "s", 1),
        Row(BENCH, case, "median during", statistics.median(busy), "s", 1),
        Row(BENCH, case, "p99 alone", p99(quiet), "s", 1),
        Row(BENCH, case, "p99 during", p99(busy), "s", 1),
    ]


async def run(args: argparse.Namespace) -> list[Row]:
    spec = ClusterSpec(1, 3, 1)
    async with process_cluster(spec) as cluster:
        rows = await moves(cluster, args.sizes, args.repeats)
        rows += await suspend_resume(cluster, max(args.sizes), args.repeats)
        rows += await other_client(cluster, max(args.sizes), args.runs)
    return rows


def _render(rows: Sequence[Row]) -> str:
    columns = [
        system_column(name, width, fmt)
        for name, width, fmt in [
            ("move", 8, ".4f"),
            ("data plane", 11, ".4f"),
            ("ratio", 6, ".2f"),
            ("GB/s", 6, ".2f"),
            ("suspend", 8, ".4f"),
            ("resume here", 12, ".4f"),
            ("resume elsewhere", 17, ".4f"),
            ("median alone", 13, ".5f"),
            ("median during", 14, ".5f"),
            ("p99 alone", 10, ".5f"),
            ("p99 during", 11, ".5f"),
        ]
    ]
    return table(rows, [*columns, unit_column()], case_width=36)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atoll bench elastic", description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 512], help="MiB")
    parser.add_argument("--repeats", type=int, default=5, help="moves per size")
    parser.add_argument("--runs", type=int, default=300, help="the other client's runs")
    parser.add_argument("--machines", choices=["one", "per-process"], default="one")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    if min(args.sizes) < 1 or args.repeats < 2 or args.runs < 10:
        parser.error("--sizes at least 1 MiB, --repeats at least 2, --runs at least 10")
    if args.machines == "per-process":
        os.environ["ATOLL_MACHINE_ID"] = "per-process"
    began = time.perf_counter()
    rows: list[Any] = anyio.run(run, args)
    emit(rows, args.json, _render)
    print(f"({time.perf_counter() - began:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
