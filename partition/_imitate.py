"""Pre-training from the solver: the policy imitates CP-SAT's partitions.

REINFORCE alone (:func:`._rl.pretrain`) learns slowly from a reward that is
one number per whole partition. On the synthetic training set CP-SAT finds
the best partition of most cases in well under a second, so each node can
instead be told where it belongs: :func:`solver_labels` solves every training
case once (the bottleneck model of :mod:`._solver`), and :func:`imitate`
minimizes the cross-entropy between the policy's per-node logits and those
chiplets (behaviour cloning). RL then fine-tunes the imitating policy on a new
graph as before (:func:`._rl.finetune`).

Nothing here is asynchronous; labelling is CPU-bound CP-SAT, one worker per
solve, and training is one jitted gradient step per case.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._cost import IntArray, throughput
from ._dp import dp_split
from ._errors import RepairTimeout
from ._graph import OpGraph
from ._hardware import Chiplets
from ._policy import Params, Policy, encode, logits
from ._rl import Adam, TrainLog
from ._solver import solve_bottleneck

__all__ = ["imitate", "solver_labels"]

Progress = Callable[[int, int, float], None]


def solver_labels(
    cases: Sequence[tuple[OpGraph, Chiplets]],
    deterministic_s: float = 1.0,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[IntArray]:
    """The best partition CP-SAT finds for each case within ``deterministic_s``
    of its deterministic time (so the labels do not depend on the machine's
    load, and training stays reproducible); the best contiguous split where
    CP-SAT found no partition in that time or a slower one (a long unrolled
    RNN, say).

    ``progress(done, total, ratio)`` gets the running share of cases proved
    optimal.
    """
    labels: list[IntArray] = []
    proved = 0
    for i, (graph, chips) in enumerate(cases):
        label, optimal = _label(graph, chips, deterministic_s, seed)
        labels.append(label)
        proved += optimal
        if progress is not None:
            progress(i + 1, len(cases), proved / (i + 1))
    return labels


def _label(
    graph: OpGraph, chips: Chiplets, deterministic_s: float, seed: int
) -> tuple[IntArray, bool]:
    """CP-SAT's best partition, or the DP's split where CP-SAT found none in
    its time or a slower one; and whether CP-SAT proved it optimal."""
    try:
        found, stats = solve_bottleneck(graph, chips, 3600.0, seed, deterministic_s=deterministic_s)
    except RepairTimeout:
        split = dp_split(graph, chips)
        if split is None:
            raise
        return split, False
    found = np.asarray(found, dtype=np.int64)
    if not stats["optimal"]:
        split = dp_split(graph, chips)
        if split is not None and throughput(graph, chips, split) > throughput(graph, chips, found):
            return split, False
    return found, bool(stats["optimal"])


def _ce_loss(p: Params, enc: tuple[Any, ...], label: Any) -> tuple[Any, Any]:
    """The mean cross-entropy over real nodes, and (aux) the share of them
    whose argmax chiplet is the label's."""
    import jax
    import jax.numpy as jnp

    nodes, pairs, a_in, a_out, mask = enc
    logp = jax.nn.log_softmax(logits(p, nodes, pairs, a_in, a_out, mask), axis=-1)
    chosen = jnp.take_along_axis(logp, label[:, None], axis=-1)[:, 0]
    agree = ((jnp.argmax(logp, axis=-1) == label) * mask).sum() / mask.sum()
    return -(chosen * mask).sum() / mask.sum(), agree


_GRAD: dict[str, Callable[..., Any]] = {}


def _grad() -> Callable[..., Any]:
    if "g" not in _GRAD:
        import jax

        _GRAD["g"] = jax.jit(jax.value_and_grad(_ce_loss, has_aux=True))
    return _GRAD["g"]


def imitate(
    policy: Policy,
    cases: Sequence[tuple[OpGraph, Chiplets]],
    labels: Sequence[IntArray],
    steps: int,
    lr: float = 3e-3,
    seed: int = 0,
    progress: Progress | None = None,
) -> TrainLog:
    """Train ``policy`` in place for ``steps`` gradient steps, one case each
    (drawn at random), towards ``labels`` (one chiplet per node per case).

    The log's "best" is the step's agreement (before its update): the share
    of nodes whose argmax chiplet is the label's, and its "mean reward" the
    negative loss.
    """
    if len(cases) != len(labels):
        raise ValueError(f"{len(cases)} cases but {len(labels)} labels")
    rng = np.random.default_rng(seed)
    encs = [encode(g, c) for g, c in cases]
    padded = [_pad(label, enc.nodes.shape[0]) for label, enc in zip(labels, encs, strict=True)]
    adam, log, start = Adam(lr), TrainLog(), time.perf_counter()
    for step in range(steps):
        i = int(rng.integers(len(cases)))
        enc = encs[i]
        arrays = (enc.nodes, enc.pairs, enc.a_in, enc.a_out, enc.mask)
        (loss, agreed), grads = _grad()(policy.params, arrays, padded[i])
        policy.params = adam.step(policy.params, grads)
        agree = float(agreed)
        log.add(step + 1, agree, np.array([-float(loss)]), start)
        if progress is not None:
            progress(step + 1, steps, agree)
    return log


def _pad(label: IntArray, size: int) -> NDArray[np.int32]:
    out = np.zeros(size, np.int32)
    out[: len(label)] = label
    return out
