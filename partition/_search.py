"""``search``: one entry point for every method, all returning valid partitions."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._background import BackgroundSolve, spare_cores
from ._baselines import Progress, Tracker, random_search, simulated_annealing
from ._cost import IntArray, Partition, evaluate, valid_throughput
from ._dp import dp_split
from ._errors import InfeasibleError, RepairTimeout
from ._graph import OpGraph
from ._hardware import Chiplets
from ._lns import Overtime, lns_polish
from ._policy import Policy, encode
from ._repair import Repairer
from ._rl import finetune
from ._solver import solve_bottleneck, solver_step

__all__ = ["METHODS", "default_budget", "default_seconds", "policy_hint", "search"]

METHODS = ("rl", "sa", "random", "solver", "dp")
# RL as shipped ends fine-tuning once this many evaluations pass without a
# gain of half a percent, and hands the rest of the budget to the solver's
# windows: on a 1,000-op GRU fine-tuning spent 260 s (two thirds of the
# search) repairing samples for a 5% gain, the windows then 130 s for 73%
PATIENCE = 24
SECONDS_PER_OP = 0.3  # when the plain call's windows end, per node of the graph


def search(
    graph: OpGraph,
    chiplets: Chiplets | int,
    method: str = "rl",
    budget: int | None = None,
    policy: Policy | Sequence[Policy] | None = None,
    seed: int = 0,
    *,
    progress: Progress | None = None,
    time_limit_s: float = 30.0,
    repair_time_limit_s: float | None = None,
    rl_hint: bool = True,
    rl_imitate: bool = False,
    rl_local: int = 2,
    rl_solver_s: float = 2.0,
    rl_lns: float = 0.5,
    rl_background: bool = True,
    solver_hint: bool = False,
    stop_at: float | None = None,
) -> Partition:
    """Partition ``graph`` onto ``chiplets`` with ``method``; the result is always valid.

    ``budget`` is the number of evaluated (repaired) partitions for ``rl``,
    ``sa`` and ``random`` (None: :func:`default_budget`, 64, more on graphs of
    more than 192 ops; for ``rl`` the solver's windows then end at
    :func:`default_seconds`, and until then the budget stretches while they
    still gain, see :class:`._lns.Overtime`; a budget given is exact).
    ``solver`` runs CP-SAT on the bottleneck for ``time_limit_s`` instead,
    and ``dp`` is a single exact split of the topological order.
    ``rl`` fine-tunes ``policy`` on this graph, in place. Given several, it
    evaluates the greedy assignment of each and trains the first, with the
    parameters of the one that scored best; None means copies
    of the shipped set (:meth:`Policy.pretrained_set`). With ``rl_hint`` the
    DP's split (the solver's hint) is evaluated after those
    greedy assignments; with ``rl_imitate`` every update
    also credits the best partition found so far (self-imitation); with
    ``rl_local`` each batch of 8 samples is followed by an annealed walk of at
    least that many local moves from the best partition so far, longer while
    the walk pays better than the samples (a local search beside the policy,
    :class:`._rl.LocalWalk`). With
    ``rl_solver_s`` (deterministic seconds, see :func:`._solver.solver_step`; 0 turns it
    off) a short CP-SAT run seeds the search (its partition is the first
    evaluation) and another, started from the best partition RL found,
    polishes it; then CP-SAT re-solves windows of a few chiplets around the
    slowest stage, one evaluation each, on ``rl_lns`` of the budget
    (:mod:`._lns`; 0 turns it off), which also get what fine-tuning leaves
    when it stalls (:data:`PATIENCE`): see :func:`_rl_search`. With
    ``rl_background`` (the default) and more than one core, a whole-graph
    CP-SAT solve runs in a thread beside those windows, and they take what
    it finds (:mod:`._background`): wall-clock dependent, so turn it off
    for results that repeat run to run. With
    ``solver_hint`` the ``solver`` starts from the policy's greedy assignment,
    repaired (:func:`policy_hint`).
    ``stop_at`` ends a budgeted search as soon as its best reaches that
    throughput. A bare chiplet count means :meth:`Chiplets.default_for` the
    graph. Raises :class:`InfeasibleError` when no valid partition exists.
    """
    chips = Chiplets.default_for(graph, chiplets) if isinstance(chiplets, int) else chiplets
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    overtime = None
    if budget is None:
        budget = default_budget(graph)
        # gains come in bursts: with a patience of 24 a WaveNet on a ring of 32 (steps
        # of 0.4 s) stopped 56 evaluations past its budget, up 3.7% in its last 30 s
        if stop_at is None:
            overtime = Overtime(default_seconds(graph), max(PATIENCE, budget // 4))
    if budget < 1:
        raise ValueError(f"budget must be at least 1, got {budget}")
    if not 0.0 <= rl_lns <= 1.0:
        raise ValueError(f"rl_lns is a share of the budget, in [0, 1]; got {rl_lns}")
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    repairer = Repairer(graph, chips, repair_time_limit_s)
    tracker = Tracker(graph, chips, repairer, budget, progress, stop_at)
    hint = dp_split(graph, chips) if method == "rl" and rl_hint else None
    extra: dict[str, Any] = {}
    if method == "random":
        random_search(tracker, rng)
    elif method == "sa":
        simulated_annealing(tracker, rng)
    elif method == "rl":
        pols = Policy.pretrained_set() if policy is None else _policies(policy)
        tune = functools.partial(
            finetune, pols[0], rng=rng, hint=hint, imitate=rl_imitate, rivals=pols[1:]
        )
        windows = rl_solver_s > 0 and rl_lns > 0  # they take what fine-tuning leaves
        tuned = functools.partial(tune, local=rl_local, patience=PATIENCE if windows else None)
        _rl_search(tracker, tuned, rl_solver_s, seed, rl_lns, rl_background, overtime)
    elif method == "solver":
        start_from = policy_hint(policy, repairer) if solver_hint else None
        assignment, extra = _solver(repairer, time_limit_s, seed, start_from)
        if start_from is not None:
            extra["hint_throughput"] = valid_throughput(graph, chips, start_from)
        tracker.evaluate(assignment)
    else:
        split = dp_split(graph, chips)
        if split is None:  # no contiguous split fits: repair an even one instead
            split = np.minimum(np.arange(len(graph)) * chips.count // len(graph), chips.count - 1)
        tracker.evaluate(split)
    extra["history_wall_s"] = tuple(tracker.times)
    if tracker.best is None:
        raise InfeasibleError(f"{method} found no valid partition of {graph.name!r}")
    return evaluate(
        graph,
        chips,
        tracker.best,
        method=method,
        evaluations=len(tracker.history),
        wall_s=time.perf_counter() - start,
        history=tuple(tracker.history),
        extra=extra,
    )


def _policies(policy: Policy | Sequence[Policy]) -> list[Policy]:
    pols = [policy] if isinstance(policy, Policy) else list(policy)
    if not pols:
        raise ValueError("policy: give a Policy, a sequence of them, or None (the shipped set)")
    return pols


def default_budget(graph: OpGraph) -> int:
    """The evaluations a search gets by default: 64 up to 192 ops; beyond, a
    third of the ops (333 at 1,000 ops), but no more than 333,000 / ops
    (111 at 3,000 ops), since an evaluation costs more the larger the graph.
    On a GRU of 1,000 ops at 8 chiplets RL as shipped ended 19% short of the
    best known with 64 evaluations, 2.6% short with 250, and reached it with
    333: its solver's windows need that many steps (``docs/partition.md``,
    at production scale). Graphs whose optimum the solver proves stop sooner."""
    n = max(len(graph), 1)
    return max(64, min(n // 3, 333_000 // n))


def default_seconds(graph: OpGraph) -> float:
    """When the plain call's windows end, within its default budget or past it
    while they still gain: :data:`SECONDS_PER_OP` a node (5 minutes at
    1,000 ops, 15 at 3,000). On a WaveNet of 1,000 ops on a ring of 32
    chiplets the default budget's evaluations took 94 to 99 s, and its best
    had risen 8% in the last 30; on a GRU of 1,000 ops on a ring of 16 they
    took 407 s (``docs/partition.md``)."""
    return SECONDS_PER_OP * max(len(graph), 1)


def _solver(
    repairer: Repairer, time_limit_s: float, seed: int, hint: IntArray | None
) -> tuple[IntArray, dict[str, Any]]:
    """CP-SAT on the bottleneck; where it finds no partition in ``time_limit_s``,
    a valid one known (the best contiguous split), marked ``fell_back`` in
    the statistics, rather than an error (the search never fails where a
    valid partition exists)."""
    graph, chips = repairer.graph, repairer.chiplets
    try:
        return solve_bottleneck(graph, chips, time_limit_s, seed, hint)
    except RepairTimeout:
        known = repairer.fallback()  # RepairTimeout again when none is known
    stats = {
        "optimal": False,
        "fell_back": True,
        "bound_s": 0.0,
        "objective_s": 1.0 / valid_throughput(graph, chips, known),
        "solve_s": time_limit_s,
        "deterministic_s": 0.0,
    }
    return known, stats


def _rl_search(
    tracker: Tracker,
    tune: Callable[[Tracker], Any],
    solver_s: float,
    seed: int,
    lns_share: float = 0.0,
    background: bool = False,
    overtime: Overtime | None = None,
) -> None:
    """RL as shipped: the solver's seed, fine-tuning (``tune``), then the solver's
    polish, each solver run ``solver_s`` deterministic seconds and one evaluation,
    then the large-neighbourhood polish (:func:`._lns.lns_polish`) on
    ``lns_share`` of the budget; with ``background``, and a spare core, beside
    a whole-graph CP-SAT solve from the polished partition
    (:class:`._background.BackgroundSolve`) whose finds the windows take;
    with an ``overtime``, the windows may run past the budget.

    The polish is CP-SAT started from the best partition fine-tuning found (the
    policy's result as the solver's hint); fine-tuning stops short of the
    budget to leave room for the polishes. ``solver_s = 0``: fine-tuning alone.
    """
    solver = solver_s > 0 and tracker.budget > 2  # a greedy assignment comes too
    reserve = 1 + int(lns_share * tracker.budget) if solver else 0
    # the seed and the first greedy assignment before it; at small budgets the
    # set's other greedy assignments and the DP's split may find no room
    reserve = max(0, min(reserve, tracker.budget - 2))
    if solver:
        start, _ = solver_step(tracker.graph, tracker.chiplets, solver_s, seed=seed)
        if start is not None:
            tracker.evaluate(start)
    tracker.held = reserve
    tune(tracker)
    tracker.held = 0
    if not solver or tracker.left <= 0 or tracker.best is None:
        return
    best = tracker.best
    polished, _ = solver_step(tracker.graph, tracker.chiplets, solver_s, best, seed)
    tracker.evaluate(polished if polished is not None else best)
    rng, cores = np.random.default_rng(seed), spare_cores() if background else 0
    if cores == 0 or tracker.left <= 1:
        lns_polish(tracker, rng, seed, overtime=overtime)
        return
    with BackgroundSolve(tracker.graph, tracker.chiplets, tracker.best, seed, cores) as whole:
        lns_polish(tracker, rng, seed, background=whole, overtime=overtime)


def policy_hint(policy: Policy | Sequence[Policy] | None, repairer: Repairer) -> IntArray | None:
    """The policy's greedy (argmax) assignment, repaired: the solver's hint.
    Of several policies (None means the shipped set, as for ``rl``), the
    greedy assignment whose repaired partition scores best. None when every
    repair times out and falls back to a known partition (a fallback is not
    the policy's): the solver then starts without one."""
    pols = Policy.pretrained_set() if policy is None else _policies(policy)
    enc = encode(repairer.graph, repairer.chiplets)
    best: tuple[float, IntArray] | None = None
    for pol in pols:
        fallbacks = repairer.fallbacks
        try:
            hint = repairer(np.argmax(pol.logits(enc), axis=-1).astype(np.int64))
        except RepairTimeout:
            continue
        if repairer.fallbacks > fallbacks:
            continue
        value = valid_throughput(repairer.graph, repairer.chiplets, hint)
        if best is None or value > best[0]:
            best = (value, hint)
    return None if best is None else best[1]
