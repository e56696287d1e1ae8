"""A GPipe-style pipeline of a tiny transformer: 4 stages on 4 hosts, micro-batches.

Each stage (one transformer block) sits on its own virtual slice of 2 devices,
which the resource manager places on its own host. The batch is cut into
micro-batches, and the program calls stage ``s`` on micro-batch ``m`` for
every pair: one node each, 16 in all. Dispatched in parallel, every stage's
devices receive their micro-batches in order ahead of the data, so stage 2
works on micro-batch 0 while stage 1 works on micro-batch 1: the pipeline
comes from the dataflow, not from a hand-written schedule. Activations hop
from host to host through the hosts' object stores, never through the
controller. The outputs are checked against the unpipelined model.

Run it: ``python -m atoll.examples.pipeline``.
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import atoll
from atoll.devices.jax import JaxDevice
from atoll.examples import use_fake_cpu_devices

__all__ = ["PipelineResult", "block", "gpipe", "init", "main", "reference", "run"]

D, HEADS, SEQ, STAGES = 16, 2, 8, 4


def init(seed: int = 0) -> list[dict[str, np.ndarray]]:
    """One parameter dict per transformer block."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        out: np.ndarray = (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
        return out

    return [
        {"qkv": w(D, 3 * D), "out": w(D, D), "up": w(D, 4 * D), "down": w(4 * D, D)}
        for _ in range(STAGES)
    ]


def _norm(x: Any) -> Any:
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


def block(p: dict[str, Any], x: Any) -> Any:
    """A pre-norm transformer block with causal self-attention: (b, seq, D) -> same."""
    b = x.shape[0]
    q, k, v = jnp.split(_norm(x) @ p["qkv"], 3, axis=-1)
    q, k, v = (t.reshape(b, SEQ, HEADS, D // HEADS) for t in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
    mask = np.tril(np.ones((SEQ, SEQ), bool))
    attn = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, SEQ, D) @ p["out"]
    return x + jax.nn.gelu(_norm(x) @ p["up"]) @ p["down"]


def gpipe(stages: Sequence[Any]) -> atoll.Program:
    """The GPipe program: every micro-batch through every stage, in order.

    ``stages[s]`` is called as ``stage(params[s], x)``; the pipelining comes
    from the dataflow when the program is dispatched, not from this loop.
    """

    @atoll.program
    def gpipe(params: list[Any], micro: list[Any]) -> list[Any]:
        outs = []
        for x in micro:
            for stage, p in zip(stages, params, strict=True):
                x = stage(p, x)
            outs.append(x)
        return outs

    return gpipe


@dataclass
class PipelineResult:
    outputs: np.ndarray
    nodes: int
    per_stage_computations: list[int]


async def run(batch: int = 8, micro_batches: int = 4, seed: int = 0) -> PipelineResult:
    """Run the pipelined model on 4 hosts x 2 JAX devices."""
    async with atoll.local_cluster(1, STAGES, 2, device_cls=JaxDevice) as cluster:
        stages = [
            (await cluster.devices(2, axis_names=("b",))).jit(
                block, in_specs=(None, P("b")), out_specs=P("b"), name=f"stage{s}"
            )
            for s in range(STAGES)
        ]
        x = inputs(batch, seed)
        micro = np.split(x, micro_batches)
        run = cluster.run(gpipe(stages), init(seed), micro)
        outs = await run
        stats = await cluster.device_stats()
        nodes = len(run.graph.nodes)
    per_host = [sum(s.computations for s in stats if s.host_id == h) for h in range(STAGES)]
    return PipelineResult(np.concatenate(outs), nodes, per_host)


def inputs(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + 1).standard_normal((batch, SEQ, D)).astype(np.float32)


def reference(batch: int = 8, seed: int = 0) -> np.ndarray:
    """The unpipelined model in plain JAX, whole batch at once."""

    @jax.jit
    def model(params: list[dict[str, Any]], x: Any) -> Any:
        for p in params:
            x = block(p, x)
        return x

    return np.asarray(model(init(seed), inputs(batch, seed)))


async def main() -> None:
    result = await run()
    ref = reference()
    print(f"{result.nodes} nodes; computations per host (one stage each): ")
    print(f"  {result.per_stage_computations}")
    print("max |pipelined - unpipelined|:", float(np.abs(result.outputs - ref).max()))
    print("match:", bool(np.allclose(result.outputs, ref, atol=1e-4)))


if __name__ == "__main__":
    use_fake_cpu_devices()
    anyio.run(main)
