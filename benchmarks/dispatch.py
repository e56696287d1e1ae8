"""Pathways' dispatch microbenchmark, on simulated devices in one process.

Every "computation" is a trivial scalar op run as a gang over *all* devices
of the cluster (hosts of 4 devices), as in the paper. Modes:

* ``opbyop``: one client call (one one-node program) per computation, each
  chained to the last by reference, awaited at the end;
* ``chained128``: one program of 128 dependent nodes;
* ``fused128``: one node that holds 128 computations.

Beside each, in the same run, the *multi-controller* baseline: every host
drives its own devices directly (one driver task per host, no controller, no
island scheduler), dispatching asynchronously as multi-controller JAX does.

Device time is simulated (a real sleep on a ``WallClock`` that uses no CPU);
everything else (controller, schedulers, device actors, the baseline's
drivers) is real code measured in wall-clock time. All hosts share this
process's CPU, so host-side work that a real cluster does on each host in
parallel is serialized here: throughput falls with cluster size for both
systems, and the ratio between them is the meaningful figure.

Run it as ``atoll bench dispatch``, ``python benchmarks/dispatch.py`` or
``python -m atoll.benchmarks.dispatch``::

    python benchmarks/dispatch.py            # full run (about 2 minutes on 2 cores)
    python benchmarks/dispatch.py --small    # quick: 16 and 128 devices
    python benchmarks/dispatch.py --json     # one JSON object per line
    python benchmarks/dispatch.py --plot docs/dispatch.png
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import numpy as np

from atoll.benchmarks._common import Column, Row, median_time, system_column, table, unit_column
from atoll.benchmarks.peers_ray import PeerFigure, ray_figures
from atoll.devices import Aval, BufferHandle, Computation, CostModel
from atoll.devices._plan import DeviceProgram, PlannedGang
from atoll.kernel import WallClock, then
from atoll.runtime import Cluster, Graph, GraphBuilder, SliceSpec, local_cluster

__all__ = [
    "Row",
    "chain_graph",
    "format_table",
    "main",
    "measure_modes",
    "parity_point",
    "pipeline_overhead",
    "pipeline_processes",
    "ray_rows",
    "run",
    "step",
]

DEVICES_PER_HOST = 4
FLOPS_PER_S = 1e12
COST = CostModel(flops_per_s=FLOPS_PER_S)
SCALAR = Aval((1,), "float32")
RPC_LATENCY_S = (
    200e-6  # a small Cap'n Proto call on this machine: 150-260 us (shared/docs/DESIGN.md)
)


def trivial(x: np.ndarray) -> np.ndarray:
    return x + np.float32(1)


def fused128(x: np.ndarray) -> np.ndarray:
    """128 increments' worth of result in one numpy op (the 128 computations'
    device time comes from the cost model, as for every simulated kernel)."""
    return x + np.float32(128)


def step(seconds: float, fused: bool = False) -> Computation:
    """The scalar op, taking ``seconds`` of device time per computation."""
    if fused:
        return Computation("fused128", fused128, 128 * seconds * FLOPS_PER_S)
    return Computation("scalar", trivial, seconds * FLOPS_PER_S)


def chain_graph(slices: Sequence[SliceSpec], computation: Computation) -> Graph:
    """A chain of one node per slice, each reading the last one's output."""
    builder = GraphBuilder()
    value = builder.input(SCALAR)
    for s in slices:
        [value] = builder.add(computation, s, [value], [SCALAR], computation.name)
    return builder.build([value])


# -- atoll: the single controller ----------------------------------------
async def atoll_chained(
    c: Cluster, s: SliceSpec, x: BufferHandle, nodes: int, t: float, fused: bool = False
) -> float:
    """Computations/s of one program of ``nodes`` chained nodes (``fused``:
    each node holds 128 computations)."""
    graph = chain_graph([s] * nodes, step(t, fused))

    async def job() -> None:
        [out] = c.run_graph(graph, [x])
        await c.free(out)

    return (128 if fused else 1) * nodes / await median_time(job)


async def atoll_opbyop(c: Cluster, s: SliceSpec, x: BufferHandle, calls: int, t: float) -> float:
    graph = chain_graph([s], step(t))

    async def job() -> None:
        ref: Any = x
        refs = []
        for _ in range(calls):
            [ref] = c.run_graph(graph, [ref])  # one client call per computation
            refs.append(ref)
        await ref.promise
        for each in refs:
            await c.free(each)

    return calls / await median_time(job)


