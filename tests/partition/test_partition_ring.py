"""The ring topology: constraints, the cost model's routing, the repair and every method."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from atoll import partition as P


def line(n: int, skips: list[tuple[int, int]]) -> P.OpGraph:
    """A chain of ``n`` unit nodes with extra ``skips`` edges; every output is 1 byte."""
    nodes = [P.Op(f"n{i}", "op", 1e12, 1.0, 1.0) for i in range(n)]
    edges = [(i, i + 1, 1.0) for i in range(n - 1)] + [(s, d, 1.0) for s, d in skips]
    return P.OpGraph.build("line", nodes, edges)


def test_ring_needs_three_chiplets_and_has_a_wrap_link() -> None:
    with pytest.raises(ValueError, match="ring"):
        P.Chiplets(2, topology="ring")
    with pytest.raises(ValueError, match="topology"):
        P.Chiplets(4, topology="torus")
    assert P.Chiplets(4, topology="ring").links == 4 and P.Chiplets(4).links == 3


def test_ring_hop_limit_counts_the_shorter_way() -> None:
    g = line(4, [(0, 3)])
    chain, ring = P.Chiplets(4, sram_bytes=10.0), P.Chiplets(4, sram_bytes=10.0, topology="ring")
    a = [0, 1, 2, 3]  # the skip edge spans 3 chips: 3 links on a chain, 1 round the ring
    assert any("skips" in v for v in P.violations(g, chain, a))
    assert P.is_valid(g, ring, a)


def test_ring_routes_each_tensor_the_shorter_way() -> None:
    g = line(5, [(0, 4)])
    ring = P.Chiplets(4, sram_bytes=10.0, topology="ring", link_bytes_per_s=1.0)
    a = np.array([0, 1, 2, 3, 3])
    # node 0's tensor is read on chips 1 and 3: forward 0 -> 3 takes 3 links; backward
    # it must reach chip 1 too (0 -> 3 -> 2 -> 1), 3 links as well: a tie goes forward
    from atoll.partition._cost import link_traffic

    assert list(link_traffic(g, ring, a)) == [1.0, 2.0, 2.0, 0.0]
    b = np.array([0, 0, 1, 2, 3])  # node 0 read on chips 0 and 3 only: wrap link, 1 hop
    assert list(link_traffic(g, ring, b)) == [1.0, 1.0, 1.0, 1.0]
    times = P.stage_times(g, ring, b)
    assert times[0] == pytest.approx(2 * 1.0 / 50.0 + 1.0 + 1.0)  # compute + links 3 and 0


def brute_nearest(g: P.OpGraph, chips: P.Chiplets, cand: np.ndarray) -> int | None:
    dists = [
        int(np.abs(np.array(a) - cand).sum())
        for a in itertools.product(range(chips.count), repeat=len(g))
        if P.is_valid(g, chips, a)
    ]
    return min(dists) if dists else None


@pytest.mark.parametrize("seed", range(5))
def test_ring_repair_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 7
    skips = [(int(s), int(min(s + rng.integers(2, 5), n - 1))) for s in rng.integers(0, n - 2, 3)]
    g = line(n, [(s, d) for s, d in skips if d > s + 1])
    chips = P.Chiplets(4, sram_bytes=float(rng.uniform(2.0, 3.0)), topology="ring")
    cand = rng.integers(0, 4, n)
    want = brute_nearest(g, chips, cand)
    if want is None:
        with pytest.raises(P.InfeasibleError):
            P.repair(g, chips, cand)
        return
    got = P.repair(g, chips, cand)
    assert P.is_valid(g, chips, got) and int(np.abs(got - cand).sum()) == want


@pytest.mark.slow
@pytest.mark.parametrize("method", P.METHODS)
def test_every_method_is_valid_on_a_ring(method: str) -> None:
    from atoll.partition._heldout import heldout_graph

    g = heldout_graph("unet")  # skips across the whole net: the wrap link helps
    chips = P.Chiplets.default_for(g, 6, hop_limit=1, topology="ring")
    part = P.search(g, chips, method, budget=6, seed=0, time_limit_s=5.0)
    assert part.valid and P.is_valid(g, chips, part.assignment)
    assert part.throughput == pytest.approx(P.throughput(g, chips, part.assignment))


def brute_best(g: P.OpGraph, chips: P.Chiplets) -> float:
    """The highest throughput of any valid assignment, by enumeration."""
    return max(
        (
            P.throughput(g, chips, a)
            for a in itertools.product(range(chips.count), repeat=len(g))
            if P.is_valid(g, chips, a)
        ),
        default=0.0,
    )


@pytest.mark.parametrize("seed", range(9))
def test_ring_solver_matches_brute_force(seed: int) -> None:
    # skips across the net, tensors of random sizes: the best partition routes some
    # of them backwards through the wrap link, which a chain model cannot price
    rng = np.random.default_rng(seed)
    n = 7
    skips = [(0, n - 1), (1, n - 2)] + [(int(s), int(d)) for s, d in rng.integers(0, n, (2, 2))]
    skips = [(s, d) for s, d in skips if d > s + 1]
    nodes = [
        P.Op(f"n{i}", "op", float(rng.uniform(0.5, 2.0)) * 1e12, 1.0, float(rng.uniform(0.2, 3.0)))
        for i in range(n)
    ]
    edges = [(i, i + 1, 1.0) for i in range(n - 1)] + [(s, d, 1.0) for s, d in skips]
    g = P.OpGraph.build("ring", nodes, edges)
    chips = P.Chiplets(
        4,
        sram_bytes=float(rng.uniform(2.0, 3.0)),
        topology="ring",
        link_bytes_per_s=float(rng.uniform(20.0, 200.0)),
        hop_limit=1 + seed % 3,  # 3: any span fits, the routing alone decides
    )
    want = brute_best(g, chips)
    if want == 0.0:
        with pytest.raises(P.InfeasibleError):
            P.search(g, chips, "solver", time_limit_s=10.0)
        return
    got = P.search(g, chips, "solver", time_limit_s=10.0)
    assert got.extra["optimal"] and P.is_valid(g, chips, got.assignment)
    assert got.throughput == pytest.approx(want, rel=1e-3)
