"""The peers' workloads (``shared/peers``) on atoll over real host processes, beside Ray.

``atoll bench peers [--json] [--quick] [--ray-python PATH] [--only W1,W4]`` runs
W1-W5 and start-up exactly as ``shared/peers/common.py`` defines them, on
``atoll.local_cluster(..., transport="capnp")``: every host is a process of its
own with one simulated device, and this process is the driver (client and
controller). Where it makes sense, a workload runs in two forms:

* ``cluster.run``: the low-level chain, one ``cluster.run(computation, device,
  inputs)`` per computation, each taking the previous one's promise;
* ``program``: the same dataflow as one graph (``GraphBuilder`` and
  ``cluster.run_graph``), dispatched as a whole.

Then, one after the other, never at the same time, it runs
``shared/peers/bench_ray.py`` with the Ray venv (``--ray-python``, else
``.venv-ray``) and prints atoll beside Ray actors and Ray Compiled Graphs, with
ratios oriented so that above 1 means atoll is better. ``--json`` prints one
JSON object per line (the :class:`Row` of ``_common.py``). Progress goes to
stderr, and so does whatever the host processes print.

The computations are defined here at module level: the host processes import
them as ``atoll.benchmarks.peers``. Every ``w*`` function takes a running
cluster and :class:`Params`, so a test can run each workload tiny.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import anyio
import numpy as np

import atoll
from atoll.benchmarks._common import Column, Row, emit, system_column, table, timings, unit_column
from atoll.benchmarks.peers_ray import find_peers, pick, ray_rows
from atoll.devices import Aval, BufferHandle, Computation, CostModel
from atoll.kernel import Promise
from atoll.runtime import Graph, GraphBuilder, SliceSpec

__all__ = [
    "CASES",
    "Params",
    "cases",
    "main",
    "measure",
    "peer_rows",
    "ratios",
    "startup",
    "w1",
    "w2",
    "w3",
    "w4",
    "w5",
]

BENCH = "peers"
ATOLL, RAY, RAY_CG = "atoll", "ray", "ray_cg"
VS_RAY, VS_RAY_CG = "atoll_vs_ray", "atoll_vs_ray_cg"
WORKLOADS = ("START", "W1", "W2", "W3", "W4", "W5")
SCALAR = Aval((), "float32")


# -- parameters ----------------------------------------------------------------------
@dataclass(frozen=True)
class Params:
    """The workloads' sizes and repetitions: ``common.py``'s constants, in lower case.

    ``startup_reps`` (ours) is how many fresh processes measure start-up.
    """

    w1_calls: int = 2000
    w1_reps: int = 5
    w1_warmup: int = 200
    w2_chain: int = 128
    w2_actors: int = 4
    w2_reps: int = 20
    w3_fused: int = 128
    w3_reps: int = 20
    w4_stages: int = 16
    w4_stage_ms: float = 2.0
    w4_microbatches: int = 8
    w4_reps: int = 20
    w5_bytes: int = 64 * 2**20
    w5_reps: int = 10
    warmup_reps: int = 3
    startup_reps: int = 3

    @classmethod
    def of(cls, quick: bool) -> Params:
        """``common.py``'s values (after its ``apply_quick`` when ``quick``), or the same
        numbers when ``shared/peers`` is missing."""
        common = _load_common()
        if common is None:
            return cls(**QUICK) if quick else cls()
        if quick:
            common.apply_quick()
        theirs = [f.name for f in fields(cls) if f.name != "startup_reps"]
        found = {name: getattr(common, name.upper()) for name in theirs}
        return cls(**found, startup_reps=1 if quick else 3)


QUICK: dict[str, Any] = dict(  # common.apply_quick's numbers
    w1_calls=200, w1_reps=2, w1_warmup=20, w2_reps=3, w3_reps=3, w4_reps=3, w5_reps=2
)
QUICK.update(warmup_reps=1, startup_reps=1)


def _load_common() -> Any:
    """``shared/peers/common.py`` as a module of its own (None when it is missing)."""
    peers = find_peers()
    if peers is None:
        return None
    spec = importlib.util.spec_from_file_location("atoll_peers_common", peers / "common.py")
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the computations (imported by the host processes) -------------------------------
def add1(x: np.ndarray) -> np.ndarray:
    """The trivial computation: ``x + 1``."""
    return x + np.float32(1)


def fused(n: int, x: np.ndarray) -> np.ndarray:
    """``n`` trivial computations in one call (W3)."""
    for _ in range(n):
        x = x + np.float32(1)
    return x


def produce(nbytes: int) -> np.ndarray:
    """W5's producer: ``nbytes`` of float32 ones."""
    return np.ones(nbytes // 4, dtype=np.float32)


def consume(a: np.ndarray) -> np.ndarray:
    """W5's consumer: reads one float per 4 KiB page, so every page is touched."""
    return np.asarray(a[::1024].sum(), dtype=np.float32)


ADD1 = Computation("add1", add1)
CONSUME = Computation("consume", consume)


def scalar(value: float = 1.0) -> np.ndarray:
    """The ``scalar`` payload: a 0-d float32 array."""
    return np.array(value, dtype=np.float32)


def _check(value: np.ndarray, expected: float, what: str) -> None:
    got = float(np.ravel(value)[0])
    if got != expected:
        raise RuntimeError(f"{what}: got {got}, expected {expected}")


# -- the two forms -------------------------------------------------------------------
async def run_chains(
    c: atoll.Cluster, step: Computation, devices: Sequence[int], xs: Sequence[np.ndarray]
) -> list[np.ndarray]:
    """The ``cluster.run`` form: for each x, run ``step`` on every device in turn,
    the first call on x itself (by value: a small array rides in the call, a
    large one is put on the device first), each later call on the previous
    promise; all are submitted before the driver waits, then it fetches the last
    value of each chain."""
    tails = []
    for x in xs:
        handle: Promise[BufferHandle] = c.run(step, devices[0], [x])
        for device in devices[1:]:
            handle = c.run(step, device, [handle])
        tails.append(handle)
    return [await c.fetch(tail) for tail in tails]


def pipeline_graph(slices: Sequence[SliceSpec], step: Computation, chains: int = 1) -> Graph:
    """``chains`` chains (micro-batches), each one node of ``step`` per slice in turn."""
    builder = GraphBuilder()
    outputs = []
    for _ in range(chains):
        value = builder.input(SCALAR)
        for s in slices:
            [value] = builder.add(step, s, [value], [SCALAR], step.name)
        outputs.append(value)
    return builder.build(outputs)


async def run_program(c: atoll.Cluster, graph: Graph, leaves: Sequence[Any]) -> list[np.ndarray]:
    """The ``program`` form: one ``run_graph``, then fetch every output."""
    return [await c.fetch(ref) for ref in c.run_graph(graph, leaves)]


# -- measuring -----------------------------------------------------------------------
def progress(message: str) -> None:
    """One progress line on stderr."""
    print(f"  .. {message}", file=sys.stderr, flush=True)


def row(case: str, samples: Sequence[float], unit: str) -> Row:
    """atoll's row for ``case``: the median of ``samples`` (shown as progress)."""
    value = statistics.median(samples)
    progress(f"{case}: {value:,.4g} {unit} (median of {len(samples)})")
    return Row(BENCH, case, ATOLL, value, unit)


async def timed(job: Callable[[], Awaitable[Any]], warmup: int, reps: int) -> list[float]:
    """Seconds of each of ``reps`` runs of ``job``, after ``warmup`` untimed ones."""
    await timings(job, warmup)
    return await timings(job, reps)


W1_RUN, W1_PROGRAM = "W1 op-by-op, cluster.run", "W1 op-by-op, program"
W2_RUN, W2_PROGRAM = "W2 chain, cluster.run", "W2 chain, program"
W3_CALL = "W3 fused, one call"
W4_RUN, W4_PROGRAM = "W4 pipeline, cluster.run", "W4 pipeline, program"
GPIPE_RUN, GPIPE_PROGRAM = "W4 GPipe, cluster.run", "W4 GPipe, program"
W5_E2E_RUN, W5_E2E_PROGRAM = "W5 end to end, cluster.run", "W5 end to end, program"
W5_HAND_RUN, W5_HAND_PROGRAM = "W5 hand-off, cluster.run", "W5 hand-off, program"
START, MEM_START, MEM_W4 = "start-up: import + 4 hosts", "memory: 4 hosts", "memory: W4 hosts"


async def w1(c: atoll.Cluster, p: Params) -> list[Row]:
    """W1: ``w1_calls`` awaited calls to one host (``x = fetch(run(add1, put(x)))``)."""
    work = c.client("peers-w1")
    graph = pipeline_graph([await work.devices(1)], ADD1)

    async def by_run(n: int) -> None:
        x = scalar()
        for _ in range(n):
            [x] = await run_chains(work, ADD1, [1], [x])
        _check(x, 1.0 + n, W1_RUN)

    async def by_program(n: int) -> None:
        x = scalar()
        for _ in range(n):
            [x] = await run_program(work, graph, [x])
        _check(x, 1.0 + n, W1_PROGRAM)

    rows = []
    for case, calls in ((W1_RUN, by_run), (W1_PROGRAM, by_program)):
        await calls(p.w1_warmup)
        seconds = await timings(functools.partial(calls, p.w1_calls), p.w1_reps)
        rows.append(row(case, [p.w1_calls / s for s in seconds], "calls/s"))
    await work.close()
    return rows


async def w2(c: atoll.Cluster, p: Params) -> list[Row]:
    """W2: ``w2_chain`` calls, call i on host i % ``w2_actors``, only the last awaited."""
    work = c.client("peers-w2")
    devices = [i % p.w2_actors for i in range(p.w2_chain)]
    slices = [await work.devices(1) for _ in range(p.w2_actors)]
    graph = pipeline_graph([slices[d] for d in devices], ADD1)

    async def by_run() -> None:
        [x] = await run_chains(work, ADD1, devices, [scalar()])
        _check(x, 1.0 + p.w2_chain, W2_RUN)

    async def by_program() -> None:
        [x] = await run_program(work, graph, [scalar()])
        _check(x, 1.0 + p.w2_chain, W2_PROGRAM)

    rows = []
    for case, job in ((W2_RUN, by_run), (W2_PROGRAM, by_program)):
        seconds = await timed(job, p.warmup_reps, p.w2_reps)
        rows.append(row(case, [p.w2_chain / s for s in seconds], "computations/s"))
    await work.close()
    return rows


async def w3(c: atoll.Cluster, p: Params) -> list[Row]:
    """W3: one call that runs ``w3_fused`` trivial computations on one host."""
    work = c.client("peers-w3")
    step = Computation(f"fused{p.w3_fused}", functools.partial(fused, p.w3_fused))

    async def job() -> None:
        [x] = await run_chains(work, step, [1], [scalar()])
        _check(x, 1.0 + p.w3_fused, W3_CALL)

    seconds = await timed(job, p.warmup_reps, p.w3_reps)
    await work.close()
    return [row(W3_CALL, [p.w3_fused / s for s in seconds], "computations/s")]


# Data moves for real here (sockets, shared memory): no modelled link time on
# top of it. Only device time is modelled (W4's stages).
REAL = CostModel(link_bytes_per_s=float("inf"), link_latency_s=0.0)


def stage(seconds: float) -> Computation:
    """A W4 stage: ``x + 1`` that keeps its device busy ``seconds``.

    The workload's stand-in for device time is time that uses no host CPU.
    Ray's actors spend it in ``time.sleep`` on their own thread; atoll's
    simulated device spends it the way it models every computation's device
    time, as ``flops`` its cost model turns into seconds (an asynchronous
    sleep: the device is busy, its host process stays free to move data).
    """
    return Computation("stage", add1, flops=seconds * REAL.flops_per_s)


async def w4(c: atoll.Cluster, p: Params) -> list[Row]:
    """W4 on a cluster of ``w4_stages`` hosts: the chain of stages, then GPipe.

    Wall time of the chain in ms (floor: stages x stage time), and GPipe's
    ``w4_microbatches`` chains submitted at once, as wall / ideal.
    """
    work = c.client("peers-w4")
    stages, m = p.w4_stages, p.w4_microbatches
    step = stage(p.w4_stage_ms / 1e3)
    slices = [await work.devices(1) for _ in range(stages)]
    chain, gpipe = pipeline_graph(slices, step), pipeline_graph(slices, step, m)
    xs = [scalar(float(i)) for i in range(m)]
    jobs: dict[str, Callable[[], Awaitable[Any]]] = {
        W4_RUN: lambda: run_chains(work, step, range(stages), xs[:1]),
        W4_PROGRAM: lambda: run_program(work, chain, xs[:1]),
        GPIPE_RUN: lambda: run_chains(work, step, range(stages), xs),
        GPIPE_PROGRAM: lambda: run_program(work, gpipe, xs),
    }
    ideal = (stages + m - 1) * p.w4_stage_ms / 1e3
    rows = []
    for case, job in jobs.items():
        seconds = await timed(job, p.warmup_reps, p.w4_reps)
        if case.startswith("W4 GPipe"):
            rows.append(row(case, [s / ideal for s in seconds], "wall/ideal"))
        else:
            rows.append(row(case, [s * 1e3 for s in seconds], "ms"))
    pids = process_tree(os.getpid())
    rows.append(row(MEM_W4, [pss_mib(pids)], "MiB"))
    await work.close()
    return rows


async def w5(c: atoll.Cluster, p: Params) -> list[Row]:
    """W5: ``w5_bytes`` made on host 0, read by reference on host 1, in MiB/s.

    End to end: produce and consume submitted together, the driver waits for
    the consumer's small result. Hand-off: the value already exists on host
    0 when the consumer is submitted. Freeing is not timed.
    """
    work = c.client("peers-w5")
    make = Computation("produce", functools.partial(produce, p.w5_bytes))
    a, b = await work.devices(1), await work.devices(1)
    big = Aval((p.w5_bytes // 4,), "float32")
    forms: dict[str, _W5Run | _W5Program] = {
        "cluster.run": _W5Run(work, make),
        "program": _W5Program(work, make, a, b, big),
    }
    mib = p.w5_bytes / 2**20
    rows = []
    for form, way in forms.items():
        e2e, hand = [], []
        for _ in range(1 + p.w5_reps):  # the first is a warm-up
            started = time.perf_counter()
            out = await way.end_to_end()
            e2e.append(time.perf_counter() - started)
            _check(out, p.w5_bytes / 4096, f"W5 {form}")
            hand.append(await way.hand_off())
        rows.append(row(f"W5 end to end, {form}", [mib / s for s in e2e[1:]], "MiB/s"))
        rows.append(row(f"W5 hand-off, {form}", [mib / s for s in hand[1:]], "MiB/s"))
    await work.close()
    return rows


@dataclass
class _W5Run:
    """W5 through ``cluster.run``: producer on device 0, consumer on device 1."""

    c: atoll.Cluster
    make: Computation

    async def end_to_end(self) -> np.ndarray:
        made = self.c.run(self.make, 0, [])
        used = self.c.run(CONSUME, 1, [made])
        out = await self.c.fetch(used)
        await self.c.free(made)
        await self.c.free(used)
        return out

    async def hand_off(self) -> float:
        made = self.c.run(self.make, 0, [])
        await made
        started = time.perf_counter()
        used = self.c.run(CONSUME, 1, [made])
        await self.c.fetch(used)
        took = time.perf_counter() - started
        await self.c.free(made)
        await self.c.free(used)
        return took


@dataclass
class _W5Program:
    """W5 as programs on two one-device slices: produce on ``a``, consume on ``b``."""

    c: atoll.Cluster
    make: Computation
    a: SliceSpec
    b: SliceSpec
    big: Aval

    def __post_init__(self) -> None:
        both = GraphBuilder()
        [made] = both.add(self.make, self.a, [], [self.big], "produce")
        self.both = both.build(both.add(CONSUME, self.b, [made], [SCALAR], "consume"))
        producer = GraphBuilder()
        self.producer = producer.build(producer.add(self.make, self.a, [], [self.big], "produce"))
        consumer = GraphBuilder()
        given = consumer.input(self.big)
        self.consumer = consumer.build(consumer.add(CONSUME, self.b, [given], [SCALAR], "consume"))

    async def end_to_end(self) -> np.ndarray:
        [out] = await run_program(self.c, self.both, [])
        return out

    async def hand_off(self) -> float:
        [made] = self.c.run_graph(self.producer, [])
        await made.promise
        started = time.perf_counter()
        await run_program(self.c, self.consumer, [made])
        took = time.perf_counter() - started
        await self.c.free(made)
        return took


# -- start-up and memory -------------------------------------------------------------
PROBE = "peers-startup-probe: "


def startup(p: Params) -> list[Row]:
    """Start-up, from nothing to ``w2_actors`` hosts ready, and memory, in fresh processes.

    Each of ``startup_reps`` probes is a new Python that imports atoll, enters
    ``local_cluster(transport="capnp")``, runs one computation on every host and
    reads the PSS of itself and its children.
    """
    code = (
        "import time; t = time.perf_counter(); import atoll; "
        f"from atoll.benchmarks.peers import startup_probe; startup_probe(t, {p.w2_actors})"
    )
    probes = []
    for _ in range(p.startup_reps):
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        line = next(x for x in done.stdout.splitlines() if x.startswith(PROBE))
        probes.append(json.loads(line[len(PROBE) :]))
        progress(f"start-up probe: {probes[-1]}")
    return [
        row(START, [x["import_s"] + x["ready_s"] for x in probes], "s"),
        row(MEM_START, [x["pss_mib"] for x in probes], "MiB"),
    ]


def startup_probe(started: float, hosts: int) -> None:
    """In a fresh process (``started``: the clock before ``import atoll``): print one
    ``PROBE`` line with the import time, the time to a ready cluster and the PSS."""
    imported = time.perf_counter() - started
    anyio.run(_probe, imported, hosts)


async def _probe(imported: float, hosts: int) -> None:
    started = time.perf_counter()
    async with atoll.local_cluster(1, hosts, 1, transport="capnp", cost=REAL) as c:
        ready = time.perf_counter() - started
        for device in range(hosts):  # every host runs once, as Ray's actors do
            await c.fetch(c.run(ADD1, device, [c.put(scalar(), device)]))
        pids = process_tree(os.getpid())
        figures = dict(import_s=imported, ready_s=ready, pss_mib=pss_mib(pids), procs=len(pids))
        print(PROBE + json.dumps(figures), flush=True)


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def pss_mib(pids: Sequence[int]) -> float:
    """The proportional set size of ``pids``, summed, in MiB (shared pages once)."""
    kib = 0
    for pid in pids:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        kib += sum(int(x.split()[1]) for x in rollup.splitlines() if x.startswith("Pss:"))
    return kib / 1024


# -- the whole atoll side ------------------------------------------------------------
async def measure(p: Params, only: Sequence[str] = WORKLOADS) -> list[Row]:
    """atoll's rows for the workloads in ``only`` (start-up is measured by :func:`startup`)."""
    rows: list[Row] = []
    small = (("W1", w1), ("W2", w2), ("W3", w3), ("W5", w5))
    if any(name in only for name, _ in small):
        progress(f"atoll: {p.w2_actors} host processes")
        async with atoll.local_cluster(1, p.w2_actors, 1, transport="capnp", cost=REAL) as c:
            for name, workload in small:
                if name in only:
                    rows += await workload(c, p)
    if "W4" in only:
        progress(f"atoll: {p.w4_stages} host processes")
        async with atoll.local_cluster(1, p.w4_stages, 1, transport="capnp", cost=REAL) as c:
            rows += await w4(c, p)
    return rows


# -- Ray, and the ratios -------------------------------------------------------------
Key = tuple[str, str, str]  # (workload, variant, metric) of a bench_ray.py row


@dataclass(frozen=True)
class Case:
    """One line of the table: which way is better, its target, and where Ray's
    figures are in ``bench_ray.py``'s rows (summed, times ``scale``)."""

    name: str
    higher_is_better: bool
    target: str
    ray: tuple[Key, ...] = ()
    ray_cg: tuple[Key, ...] = ()
    scale: float = 1.0


def cases(p: Params) -> list[Case]:
    """Every case, with the names ``bench_ray.py`` gives the matching rows."""
    w1 = (("W1", "actor op-by-op scalar", "calls/s"),)
    w1_cg = (("W6", "CG 1 actor add1 scalar", "calls/s"),)
    w2 = (("W2", "chain128/4 actors scalar", "computations/s"),)
    w2_cg = (("W6", "CG chain128/4 scalar", "computations/s"),)
    pipe = f"{p.w4_stages} stages x {p.w4_stage_ms:g}ms"
    w4, w4_cg = (("W4", pipe, "wall"),), (("W6", f"CG {pipe}", "wall"),)
    gpipe = f"GPipe {p.w4_microbatches} mb x {p.w4_stages} stages"
    gp, gp_cg = (("W4", gpipe, "wall/ideal"),), (("W6", f"CG {gpipe}", "wall/ideal"),)
    e2e = (("W5", "64MiB A->B by ref", "end-to-end MiB/s"),)
    hand = (("W5", "64MiB A->B by ref", "hand-off MiB/s"),)
    start = ("import ray", "ray.init()", f"create+ready {p.w2_actors} actors")
    mem4 = (("mem", f"{p.w2_actors} actors", "PSS all processes"),)
    mem16 = (("mem", f"{p.w4_stages} actors", "PSS all processes"),)
    return [
        Case(W1_RUN, True, ">= 2x Ray", w1, w1_cg),
        Case(W1_PROGRAM, True, ">= 2x Ray", w1, w1_cg),
        Case(W2_RUN, True, ">= 5x Ray", w2, w2_cg),
        Case(W2_PROGRAM, True, ">= Ray CG", w2, w2_cg),
        Case(W3_CALL, True, ">= Ray", (("W3", "fused128 scalar", "computations/s"),)),
        Case(W4_RUN, False, "<= Ray CG, -> 36 ms", w4, w4_cg),
        Case(W4_PROGRAM, False, "<= Ray CG, -> 36 ms", w4, w4_cg),
        Case(GPIPE_RUN, False, "<= 1.3x ideal", gp, gp_cg),
        Case(GPIPE_PROGRAM, False, "<= 1.3x ideal", gp, gp_cg),
        Case(W5_E2E_RUN, True, ">= 2,000 MiB/s", e2e),
        Case(W5_E2E_PROGRAM, True, ">= 2,000 MiB/s", e2e),
        Case(W5_HAND_RUN, True, ">= 5 GB/s", hand),
        Case(W5_HAND_PROGRAM, True, ">= 5 GB/s", hand),
        Case(START, False, "<= 2 s", tuple(("start", s, "time") for s in start), scale=1e-3),
        Case(MEM_START, False, "<= Ray", mem4),
        Case(MEM_W4, False, "", mem16),
    ]


CASES = cases(Params())


def peer_rows(
    raw: list[dict[str, Any]], wanted: Sequence[Case], units: dict[str, str]
) -> list[Row]:
    """Ray's and Ray CG's rows for the ``wanted`` cases, in atoll's ``units`` (by case)."""
    found = []
    for case in wanted:
        for system, keys in ((RAY, case.ray), (RAY_CG, case.ray_cg)):
            values = [pick(raw, *key) for key in keys]
            if keys and case.name in units and all(v is not None for v in values):
                total = sum(v for v in values if v is not None) * case.scale
                found.append(Row(BENCH, case.name, system, total, units[case.name]))
    return found


def ratios(rows: Sequence[Row], wanted: Sequence[Case]) -> list[Row]:
    """atoll against each peer, per case, oriented so that above 1 means atoll is better:
    atoll / peer where more is better, peer / atoll where less is (times, memory)."""
    value = {(r.case, r.system): r.value for r in rows}
    found = []
    for case in wanted:
        ours = value.get((case.name, ATOLL))
        for peer, system in ((RAY, VS_RAY), (RAY_CG, VS_RAY_CG)):
            theirs = value.get((case.name, peer))
            if ours and theirs:
                better = ours / theirs if case.higher_is_better else theirs / ours
                found.append(Row(BENCH, case.name, system, better, "x"))
    return found


def ray_only(only: Sequence[str]) -> str:
    """``bench_ray.py``'s ``--only`` for ours: Compiled Graphs (W6) come with W1, W2, W4."""
    if set(WORKLOADS) <= set(only):
        return ""
    theirs = [w for w in only if w != "START"]
    if {"W1", "W2", "W4"} & set(only):
        theirs.append("W6")
    return ",".join(theirs) or "START"


# -- output --------------------------------------------------------------------------
def _fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def format_table(rows: Sequence[Row], wanted: Sequence[Case] = CASES) -> str:
    """The rows as a table: atoll, Ray actors, Ray CG, the ratios, the target."""
    targets = {case.name: case.target for case in wanted}
    columns = [
        system_column(ATOLL, 10, _fmt),
        system_column(RAY, 10, _fmt, title="Ray"),
        system_column(RAY_CG, 10, _fmt, title="Ray CG"),
        system_column(VS_RAY, 8, ".2f", title="vs Ray"),
        system_column(VS_RAY_CG, 9, ".2f", title="vs Ray CG"),
        unit_column(15),
        Column("target", 20, lambda g: targets.get(next(iter(g.values())).case, "")),
    ]
    header = "medians; 'vs' columns: atoll's figure against the peer's, > 1 means atoll is better"
    return header + "\n" + table(rows, columns, case_width=30)


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr meanwhile: the host processes (and the peer
    script) inherit it, so stdout carries only the results."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure atoll, then Ray (when found), and print the rows."""
    parser = argparse.ArgumentParser(prog="atoll bench peers", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--quick", action="store_true", help="few repetitions (about a minute)")
    parser.add_argument("--ray-python", help="a Python with Ray (default: .venv-ray/bin/python)")
    parser.add_argument("--only", default="", help="comma list of W1..W5, START")
    args = parser.parse_args(argv)
    only = [w.strip().upper() for w in args.only.split(",") if w.strip()] or list(WORKLOADS)
    p = Params.of(args.quick)
    wanted = cases(p)
    with _stdout_to_stderr():
        rows = startup(p) if "START" in only else []
        rows += anyio.run(measure, p, only)
        raw = ray_rows(ray_only(only), args.quick, args.ray_python, echo=True)
    rows += peer_rows(raw, wanted, {r.case: r.unit for r in rows})
    rows += ratios(rows, wanted)
    emit(rows, args.json, functools.partial(format_table, wanted=wanted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
