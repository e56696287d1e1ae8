"""Train a GPT-style language model through atoll, beside plain JAX.

The model, its byte-level data (the standard library's sources) and the
AdamW step are in :mod:`atoll.examples.lm`. Here the step runs as **one SPMD
node over a slice** of ``data_parallel`` devices: the batch is split along
the ``data`` axis, the parameters and the optimizer state are replicated,
and the gradient's all-reduce happens inside the step. Parameters and
optimizer state stay on the devices from step to step, chained through
``outputs.refs``; only each step's loss comes back. The client keeps a few
steps in flight (``AHEAD``), so the devices never wait for it.

The same steps then run in plain JAX (one ``jit``, one device, the same
seed and data) for the reference losses.

The batches are made on the hosts (``--input hosts``, the default for
data-parallel training): each host of the slice cuts its own rows of each
step's batch out of the corpus, into its own devices' store, a few steps
ahead (:mod:`atoll.examples.lm_input`); the client sends only the step.
``--input client`` builds each batch here and sends it with the step, as a
pipeline's micro-batches always are.

Run it: ``atoll run train_lm [--steps N] [--data-parallel D] [--config
tiny|small|gpt2] [--hosts H] [--input hosts|client] [--json] [--plot
PATH]``. ``--hosts`` runs the devices in host processes (``atoll up``'s
kind) instead of this one.
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import atoll
from atoll.devices.jax import JaxDevice
from atoll.examples import lm, lm_input, lm_pipeline
from atoll.kernel.lowlevel import counts
from atoll.runtime import ClusterSpec, process_cluster

__all__ = ["AHEAD", "StepReport", "TrainResult", "main", "parse", "reference", "train"]

AHEAD = 4  # steps dispatched ahead of the loss the client waits for


@dataclass(frozen=True)
class StepReport:
    """One step as its loss arrived: the loss, and tokens per second over the
    last few steps (losses come back in bursts, so one gap says little)."""

    step: int
    loss: float
    tokens_per_s: float


@dataclass
class TrainResult:
    losses: list[float]
    tokens_per_s: list[float] = field(default_factory=list)
    finished_at: list[float] = field(default_factory=list)  # perf_counter, per step
    tokens_per_step: int = 0
    start: int = 0  # the step number of the first loss (a resumed run's)
    params: Any = None
    state: Any = None  # the last step's (params, opt_state) as ArrayRefs, for save
    slices: list[Any] = field(default_factory=list)  # where it ran: pass them on to reuse
    rate: float | None = None  # timed as a whole (the reference's), else from finished_at
    input_state: dict[str, Any] | None = None  # the host-side input's position (--input hosts)
    # bytes the client's process wrote to sockets per step, once the first
    # loss came back, and the bytes of arrays among them (None: an in-process
    # cluster, where nothing goes by socket)
    client_bytes_per_step: float | None = None
    client_array_bytes_per_step: float | None = None

    def overall_tokens_per_s(self) -> float:
        """Tokens per second over the steps after the first fifth (compiling
        and filling the pipeline of steps is not the rate); for a run of a
        window or fewer, its last step's rate, since it began (the first
        losses arrive together: their spacing is not the work's)."""
        if self.rate is not None:
            return self.rate
        times = self.finished_at
        first = max(1, len(times) // 5)
        if len(times) <= WINDOW or len(times) - first < 1:
            return self.tokens_per_s[-1] if self.tokens_per_s else 0.0
        return self.tokens_per_step * (len(times) - first) / (times[-1] - times[first - 1])


WINDOW = 8  # steps a reported rate is measured over


@asynccontextmanager
async def cluster_for(
    devices: int, hosts: int, in_process_hosts: int = 1
) -> AsyncIterator[atoll.Cluster]:
    """An in-process cluster of ``devices`` JAX devices over
    ``in_process_hosts`` hosts, or (``hosts`` > 0) one whose devices live in
    ``hosts`` host processes."""
    if hosts <= 0:
        per_host = devices // in_process_hosts
        async with atoll.local_cluster(
            1, in_process_hosts, per_host, device_cls=JaxDevice
        ) as cluster:
            yield cluster
        return
    if devices % hosts:
        raise ValueError(f"{devices} devices do not split over {hosts} hosts")
    spec = ClusterSpec(1, hosts, devices // hosts, device_cls=JaxDevice)
    async with process_cluster(spec) as cluster:
        yield cluster


async def train(
    cluster: atoll.Cluster,
    config: lm.LMConfig,
    steps: int,
    data_parallel: int = 1,
    on_step: Callable[[StepReport], None] | None = None,
    start: int = 0,
    state: Any = None,
    slices: Sequence[Any] = (),
    input_from: str = "client",
    input_state: dict[str, Any] | None = None,
    over_sockets: bool = False,
) -> TrainResult:
    """Train ``steps`` steps data-parallel over ``data_parallel`` devices of
    ``cluster``; ``on_step`` hears of each step as its loss arrives.
    ``start``, ``state``: go on from step ``start`` with these
    ``(params, opt_state)`` (restored from a checkpoint, say). ``slices``:
    the slice to run on (an earlier result's), else a new one.
    ``input_from``: ``"client"`` (this process builds each batch and sends
    it) or ``"hosts"`` (each host makes its own rows, ``lm_input.py``);
    ``input_state``: where the hosts' input goes on from (a checkpoint's).
    ``over_sockets``: the hosts are processes: count the bytes this process
    sends per step."""
    if config.batch % data_parallel:
        raise ValueError(f"batch {config.batch} does not split over {data_parallel} devices")
    [mesh] = slices or [await _slice(cluster, data_parallel)]
    step = mesh.jit(
        lm.step_function(config), in_specs=(None, None, P("data")), out_specs=(None, None, P())
    )
    params, opt_state = state if state is not None else _fresh(config)
    result = TrainResult([], tokens_per_step=config.batch * config.context, start=start)
    feed = _feed(cluster, mesh, config, start, input_from, input_state)
    sent = _SentBytes(steps, over_sockets)
    pending: list[Any] = []
    out: Any = None
    began = time.perf_counter()
    for i in range(steps):
        sent.at(i, result)
        batch = lm.batch_at(start + i, config) if feed is None else await feed.next()
        out = cluster.run(step, params, opt_state, batch)  # returns at once
        params, opt_state, loss = out.refs  # chained on the devices
        pending.append(loss)
        while pending and (len(pending) > AHEAD or i == steps - 1):
            _arrived(result, float(await cluster.fetch(pending.pop(0))), began, on_step)
    result.state, result.slices = (params, opt_state), [mesh]
    result.params = (await out)[0] if steps else params  # the last step's, fetched
    result.client_bytes_per_step, result.client_array_bytes_per_step = sent.per_step()
    result.input_state = None if feed is None else feed.state()
    return result


def _feed(
    cluster: atoll.Cluster,
    mesh: Any,
    config: lm.LMConfig,
    start: int,
    input_from: str,
    state: dict[str, Any] | None,
) -> lm_input.HostBatches | None:
    """The hosts' input, from ``start`` (or from ``state``, which must agree)."""
    if input_from not in INPUTS:
        raise ValueError(f"input_from must be one of {INPUTS}, not {input_from!r}")
    if input_from == "client":
        return None
    if state is None:
        return lm_input.HostBatches(cluster, mesh, config, start, prefetch=AHEAD)
    feed = lm_input.HostBatches.restored(cluster, mesh, config, state, prefetch=AHEAD)
    if feed.position != start:
        raise ValueError(f"the saved input goes on from step {feed.position}, not {start}")
    return feed


INPUTS = ("client", "hosts")


class _SentBytes:
    """What this process sends per step, from the first step dispatched
    after a loss came back (the first steps' puts, the parameters and the
    optimizer state, are behind it by then): bytes written to sockets, and
    the bytes of arrays among them (``kernel.lowlevel.counts``)."""

    def __init__(self, steps: int, counting: bool) -> None:
        self.steps, self.counting = steps, counting
        self.mark: tuple[int, int, int] | None = None  # step, bytes, array bytes

    def at(self, step: int, result: TrainResult) -> None:
        if self.mark is None and self.counting and result.losses:
            self.mark = (step, counts["bytes_out"], counts["array_bytes_out"])

    def per_step(self) -> tuple[float, float] | tuple[None, None]:
        if self.mark is None:
            return None, None
        step, sent, arrays = self.mark
        steps = self.steps - step
        return (counts["bytes_out"] - sent) / steps, (counts["array_bytes_out"] - arrays) / steps


async def _slice(cluster: atoll.Cluster, devices: int) -> Any:
    return await cluster.devices(devices, mesh_shape=(devices,), axis_names=("data",))


def _fresh(config: lm.LMConfig) -> tuple[Any, Any]:
    params = lm.init(config)
    return params, jax.tree_util.tree_map(np.asarray, lm.make_optimizer(config).init(params))


async def train_pipelined(
    cluster: atoll.Cluster,
    config: lm.LMConfig,
    steps: int,
    cut: lm_pipeline.Cut,
    micro_batches: int,
    data_parallel: int = 1,
    on_step: Callable[[StepReport], None] | None = None,
    start: int = 0,
    state: Any = None,
    slices: Sequence[Any] = (),
    schedule: str = "gpipe",
) -> TrainResult:
    """Train ``steps`` pipelined steps (``schedule``: ``gpipe`` or ``1f1b``):
    one stage per slice of ``data_parallel`` devices (its own host, where the
    cluster has one per stage), the blocks of each as ``cut`` says, ``micro_batches`` per step
    (:mod:`atoll.examples.lm_pipeline`). ``start``, ``state``, ``slices``:
    as :func:`train` (per-stage lists)."""
    if config.batch % (micro_batches * data_parallel):
        raise ValueError(
            f"batch {config.batch} does not split into {micro_batches} micro-batches "
            f"over {data_parallel} devices"
        )
    slices = list(slices) or [await _slice(cluster, data_parallel) for _ in cut.blocks]
    program = lm_pipeline.step_program(lm_pipeline.place(slices, config), schedule)
    params, states = state if state is not None else _fresh_stages(config, cut)
    result = TrainResult([], tokens_per_step=config.batch * config.context, start=start)
    pending: list[Any] = []
    out: Any = None
    began = time.perf_counter()
    for i in range(steps):
        micro = np.split(lm.batch_at(start + i, config), micro_batches)
        inputs, targets = [m[:, :-1] for m in micro], [m[:, 1:] for m in micro]
        out = cluster.run(program, params, states, inputs, targets)  # returns at once
        params, states, losses = out.refs
        pending.append(losses)
        while pending and (len(pending) > AHEAD or i == steps - 1):
            values = [float(await cluster.fetch(loss)) for loss in pending.pop(0)]
            _arrived(result, sum(values) / len(values), began, on_step)
    result.state, result.slices = (params, states), slices
    if steps:
        result.params = lm_pipeline.join_params((await out)[0])
    return result


def _fresh_stages(config: lm.LMConfig, cut: lm_pipeline.Cut) -> tuple[Any, Any]:
    params = lm_pipeline.split_params(lm.init(config), cut.blocks)
    optimizer = lm.make_optimizer(config)
    return params, [jax.tree_util.tree_map(np.asarray, optimizer.init(p)) for p in params]


def _arrived(
    result: TrainResult,
    loss: float,
    began: float,
    on_step: Callable[[StepReport], None] | None,
) -> None:
    """Record a step whose loss arrived, and tell ``on_step``."""
    now = time.perf_counter()
    times = result.finished_at
    times.append(now)
    # the last WINDOW steps; until there are that many, all since training
    # began (losses of the first steps arrive together, as the dispatch ran
    # ahead: timed from one another they would time dispatch, not work)
    if len(times) > WINDOW:
        steps, since = WINDOW, times[-WINDOW - 1]
    else:
        steps, since = len(times), began
    rate = result.tokens_per_step * steps / max(now - since, 1e-9)
    result.losses.append(loss)
    result.tokens_per_s.append(rate)
    if on_step is not None:
        on_step(StepReport(result.start + len(result.losses) - 1, loss, rate))


async def evaluate(
    cluster: atoll.Cluster, config: lm.LMConfig, params: Any, batches: int, devices: int = 1
) -> list[float]:
    """The loss of ``params`` on ``batches`` batches of the held-out split,
    data-parallel over ``devices`` devices of ``cluster`` (a session of its
    own, at its own weight, beside a trainer, say)."""
    mesh = await _slice(cluster, devices)
    score = mesh.jit(
        functools.partial(lm.loss_fn, heads=config.heads, dtype=config.dtype),
        in_specs=(None, P("data")),
        out_specs=P(),
        name="eval",
    )
    losses = [cluster.run(score, params, lm.batch_at(i, config, "eval")) for i in range(batches)]
    return [float(await loss) for loss in losses]


def reference_eval(config: lm.LMConfig, params: Any, batches: int) -> list[float]:
    """:func:`evaluate` in plain JAX, on one device."""
    score = jax.jit(functools.partial(lm.loss_fn, heads=config.heads, dtype=config.dtype))
    return [float(score(params, lm.batch_at(i, config, "eval"))) for i in range(batches)]


def reference(config: lm.LMConfig, steps: int, devices: int = 1) -> TrainResult:
    """The same steps in plain JAX: one ``jit``, on one device, or (``devices``
    > 1) data-parallel over that many with the shardings atoll's step uses;
    run ahead as JAX dispatches (the losses are read at the end)."""
    step = jax.jit(lm.step_function(config), **_data_parallel(devices))
    params: Any = lm.init(config)
    opt_state = lm.make_optimizer(config).init(params)
    result = TrainResult([], tokens_per_step=config.batch * config.context)
    losses = []
    first = max(1, steps // 5)  # the rate is timed after these (as atoll's)
    timed_from = time.perf_counter()
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, lm.batch_at(i, config))
        losses.append(loss)
        if i == first - 1 and steps > first:
            jax.block_until_ready(loss)
            timed_from = time.perf_counter()
    jax.block_until_ready(losses)
    timed = steps - first if steps > first else steps  # one step: its own, compile and all
    result.rate = result.tokens_per_step * timed / (time.perf_counter() - timed_from)
    result.losses = [float(loss) for loss in losses]
    result.params = jax.tree_util.tree_map(np.asarray, params)
    return result


def _data_parallel(devices: int) -> dict[str, Any]:
    """``jax.jit``'s shardings for a step data-parallel over ``devices``."""
    if devices == 1:
        return {}
    from jax.sharding import Mesh, NamedSharding

    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    whole, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return {"in_shardings": (whole, whole, split), "out_shardings": (whole, whole, whole)}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="atoll run train_lm",
        description="Train a GPT-style byte-level model through atoll, data-parallel or "
        "pipelined, and check its losses against plain JAX (docs/training.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=_positive, default=300, help="steps to run now")
    parser.add_argument("--data-parallel", type=_positive, default=4, metavar="D")
    parser.add_argument(
        "--pipeline", type=_positive, default=1, metavar="S", help="stages (1: no pipeline)"
    )
    parser.add_argument(
        "--micro-batches", type=_positive, default=4, metavar="M", help="per step, pipelined"
    )
    parser.add_argument(
        "--cut", choices=["partitioner", "even"], default="partitioner", help="stage cut"
    )
    parser.add_argument(
        "--schedule", choices=lm_pipeline.SCHEDULES, default="gpipe", help="pipelined"
    )
    parser.add_argument("--config", choices=sorted(lm.CONFIGS), default="small")
    parser.add_argument("--dtype", choices=lm.DTYPES, default="float32", help="of the computation")
    parser.add_argument(
        "--hosts", type=_at_least_0, default=0, help="host processes (0: in-process)"
    )
    parser.add_argument(
        "--input",
        choices=INPUTS,
        default=None,
        help="who makes the batches: each host its own rows (the default without "
        "--pipeline), or this client, which sends them",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per step")
    parser.add_argument("--plot", metavar="PNG", help="write the loss curve there (default: none)")
    parser.add_argument("--no-reference", action="store_true", help="skip plain JAX")
    parser.add_argument(
        "--save", metavar="DIR", help="checkpoint the last step there (a new directory)"
    )
    parser.add_argument("--resume", metavar="DIR", help="go on from a checkpoint")
    return parser.parse_args(argv)


async def _resumed(
    cluster: atoll.Cluster, directory: str | None, layout: str
) -> tuple[int, Any, dict[str, Any] | None]:
    """The step, state and input position a checkpoint holds (from the
    hosts), or a fresh start; a checkpoint of another model or cut is refused."""
    if directory is None:
        return 0, None, None
    saved = await cluster.restore(directory)
    if str(saved["layout"]) != layout:
        raise SystemExit(
            f"train_lm: {directory} holds {saved['layout']}, not {layout}: "
            "resume with the --config, --pipeline and --cut it was saved with"
        )
    return int(saved["step"]), saved["state"], saved.get("input")


def _layout(args: argparse.Namespace, cut: lm_pipeline.Cut | None) -> str:
    """What a checkpoint's state fits: the config, and the blocks per stage."""
    blocks = None if cut is None else [list(b) for b in cut.blocks]
    return json.dumps({"config": args.config, "stages": blocks})


def _check_paths(args: argparse.Namespace) -> None:
    """Refuse a ``--save`` that would fail only after training."""
    if args.save and Path(args.save).exists():
        raise SystemExit(f"train_lm: {args.save} exists: a checkpoint is never written over")
    if args.save and args.resume and Path(args.save).absolute() == Path(args.resume).absolute():
        raise SystemExit("train_lm: --save must name a new directory, not the --resume one")


def _cut(config: lm.LMConfig, stages: int, how: str, micro_batch: int) -> lm_pipeline.Cut:
    chosen = (  # the partitioner's, from the blocks' times measured here
        lm_pipeline.cut(config, stages, micro_batch, lm_pipeline.profile(config, micro_batch))
        if how == "partitioner"
        else lm_pipeline.even_cut(config, stages)
    )
    print(f"stages (blocks of each): {[list(b) for b in chosen.blocks]}", file=sys.stderr)
    return chosen


def _input(args: argparse.Namespace) -> str:
    """Who makes the batches: the hosts where they can (data-parallel
    training), else this client."""
    if args.input == "hosts" and args.pipeline > 1:
        raise SystemExit(
            "train_lm: --input hosts makes the batches of data-parallel training; "
            "a pipeline's micro-batches come from the client (--input client)"
        )
    return args.input or ("client" if args.pipeline > 1 else "hosts")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _at_least_0(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


async def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    _check_paths(args)
    args.input = _input(args)
    config = lm.CONFIGS[args.config].with_(dtype=args.dtype)
    params = lm.parameter_count(lm.init(config))
    if not args.json:
        print(
            f"train_lm: {args.config} ({params:,} parameters), {args.steps} steps, "
            f"batch {config.batch} x {config.context} bytes, data-parallel over "
            f"{args.data_parallel} devices" + (f" in {args.hosts} hosts" if args.hosts else "")
        )
    stages = args.pipeline
    devices = stages * args.data_parallel
    cut = None
    if stages > 1:
        cut = _cut(config, stages, args.cut, config.batch // args.micro_batches)
    layout = _layout(args, cut)
    async with cluster_for(devices, args.hosts, in_process_hosts=stages) as cluster:
        start, state, input_state = await _resumed(cluster, args.resume, layout)
        show = _printer(args.json, start, args.steps)
        if cut is None:
            result = await train(
                cluster,
                config,
                args.steps,
                args.data_parallel,
                show,
                start,
                state,
                input_from=args.input,
                input_state=input_state if args.input == "hosts" else None,
                over_sockets=args.hosts > 0,
            )
        else:
            result = await train_pipelined(
                cluster,
                config,
                args.steps,
                cut,
                args.micro_batches,
                args.data_parallel,
                show,
                start,
                state,
                schedule=args.schedule,
            )
        if args.save:
            step = np.int64(start + args.steps)
            saved = {"step": step, "layout": np.array(layout), "state": result.state}
            if result.input_state is not None:
                saved["input"] = result.input_state
            await cluster.save(saved, args.save)
    reference_steps = None if args.no_reference else start + args.steps
    same = args.data_parallel if stages == 1 else 1  # a pipeline has no plain-JAX twin here
    summary = _summary(config, params, result, devices, reference_steps, same)
    summary["input"] = args.input
    summary["client_bytes_per_step"] = result.client_bytes_per_step
    summary["client_array_bytes_per_step"] = result.client_array_bytes_per_step
    if args.json:
        print(json.dumps(summary))
    else:
        _print_summary(summary)
    if args.plot:
        title = f"train_lm {args.config}, {devices} device{'s' if devices > 1 else ''}"
        _plot(args.plot, start, result.losses, summary, title)


def _printer(as_json: bool, start: int, steps: int) -> Callable[[StepReport], None]:
    every, last = max(1, steps // 20), start + steps - 1

    def show(report: StepReport) -> None:
        row = {"step": report.step, "loss": report.loss, "tokens_per_s": report.tokens_per_s}
        if as_json:
            print(json.dumps(row), flush=True)
        elif (report.step - start) % every == 0 or report.step == last:
            print(
                f"step {report.step:5d}  loss {report.loss:.4f}  "
                f"{report.tokens_per_s:,.0f} tokens/s",
                flush=True,
            )

    return show


def _summary(
    config: lm.LMConfig,
    params: int,
    result: TrainResult,
    devices: int,
    reference_steps: int | None,
    same_devices: int = 1,
) -> dict[str, Any]:
    """The final line. ``reference_loss``: plain JAX on one device (the
    all-reduce of a data-parallel step sums in another order, so long runs
    drift apart); with ``same_devices`` > 1, also plain JAX data-parallel
    over that many devices with the same shardings
    (``same_devices_reference_loss``)."""
    rate = result.overall_tokens_per_s()
    flops = lm.flops_per_token(config, lm.init(config)) * rate
    summary: dict[str, Any] = {
        "final": True,
        "steps": len(result.losses),
        "loss": result.losses[-1],
        "tokens_per_s": rate,
        "model_flops_per_s": flops,
        "mfu": _mfu(flops, devices),
        "parameters": params,
    }
    if reference_steps is None:
        return summary
    ref = reference(config, reference_steps)  # from step 0: a resumed run is its tail
    tail = len(result.losses)
    summary["reference_loss"] = ref.losses[-tail:]
    summary["max_relative_gap"] = _gap(result.losses, ref.losses[-tail:])
    summary["reference_tokens_per_s"] = ref.overall_tokens_per_s()
    if same_devices > 1:
        same = reference(config, reference_steps, same_devices)
        summary["same_devices_reference_loss"] = same.losses[-tail:]
        summary["max_relative_gap_same_devices"] = _gap(result.losses, same.losses[-tail:])
        summary["same_devices_reference_tokens_per_s"] = same.overall_tokens_per_s()
    return summary


def _gap(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def _mfu(flops_per_s: float, devices: int) -> float | None:
    """Model FLOPs utilization of ``devices`` devices, where their peak is
    known (GPUs named in ``PEAK_FLOPS``); None elsewhere (a CPU's is not)."""
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK_FLOPS.items() if k in kind), None)
    return None if peak is None else flops_per_s / (peak * devices)


# dense bf16 peaks per device (SXM parts): MFU is quoted against these, as is
# usual, though this model trains in float32 (so it reads low)
PEAK_FLOPS = {"H200": 989e12, "H100 80GB HBM3": 989e12, "A100": 312e12}


def _print_summary(summary: dict[str, Any]) -> None:
    mfu = summary["mfu"]
    print(
        f"done: loss {summary['loss']:.4f} (ln 256 = {math.log(256):.2f}), "
        f"{summary['tokens_per_s']:,.0f} tokens/s, "
        f"{summary['model_flops_per_s'] / 1e9:,.1f} model GFLOP/s"
        + (f", MFU {mfu:.1%}" if mfu is not None else "")
    )
    sent, arrays = summary.get("client_bytes_per_step"), summary.get("client_array_bytes_per_step")
    print(
        f"batches made by the {summary.get('input', 'client')}"
        + ("" if sent is None else f"; this process sent {sent:,.0f} bytes per step")
        + ("" if arrays is None else f", {arrays:,.0f} of them arrays")
    )
    if "reference_loss" in summary:
        print(
            f"plain JAX, one device: loss {summary['reference_loss'][-1]:.4f}, "
            f"{summary['reference_tokens_per_s']:,.0f} tokens/s; the largest relative "
            f"gap between the two losses is {summary['max_relative_gap']:.1e}"
        )
    if "same_devices_reference_loss" in summary:
        print(
            "plain JAX on the same devices, data-parallel: loss "
            f"{summary['same_devices_reference_loss'][-1]:.4f}, "
            f"{summary['same_devices_reference_tokens_per_s']:,.0f} tokens/s; largest gap "
            f"{summary['max_relative_gap_same_devices']:.1e}"
        )


def _plot(path: str, start: int, losses: list[float], summary: dict[str, Any], title: str) -> None:
    """The loss curve beside plain JAX's: on one device, and on the same
    devices with the same shardings (the bit-exact reference, when there is one)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no loss curve: matplotlib is missing (pip install 'atoll[bench]')", file=sys.stderr)
        return
    figure, axes = plt.subplots(figsize=(7, 4))
    steps = range(start, start + len(losses))
    axes.plot(steps, losses, label="atoll")
    same = summary.get("same_devices_reference_loss")
    if same is not None:
        axes.plot(steps, same, ":", lw=2, label="plain JAX, same devices and shardings")
    if summary.get("reference_loss") is not None:
        axes.plot(steps, summary["reference_loss"], "--", label="plain JAX, one device")
    axes.axhline(math.log(256), color="grey", lw=0.5, label="ln 256: a uniform guess")
    axes.set(xlabel="step", ylabel="loss (nats per byte)", title=title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"loss curve: {path}", file=sys.stderr)


if __name__ == "__main__":
    import anyio

    from atoll.examples import use_fake_cpu_devices

    use_fake_cpu_devices()
    anyio.run(main)
