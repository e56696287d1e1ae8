"""Baselines at an equal budget of evaluated (repaired) partitions.

Each evaluation is one candidate, repaired by the shared CP-SAT step, then
scored by the cost model. ``Tracker`` keeps the best so far and the curve.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._cost import IntArray, valid_throughput
from ._graph import OpGraph
from ._hardware import Chiplets
from ._repair import Repairer, RepairTimeout

__all__ = ["Progress", "Tracker", "random_search", "score", "simulated_annealing"]

Progress = Callable[[int, int, float], None]


def score(
    graph: OpGraph, chiplets: Chiplets, repairer: Repairer, candidate: Any, *, strict: bool = False
) -> tuple[IntArray | None, float]:
    """Repair ``candidate`` and score it: (the repaired assignment, its throughput).

    A repair is valid, so its validity is not checked again. When the repair
    times out the result is ``(None, 0.0)``, or with ``strict`` the
    :class:`RepairTimeout` is raised.
    """
    try:
        fixed = repairer(candidate)
    except RepairTimeout:
        if strict:
            raise
        return None, 0.0
    return fixed, valid_throughput(graph, chiplets, fixed)


@dataclass
class Tracker:
    """Counts evaluations, keeps the best valid assignment and its history.

    With ``stop_at`` the search ends early, as soon as its best reaches that
    throughput (the transfer benchmark's "time to reach" runs).
    """

    graph: OpGraph
    chiplets: Chiplets
    repairer: Repairer
    budget: int
    progress: Progress | None = None
    stop_at: float | None = None
    best: IntArray | None = None
    history: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    @property
    def left(self) -> int:
        """Evaluations still allowed (none once the best reaches ``stop_at``)."""
        if self.stop_at is not None and self.history and self.best_tp >= self.stop_at:
            return 0
        return self.budget - len(self.history)

    @property
    def best_tp(self) -> float:
        """The best throughput so far (0.0 before the first evaluation)."""
        return self.history[-1] if self.history else 0.0

    def evaluate(self, candidate: IntArray) -> tuple[IntArray, float]:
        """Repair ``candidate``, score it, record it; returns (repaired, throughput).

        A candidate whose repair times out scores 0 (the best so far stands in
        for it) once some valid partition is known; before that the timeout
        is raised, since there is nothing valid to return.
        """
        fixed, tp = score(
            self.graph, self.chiplets, self.repairer, candidate, strict=self.best is None
        )
        if fixed is None:  # timed out: not strict, so a best is known
            assert self.best is not None
            fixed = self.best
        if tp > self.best_tp:
            self.best = fixed
        self.history.append(max(tp, self.best_tp))
        self.times.append(time.perf_counter() - self.started)
        if self.progress is not None:
            self.progress(len(self.history), self.budget, self.best_tp)
        return fixed, tp


def random_search(t: Tracker, rng: np.random.Generator) -> None:
    """Uniformly random candidates, each repaired."""
    n, c = len(t.graph), t.chiplets.count
    while t.left > 0:
        t.evaluate(rng.integers(0, c, n))


def _neighbour(a: IntArray, c: int, rng: np.random.Generator) -> IntArray:
    """Shift one boundary: move the last few nodes of chip k to k + 1, or the
    first few of chip k + 1 to k (repair fixes whatever this breaks)."""
    b = a.copy()
    k = int(rng.integers(0, max(c - 1, 1)))
    if rng.random() < 0.5:
        idx, to = np.flatnonzero(a == k)[::-1], min(k + 1, c - 1)
    else:
        idx, to = np.flatnonzero(a == k + 1), k
    if len(idx) > 1:
        b[idx[: int(rng.integers(1, max(2, len(idx) // 3) + 1))]] = to
    return b


def simulated_annealing(
    t: Tracker, rng: np.random.Generator, t0: float = 0.05, t1: float = 0.002
) -> None:
    """Metropolis on log-throughput, temperature falling geometrically from t0 to t1."""
    c = t.chiplets.count
    cur, cur_tp = t.evaluate(rng.integers(0, c, len(t.graph)))
    steps = t.left  # the start above was the first of the budget
    for step in range(steps):
        if t.left <= 0:  # reached ``stop_at``
            break
        temp = t0 * (t1 / t0) ** (step / steps)
        cand, tp = t.evaluate(_neighbour(cur, c, rng))
        gain = math.log(max(tp, 1e-30)) - math.log(max(cur_tp, 1e-30))
        if gain >= 0 or rng.random() < math.exp(gain / temp):
            cur, cur_tp = cand, tp
