"""atoll beside plain JAX on the same accelerator: does atoll keep it busy?

``atoll bench accelerator [--json] [--sizes N,N,N] [--reps R] [--seconds S]
[--forms chain,program,computation] [--where inproc,process]
[--variants fused,unfused] [--tiny]``

The workload is a chain of steps ``x <- tanh(x @ w)`` in bfloat16, with
``w`` resident on the device and batch = width, on one device. Plain JAX is
a jitted step called once per step, with one wait at the end. atoll runs it
on one ``JaxDevice`` (``local_cluster(1, 1, 1, device_cls=JaxDevice)``), in
three forms:

* ``chain``: ``x = cluster.run(step, x, w).refs``, one run per step;
* ``program``: a 16-node ``@atoll.program``, run steps/16 times;
* ``computation``: the low-level ``h = cluster.run(Computation, 0, [h, w])``;

each with the device in this process (``inproc``) and in a host process of
its own (``process``, ``transport="capnp"``). Every form drops its
references as it goes, as a training loop does; the peak of the store's
bytes shows whether dropped links were freed.

On a GPU the steps are 1024², 4096² and 8192². On a CPU they are 64², 256²
and 512², with XLA pinned to one thread (``--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1``), so that the second core plays the host:
the shape of the GPU's gap, on this machine. Each size runs in a process of
its own (the XLA flags must be set before JAX starts), plain JAX first.

Each form runs twice: as atoll runs by default (``fused``: consecutive
gangs alone on the device run as one computation, ``devices/jax/fused.py``)
and ``unfused`` (``ATOLL_FUSE=0``: every gang is dispatched on its own, the
same work as plain JAX's, so the ratio is atoll's overhead alone). Each
variant runs in a process of its own, beside plain JAX measured there (the
table shows the first variant's plain JAX).

Figures are µs per step, the median of ``--reps`` repetitions, each long
enough for about ``--seconds`` of plain JAX; the ratio is plain JAX's µs
per step over atoll's (1.0: atoll keeps the device as busy as JAX alone;
above 1, fused: XLA did better with the steps together than one by one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from atoll.benchmarks._common import Column, Row, emit, table, track

__all__ = ["CPU_FLAGS", "CPU_SIZES", "GPU_SIZES", "TARGETS", "main", "measure_size"]

CPU_SIZES = (64, 256, 512)
GPU_SIZES = (1024, 4096, 8192)
CPU_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
FORMS = ("chain", "program", "computation")
# fused: as atoll runs by default; unfused: ATOLL_FUSE=0, every gang dispatched on its own
VARIANTS = ("fused", "unfused")
WHERE = ("inproc", "process")
NODES = 16  # nodes of the program form
# (form, size rank: 0 small, 1 medium, 2 large) -> the ratio to reach
TARGETS: dict[tuple[str, int], float] = {
    ("program", 2): 0.95,
    ("chain", 2): 0.9,
    ("program", 1): 0.9,
    ("chain", 1): 0.8,
    ("program", 0): 0.5,
}


def _platform() -> str:
    """``gpu`` when JAX sees one here, else ``cpu`` (asked in a process of its own)."""
    probe = "import jax; print(jax.default_backend())"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    try:
        out = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return "cpu"
    return "gpu" if out.stdout.strip().endswith(("gpu", "cuda", "rocm")) else "cpu"


def _env(platform: str) -> dict[str, str]:
    """The environment a size runs in (and its host processes inherit)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    if platform == "cpu":
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=CPU_FLAGS)
    return env


# -- one size, in a process of its own ----------------------------------------------
def _step(x: Any, w: Any) -> Any:
    import jax.numpy as jnp

    return jnp.tanh(x @ w)


def _plain(size: int, steps: int, reps: int) -> float:
    """Plain JAX: µs per step (median of ``reps``), one jitted call per step."""
    import jax
    import jax.numpy as jnp

    f = jax.jit(_step)
    x = jnp.full((size, size), 0.01, jnp.bfloat16)
    w = jnp.full((size, size), 0.01, jnp.bfloat16)
    f(x, w).block_until_ready()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        y = x
        for _ in range(steps):
            y = f(y, w)
        y.block_until_ready()
        times.append((time.perf_counter() - began) / steps)
    return statistics.median(times) * 1e6


