"""The whole-graph CP-SAT solve that runs in a thread beside the solver's windows."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from atoll import partition as P
from atoll.partition import _background, _lns, _solver
from atoll.partition._baselines import Tracker
from atoll.partition._cost import IntArray
from atoll.partition._repair import Repairer

THREAD = "atoll-partition-solve"


def _chain(n: int = 40) -> P.OpGraph:
    """Matmuls of uneven cost in a chain, with skip edges two ahead."""
    rng = np.random.default_rng(3)
    nodes = [P.Op(f"n{i}", "matmul", float(rng.uniform(1e9, 8e9)), 0.0, 1e6) for i in range(n)]
    edges = [(i, i + 1, 1e6) for i in range(n - 1)] + [(i, i + 2, 5e5) for i in range(n - 2)]
    return P.OpGraph.build("chain", nodes, edges)


def _poor(g: P.OpGraph, count: int) -> IntArray:
    """A valid partition far from the best: 4 nodes on each chiplet, the rest on the last."""
    return np.minimum(np.arange(len(g)) // 4, count - 1).astype(np.int64)


def _running() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD]


def test_it_finds_and_proves_what_the_solver_proves() -> None:
    g, chips = _chain(), P.Chiplets(5, link_bytes_per_s=5e10)
    best, stats = _solver.solve_bottleneck(g, chips, 60.0)
    assert stats["optimal"]
    with _background.BackgroundSolve(g, chips, _poor(g, 5)) as whole:
        assert whole.wait(60.0)  # it proves this one in well under a second
        assert whole.optimal
        found = whole.found()
    assert found is not None
    assignment, slowest = found
    assert P.is_valid(g, chips, assignment)
    optimum = P.throughput(g, chips, best)
    assert P.throughput(g, chips, assignment) == pytest.approx(optimum, rel=1e-4)
    assert 1.0 / slowest == pytest.approx(P.throughput(g, chips, assignment), rel=1e-3)
    assert not _running()


def test_a_stop_at_once_ends_the_thread() -> None:
    g, chips = _chain(200), P.Chiplets(8, link_bytes_per_s=5e10)
    whole = _background.BackgroundSolve(g, chips, _poor(g, 8))
    with whole:
        pass  # stopped before CP-SAT may even have started: it must still end
    assert whole.done and not _running()
    found = whole.found()
    assert found is None or P.is_valid(g, chips, found[0])


class _Found(_background.BackgroundSolve):
    """A background solve that has already found ``assignment`` (no thread)."""

    def __init__(self, g: P.OpGraph, chips: P.Chiplets, assignment: IntArray) -> None:
        super().__init__(g, chips, assignment)
        self._record(assignment, float(P.stage_times(g, chips, assignment).max()))


def test_the_windows_take_what_it_found() -> None:
    g, chips = _chain(), P.Chiplets(5, link_bytes_per_s=5e10)
    best, _ = _solver.solve_bottleneck(g, chips, 60.0)
    tracker = Tracker(g, chips, Repairer(g, chips), budget=3)
    tracker.evaluate(_poor(g, 5))
    # a budget of 3: one window at most, then the found partition (kept back for it)
    _lns.lns_polish(tracker, np.random.default_rng(0), background=_Found(g, chips, best))
    assert len(tracker.history) <= 3
    assert tracker.best is not None
    assert tracker.best_tp == pytest.approx(P.throughput(g, chips, best), rel=1e-6)


def test_rl_as_shipped_with_it_stays_valid_and_leaves_no_thread() -> None:
    g, chips = _chain(60), P.Chiplets(6, link_bytes_per_s=5e10)
    if _background.spare_cores() == 0:
        pytest.skip("one core: the search runs no background solve")
    rl = P.search(g, chips, "rl", budget=20, seed=0, rl_solver_s=0.2)
    assert rl.valid and rl.evaluations <= 20
    assert not _running()
    off = P.search(g, chips, "rl", budget=20, seed=0, rl_solver_s=0.2, rl_background=False)
    assert off.valid and not _running()


def test_fine_tuning_that_stalls_leaves_the_rest_of_the_budget() -> None:
    g, chips = _chain(), P.Chiplets(5, link_bytes_per_s=5e10)
    best, _ = _solver.solve_bottleneck(g, chips, 60.0)
    policy = P.Policy.pretrained()
    tracker = Tracker(g, chips, Repairer(g, chips), budget=100)
    # handed the optimum as its hint, nothing can raise the best: it stops
    P.finetune(policy, tracker, np.random.default_rng(0), hint=best, patience=8)
    assert 10 <= len(tracker.history) <= 2 + 8 + 8  # the greedy, the hint, then one batch past
    assert tracker.left > 0
    never = Tracker(g, chips, Repairer(g, chips), budget=30)
    P.finetune(policy, never, np.random.default_rng(0), hint=best)  # no patience: all of it
    assert len(never.history) == 30


class _History:
    """What ``Stall`` reads of a tracker: its best-so-far history."""

    def __init__(self) -> None:
        self.history: list[float] = []

    @property
    def best_tp(self) -> float:
        return self.history[-1] if self.history else 0.0


def test_patience_counts_from_the_evaluation_that_gained() -> None:
    """Asked after a batch, the patience still counts from the evaluation
    that raised the best, not from the question (on a 1,000-op GRU the late
    count cost 13 evaluations of fine-tuning, 1.4 s each)."""
    from atoll.partition._baselines import Stall

    t = _History()
    t.history += [100.0, 100.0]
    stall = Stall(t, 8)  # type: ignore[arg-type]
    t.history += [100.0, 102.0, 102.0, 102.0, 102.1]  # the gain at evaluation 4
    assert not stall.stalled()
    t.history += [102.1] * 4  # 8 evaluations since the gain (11 in all)
    assert not stall.stalled()
    t.history.append(102.2)  # 8 past the gain, a rise below half a percent
    assert stall.stalled()


def test_a_walk_stops_when_fine_tuning_stalls() -> None:
    from atoll.partition._rl import LocalWalk

    g, chips = _chain(), P.Chiplets(5, link_bytes_per_s=5e10)
    tracker = Tracker(g, chips, Repairer(g, chips), budget=40)
    tracker.evaluate(np.zeros(len(g), dtype=np.int64))
    walker = LocalWalk(floor=16)
    asked = iter([False, False, False, True])
    walker.walk(tracker, np.random.default_rng(0), lambda: next(asked))
    assert len(tracker.history) == 1 + 3