# -- the multi-controller baseline ----------------------------------------
async def multicontroller(
    c: Cluster, calls: int, computation: Computation, per_call: int, one_host: bool = False
) -> float:
    """Each host's driver dispatches ``calls`` chained computations to each of its devices.

    ``one_host``: drive host 0 alone. Multi-controller hosts never wait for
    each other, so on real machines (one CPU per host) the cluster runs at
    one host's rate: this is the baseline with the hosts' parallelism that
    a single process cannot give, an upper bound for the real baseline.
    """
    hosts = [0] if one_host else sorted({d.host for d in c.device_infos})
    inputs = {
        d.id: c.device_ref(d.id).put(np.zeros(1, np.float32))
        for d in c.device_infos
        if d.host in hosts
    }
    for each in inputs.values():
        await each  # placed before the clock starts, as atoll's input is

    epochs = itertools.count()
    for d in c.device_infos:  # each driver installs its one-step program on its devices
        if d.host in hosts:
            await c.device_ref(d.id).install_plan(_one_step(computation, d.id, d.host))

    async def drive(host: int) -> None:
        tails = []
        for device in [d.id for d in c.device_infos if d.host == host]:
            ref = c.device_ref(device)
            handle: Any = inputs[device]
            for _ in range(calls):
                report = ref.run_plan(_ONE_STEP, next(epochs), [handle])
                handle = then(report, lambda r: r.output(0, 0))
            tails.append(handle)
        for tail in tails:
            done = await tail
            await done.host.free(done.id)

    async def job() -> None:
        async with anyio.create_task_group() as tg:
            for host in hosts:
                tg.start_soon(drive, host)

    rate = calls * per_call / await median_time(job)
    for each in inputs.values():
        handle = await each
        await handle.host.free(handle.id)
    return rate


_ONE_STEP = 1  # the multi-controller baseline's program id on each device


def _one_step(computation: Computation, device: int, host: int) -> DeviceProgram:
    """One computation on ``device``, its one input the program's: what a
    multi-controller driver installs on its devices, and then runs (a run
    reaches a device only as its part of an installed program)."""
    entry = PlannedGang(
        0, computation, (device,), (1,), ("x",), (SCALAR,), (0,), (False,), (), (True,), host
    )
    return DeviceProgram(_ONE_STEP, device, (entry,), (0,))


async def measure_modes(hosts: int, calls: int, nodes: int, reps: int) -> list[Row]:
    """All three modes, atoll and baseline, on one cluster of ``hosts`` hosts."""
    devices = hosts * DEVICES_PER_HOST
    clock = WallClock(spin_s=0.0)  # thousands of sleeping devices must not spin
    async with local_cluster(1, hosts, DEVICES_PER_HOST, clock=clock, cost=COST) as c:
        s = await c.devices(devices)
        x = await c.put(np.zeros(1, np.float32), 0)
        figures = {
            ("opbyop", "atoll"): await atoll_opbyop(c, s, x, calls, 0.0),
            ("opbyop", "multicontroller"): await multicontroller(c, calls, step(0.0), 1),
            ("chained128", "atoll"): await atoll_chained(c, s, x, nodes, 0.0),
            ("chained128", "multicontroller"): await multicontroller(c, nodes, step(0.0), 1),
            ("fused128", "atoll"): await atoll_chained(c, s, x, reps, 0.0, fused=True),
            ("fused128", "multicontroller"): await multicontroller(
                c, reps, step(0.0, fused=True), 128
            ),
        }
    return [
        Row("dispatch", case, system, value, "computations/s", devices, hosts)
        for (case, system), value in figures.items()
    ]


PARITY_GRID_MS = (0.25, 0.5, 1, 2, 3, 5, 8, 13, 20, 35, 50, 80, 130, 200, 350, 500, 1000)


