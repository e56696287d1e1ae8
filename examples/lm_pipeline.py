"""The language model of :mod:`atoll.examples.lm`, cut into pipeline stages.

A stage holds a run of consecutive transformer blocks; the first stage also
holds the embeddings, the last the final layer norm and the head. The head
is tied to the token embedding (as in :mod:`~atoll.examples.lm`), so the
last stage reads the first stage's ``wte`` and sends its gradient back to
the first stage's update.

One training step is one atoll program: the forward of every micro-batch
through every stage and its backward back through them (each backward
recomputes its stage's forward, so no closure crosses between nodes), in
GPipe's order (every forward first) or 1F1B's (:func:`schedule`), then one
AdamW update per stage over the mean of its micro-batches' gradients.
Every stage runs on its own slice, data-parallel
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

__all__ = [
    "SCHEDULES",
    "Cut",
    "Stages",
    "cut",
    "even_cut",
    "profile",
    "schedule",
    "split_params",
    "step_program",
]


@dataclass(frozen=True)
class Cut:
    """Which blocks each stage holds (stage ``s``: ``blocks[s]``), and the
    partitioner's modelled throughput for it and for an even cut."""

    blocks: tuple[tuple[int, ...], ...]
    throughput: float = 0.0
    even_throughput: float = 0.0


def layer_graph(
    config: lm.LMConfig, micro_batch: int, seconds: Sequence[float] | None = None
) -> Any:
    """The model as the partitioner sees it: embedding, blocks, head, a chain.

    Each op's work is its FLOPs, counted from the shapes; or, with
    ``seconds`` (from :func:`profile`: embedding, each block, head), its
    measured time on a device, as FLOPs at the partitioner's 1e12 per second.
    """
    p = atoll.partition
    tokens, w = micro_batch * config.context, config.width
    act = 4.0 * tokens * w
    measured = None if seconds is None else [s * _FLOPS_PER_S for s in seconds]
    embed = 3 * tokens * w if measured is None else measured[0]
    nodes = [p.Op("embed", "gather", embed, 4.0 * (lm.VOCAB + config.context) * w, act)]
    for i in range(config.layers):
        weights = (4 + 2 * config.mlp_of(i)) * w * w  # attention's 4 w^2, the MLP's 2 m w^2
        flops = 3 * (2.0 * tokens * weights + 4.0 * tokens * config.context * w)  # fwd + bwd
        flops = flops if measured is None else measured[1 + i]
        nodes.append(p.Op(f"block{i}", "block", flops, 4.0 * weights, act))
    head = 3 * 2.0 * tokens * w * lm.VOCAB if measured is None else measured[-1]
    nodes.append(p.Op("head", "matmul", head, 4.0 * w, 4.0 * tokens))
    edges = [(i, i + 1, nodes[i].output_bytes) for i in range(len(nodes) - 1)]
    return p.OpGraph.build(f"lm{config.layers}x{w}", nodes, edges)


def cut(
    config: lm.LMConfig, stages: int, micro_batch: int, seconds: Sequence[float] | None = None
) -> Cut:
    """The partitioner's cut of the model into ``stages`` (exact DP over the
    chain), from the ops' FLOPs or, with ``seconds``, their measured times
    (:func:`profile`)."""
    if not 2 <= stages <= config.layers + 1:
        raise ValueError(f"{stages} stages for {config.layers} blocks: need 2 to layers + 1")
    p = atoll.partition
    graph = layer_graph(config, micro_batch, seconds)
    chips = p.Chiplets(stages, sram_bytes=1 << 40, flops_per_s=_FLOPS_PER_S, link_bytes_per_s=1e10)
    best = p.search(graph, chips, method="dp")
    assembled = _blocks_of([list(stage.nodes) for stage in best.stages], stages, config.layers)
    even = even_cut(config, stages)
    assignment = [0] + [s for s, bs in enumerate(even.blocks) for _ in bs] + [stages - 1]
    return Cut(assembled, best.throughput, p.throughput(graph, chips, assignment))


_FLOPS_PER_S = 1e12  # the partitioner's chips (measured seconds become FLOPs at it)


