"""A pipeline whose stages the partitioner chose: no hand-written split.

The model is a deep MLP with uneven layers (a few wide ones, many narrow
ones), so cutting it into equal numbers of layers per stage would leave one
stage much slower than the rest. The example describes each layer to the
partitioner (FLOPs, weight bytes, activation bytes), asks
``atoll.partition.search`` for the best chain placement over 4 pipeline
devices, places the layers of each of the 4 stages on its own one-device
slice (a host of its own) and runs micro-batches through them with the
GPipe-style program of ``examples/pipeline.py``. The outputs are checked
against the unpipelined model, and the chosen split against an even one by the
partitioner's own cost model.

Run it: ``atoll run partitioned_pipeline``.
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import anyio
import jax
import jax.numpy as jnp
import numpy as np

import atoll
from atoll.devices.jax import JaxDevice
from atoll.examples import use_fake_cpu_devices
from atoll.examples.pipeline import gpipe

__all__ = ["Split", "forward", "layer_graph", "main", "plan", "reference", "run"]

WIDTHS = [16, 256, 256, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16]  # 12 layers, 2 wide
STAGES, BATCH = 4, 32


def init(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        for a, b in itertools.pairwise(WIDTHS)
    ]


def layer_graph(batch: int = BATCH) -> Any:
    """The model as the partitioner sees it: one op per layer, a chain."""
    p = atoll.partition
    nodes = [
        p.Op(f"layer{i}", "matmul", 2.0 * batch * a * b, 4.0 * a * b, 4.0 * batch * b)
        for i, (a, b) in enumerate(itertools.pairwise(WIDTHS))
    ]
    edges = [(i, i + 1, nodes[i].output_bytes) for i in range(len(nodes) - 1)]
    return p.OpGraph.build("uneven-mlp", nodes, edges)


@dataclass
class Split:
    """Which layers each stage runs, and the cost model's throughput for it."""

    stages: list[list[int]]
    throughput: float
    even_throughput: float


def plan(batch: int = BATCH) -> Split:
    """Ask the partitioner for the stages (exact DP over the chain)."""
    p = atoll.partition
    graph = layer_graph(batch)
    chips = p.Chiplets(STAGES, sram_bytes=1 << 20, flops_per_s=1e9, link_bytes_per_s=1e9)
    best = p.search(graph, chips, method="dp")
    assert best.valid
    stages = [list(stage.nodes) for stage in best.stages]
    per = len(graph) // STAGES
    even = [min(i // per, STAGES - 1) for i in range(len(graph))]
    return Split(stages, best.throughput, p.throughput(graph, chips, even))


def forward(weights: list[Any], x: Any) -> Any:
    """Layers ``tanh(x @ w)`` in turn: a stage's body, and the whole model's."""
    for w in weights:
        x = jnp.tanh(x @ w)
    return x


async def run(micro_batches: int = 4, seed: int = 0) -> tuple[np.ndarray, Split]:
    """Plan, place, and run the pipeline on 4 hosts of one JAX device each."""
    split = plan()
    weights = init(seed)
    async with atoll.local_cluster(1, STAGES, 1, device_cls=JaxDevice) as cluster:
        stages = [
            (await cluster.devices(1)).jit(forward, name=f"layers_{layers[0]}_{layers[-1]}")
            for layers in split.stages
        ]
        per_stage = [[weights[i] for i in layers] for layers in split.stages]
        outs = await cluster.run(gpipe(stages), per_stage, np.split(inputs(seed), micro_batches))
    return np.concatenate(outs), split


def inputs(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + 1).standard_normal((BATCH, WIDTHS[0])).astype(np.float32)


def reference(seed: int = 0) -> np.ndarray:
    """The whole model in plain JAX, unpipelined."""
    return np.asarray(jax.jit(forward)(init(seed), inputs(seed)))


async def main() -> None:
    out, split = await run()
    print("stages chosen by the partitioner (layer indices):", split.stages)
    print(
        f"modelled throughput: {split.throughput:,.0f}/s against {split.even_throughput:,.0f}/s "
        "for an even split of the layers"
    )
    print("match:", bool(np.allclose(out, reference(), atol=1e-5)))


if __name__ == "__main__":
    use_fake_cpu_devices()
    anyio.run(main)