async def _atoll(
    size: int, steps: int, reps: int, where: str, forms: Sequence[str]
) -> dict[str, tuple[float, int]]:
    """Each form on one JaxDevice: (µs per step, peak store bytes)."""
    import numpy as np

    import atoll
    from atoll.devices import Computation
    from atoll.devices.jax import JaxDevice

    transport = "capnp" if where == "process" else "inproc"
    out: dict[str, tuple[float, int]] = {}
    async with atoll.local_cluster(1, 1, 1, device_cls=JaxDevice, transport=transport) as cluster:
        slice_ = await cluster.devices(1)
        step = slice_.jit(_step, name="step")

        @atoll.program
        def program(x: Any, w: Any) -> Any:
            for _ in range(NODES):
                x = step(x, w)
            return x

        low = Computation("step", _step)
        start = np.full((size, size), 0.01, np.float32).astype("bfloat16")
        w = cluster.run(slice_.jit(lambda a: a, name="w"), start).refs
        w_handle = await w.promise

        def chain(x: Any) -> Any:
            for _ in range(steps):
                x = cluster.run(step, x, w).refs
            return x

        def programs(x: Any) -> Any:
            for _ in range(steps // NODES):
                x = cluster.run(program, x, w).refs
            return x

        def computations(x: Any) -> Any:
            h = x.promise
            for _ in range(steps):
                h = cluster.run(low, 0, [h, w_handle])
            return h

        bodies: dict[str, Callable[[Any], Any]] = {
            "chain": chain,
            "program": programs,
            "computation": computations,
        }
        for form in forms:
            out[form] = await _time(cluster, bodies[form], start, step, steps, reps)
    return out


async def _time(
    cluster: Any, body: Callable[[Any], Any], start: Any, step: Any, steps: int, reps: int
) -> tuple[float, int]:
    """µs per step (median of ``reps``, after one warm-up) and the store's peak."""
    x0 = cluster.run(step, start, start).refs  # a device-resident x
    await cluster.ready(x0)
    times = []
    for rep in range(reps + 1):
        if rep == 1:
            await _quiet(cluster)
            await cluster.store_usage(reset_peak=True)
        began = time.perf_counter()
        await cluster.ready(body(x0))
        if rep:
            times.append((time.perf_counter() - began) / steps)
    peak = max(u["peak_bytes"] for u in await cluster.store_usage())
    return statistics.median(times) * 1e6, int(peak)


async def _quiet(cluster: Any, seconds: float = 10.0) -> None:
    """Wait until the frees of what ran before have reached the store (they
    follow the runs that read each buffer, and may lag behind the device)."""
    deadline = time.monotonic() + seconds
    last = -1
    while time.monotonic() < deadline:
        held = sum(u["buffers"] for u in await cluster.store_usage())
        if held == last:
            return
        last = held
        await asyncio.sleep(0.05)


def measure_size(
    size: int,
    rank: int,
    seconds: float,
    reps: int,
    wheres: Sequence[str],
    forms: Sequence[str],
    variant: str = "",
) -> list[Row]:
    """One size: plain JAX, then every form in every place (this process's JAX).
    ``variant`` ('' or "unfused") suffixes atoll's systems."""
    probe = _plain(size, 16, 1)
    steps = max(NODES, int(seconds * 1e6 / max(probe, 1.0)) // NODES * NODES)
    jax_us = _plain(size, steps, reps)
    rows = []
    tail = f" {variant}" if variant else ""
    for where in wheres:
        measured = asyncio.run(_atoll(size, steps, reps, where, forms))
        for form, (us, peak) in measured.items():
            case = f"{form} {size}² {where}"
            target = TARGETS.get((form, rank))
            rows += [
                Row("accelerator", case, f"jax{tail}", round(jax_us, 1), "us/step"),
                Row("accelerator", case, f"atoll{tail}", round(us, 1), "us/step"),
                Row("accelerator", case, f"ratio{tail}", round(jax_us / us, 3), "jax/atoll"),
                Row("accelerator", case, f"peak{tail}", peak, "bytes"),
            ]
            if target is not None and not variant:
                rows.append(Row("accelerator", case, "target", target, "jax/atoll"))
    return rows


# -- the whole benchmark ----------------------------------------------------------
def _rank(size: int, position: int, default: Sequence[int]) -> int:
    """A size's rank for its targets: its place among the platform's sizes
    (``--sizes 512`` is the CPU's large one), else its place as asked."""
    return default.index(size) if size in default else min(position, 2)


def run(
    sizes: Sequence[int] | None,
    seconds: float,
    reps: int,
    wheres: Sequence[str],
    forms: Sequence[str],
    variants: Sequence[str] = VARIANTS,
) -> list[Row]:
    """Every size and variant, each in a process of its own; the rows they printed."""
    platform = _platform()
    default = GPU_SIZES if platform == "gpu" else CPU_SIZES
    chosen = list(sizes or default)
    rows: list[Row] = []
    jobs = [(_rank(size, i, default), size, v) for i, size in enumerate(chosen) for v in variants]
    for rank, size, variant in track(jobs, "sizes"):
        env = _env(platform)
        if variant == "unfused":
            env["ATOLL_FUSE"] = "0"
        argv = [
            sys.executable,
            "-m",
            "atoll.benchmarks.accelerator",
            "--one",
            f"{size}:{rank}",
            "--seconds",
            str(seconds),
            "--reps",
            str(reps),
            "--where",
            ",".join(wheres),
            "--forms",
            ",".join(forms),
            "--variant",
            variant if variant != "fused" else "",
        ]
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0:  # say why, and go on with the other sizes
            sys.stderr.write(done.stderr[-4000:])
            sys.stderr.write(f"size {size} failed (exit {done.returncode})\n")
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                rows.append(Row(**json.loads(line)))
    return rows


def _cell(system: str, fmt: str) -> Callable[[Mapping[str, Row]], str]:
    def cell(group: Mapping[str, Row]) -> str:
        row = group.get(system)
        return "-" if row is None or row.value is None else format(row.value, fmt)

    return cell


def _met(group: Mapping[str, Row]) -> str:
    target, ratio = group.get("target"), group.get("ratio")
    if target is None or ratio is None or target.value is None or ratio.value is None:
        return ""
    return f"≥ {target.value:.2f} " + ("met" if ratio.value >= target.value else "MISSED")


def _mib(system: str) -> Callable[[Mapping[str, Row]], str]:
    def cell(group: Mapping[str, Row]) -> str:
        peak = group.get(system)
        return "-" if peak is None or peak.value is None else f"{peak.value / 2**20:.1f}"

    return cell


def _render(rows: Sequence[Row]) -> str:
    columns = [
        Column("JAX µs", 9, _cell("jax", ",.1f")),
        Column("atoll µs", 10, _cell("atoll", ",.1f")),
        Column("ratio", 6, _cell("ratio", ".2f")),
        Column("target", 14, _met),
        Column("peak MiB", 9, _mib("peak")),
        Column("unfused µs", 11, _cell("atoll unfused", ",.1f")),
        Column("ratio", 6, _cell("ratio unfused", ".2f")),
        Column("peak MiB", 9, _mib("peak unfused")),
    ]
    return table(rows, columns, case_width=26)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atoll bench accelerator", description=__doc__)
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--sizes", help="comma-separated widths (default: by platform)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (median)")
    parser.add_argument("--seconds", type=float, default=0.5, help="plain JAX time per rep")
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--where", default=",".join(WHERE))
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="fused, unfused, or both (the default): comma-separated",
    )
    parser.add_argument("--tiny", action="store_true", help="one small size, short (tests)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # SIZE:RANK, in this process
    parser.add_argument("--variant", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    forms, wheres = args.forms.split(","), args.where.split(",")
    if args.one:
        size, rank = (int(part) for part in args.one.split(":"))
        for row in measure_size(size, rank, args.seconds, args.reps, wheres, forms, args.variant):
            print(row.json(), flush=True)
        return 0
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
    if args.tiny:
        sizes, args.seconds, args.reps = sizes or [32], 0.02, 1
    variants = list(VARIANTS) if args.variants == "both" else args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:  # (each would run, and measure nothing)
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    emit(run(sizes, args.seconds, args.reps, wheres, forms, variants), args.json, _render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