def profile(config: lm.LMConfig, micro_batch: int, repeats: int = 5) -> list[float]:
    """Measured seconds of the forward and backward of the embedding, each
    block and the head, for one micro-batch on this process's first device
    (medians of ``repeats``, after a compiling run). FLOPs miss what a block
    also spends (layer norms, softmax, small matmuls that run below peak):
    a cut from measured times balances the stages as they really run."""
    params = lm.init(config)
    tokens = jnp.asarray(lm.batch_at(0, config)[:micro_batch, :-1])
    x = params["wte"][tokens] + params["wpe"][: config.context]

    def embed(p: Any, t: Any) -> Any:
        return p["wte"][t] + p["wpe"][: t.shape[1]]

    def head(p: Any, h: Any) -> Any:
        return jnp.mean(lm._layer_norm(h, p["ln_f"]) @ p["wte"].T)

    def block(p: Any, h: Any) -> Any:
        return lm.block_forward(h, p, config.heads)

    ends = {"wte": params["wte"], "wpe": params["wpe"], "ln_f": params["ln_f"]}
    seconds = [_time_fwd_bwd(embed, ends, tokens, repeats)]
    seconds += [_time_fwd_bwd(block, b, x, repeats) for b in params["blocks"]]
    return [*seconds, _time_fwd_bwd(head, ends, x, repeats)]


def _time_fwd_bwd(fn: Any, params: Any, x: Any, repeats: int) -> float:
    """Median seconds of ``fn``'s forward and its gradients (jitted)."""
    import time

    def step(p: Any, h: Any) -> Any:
        out, pull = jax.vjp(lambda q: fn(q, h), p)
        return pull(jnp.ones_like(out))

    jitted = jax.jit(step)
    jax.block_until_ready(jitted(params, x))  # compiles
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        jax.block_until_ready(jitted(params, x))
        times.append(time.perf_counter() - began)
    return float(np.median(times))


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
def forward(p: dict[str, Any], x: Any, *, heads: int, first: bool, dtype: str = "float32") -> Any:
    """A stage's forward in ``dtype``: its blocks (after embedding the
    bytes, on the first). Activations leave in ``dtype``."""
    p = lm.cast(p, dtype)
    if first:
        x = p["wte"][x] + p["wpe"][: x.shape[1]]
    for block in p["blocks"]:
        x = lm.block_forward(x, block, heads)
    return x


