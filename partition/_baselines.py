"""Baselines at an equal budget of evaluated (repaired) partitions.

Each evaluation is one candidate, repaired by the shared step (an LP, then
CP-SAT), then scored by the cost model. ``Tracker`` keeps the best so far and the curve.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._cost import IntArray, is_valid_array, stage_times, valid_throughput
from ._errors import RepairTimeout
from ._graph import OpGraph
from ._hardware import Chiplets
from ._repair import Repairer

__all__ = [
    "STALLED",
    "Progress",
    "Stall",
    "Tracker",
    "accept",
    "anneal_temperature",
    "log_gain",
    "random_search",
    "score",
    "simulated_annealing",
]

Progress = Callable[[int, int, float], None]
STALLED = 0.005  # a gain of the best below this share does not reset a patience


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
    throughput (the transfer benchmark's "time to reach" runs). ``held``
    evaluations are kept back from :attr:`left` for a later phase of the
    search (RL as shipped keeps its solver's polish and windows that way).
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
    held: int = 0

    @property
    def left(self) -> int:
        """Evaluations still allowed (none once the best reaches ``stop_at``)."""
        if self.stop_at is not None and self.history and self.best_tp >= self.stop_at:
            return 0
        return self.budget - self.held - len(self.history)

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


class Stall:
    """Whether a search's best has stopped rising: ``patience`` evaluations
    without a gain of :data:`STALLED` (never, without a patience), counted
    from the evaluation that made the last such gain, whenever it is asked
    (fine-tuning after a batch or during a walk; the solver's windows at the
    end of their budget, :class:`._lns.Overtime`)."""

    def __init__(self, tracker: Tracker, patience: int | None) -> None:
        self._tracker, self._patience = tracker, patience
        self._mark, self._at = tracker.best_tp, len(tracker.history)

    def stalled(self) -> bool:
        t = self._tracker
        if t.best_tp > self._mark * (1 + STALLED):  # gains since: the last one counts
            for i in range(self._at, len(t.history)):
                if t.history[i] > self._mark * (1 + STALLED):
                    self._mark, self._at = t.history[i], i + 1
        return self._patience is not None and len(t.history) - self._at >= self._patience


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


class _Pusher:
    """Moves one node to an adjacent chip and drags along whatever must follow
    for the flow constraint (and on a chain the hop limit) to hold again."""

    def __init__(self, graph: OpGraph, chiplets: Chiplets) -> None:
        n = len(graph)
        self.succ: list[list[int]] = [[] for _ in range(n)]
        self.pred: list[list[int]] = [[] for _ in range(n)]
        for s, d in zip(graph.array("src").tolist(), graph.array("dst").tolist(), strict=True):
            self.succ[s].append(d)
            self.pred[d].append(s)
        # on a ring an edge may wrap round instead: only flow is propagated there
        self.hop = chiplets.hop_limit if chiplets.topology != "ring" else None

    def push(self, b: IntArray, v: int, to: int) -> dict[int, int]:
        """Set ``b[v] = to`` (one chip up or down) and propagate in place;
        returns the old chip of every node changed, for :meth:`undo`."""
        old = {v: int(b[v])}
        b[v] = to
        up, h, stack = to > old[v], self.hop, [v]
        sign = 1 if up else -1  # compare as if pushing up: sign * chip
        while stack:
            u = stack.pop()
            bu = int(b[u])
            # up: consumers may not sit below u, producers not more than h below;
            # down: producers may not sit above u, consumers not more than h above
            follow = [(w, bu) for w in (self.succ[u] if up else self.pred[u])]
            if h is not None:
                follow += [(w, bu - sign * h) for w in (self.pred[u] if up else self.succ[u])]
            for w, lim in follow:
                if sign * int(b[w]) < sign * lim:
                    old.setdefault(w, int(b[w]))
                    b[w] = lim
                    stack.append(w)
        return old

    @staticmethod
    def undo(b: IntArray, old: dict[int, int]) -> None:
        for u, k in old.items():
            b[u] = k


def _bottleneck_moves(
    graph: OpGraph, chiplets: Chiplets, a: IntArray, cap: int, rng: np.random.Generator
) -> list[tuple[int, int]]:
    """Moves that touch the slowest stage: a node of it to either neighbour
    chip, or a node of a neighbour chip into it (at most ``cap``, a random
    subset when there are more)."""
    s, c = int(stage_times(graph, chiplets, a).argmax()), chiplets.count
    on = np.flatnonzero(a == s).tolist()
    moves = [(v, s - 1) for v in on if s > 0] + [(v, s + 1) for v in on if s < c - 1]
    moves += [(int(v), s) for v in np.flatnonzero((a == s - 1) | (a == s + 1))]
    if len(moves) > cap:
        moves = [moves[i] for i in sorted(rng.choice(len(moves), cap, replace=False).tolist())]
    return moves


def _bottleneck_neighbour(
    graph: OpGraph,
    chiplets: Chiplets,
    a: IntArray,
    rng: np.random.Generator,
    cap: int = 48,
) -> IntArray:
    """A neighbour of a valid ``a`` that touches its slowest stage, found without
    the solver and without scoring any candidate.

    One move, drawn at random among those that touch the slowest stage of
    ``a`` (one node of it to an adjacent chip, or one node of an adjacent chip
    into it), dragging along the nodes the flow constraint and the hop limit
    then force to follow, so the result stays valid (checked; the first valid
    move in a random order is taken, ``a`` itself when none is). Moves follow
    the dataflow graph, not the node order, so parallel branches can be split
    between chips. Only ``a``'s own stage times, already known, choose where
    to move: the candidate is scored once, by the caller, like any other, so
    a search that uses this move stays within its budget of evaluations.
    """
    b, pusher = a.copy(), _Pusher(graph, chiplets)
    moves = _bottleneck_moves(graph, chiplets, b, cap, rng)
    for i in rng.permutation(len(moves)).tolist():
        v, to = moves[i]
        old = pusher.push(b, v, to)
        if is_valid_array(graph, chiplets, b):
            return b
        pusher.undo(b, old)
    return b


def _local_neighbour(
    graph: OpGraph, chiplets: Chiplets, a: IntArray, rng: np.random.Generator, mix: float = 0.5
) -> IntArray:
    """RL's local move: :func:`_bottleneck_neighbour`, or with probability
    ``mix`` SA's boundary shift (:func:`_neighbour`, repaired later), which can
    move whole runs of nodes at once."""
    if rng.random() < mix:
        return _neighbour(a, chiplets.count, rng)
    return _bottleneck_neighbour(graph, chiplets, a, rng)


T0, T1 = 0.05, 0.002  # SA's temperatures (on log-throughput) at its start and end


def anneal_temperature(done: float, t0: float = T0, t1: float = T1) -> float:
    """SA's schedule: ``t0`` with none of the budget spent, falling geometrically
    to ``t1`` as the share spent, ``done``, reaches 1."""
    return float(t0 * (t1 / t0) ** min(max(done, 0.0), 1.0))


def log_gain(before: float, after: float) -> float:
    """``log(after / before)``, a throughput of 0 counted as 1e-30."""
    return math.log(max(after, 1e-30)) - math.log(max(before, 1e-30))


def accept(new_tp: float, cur_tp: float, temp: float, rng: np.random.Generator) -> bool:
    """Metropolis on log-throughput: always take a move that does not lose, and
    one that loses ``g`` (in log-throughput) with probability ``exp(-g / temp)``."""
    gain = log_gain(cur_tp, new_tp)
    return gain >= 0 or rng.random() < math.exp(gain / temp)


def simulated_annealing(
    t: Tracker, rng: np.random.Generator, t0: float = T0, t1: float = T1
) -> None:
    """Metropolis on log-throughput, temperature falling geometrically from t0 to t1."""
    c = t.chiplets.count
    cur, cur_tp = t.evaluate(rng.integers(0, c, len(t.graph)))
    steps = t.left  # the start above was the first of the budget
    for step in range(steps):
        if t.left <= 0:  # reached ``stop_at``
            break
        cand, tp = t.evaluate(_neighbour(cur, c, rng))
        if accept(tp, cur_tp, anneal_temperature(step / steps, t0, t1), rng):
            cur, cur_tp = cand, tp
