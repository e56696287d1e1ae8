"""``search``: one entry point for every method, all returning valid partitions."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ._baselines import Progress, Tracker, random_search, simulated_annealing
from ._cost import Partition, evaluate
from ._dp import dp_split
from ._graph import OpGraph
from ._hardware import Chiplets
from ._policy import Policy
from ._repair import InfeasibleError, Repairer
from ._rl import finetune
from ._solver import solve_bottleneck

__all__ = ["METHODS", "search"]

METHODS = ("rl", "sa", "random", "solver", "dp")


def search(
    graph: OpGraph,
    chiplets: Chiplets | int,
    method: str = "rl",
    budget: int = 64,
    policy: Policy | None = None,
    seed: int = 0,
    *,
    progress: Progress | None = None,
    time_limit_s: float = 30.0,
    repair_time_limit_s: float = 5.0,
    rl_hint: bool = True,
    rl_imitate: bool = False,
) -> Partition:
    """Partition ``graph`` onto ``chiplets`` with ``method``; the result is always valid.

    ``budget`` is the number of evaluated (repaired) partitions for ``rl``,
    ``sa`` and ``random``. ``solver`` runs CP-SAT on the bottleneck for
    ``time_limit_s`` instead, and ``dp`` is a single exact split of the
    topological order. ``rl`` fine-tunes ``policy`` (a copy of the shipped
    pre-trained one, :meth:`Policy.pretrained`, when None) on this graph; the
    policy object is trained in place. With ``rl_hint`` its second evaluation
    is the DP's split (the solver's hint); with ``rl_imitate`` every update
    also credits the best partition found so far (self-imitation). A bare
    chiplet count means :meth:`Chiplets.default_for` the graph. Raises
    :class:`InfeasibleError` when no valid partition exists.
    """
    chips = Chiplets.default_for(graph, chiplets) if isinstance(chiplets, int) else chiplets
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    if budget < 1:
        raise ValueError(f"budget must be at least 1, got {budget}")
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    tracker = Tracker(graph, chips, Repairer(graph, chips, repair_time_limit_s), budget, progress)
    hint = dp_split(graph, chips) if method == "rl" and rl_hint else None
    extra: dict[str, Any] = {}
    if method == "random":
        random_search(tracker, rng)
    elif method == "sa":
        simulated_annealing(tracker, rng)
    elif method == "rl":
        pol = policy if policy is not None else Policy.pretrained()
        finetune(pol, tracker, rng, hint=hint, imitate=rl_imitate)
    elif method == "solver":
        assignment, extra = solve_bottleneck(graph, chips, time_limit_s, seed=seed)
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
