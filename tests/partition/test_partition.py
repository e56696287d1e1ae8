"""The partitioner: graph model, constraints, cost model, repair and every method."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from atoll import partition as P


def chain_graph(n: int, weight: float = 10.0) -> P.OpGraph:
    """A small diamond-studded chain: i -> i+1, and i -> i+2 every third node."""
    nodes = [P.Op(f"n{i}", "matmul", 1e9, weight, 1e5) for i in range(n)]
    edges = [(i, i + 1, 1e5) for i in range(n - 1)]
    edges += [(i, i + 2, 1e5) for i in range(0, n - 2, 3)]
    return P.OpGraph.build("chain", nodes, edges)


def random_graph(rng: np.random.Generator, n: int) -> P.OpGraph:
    """A random DAG in topological order with random costs."""
    nodes = [
        P.Op(
            f"n{i}",
            "op",
            float(rng.uniform(1e8, 1e10)),
            float(rng.uniform(0, 1e6)),
            float(rng.uniform(1e3, 1e6)),
        )
        for i in range(n)
    ]
    edges = [(i, i + 1, nodes[i].output_bytes) for i in range(n - 1)]
    for _ in range(n // 2):
        s = int(rng.integers(0, n - 2))
        d = int(rng.integers(s + 1, min(s + 4, n)))
        edges.append((s, d, nodes[s].output_bytes))
    return P.OpGraph.build("random", nodes, edges)


def test_json_round_trip(tmp_path: Path) -> None:
    g = chain_graph(7)
    path = tmp_path / "g.json"
    P.save_graph(g, path)
    back = P.load_graph(path)
    assert back == g
    assert back.nodes[3].flops == 1e9 and back.edges == g.edges


def test_graph_rejects_backward_edges() -> None:
    with pytest.raises(ValueError, match="not forward"):
        P.OpGraph.build("bad", [P.Op("a"), P.Op("b")], [(1, 0, 1.0)])


def test_constraints_each_reported() -> None:
    g = chain_graph(6)
    chips = P.Chiplets(3, sram_bytes=25.0)
    assert P.is_valid(g, chips, [0, 0, 1, 1, 2, 2])
    assert any("backward" in v for v in P.violations(g, chips, [0, 1, 0, 1, 2, 2]))
    assert any("skips" in v for v in P.violations(g, chips, [0, 0, 0, 2, 2, 2]))
    assert any("unused" in v for v in P.violations(g, chips, [0, 0, 0, 1, 1, 1]))
    assert any("weights" in v for v in P.violations(g, chips, [0, 0, 0, 1, 1, 2]))


def test_cost_model_stage_time_and_throughput() -> None:
    g = P.OpGraph.build(
        "two", [P.Op("a", flops=1e12, output_bytes=1e9), P.Op("b", flops=2e12)], [(0, 1, 1e9)]
    )
    chips = P.Chiplets(2, flops_per_s=1e12, link_bytes_per_s=1e9, mem_bytes_per_s=1e15)
    times = P.stage_times(g, chips, [0, 1])
    assert times == pytest.approx([1.0 + 1.0, 2.0 + 1.0])
    assert P.throughput(g, chips, [0, 1]) == pytest.approx(1 / 3.0)
    assert P.throughput(g, chips, [1, 0]) == 0.0  # invalid: backward


def brute_force_nearest(g: P.OpGraph, chips: P.Chiplets, cand: np.ndarray) -> int | None:
    best = None
    for a in itertools.product(range(chips.count), repeat=len(g)):
        if P.is_valid(g, chips, a):
            d = int(np.abs(np.array(a) - cand).sum())
            best = d if best is None else min(best, d)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_repair_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = random_graph(rng, 6)
    chips = P.Chiplets(3, sram_bytes=float(g.total_weight_bytes) / 2.2, hop_limit=1 + seed % 2)
    cand = rng.integers(0, 3, len(g))
    want = brute_force_nearest(g, chips, cand)
    if want is None:
        with pytest.raises(P.InfeasibleError):
            P.repair(g, chips, cand)
        return
    got = P.repair(g, chips, cand)
    assert P.is_valid(g, chips, got)
    assert int(np.abs(got - cand).sum()) == want


def test_repair_keeps_valid_candidates() -> None:
    g = chain_graph(6)
    a = np.array([0, 0, 1, 1, 2, 2])
    assert list(P.repair(g, P.Chiplets(3), a)) == list(a)


def test_infeasible_is_a_clear_error() -> None:
    g = chain_graph(3, weight=100.0)
    with pytest.raises(P.InfeasibleError, match="cannot use all 4 chiplets"):
        P.search(g, P.Chiplets(4), "random", budget=2)
    with pytest.raises(P.InfeasibleError, match="exceed"):
        P.repair(g, P.Chiplets(2, sram_bytes=120.0), [0, 0, 1])


def test_random_assignments_are_almost_never_valid() -> None:
    g = P.bert_graph()
    rng = np.random.default_rng(0)
    for count in (4, 8):
        chips = P.Chiplets(count)
        valid = sum(P.is_valid(g, chips, rng.integers(0, count, len(g))) for _ in range(2000))
        assert valid == 0


@pytest.mark.slow
@pytest.mark.parametrize("method", P.METHODS)
def test_every_method_is_valid_on_random_graphs(method: str) -> None:
    """Property: on random graphs and chiplet counts, every method returns a valid partition."""
    rng = np.random.default_rng(42)
    for trial in range(4):
        g = random_graph(rng, int(rng.integers(8, 30)))
        count = int(rng.integers(2, 5))
        chips = P.scaled_chiplets(
            g, count, slack=float(rng.uniform(1.2, 2.0)), hop_limit=1 + trial % 2
        )
        try:
            part = P.search(g, chips, method, budget=6, seed=trial, time_limit_s=2.0)
        except P.InfeasibleError:
            continue
        assert part.valid and P.is_valid(g, chips, part.assignment)
        assert part.throughput == pytest.approx(P.throughput(g, chips, part.assignment))
        assert len(part.stages) == count and all(s.nodes for s in part.stages)


def test_dp_is_optimal_among_contiguous_splits() -> None:
    g = chain_graph(8)
    chips = P.Chiplets(3, sram_bytes=40.0)
    a = P.dp_split(g, chips)
    assert a is not None
    best = 0.0
    for cuts in itertools.combinations(range(1, 8), 2):
        split = np.searchsorted(np.array(cuts), np.arange(8), side="right")
        best = max(best, P.throughput(g, chips, split))
    assert P.throughput(g, chips, a) == pytest.approx(best)


@pytest.mark.slow
@pytest.mark.parametrize("count", [4, 8])
def test_bert_partitions(count: int) -> None:
    g = P.bert_graph()
    assert 150 <= len(g) <= 400
    assert {"matmul", "attention", "norm", "softmax", "add", "embed"} <= {n.kind for n in g.nodes}
    parts = {m: P.search(g, count, m, budget=4, time_limit_s=10.0) for m in ("dp", "solver", "sa")}
    for part in parts.values():
        assert part.valid and len(part.stages) == count
    assert parts["solver"].throughput >= 0.99 * parts["dp"].throughput


def test_public_api_is_pinned() -> None:
    assert sorted(P.__all__) == sorted(
        [
            "METHODS",
            "Chiplets",
            "Edge",
            "GraphError",
            "InfeasibleError",
            "Op",
            "OpGraph",
            "Partition",
            "Policy",
            "ProgressBar",
            "RepairTimeout",
            "Repairer",
            "Stage",
            "TrainLog",
            "Tracker",
            "bert_graph",
            "builtin_graph",
            "builtin_names",
            "decoder_graph",
            "dp_split",
            "evaluate",
            "finetune",
            "from_jax",
            "is_valid",
            "load_graph",
            "plot_curves",
            "plot_partition",
            "pretrain",
            "repair",
            "save_graph",
            "scaled_chiplets",
            "search",
            "stage_times",
            "synthetic_cases",
            "throughput",
            "violations",
        ]
    )
    for name in P.__all__:
        assert hasattr(P, name), name


def test_a_repair_that_times_out_scores_zero_and_the_search_goes_on() -> None:
    RepairTimeout, Tracker = P.RepairTimeout, P.Tracker
    graph, chips = P.bert_graph(), P.Chiplets(4)
    good = np.asarray(P.search(graph, chips, method="dp").assignment, dtype=np.int64)

    class Flaky:
        calls = 0

        def __call__(self, candidate: object) -> object:
            self.calls += 1
            if self.calls == 2:
                raise RepairTimeout("slow solver")
            return good

    tracker = Tracker(graph, chips, Flaky(), budget=3)  # type: ignore[arg-type]
    _, first = tracker.evaluate(good)
    fixed, second = tracker.evaluate(good)
    assert first > 0 and second == 0.0 and list(fixed) == list(good)
    assert tracker.history == [first, first]  # the best so far stands
    flaky = Flaky()
    flaky.calls = 1
    fresh = Tracker(graph, chips, flaky, budget=3)  # type: ignore[arg-type]
    with pytest.raises(RepairTimeout):
        fresh.evaluate(good)  # nothing valid known yet: the timeout is the answer
