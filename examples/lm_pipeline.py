"""The language model of :mod:`atoll.examples.lm`, cut into pipeline stages.

A stage holds a run of consecutive transformer blocks; the first stage also
holds the embeddings, the last the final layer norm and the head. The head
is tied to the token embedding (as in :mod:`~atoll.examples.lm`), so the
last stage reads the first stage's ``wte`` and sends its gradient back to
the first stage's update.

One training step is one atoll program (GPipe): the forward of every
micro-batch through every stage, then the backward of every micro-batch back
through them (each backward recomputes its stage's forward, so no closure
crosses between nodes), then one AdamW update per stage over the mean of its
micro-batches' gradients. Every stage runs on its own slice, data-parallel
over the slice's devices along the batch. AdamW is elementwise, so updating
each stage's part of the parameters on its own gives the whole model's step:
the losses equal those of :func:`atoll.examples.lm.train_step` on the whole
batch (to float32 rounding).

Where to cut comes from the partitioner (:func:`cut`): the model as a chain
of ops (embedding, blocks, head) with their FLOPs, weights and activations,
placed over the stages by ``atoll.partition.search``.
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import atoll
from atoll.examples import lm

__all__ = ["Cut", "Stages", "cut", "even_cut", "split_params", "step_program"]


@dataclass(frozen=True)
class Cut:
    """Which blocks each stage holds (stage ``s``: ``blocks[s]``), and the
    partitioner's modelled throughput for it and for an even cut."""

    blocks: tuple[tuple[int, ...], ...]
    throughput: float = 0.0
    even_throughput: float = 0.0


def layer_graph(config: lm.LMConfig, micro_batch: int) -> Any:
    """The model as the partitioner sees it: embedding, blocks, head, a chain."""
    p = atoll.partition
    tokens, w = micro_batch * config.context, config.width
    act = 4.0 * tokens * w
    block_flops = 3 * (24.0 * tokens * w * w + 4.0 * tokens * config.context * w)  # fwd + bwd
    nodes = [p.Op("embed", "gather", 3 * tokens * w, 4.0 * (lm.VOCAB + config.context) * w, act)]
    weights = 48.0 * w * w
    nodes += [p.Op(f"block{i}", "block", block_flops, weights, act) for i in range(config.layers)]
    nodes.append(p.Op("head", "matmul", 3 * 2.0 * tokens * w * lm.VOCAB, 4.0 * w, 4.0 * tokens))
    edges = [(i, i + 1, nodes[i].output_bytes) for i in range(len(nodes) - 1)]
    return p.OpGraph.build(f"lm{config.layers}x{w}", nodes, edges)


def cut(config: lm.LMConfig, stages: int, micro_batch: int) -> Cut:
    """The partitioner's cut of the model into ``stages`` (exact DP over the chain)."""
    if not 2 <= stages <= config.layers + 1:
        raise ValueError(f"{stages} stages for {config.layers} blocks: need 2 to layers + 1")
    p = atoll.partition
    graph = layer_graph(config, micro_batch)
    chips = p.Chiplets(stages, sram_bytes=1 << 40, flops_per_s=1e12, link_bytes_per_s=1e10)
    best = p.search(graph, chips, method="dp")
    assembled = _blocks_of([list(stage.nodes) for stage in best.stages], stages, config.layers)
    even = even_cut(config, stages)
    assignment = [0] + [s for s, bs in enumerate(even.blocks) for _ in bs] + [stages - 1]
    return Cut(assembled, best.throughput, p.throughput(graph, chips, assignment))


def even_cut(config: lm.LMConfig, stages: int) -> Cut:
    """Equal numbers of blocks per stage (the first ones take the rest)."""
    bounds = np.array_split(np.arange(config.layers), stages)
    return Cut(tuple(tuple(int(b) for b in part) for part in bounds))


def _blocks_of(
    stage_nodes: list[list[int]], stages: int, layers: int
) -> tuple[tuple[int, ...], ...]:
    """Blocks per stage from the partitioner's node lists (node 0 is the
    embedding, node ``layers + 1`` the head); padded to ``stages`` stages."""
    found = [tuple(n - 1 for n in sorted(nodes) if 1 <= n <= layers) for nodes in stage_nodes]
    found += [()] * (stages - len(found))
    flat = [b for part in found for b in part]
    if flat != list(range(layers)):
        raise ValueError(f"the partitioner's stages are not a chain of the blocks: {found}")
    return tuple(found)