async def parity_point(hosts: int, nodes: int = 8) -> list[Row]:
    """The smallest grid device time at which Chained reaches 95% of the baseline.

    Two rows: against the baseline run in this process (``multicontroller``:
    its hosts share our CPU, as atoll's do) and against one host's rate
    (``multicontroller_parallel_hosts``: as if every host had its own CPU).
    A value of None means not reached on the grid.
    """
    devices = hosts * DEVICES_PER_HOST
    found: dict[str, float | None] = {
        "multicontroller": None,
        "multicontroller_parallel_hosts": None,
    }
    async with local_cluster(1, hosts, DEVICES_PER_HOST, clock=WallClock(0.0), cost=COST) as c:
        s = await c.devices(devices)
        x = await c.put(np.zeros(1, np.float32), 0)
        for ms in PARITY_GRID_MS:
            t = ms / 1e3
            ours = await atoll_chained(c, s, x, nodes, t)
            for baseline in [k for k, v in found.items() if v is None]:
                parallel = baseline.endswith("parallel_hosts")
                base = await multicontroller(c, nodes, step(t), 1, one_host=parallel)
                if ours >= 0.95 * base:
                    found[baseline] = ms
            if all(v is not None for v in found.values()):
                break
    return [
        Row("dispatch", "parity_point", f"atoll_vs_{baseline}", value, "ms", devices, hosts)
        for baseline, value in found.items()
    ]


STAGE_S = 0.002  # W4: each pipeline stage runs 2 ms of device time


async def _pipeline(c: Cluster, stages: int) -> Callable[[bool], Awaitable[float]]:
    """The W4 chain on ``stages`` one-device slices. Returns one timed run of
    it, dispatched in parallel (False) or sequentially (True): the ms beyond
    the floor until its output exists (freeing it is not timed)."""
    slices = [await c.devices(1) for _ in range(stages)]
    graph = chain_graph(slices, step(STAGE_S))
    x = await c.put(np.zeros(1, np.float32), 0)

    async def overhead_ms(sequential: bool) -> float:
        started = time.perf_counter()
        if sequential:
            [out] = await c.run_graph_sequential(graph, [x])
        else:
            [out] = c.run_graph(graph, [x])
        await out.promise
        took = time.perf_counter() - started
        await c.free(out)
        return (took - stages * STAGE_S) * 1e3

    return overhead_ms


async def pipeline_overhead(
    sequential: bool, reps: int = 5, stages: int = 16, rpc_latency_s: float = 0.0
) -> Row:
    """A chain of ``stages`` nodes of 2 ms on as many hosts: wall time over the floor
    (the best of ``reps`` runs).

    ``rpc_latency_s`` > 0 adds a modelled latency to every control-plane hop
    (see ``kernel/_latency.py``); the case name then says how much.
    """
    async with local_cluster(1, stages, 1, cost=COST, rpc_latency_s=rpc_latency_s) as c:
        overhead_ms = await _pipeline(c, stages)
        best = min([await overhead_ms(sequential) for _ in range(reps)])
    case = f"pipeline{stages}_{'sequential' if sequential else 'parallel'}_overhead"
    if rpc_latency_s > 0:
        case += f"_rpc{rpc_latency_s * 1e6:.0f}us"
    return Row("dispatch", case, "atoll", best, "ms", stages, stages)


async def pipeline_processes(runs: int = 15, stages: int = 16) -> list[Row]:
    """The pipeline over real host processes (Cap'n Proto), three ways, interleaved.

    ``parallel`` (push on, the default), ``parallel_no_push`` (inputs reach
    their readers through the controller's promises) and ``sequential``;
    median wall time beyond the floor of ``runs`` runs each (asyncio only).
    """
    modes = {"parallel": (True, False), "parallel_no_push": (False, False)}
    modes["sequential"] = (False, True)  # (push, sequential)
    samples: dict[str, list[float]] = {name: [] for name in modes}
    async with local_cluster(1, stages, 1, transport="capnp", cost=COST) as c:
        overhead_ms = await _pipeline(c, stages)
        for run in range(runs + 1):  # the first round warms up and is dropped
            for name, (push, sequential) in modes.items():
                await c.controller.set_push(push)
                took = await overhead_ms(sequential)
                if run:
                    samples[name].append(took)
    return [
        Row(
            "dispatch",
            f"pipeline{stages}_{name}_overhead_processes",
            "atoll",
            statistics.median(xs),
            "ms",
            stages,
            stages,
        )
        for name, xs in samples.items()
    ]


