"""Training the policy: REINFORCE with a batch-mean baseline, Adam, plain JAX.

Each step samples a batch of candidate assignments from the policy's
per-node logits, repairs every one with the shared CP-SAT step, and rewards
each with the log-throughput of its repaired partition. The repair is part of
the environment; the action credited is the candidate the policy emitted.
(Crediting the repaired assignment instead was tried: the policy collapsed
onto one chiplet, whose repairs it then imitated.) The advantage is the
reward minus the batch mean, over the batch's standard deviation. A small
entropy bonus keeps the policy exploring.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._baselines import Tracker
from ._cost import IntArray, throughput
from ._graph import Graph
from ._hardware import Chiplets
from ._policy import Encoded, Params, Policy, encode, logits
from ._repair import Repairer, RepairTimeout

__all__ = ["Adam", "TrainLog", "finetune", "pretrain"]

ENTROPY = 1e-3  # weight of the entropy bonus (1e-2 was tried: no better on BERT)


@dataclass
class Adam:
    """The Adam optimizer over a flat parameter dict, in numpy."""

    lr: float = 3e-3
    b1: float = 0.9
    b2: float = 0.999
    t: int = 0
    m: dict[str, NDArray[np.float32]] = field(default_factory=dict)
    v: dict[str, NDArray[np.float32]] = field(default_factory=dict)

    def step(self, params: Params, grads: Params) -> Params:
        """Return updated parameters."""
        self.t += 1
        new: Params = {}
        for k, grad in grads.items():
            g: NDArray[np.float32] = np.asarray(grad, dtype=np.float32)
            self.m[k] = self.b1 * self.m.get(k, np.zeros_like(g)) + (1 - self.b1) * g
            self.v[k] = self.b2 * self.v.get(k, np.zeros_like(g)) + (1 - self.b2) * g * g
            mh = self.m[k] / (1 - self.b1**self.t)
            vh = self.v[k] / (1 - self.b2**self.t)
            new[k] = (np.asarray(params[k]) - self.lr * mh / (np.sqrt(vh) + 1e-8)).astype(
                np.float32
            )
        return new


@dataclass
class TrainLog:
    """What training did: evaluations so far, best throughput and wall time at each step."""

    evaluations: list[int] = field(default_factory=list)
    best: list[float] = field(default_factory=list)
    mean_reward: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)


def _loss(p: Params, enc: tuple[Any, ...], actions: Any, adv: Any, ent_coef: float) -> Any:
    import jax
    import jax.numpy as jnp

    nodes, pairs, a_in, a_out, mask = enc
    logp = jax.nn.log_softmax(logits(p, nodes, pairs, a_in, a_out, mask), axis=-1)
    chosen = jnp.take_along_axis(logp[None], actions[..., None], axis=-1)[..., 0]
    count = mask.sum()
    entropy = (-(jnp.exp(logp) * logp).sum(-1) * mask).sum() / count
    return -(adv * (chosen * mask).sum(-1)).mean() / count - ent_coef * entropy


_GRAD: dict[str, Callable[..., Any]] = {}


def _grad() -> Callable[..., Any]:
    if "g" not in _GRAD:
        import jax

        _GRAD["g"] = jax.jit(jax.grad(_loss), static_argnums=(4,))
    return _GRAD["g"]


def sample(policy: Policy, enc: Encoded, k: int, rng: np.random.Generator) -> IntArray:
    """``k`` candidate assignments drawn from the policy (Gumbel-max per node)."""
    lg = policy.logits(enc)
    drawn: IntArray = np.argmax(lg[None] + rng.gumbel(size=(k, *lg.shape)), axis=-1)
    return drawn.astype(np.int64)


def update(
    policy: Policy, adam: Adam, enc: Encoded, cands: IntArray, rewards: NDArray[np.float64]
) -> None:
    """One REINFORCE step on a batch of candidates and their rewards."""
    if len(rewards) < 2 or float(rewards.std()) < 1e-12:
        return
    adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-8)).astype(np.float32)
    actions = np.zeros((len(cands), enc.nodes.shape[0]), np.int32)
    actions[:, : enc.n] = cands
    arrays = (enc.nodes, enc.pairs, enc.a_in, enc.a_out, enc.mask)
    grads = _grad()(policy.params, arrays, actions, adv, ENTROPY)
    policy.params = adam.step(policy.params, grads)


def finetune(
    policy: Policy, tracker: Tracker, rng: np.random.Generator, batch: int = 8, lr: float = 3e-3
) -> TrainLog:
    """Train ``policy`` on one graph until the tracker's budget is spent.

    The first evaluation is the policy's greedy (argmax) assignment, so a
    pre-trained policy is scored on what it already knows.
    """
    enc, adam, log = encode(tracker.graph, tracker.chiplets), Adam(lr), TrainLog()
    start = time.perf_counter()
    tracker.evaluate(np.argmax(policy.logits(enc), axis=-1).astype(np.int64))
    while tracker.left > 0:
        cands = sample(policy, enc, min(batch, tracker.left), rng)
        rewards = np.log([max(tracker.evaluate(c)[1], 1e-30) for c in cands])
        update(policy, adam, enc, cands, rewards)
        policy.trained_evaluations += len(cands)
        log.evaluations.append(len(tracker.history))
        log.best.append(tracker.best_tp)
        log.mean_reward.append(float(rewards.mean()))
        log.wall_s.append(time.perf_counter() - start)
    return log


def pretrain(
    policy: Policy,
    cases: Sequence[tuple[Graph, Chiplets]],
    evaluations: int,
    seed: int = 0,
    batch: int = 8,
    lr: float = 3e-3,
    progress: Callable[[int, int, float], None] | None = None,
) -> TrainLog:
    """Train ``policy`` across many graphs for about ``evaluations`` repaired samples.

    The logged "best" is the batch's mean throughput relative to the best seen
    on that graph, a size-free measure of how good the policy's samples are.
    """
    rng = np.random.default_rng(seed)
    encs = [encode(g, c) for g, c in cases]
    repairers = [Repairer(g, c, time_limit_s=2.0) for g, c in cases]
    best = [0.0] * len(cases)
    adam, log, done, start = Adam(lr), TrainLog(), 0, time.perf_counter()
    while done < evaluations:
        i = int(rng.integers(len(cases)))
        g, ch = cases[i]
        cands = sample(policy, encs[i], batch, rng)
        tps = np.array([_score(g, ch, repairers[i], c) for c in cands])
        best[i] = max(best[i], float(tps.max()))
        update(policy, adam, encs[i], cands, np.log(np.maximum(tps, 1e-30)))
        done += len(cands)
        policy.trained_evaluations += len(cands)
        log.evaluations.append(done)
        log.best.append(float(tps.mean() / best[i]))
        log.mean_reward.append(float(np.log(tps).mean()))
        log.wall_s.append(time.perf_counter() - start)
        if progress is not None:
            progress(min(done, evaluations), evaluations, log.best[-1])
    return log


def _score(graph: Graph, chiplets: Chiplets, repairer: Repairer, candidate: Any) -> float:
    """Throughput of the repaired candidate; 0 when its repair timed out."""
    try:
        return throughput(graph, chiplets, repairer(candidate))
    except RepairTimeout:
        return 0.0