def split_params(params: dict[str, Any], blocks: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    """The parameters of each stage (the first adds the embeddings, the last
    the final layer norm)."""
    out: list[dict[str, Any]] = [{"blocks": [params["blocks"][b] for b in part]} for part in blocks]
    out[0].update(wte=params["wte"], wpe=params["wpe"])
    out[-1]["ln_f"] = params["ln_f"]
    return out


def join_params(stages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The whole model's parameters from its stages' (the inverse of :func:`split_params`)."""
    return {
        "wte": stages[0]["wte"],
        "wpe": stages[0]["wpe"],
        "blocks": [block for stage in stages for block in stage["blocks"]],
        "ln_f": stages[-1]["ln_f"],
    }


# -- what each stage computes ---------------------------------------------------
def forward(p: dict[str, Any], x: Any, *, heads: int, first: bool) -> Any:
    """A stage's forward: its blocks (after embedding the bytes, on the first)."""
    if first:
        x = p["wte"][x] + p["wpe"][: x.shape[1]]
    for block in p["blocks"]:
        x = lm.block_forward(x, block, heads)
    return x


def last(p: dict[str, Any], wte: Any, x: Any, targets: Any, *, heads: int) -> tuple[Any, ...]:
    """The last stage, forward and backward: the micro-batch's loss, the
    gradient for its input, its own parameters' and the head's ``wte``'s."""

    def loss(p: dict[str, Any], wte: Any, x: Any) -> Any:
        h = lm._layer_norm(forward(p, x, heads=heads, first=False), p["ln_f"])
        logp = jax.nn.log_softmax(h @ wte.T, -1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

    value, (g_p, g_wte, dx) = jax.value_and_grad(loss, argnums=(0, 1, 2))(p, wte, x)
    return value, dx, g_p, g_wte


def backward(p: dict[str, Any], x: Any, dy: Any, *, heads: int) -> tuple[Any, Any]:
    """A middle stage's backward (recomputing its forward): the gradient for
    its input, and its parameters'."""
    _, vjp = jax.vjp(lambda p, x: forward(p, x, heads=heads, first=False), p, x)
    g_p, dx = vjp(dy)
    return dx, g_p


def backward_first(p: dict[str, Any], tokens: Any, dy: Any, *, heads: int) -> Any:
    """The first stage's backward: its parameters' gradient."""
    _, vjp = jax.vjp(lambda p: forward(p, tokens, heads=heads, first=True), p)
    (g_p,) = vjp(dy)
    return g_p


def update(
    p: Any, opt_state: Any, grads: list[Any], head_grads: list[Any], *, config: lm.LMConfig
) -> tuple[Any, Any]:
    """AdamW on the mean of the micro-batches' gradients (``head_grads``: the
    tied head's, added to the first stage's ``wte``)."""
    import optax

    mean = jax.tree_util.tree_map(lambda *gs: sum(gs) / len(gs), *grads)
    if head_grads:
        mean = {**mean, "wte": mean["wte"] + sum(head_grads) / len(head_grads)}
    updates, opt_state = lm.make_optimizer(config).update(mean, opt_state, p)
    return optax.apply_updates(p, updates), opt_state


# -- the program -----------------------------------------------------------------
@dataclass(frozen=True)
class Stages:
    """The placed functions of every stage (see :func:`place`)."""

    forward: list[Any]
    last: Any
    backward: list[Any]  # index 0: the first stage's
    update: list[Any]


def place(slices: Sequence[Any], config: lm.LMConfig) -> Stages:
    """Each stage's functions placed on its slice (axis ``data``: the batch)."""
    heads, data = config.heads, P("data")
    fwd = [
        s.jit(
            functools.partial(forward, heads=heads, first=i == 0),
            in_specs=(None, data),
            out_specs=data,
            name=f"forward{i}",
        )
        for i, s in enumerate(slices[:-1])
    ]
    final = slices[-1].jit(
        functools.partial(last, heads=heads),
        in_specs=(None, None, data, data),
        out_specs=(P(), data, None, None),
        name="last",
    )
    back = [
        slices[0].jit(
            functools.partial(backward_first, heads=heads),
            in_specs=(None, data, data),
            out_specs=None,
            name="backward0",
        )
    ]
    back += [
        s.jit(
            functools.partial(backward, heads=heads),
            in_specs=(None, data, data),
            out_specs=(data, None),
            name=f"backward{i}",
        )
        for i, s in enumerate(slices[:-1])
        if i > 0
    ]
    upd = [
        s.jit(functools.partial(update, config=config), name=f"update{i}")
        for i, s in enumerate(slices)
    ]
    return Stages(fwd, final, back, upd)


def step_program(stages: Stages) -> atoll.Program:
    """One GPipe training step: ``(params, opt_states, inputs, targets) ->
    (params, opt_states, losses)``, a list entry per stage or micro-batch."""
    count = len(stages.update)

    @atoll.program
    def gpipe_step(
        params: list[Any], opt_states: list[Any], inputs: list[Any], targets: list[Any]
    ) -> tuple[list[Any], list[Any], list[Any]]:
        acts: list[list[Any]] = []
        for tokens in inputs:  # every forward first: GPipe
            x, seen = tokens, []
            for s in range(count - 1):
                seen.append(x)
                x = stages.forward[s](params[s], x)
            acts.append([*seen, x])
        losses: list[Any] = []
        grads: list[list[Any]] = [[] for _ in range(count)]
        head: list[Any] = []
        for m, (tokens, target) in enumerate(zip(inputs, targets, strict=True)):
            loss, dy, g_last, g_wte = stages.last(params[-1], params[0]["wte"], acts[m][-1], target)
            losses.append(loss)
            grads[-1].append(g_last)
            head.append(g_wte)
            for s in range(count - 2, 0, -1):
                dy, g = stages.backward[s](params[s], acts[m][s], dy)
                grads[s].append(g)
            grads[0].append(stages.backward[0](params[0], tokens, dy))
        new_params, new_states = [], []
        for s in range(count):
            p, o = stages.update[s](params[s], opt_states[s], grads[s], head if s == 0 else [])
            new_params.append(p)
            new_states.append(o)
        return new_params, new_states, losses

    return gpipe_step
