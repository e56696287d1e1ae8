"""Training the policy: REINFORCE with a batch-mean baseline, Adam, plain JAX.

Each step samples a batch of candidate assignments from the policy's
per-node logits, repairs every one with the shared step (an LP, then
CP-SAT), and rewards each with the log-throughput of its repaired partition. The repair is part of
the environment; the action credited is the candidate the policy emitted.
(Crediting the repaired assignment instead was tried: the policy collapsed
onto one chiplet, whose repairs it then imitated.) The advantage is the
reward minus the batch mean, over the batch's standard deviation. A small
entropy bonus keeps the policy exploring.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._baselines import (
    Stall,
    Tracker,
    _local_neighbour,
    accept,
    anneal_temperature,
    log_gain,
    score,
)
from ._cost import IntArray
from ._graph import OpGraph
from ._hardware import Chiplets
from ._policy import Encoded, Params, Policy, encode, logits
from ._repair import Repairer

__all__ = ["Adam", "LocalWalk", "TrainLog", "finetune", "pretrain"]

ENTROPY = 1e-3  # weight of the entropy bonus (1e-2 was tried: no better on BERT)
MAX_TEMPERATURE = 16.0  # sampling temperature cap while fine-tuning is stuck
MAX_LOCAL = 64  # the most local moves after one batch (see LocalWalk)


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

    def add(
        self, evaluations: int, best: float, rewards: NDArray[np.float64], start: float
    ) -> None:
        """Record one training step (``start``: the ``time.perf_counter`` training began at)."""
        self.evaluations.append(evaluations)
        self.best.append(best)
        self.mean_reward.append(float(rewards.mean()))
        self.wall_s.append(time.perf_counter() - start)


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


def sample(
    policy: Policy, enc: Encoded, k: int, rng: np.random.Generator, temperature: float = 1.0
) -> IntArray:
    """``k`` candidate assignments drawn from the policy (Gumbel-max per node), its
    logits divided by ``temperature``."""
    lg = policy.logits(enc) / temperature
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


def _train_step(
    policy: Policy,
    adam: Adam,
    enc: Encoded,
    batch: int,
    rng: np.random.Generator,
    score_fn: Callable[[IntArray], float],
    best: tuple[IntArray, float] | None = None,
    temperature: float = 1.0,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Sample ``batch`` candidates, score each, take one REINFORCE step.

    ``best`` (an assignment and its throughput, not re-evaluated) joins the
    update as one more action: self-imitation of the incumbent. Returns the
    throughputs and the rewards (their logs, floored for a 0) of the samples.
    """
    cands = sample(policy, enc, batch, rng, temperature)
    tps = np.array([score_fn(c) for c in cands], dtype=np.float64)
    rewards: NDArray[np.float64] = np.log(np.maximum(tps, 1e-30))
    if best is None:
        update(policy, adam, enc, cands, rewards)
    else:
        extra = np.log(max(best[1], 1e-30))
        update(policy, adam, enc, np.vstack([cands, best[0]]), np.append(rewards, extra))
    policy.trained_evaluations += len(cands)
    return tps, rewards


