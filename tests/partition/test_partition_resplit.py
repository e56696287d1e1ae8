"""Re-splitting a partition along its own order: an annealed walk over its cuts."""

from __future__ import annotations

import numpy as np
import pytest

from atoll import partition as P
from atoll.partition import _lns, _resplit, _solver
from atoll.partition._cost import IntArray


def _uniform(n: int = 60) -> P.OpGraph:
    """A chain of equal matmuls with light tensors: stage time ~ nodes per stage."""
    nodes = [P.Op(f"n{i}", "matmul", 1e9, 0.0, 1e3) for i in range(n)]
    return P.OpGraph.build("uniform", nodes, [(i, i + 1, 1e3) for i in range(n - 1)])


def _branches(n: int = 24) -> P.OpGraph:
    """Two chains of equal matmuls side by side from one source into one sink:
    the node order alternates between them."""
    nodes = [P.Op(f"n{i}", "matmul", 1e9, 0.0, 1e3) for i in range(2 * n + 2)]
    edges = [(0, 1, 1e3), (0, 2, 1e3), (2 * n - 1, 2 * n + 1, 1e3), (2 * n, 2 * n + 1, 1e3)]
    edges += [(i, i + 2, 1e3) for i in range(1, 2 * n - 1)]
    return P.OpGraph.build("branches", nodes, edges)


def _in_order(start: IntArray, new: IntArray) -> bool:
    """Whether ``new`` is a contiguous split of ``start``'s own order."""
    order = np.lexsort((np.arange(len(start)), start))
    return bool(np.all(np.diff(new[order]) >= 0))


def test_a_resplit_passes_load_along_the_chain_to_a_drained_chiplet() -> None:
    """Stages of 12, 11, 11, 11, 10 and 5 nodes: no window of 3 chiplets next to
    the slowest gains; moving the cuts a node at a time balances the chain."""
    g, chips = _uniform(), P.Chiplets(6, link_bytes_per_s=1e15)
    start = np.repeat(np.arange(6), [12, 11, 11, 11, 10, 5])
    new = _resplit.resplit(g, chips, start, np.random.default_rng(0))
    assert P.is_valid(g, chips, new) and _in_order(start, new)
    assert np.bincount(new, minlength=6).tolist() == [10] * 6
    assert _lns._faster(P.stage_times(g, chips, new), P.stage_times(g, chips, start))


@pytest.mark.parametrize("topology", ["chain", "ring"])
def test_a_resplit_keeps_the_flow_forward_where_branches_interleave(topology: str) -> None:
    """Each branch's nodes on chiplets of their own: the order the partition
    implies is not the graph's, and every split of it is still valid."""
    g = _branches()
    chips = P.Chiplets(4, link_bytes_per_s=1e15, topology=topology, hop_limit=2)
    start = np.zeros(len(g), dtype=np.int64)
    start[1:-1:2], start[2:-1:2] = 1, 2  # one branch on 1, the other on 2
    start[-1] = 3
    assert P.is_valid(g, chips, start)
    new = _resplit.resplit(g, chips, start, np.random.default_rng(0))
    assert P.is_valid(g, chips, new) and _in_order(start, new)
    assert P.stage_times(g, chips, new).max() < P.stage_times(g, chips, start).max()


def test_a_resplit_keeps_within_the_sram_and_the_hop_limit() -> None:
    """Weights that allow at most 12 nodes a chiplet, and tensors that skip a
    chiplet: no split it returns breaks either limit."""
    n = 60
    nodes = [P.Op(f"n{i}", "matmul", 1e9, 1e6, 1e3) for i in range(n)]
    edges = [(i, i + 1, 1e3) for i in range(n - 1)] + [(i, i + 3, 1e3) for i in range(n - 3)]
    g = P.OpGraph.build("skips", nodes, edges)
    chips = P.Chiplets(6, sram_bytes=12.5e6, link_bytes_per_s=1e15, hop_limit=1)
    start = np.repeat(np.arange(6), [12, 12, 12, 12, 8, 4])
    assert P.is_valid(g, chips, start)
    for seed in range(3):
        new = _resplit.resplit(g, chips, start, np.random.default_rng(seed))
        assert P.is_valid(g, chips, new) and _in_order(start, new)
        assert P.stage_times(g, chips, new).max() < P.stage_times(g, chips, start).max()


def test_a_resplit_of_a_proved_optimum_finds_nothing_faster() -> None:
    g, chips = _uniform(30), P.Chiplets(5, link_bytes_per_s=5e10)
    best, stats = _solver.solve_bottleneck(g, chips, 60.0)
    assert stats["optimal"]
    new = _resplit.resplit(g, chips, best, np.random.default_rng(0))
    assert P.is_valid(g, chips, new)
    assert not _lns._faster(P.stage_times(g, chips, new), P.stage_times(g, chips, best))


def test_the_walks_check_of_a_split_is_the_cost_models() -> None:
    """A split of the order breaks only the hop limit or the SRAM, and the walk's
    own check of those two agrees with the cost model's on random splits."""
    n = 60
    nodes = [P.Op(f"n{i}", "matmul", 1e9, 1e6, 1e3) for i in range(n)]
    edges = [(i, i + 1, 1e3) for i in range(n - 1)] + [(i, i + 3, 1e3) for i in range(n - 3)]
    g = P.OpGraph.build("skips", nodes, edges)
    rng = np.random.default_rng(0)
    order = np.arange(n)
    for topology in ("chain", "ring"):
        chips = P.Chiplets(6, sram_bytes=12.5e6, topology=topology, hop_limit=1)
        answers = set()
        for _ in range(200):
            inner = 10 * np.arange(1, 6) + rng.integers(-4, 5, size=5)  # 2 to 18 a chiplet
            a = _resplit._split(order, np.concatenate([[0], inner, [n]]))
            fits = _resplit._fits(g, chips, a)
            assert fits == P.is_valid(g, chips, a)
            answers.add(fits)
        assert answers == {True, False}
