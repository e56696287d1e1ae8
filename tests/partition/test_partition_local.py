"""RL's local move (the bottleneck-aware neighbour beside SA's boundary shift) and
the annealed walk of such moves that RL runs beside its policy."""

from __future__ import annotations

import numpy as np
import pytest

from atoll import partition as P
from atoll.partition._baselines import (
    Tracker,
    _bottleneck_neighbour,
    _local_neighbour,
    accept,
    anneal_temperature,
)
from atoll.partition._repair import Repairer
from atoll.partition._rl import LocalWalk


def branches_graph(length: int = 6) -> P.OpGraph:
    """A stem, two parallel chains interleaved in node order, and a join."""
    n = 2 * length + 2
    nodes = [P.Op(f"n{i}", "matmul", 1e9, 10.0, 1e5) for i in range(n)]
    edges = [(0, 1, 1e5), (0, 2, 1e5)]
    edges += [(i, i + 2, 1e5) for i in range(1, n - 3)]  # 1, 3, 5, ... and 2, 4, 6, ...
    edges += [(n - 3, n - 1, 1e5), (n - 2, n - 1, 1e5)]
    return P.OpGraph.build("branches", nodes, edges)


def test_shape_range_and_validity() -> None:
    g, chips = branches_graph(), P.Chiplets(3)
    rng = np.random.default_rng(0)
    a = np.array([0] * 5 + [1] * 5 + [2] * 4, dtype=np.int64)
    assert P.is_valid(g, chips, a)
    for _ in range(20):
        b = _local_neighbour(g, chips, a, rng)
        assert b.shape == a.shape and b.dtype == np.int64
        assert b.min() >= 0 and b.max() < chips.count
        c = _bottleneck_neighbour(g, chips, a, rng)
        assert P.is_valid(g, chips, c)  # no repair needed: it keeps validity
    assert not np.shares_memory(b, a) and a.tolist() == [0] * 5 + [1] * 5 + [2] * 4


def test_deterministic_given_rng() -> None:
    g, chips = branches_graph(), P.Chiplets(2)
    a = np.array([0] * 13 + [1], dtype=np.int64)
    runs = [
        [_local_neighbour(g, chips, a, np.random.default_rng(3)).tolist() for _ in range(3)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_improves_an_unbalanced_partition() -> None:
    # all but the join on chip 0: the slowest stage holds 13 of 14 equal nodes
    g, chips = branches_graph(), P.Chiplets(2)
    a = np.array([0] * 13 + [1], dtype=np.int64)
    before = P.throughput(g, chips, a)
    rng = np.random.default_rng(0)
    moved = [_bottleneck_neighbour(g, chips, a, rng) for _ in range(10)]
    for b in moved:  # one move each, off the slowest stage, valid without repair
        assert P.is_valid(g, chips, b) and b.tolist() != a.tolist()
        assert (b != a).sum() >= 1 and set(a[b != a].tolist()) == {0}
    # as a search uses it: keep the best, move from it again (each call one evaluation)
    best, best_tp = a, before
    for _ in range(30):
        b = _bottleneck_neighbour(g, chips, best, rng)
        if P.throughput(g, chips, b) > best_tp:
            best, best_tp = b, P.throughput(g, chips, b)
    assert best_tp > 1.5 * before


def test_ring_stays_valid() -> None:
    g, chips = branches_graph(), P.Chiplets(4, topology="ring")
    a = np.array([0] * 8 + [1, 1, 2, 2, 3, 3], dtype=np.int64)
    assert P.is_valid(g, chips, a)
    rng = np.random.default_rng(0)
    moved = 0
    for _ in range(10):
        b = _bottleneck_neighbour(g, chips, a, rng)
        assert P.is_valid(g, chips, b)
        moved += b.tolist() != a.tolist()
        a = b
    assert moved >= 5  # it moves (returning ``a`` unchanged would also be valid)


def test_acceptance_follows_the_temperature() -> None:
    rng = np.random.default_rng(0)
    assert all(accept(100.0, 100.0, 1e-9, rng) for _ in range(20))  # no loss: always
    assert not any(accept(90.0, 100.0, 1e-3, rng) for _ in range(200))  # cold: never
    hot = sum(accept(90.0, 100.0, 1.0, rng) for _ in range(200))  # exp(-0.105): ~90%
    assert 160 <= hot <= 200
    assert anneal_temperature(0.0) == pytest.approx(0.05)
    assert anneal_temperature(1.0) == pytest.approx(0.002)
    assert anneal_temperature(0.5) == pytest.approx((0.05 * 0.002) ** 0.5)


def test_the_walk_lengthens_while_it_pays_and_shortens_when_samples_pay() -> None:
    walk = LocalWalk(floor=2)
    assert walk.moves == 2
    for want in (4, 8, 16, 32, 64, 64):
        walk.adapt(sampled=0.0, walked=0.01)
        assert walk.moves == want
    walk.adapt(sampled=0.01, walked=0.01)  # a tie keeps it
    assert walk.moves == 64
    for want in (32, 16, 8, 4, 2, 2):
        walk.adapt(sampled=0.02, walked=0.0)
        assert walk.moves == want


def test_a_walk_spends_its_moves_from_the_best_and_keeps_the_best() -> None:
    g, chips = branches_graph(), P.Chiplets(2)
    tracker = Tracker(g, chips, Repairer(g, chips), budget=40)
    start = np.array([0] * 13 + [1], dtype=np.int64)  # the slowest stage: 13 of 14 nodes
    tracker.evaluate(start)
    walk = LocalWalk(floor=8, steps=39)
    rng = np.random.default_rng(0)
    gain = walk.walk(tracker, rng)
    assert len(tracker.history) == 9  # the start and eight moves, each one evaluation
    assert gain > 0 and tracker.best_tp == pytest.approx(tracker.history[0] * np.exp(8 * gain))
    while tracker.left > 0:  # it stops at the budget, mid-walk if need be
        walk.walk(tracker, rng)
    assert len(tracker.history) == 40 and tracker.best_tp > 1.5 * tracker.history[0]