@dataclass
class LocalWalk:
    """RL's local search beside the policy: after each batch of samples, a short
    annealed walk of ``moves`` local moves from the best partition so far.

    Each move is :func:`._baselines._local_neighbour` of the walk's current
    partition; a move that loses is still taken with SA's probability, at SA's
    temperature for the share of the search's budget spent (falling from 0.05
    to 0.002 in log-throughput), so a walk can cross a ridge that climbing
    from the best cannot. Every walk starts again from the best partition
    found, by the walk or by the samples. After each batch the length adapts,
    a bandit between the two ways of spending evaluations: it doubles (up to
    :data:`MAX_LOCAL`) when the walk raised the best more per evaluation than
    the batch's samples did, and halves (down to ``floor``) when the samples
    did better. Every move is one evaluation of the tracker's budget; none
    enters the policy's update.
    """

    floor: int
    steps: int = 1  # evaluations the schedule spans (fine-tuning's share of the budget)
    moves: int = field(init=False)  # the next walk's length: ``floor`` at first

    def __post_init__(self) -> None:
        self.moves = self.floor

    def walk(
        self, tracker: Tracker, rng: np.random.Generator, stop: Callable[[], bool] | None = None
    ) -> float:
        """Take up to ``moves`` moves, fewer once ``stop()`` says so (fine-tuning's
        patience ran out); returns the best's log-gain per evaluation."""
        assert tracker.best is not None  # the greedy evaluation came first
        cur, cur_tp, before, taken = tracker.best, tracker.best_tp, tracker.best_tp, 0
        while taken < self.moves and tracker.left > 0 and not (stop is not None and stop()):
            temp = anneal_temperature(1.0 - tracker.left / self.steps)
            cand, tp = tracker.evaluate(_local_neighbour(tracker.graph, tracker.chiplets, cur, rng))
            if accept(tp, cur_tp, temp, rng):
                cur, cur_tp = cand, tp
            taken += 1
        return log_gain(before, tracker.best_tp) / max(taken, 1)

    def adapt(self, sampled: float, walked: float) -> None:
        """Lengthen the next walk when it paid better per evaluation than the
        samples (``sampled``, ``walked``: the best's log-gain per evaluation)."""
        if walked > sampled:
            self.moves = min(2 * self.moves, MAX_LOCAL)
        elif sampled > walked:
            self.moves = max(self.moves // 2, self.floor)


def finetune(
    policy: Policy,
    tracker: Tracker,
    rng: np.random.Generator,
    batch: int = 8,
    lr: float = 3e-3,
    hint: IntArray | None = None,
    imitate: bool = False,
    local: int = 0,
    patience: int | None = None,
    rivals: Sequence[Policy] = (),
) -> TrainLog:
    """Train ``policy`` on one graph until the tracker's budget is spent.

    The first evaluation is the policy's greedy (argmax) assignment, so a
    pre-trained policy is scored on what it already knows; with ``rivals``
    (other pre-trained policies) each one's greedy assignment comes next, and
    ``policy`` takes the parameters of the one whose assignment scored best
    (the first of equals) before it trains. A ``hint`` (e.g. the DP's split)
    is evaluated after them, counted in the budget like any other. With
    ``imitate`` each update also credits the best valid assignment found so far
    with its reward (self-imitation; tried, no better, off by default).
    Sampling heats up while a batch's rewards are all equal (see
    :func:`_next_temperature`). With ``local`` each batch is followed by an
    annealed walk of at least that many local moves from the best partition
    so far, whose length adapts to how well it pays (:class:`LocalWalk`): a
    local search beside the policy, within the same budget. With ``patience``
    it stops early, leaving the rest of the budget, once that many
    evaluations have passed without raising the best by :data:`._baselines.STALLED`
    (RL as shipped then hands the rest to the solver's windows).
    """
    enc, adam, log = encode(tracker.graph, tracker.chiplets), Adam(lr), TrainLog()
    start = time.perf_counter()
    _take_best_greedy(policy, rivals, enc, tracker)
    if hint is not None and tracker.left > 0:
        tracker.evaluate(hint)

    def score_fn(candidate: IntArray) -> float:
        return tracker.evaluate(candidate)[1]

    temp, walker = 1.0, LocalWalk(floor=local, steps=max(tracker.left, 1))
    stall = Stall(tracker, patience)
    while tracker.left > 0 and not stall.stalled():
        best = (tracker.best, tracker.best_tp) if imitate and tracker.best is not None else None
        k, before = min(batch, tracker.left), tracker.best_tp
        _, rewards = _train_step(policy, adam, enc, k, rng, score_fn, best, temp)
        temp = _next_temperature(temp, rewards)
        if local > 0 and tracker.left > 0:
            sampled = log_gain(before, tracker.best_tp) / k
            walker.adapt(sampled, walker.walk(tracker, rng, stall.stalled))
        log.add(len(tracker.history), tracker.best_tp, rewards, start)
    return log


def _take_best_greedy(
    policy: Policy, rivals: Sequence[Policy], enc: Encoded, tracker: Tracker
) -> None:
    """Evaluate the greedy assignment of ``policy`` and of each rival (while
    the budget lasts); ``policy`` takes the parameters of the best. A repair
    that ran out of time returns a partition known already, not the policy's:
    it does not count."""
    best_tp, best = -1.0, policy
    for candidate in (policy, *rivals):
        if tracker.left <= 0:
            break
        fallbacks = tracker.repairer.fallbacks
        tp = tracker.evaluate(np.argmax(candidate.logits(enc), axis=-1).astype(np.int64))[1]
        if tracker.repairer.fallbacks > fallbacks:
            continue
        if tp > best_tp:
            best_tp, best = tp, candidate
    if best is not policy:
        policy.params = {k: v.copy() for k, v in best.params.items()}
        policy.trained_evaluations = best.trained_evaluations


def _next_temperature(temp: float, rewards: NDArray[np.float64]) -> float:
    """Heat up while every sample of a batch scores the same (the policy has
    collapsed: all its candidates repair to one partition, REINFORCE has no
    signal); cool back towards 1 once the batch's rewards spread again."""
    if len(rewards) > 1 and float(rewards.std()) < 1e-9:
        return min(temp * 2.0, MAX_TEMPERATURE)
    return max(temp / 2.0, 1.0)


def pretrain(
    policy: Policy,
    cases: Sequence[tuple[OpGraph, Chiplets]],
    evaluations: int,
    seed: int = 0,
    batch: int = 8,
    lr: float = 3e-3,
    progress: Callable[[int, int, float], None] | None = None,
) -> TrainLog:
    """Train ``policy`` across many graphs for about ``evaluations`` repaired samples.

    The logged "best" is the batch's mean throughput relative to the best seen
    on that graph, a size-free measure of how good the policy's samples are
    (0 while every repair on that graph has timed out). A candidate whose
    repair times out scores 0.
    """
    rng = np.random.default_rng(seed)
    encs = [encode(g, c) for g, c in cases]
    scorers = [
        functools.partial(_throughput, g, c, Repairer(g, c, time_limit_s=2.0)) for g, c in cases
    ]
    best = [0.0] * len(cases)
    adam, log, done, start = Adam(lr), TrainLog(), 0, time.perf_counter()
    while done < evaluations:
        i = int(rng.integers(len(cases)))
        tps, rewards = _train_step(policy, adam, encs[i], batch, rng, scorers[i])
        best[i] = max(best[i], float(tps.max()))
        done += len(tps)
        log.add(done, float(tps.mean()) / best[i] if best[i] > 0 else 0.0, rewards, start)
        if progress is not None:
            progress(min(done, evaluations), evaluations, log.best[-1])
    return log


def _throughput(
    graph: OpGraph, chiplets: Chiplets, repairer: Repairer, candidate: IntArray
) -> float:
    """Throughput of the repaired candidate; 0 when its repair timed out."""
    return score(graph, chiplets, repairer, candidate)[1]