async def run(
    small: bool = False, emit: Callable[[Row], None] = print, processes: bool = False
) -> list[Row]:
    """The whole benchmark; ``emit`` sees each row as soon as it is measured."""
    rows: list[Row] = []

    def keep(row: Row) -> None:
        rows.append(row)
        emit(row)

    for latency in (0.0, RPC_LATENCY_S):
        for sequential in (False, True):
            keep(await pipeline_overhead(sequential, rpc_latency_s=latency))
    if processes:
        for row in await pipeline_processes(runs=5 if small else 15):
            keep(row)
    sizes = (4, 32) if small else (4, 32, 128, 512)
    for hosts in sizes:
        devices = hosts * DEVICES_PER_HOST
        calls = max(8, min(128, 8192 // devices))
        nodes = 128 if not small or devices <= 16 else 32
        for row in await measure_modes(hosts, calls, nodes, reps=4):
            keep(row)
    for hosts in (sizes[0], sizes[-1]) if small else (32, 512):
        for row in await parity_point(hosts):
            keep(row)
    return rows


def _fmt(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def _size(attribute: str, width: int) -> Column:
    """The cluster size of a case: its ``devices`` or its ``hosts``."""
    return Column(
        attribute, width, lambda group: str(getattr(next(iter(group.values())), attribute) or "")
    )


COLUMNS = [
    _size("devices", 7),
    _size("hosts", 5),
    system_column("atoll", 12, _fmt, also=["atoll_vs_multicontroller"]),
    system_column(
        "multicontroller",
        12,
        _fmt,
        title="multi-ctl",
        also=["atoll_vs_multicontroller_parallel_hosts"],
    ),
    unit_column(0),
]


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a text table: each mode beside its baseline, then the rest."""
    lines = [table(rows, COLUMNS, case_width=40, key=lambda row: (row.case, row.devices))]
    if any(row.case == "parity_point" for row in rows):
        lines.append(
            "parity_point: 'atoll' column against the baseline in this process, "
            "'multi-ctl' column against one host's rate (hosts in parallel)"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    """Computations/s against devices, each mode beside its baseline (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"opbyop": "o", "chained128": "s", "fused128": "^"}
    for case, marker in styles.items():
        for system, line in (("atoll", "-"), ("multicontroller", "--")):
            points = sorted(
                (r.devices or 0, r.value)
                for r in rows
                if r.case == case and r.system == system and r.value is not None
            )
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, line, marker=marker, label=f"{case} {system}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("simulated devices (4 per host)")
    ax.set_ylabel("computations/s")
    ax.set_title("Dispatch microbenchmark (one process, simulated devices)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


RAY = [
    PeerFigure("opbyop", "W1", "actor op-by-op scalar", "calls/s", "computations/s", hosts=1),
    PeerFigure(
        "chained128", "W2", "chain128/4 actors scalar", "computations/s", "computations/s", hosts=4
    ),
    PeerFigure(
        "pipeline16_overhead",
        "W4",
        "16 stages x 2ms",
        "wall",
        "ms",
        offset=-16 * STAGE_S * 1e3,
        hosts=16,
    ),
]


def ray_rows(quick: bool, ray_python: str | None) -> list[Row]:
    """Ray's OpByOp, Chained and pipeline figures, from ``shared/peers`` (W1, W2, W4).

    Ray runs real actor processes (one per host), so its rows say ``hosts`` and
    sit beside atoll's smallest cluster; they are not simulated devices.
    """
    return ray_figures("dispatch", RAY, quick, ray_python)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atoll bench dispatch", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--small", action="store_true", help="small clusters only (quick)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--plot", metavar="PNG", help="also write a plot of computations/s")
    parser.add_argument("--ray-python", help="a Python that can `import ray` (default .venv-ray)")
    parser.add_argument(
        "--processes",
        action="store_true",
        help="also run the pipeline over 16 real host processes (Cap'n Proto)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``atoll bench dispatch [--small] [--json] [--plot PNG]``: run, print, plot."""
    args = _parser().parse_args(argv)

    def emit(row: Row) -> None:
        if args.json:
            print(row.json(), flush=True)

    rows = anyio.run(run, args.small, emit, args.processes)  # asyncio: Cap'n Proto needs it
    ray = ray_rows(args.small, args.ray_python)
    for row in ray:
        emit(row)
    if not args.json:
        print(format_table(rows))
        for row in ray:
            print(f"ray {row.case:<36} {row.hosts:>5} hosts {row.value:>12,.1f} {row.unit}")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