def last(
    p: dict[str, Any], wte: Any, x: Any, targets: Any, *, heads: int, dtype: str = "float32"
) -> tuple[Any, ...]:
    """The last stage, forward and backward: the micro-batch's loss, the
    gradient for its input, its own parameters' and the head's ``wte``'s."""

    def loss(p: dict[str, Any], wte: Any, x: Any) -> Any:
        h = forward(p, x, heads=heads, first=False, dtype=dtype)
        h = lm._layer_norm(h, lm.cast(p["ln_f"], dtype))
        out = (h @ lm.cast(wte, dtype).T).astype(jnp.float32)
        logp = jax.nn.log_softmax(out, -1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

    value, (g_p, g_wte, dx) = jax.value_and_grad(loss, argnums=(0, 1, 2))(p, wte, x)
    return value, dx, g_p, g_wte


def backward(
    p: dict[str, Any], x: Any, dy: Any, *, heads: int, dtype: str = "float32"
) -> tuple[Any, Any]:
    """A middle stage's backward (recomputing its forward): the gradient for
    its input, and its parameters'."""
    _, vjp = jax.vjp(lambda p, x: forward(p, x, heads=heads, first=False, dtype=dtype), p, x)
    g_p, dx = vjp(dy)
    return dx, g_p


def backward_first(
    p: dict[str, Any], tokens: Any, dy: Any, *, heads: int, dtype: str = "float32"
) -> Any:
    """The first stage's backward: its parameters' gradient."""
    _, vjp = jax.vjp(lambda p: forward(p, tokens, heads=heads, first=True, dtype=dtype), p)
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
    heads, dtype, data = config.heads, config.dtype, P("data")
    fwd = [
        s.jit(
            functools.partial(forward, heads=heads, first=i == 0, dtype=dtype),
            in_specs=(None, data),
            out_specs=data,
            name=f"forward{i}",
        )
        for i, s in enumerate(slices[:-1])
    ]
    final = slices[-1].jit(
        functools.partial(last, heads=heads, dtype=dtype),
        in_specs=(None, None, data, data),
        out_specs=(P(), data, None, None),
        name="last",
    )
    back = [
        slices[0].jit(
            functools.partial(backward_first, heads=heads, dtype=dtype),
            in_specs=(None, data, data),
            out_specs=None,
            name="backward0",
        )
    ]
    back += [
        s.jit(
            functools.partial(backward, heads=heads, dtype=dtype),
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


Op = tuple[str, int, int]  # ("F" forward | "L" last stage | "B" backward, stage, micro-batch)
SCHEDULES = ("gpipe", "1f1b")


def schedule(stages: int, micro: int, kind: str = "gpipe") -> list[Op]:
    """The order a step's nodes are made in, which is each device's order of
    work (the island keeps it). ``gpipe``: every forward, then every
    backward. ``1f1b``: stage ``s`` runs ``stages - 1 - s`` forwards ahead,
    then alternates one forward and one backward, so at most ``stages - s``
    micro-batches' activations wait on it, not all of them (PipeDream-Flush)."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, not {kind!r}")
    per_stage = [_stage_order(s, stages, micro, kind) for s in range(stages - 1)]
    per_stage.append([("L", stages - 1, m) for m in range(micro)])
    out: list[Op] = []
    done: set[Op] = set()
    at = [0] * stages
    while len(out) < sum(len(ops) for ops in per_stage):
        moved = False
        for s, ops in enumerate(per_stage):
            if at[s] < len(ops) and _ready(ops[at[s]], stages, done):
                out.append(ops[at[s]])
                done.add(ops[at[s]])
                at[s] += 1
                moved = True
        if not moved:
            raise AssertionError(f"a {kind} schedule of {stages} x {micro} cannot go on")
    return out


def _stage_order(s: int, stages: int, micro: int, kind: str) -> list[Op]:
    if kind == "gpipe":
        return [("F", s, m) for m in range(micro)] + [("B", s, m) for m in range(micro)]
    ahead = min(micro, stages - 1 - s)
    order: list[Op] = [("F", s, m) for m in range(ahead)]
    for m in range(micro):
        if ahead + m < micro:
            order.append(("F", s, ahead + m))
        order.append(("B", s, m))
    return order


def _ready(op: Op, stages: int, done: set[Op]) -> bool:
    kind, s, m = op
    if kind == "F":
        return s == 0 or ("F", s - 1, m) in done
    if kind == "L":
        return ("F", stages - 2, m) in done
    later = ("L", stages - 1, m) if s == stages - 2 else ("B", s + 1, m)
    return later in done and ("F", s, m) in done


def step_program(stages: Stages, kind: str = "gpipe") -> atoll.Program:
    """One training step: ``(params, opt_states, inputs, targets) ->
    (params, opt_states, losses)``, a list entry per stage or micro-batch;
    its nodes made in :func:`schedule` ``kind``'s order."""
    count = len(stages.update)

    @atoll.program
    def pipeline_step(
        params: list[Any], opt_states: list[Any], inputs: list[Any], targets: list[Any]
    ) -> tuple[list[Any], list[Any], list[Any]]:
        micro = len(inputs)
        seen: dict[tuple[int, int], Any] = {}  # (stage, micro): its input, then its output
        made: dict[tuple[int, int], Any] = {}
        dys: dict[int, Any] = {}
        grads: list[dict[int, Any]] = [{} for _ in range(count)]
        losses: dict[int, Any] = {}
        head: dict[int, Any] = {}
        for kind_, s, m in schedule(count, micro, kind):
            if kind_ == "F":
                seen[s, m] = inputs[m] if s == 0 else made[s - 1, m]
                made[s, m] = stages.forward[s](params[s], seen[s, m])
            elif kind_ == "L":
                wte = params[0]["wte"]
                out = stages.last(params[-1], wte, made[count - 2, m], targets[m])
                losses[m], dys[m], grads[-1][m], head[m] = out
            elif s == 0:
                grads[0][m] = stages.backward[0](params[0], inputs[m], dys[m])
            else:
                dys[m], grads[s][m] = stages.backward[s](params[s], seen[s, m], dys[m])
        new_params, new_states = [], []
        for s in range(count):
            mine = [grads[s][m] for m in range(micro)]
            heads = [head[m] for m in range(micro)] if s == 0 else []
            p, o = stages.update[s](params[s], opt_states[s], mine, heads)
            new_params.append(p)
            new_states.append(o)
        return new_params, new_states, [losses[m] for m in range(micro)]

    return pipeline_step
