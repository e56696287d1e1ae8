"""``atoll bench train``: the language model of ``atoll run train_lm``, beside plain JAX.

Cases, each measured in this run:

* ``data-parallel D``: tokens/s of the data-parallel step through atoll,
  against plain JAX running the same step with the same shardings on the
  same D devices (target: 0.95 of it).
* ``pipeline S x D, M micro (cut)``: tokens/s of the GPipe form with the
  partitioner's cut (from the blocks' measured times, ``lm_pipeline.profile``)
  and with equal block counts, against plain JAX
  data-parallel over the same S x D devices; its bubble, measured as the
  share of the stages' wall time their devices were idle, beside GPipe's
  ideal ``(S-1)/(M+S-1)``.
* ``memory``: the hosts' store bytes after the first tenth of a long
  data-parallel run and at its end (they must not grow).
* ``input``: data-parallel over 2 host processes, the batches made on the
  hosts (``--input hosts``, each its own rows) against made and sent by the
  client (``--input client``), alternately on the same cluster: tokens/s
  (medians), the client's bytes per step (all it wrote to sockets, and the
  arrays among them), and whether the losses are the same, bit for bit.

Rates skip the first fifth of the steps (compiling, filling the run-ahead).
On this machine the "devices" are XLA's fake CPU devices sharing its cores,
so busy times and bubbles are rough there; on a GPU they are the real thing.
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio

from atoll.examples import lm, lm_pipeline, train_lm, use_fake_cpu_devices

from ._common import Row, emit, system_column, table, unit_column

BENCH = "train"


async def data_parallel(config: lm.LMConfig, steps: int, devices: int) -> list[Row]:
    case = f"data-parallel {devices}"
    async with train_lm.cluster_for(devices, hosts=0) as cluster:
        result = await train_lm.train(cluster, config, steps, devices)
    same = train_lm.reference(config, steps, devices)
    atoll_rate, jax_rate = result.overall_tokens_per_s(), same.overall_tokens_per_s()
    return [
        Row(BENCH, case, "atoll", atoll_rate, "tokens/s", devices),
        Row(BENCH, case, "plain JAX", jax_rate, "tokens/s", devices),
        Row(BENCH, case, "ratio", atoll_rate / jax_rate, "x", devices),
    ]


async def pipeline(
    config: lm.LMConfig, steps: int, stages: int, devices: int, micro: int, how: str
) -> list[Row]:
    cut = (
        lm_pipeline.cut(config, stages, config.batch // micro, _profiled(config, micro))
        if how == "partitioner"
        else lm_pipeline.even_cut(config, stages)
    )
    case = f"pipeline {stages}x{devices}, {micro} micro ({how} {_sizes(cut)})"
    async with train_lm.cluster_for(stages * devices, 0, in_process_hosts=stages) as cluster:
        warm = await train_lm.train_pipelined(cluster, config, 3, cut, micro, devices)  # compiles
        before, began = await cluster.device_stats(), time.perf_counter()
        result = await train_lm.train_pipelined(
            cluster, config, steps, cut, micro, devices, slices=warm.slices
        )
        wall, after = time.perf_counter() - began, await cluster.device_stats()
    busy = [b.busy_s - a.busy_s for a, b in zip(before, after, strict=True)]
    bubble = 1 - sum(busy) / len(busy) / wall  # each device's idle share, on average
    same = train_lm.reference(config, steps, stages * devices)
    rate, jax_rate = result.overall_tokens_per_s(), same.overall_tokens_per_s()
    n = stages * devices
    return [
        Row(BENCH, case, "atoll", rate, "tokens/s", n, stages),
        Row(BENCH, case, "plain JAX", jax_rate, "tokens/s", n),
        Row(BENCH, case, "ratio", rate / jax_rate, "x", n),
        Row(BENCH, case, "bubble", bubble, "share", n),
        Row(BENCH, case, "GPipe ideal", (stages - 1) / (micro + stages - 1), "share", n),
    ]


@functools.cache
def _profiled(config: lm.LMConfig, micro: int) -> tuple[float, ...]:
    """The model's ops' measured seconds, for the partitioner (once per config)."""
    return tuple(lm_pipeline.profile(config, config.batch // micro))


def _sizes(cut: lm_pipeline.Cut) -> str:
    return "/".join(str(len(blocks)) for blocks in cut.blocks)


async def memory(config: lm.LMConfig, steps: int, devices: int) -> list[Row]:
    """Store bytes after a tenth of ``steps`` data-parallel steps, and after all."""
    marks: dict[str, float] = {}
    async with train_lm.cluster_for(devices, hosts=0) as cluster:

        async def measure(when: str) -> None:
            marks[when] = sum(u["bytes"] for u in await cluster.store_usage())

        tenth = max(1, steps // 10)
        early = await train_lm.train(cluster, config, tenth, devices)
        await measure("early")  # the working set: one step's parameters and state
        state, slices = early.state, early.slices
        del early
        late = await train_lm.train(
            cluster, config, steps - tenth, devices, start=tenth, state=state, slices=slices
        )
        del state  # what the first run left is freed when dropped
        await anyio.sleep(0)  # (frees leave at the end of a loop turn)
        await measure("late")  # late.state, the working set now, is still held
        del late
    case = f"memory over {steps} steps"
    return [
        Row(BENCH, case, "store bytes early", marks["early"], "bytes", devices),
        Row(BENCH, case, "store bytes late", marks["late"], "bytes", devices),
    ]


async def inputs(config: lm.LMConfig, steps: int, devices: int, rounds: int = 3) -> list[Row]:
    """``--input hosts`` against ``--input client`` over 2 host processes."""
    from atoll.devices.jax import JaxDevice
    from atoll.runtime import ClusterSpec, process_cluster

    got: dict[str, list[Any]] = {"hosts": [], "client": []}
    spec = ClusterSpec(1, 2, devices // 2, device_cls=JaxDevice)
    async with process_cluster(spec) as cluster:
        slices: Any = ()
        for _ in range(rounds):
            for how in got:
                result = await train_lm.train(
                    cluster,
                    config,
                    steps,
                    devices,
                    slices=slices,
                    input_from=how,
                    over_sockets=True,
                )
                slices = result.slices
                got[how].append(result)
    case = f"input, 2 host processes, {devices} devices:"
    rows = []
    for what, unit, of in (
        ("tokens/s", "tokens/s", lambda r: r.overall_tokens_per_s()),
        ("client bytes/step", "bytes", lambda r: r.client_bytes_per_step),
        ("client array bytes/step", "bytes", lambda r: r.client_array_bytes_per_step),
    ):
        medians = {how: statistics.median(of(r) for r in results) for how, results in got.items()}
        rows += [
            Row(BENCH, f"{case} {what}", f"{how} input", medians[how], unit, devices, 2)
            for how in got
        ]
        if what == "tokens/s":
            ratio = medians["hosts"] / medians["client"]
            rows.append(Row(BENCH, f"{case} {what}", "ratio", ratio, "x", devices, 2))
    same = all(h.losses == c.losses for h, c in zip(got["hosts"], got["client"], strict=True))
    rows.append(Row(BENCH, f"{case} same losses", "atoll", float(same), "1: bit for bit", devices))
    return rows


async def run(args: argparse.Namespace) -> list[Row]:
    config = lm.CONFIGS[args.config]
    rows = await data_parallel(config, args.steps, args.devices)
    per_stage = max(1, args.devices // args.stages)
    for how in ("partitioner", "even"):
        rows += await pipeline(config, args.steps, args.stages, per_stage, args.micro, how)
    if args.memory_steps:
        rows += await memory(lm.CONFIGS["tiny"], args.memory_steps, 2)
    if args.input_steps:
        rows += await inputs(config, args.input_steps, 2 * max(1, args.devices // 2))
    return rows


def _render(rows: Sequence[Row]) -> str:
    columns = [
        system_column("atoll", 12, ",.0f"),
        system_column("hosts input", 12, ",.0f"),
        system_column("client input", 13, ",.0f"),
        system_column("plain JAX", 12, ",.0f"),
        system_column("ratio", 7, ".2f"),
        system_column("bubble", 7, ".2f"),
        system_column("GPipe ideal", 12, ".2f"),
        system_column("store bytes early", 18, ",.0f"),
        system_column("store bytes late", 17, ",.0f"),
        unit_column(),
    ]
    return table(rows, columns, case_width=60)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atoll bench train", description=__doc__)
    parser.add_argument("--config", choices=sorted(lm.CONFIGS), default="small")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--devices", type=int, default=4, help="data-parallel devices")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--memory-steps", type=int, default=5000, help="0: skip")
    parser.add_argument(
        "--input-steps", type=int, default=40, help="per round of the input case (0: skip)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    if args.stages < 2 or min(args.devices, args.micro, args.steps) < 1 or args.memory_steps < 0:
        parser.error("--stages must be 2 or more; --devices, --micro and --steps at least 1")
    if args.input_steps < 0:
        parser.error("--input-steps must be 0 or more")
    use_fake_cpu_devices()
    began = time.perf_counter()
    rows: list[Any] = anyio.run(run, args)
    emit(rows, args.json, _render)
    print(f"({time.perf_counter() - began:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
