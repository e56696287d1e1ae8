"""The repair's fast paths (issue 39, point 3): the LP, then windows around broken chiplets.

The LP (:mod:`atoll.partition._nearest`) is exact under forward flow and the
hop limit; where its assignment also fits SRAM and uses every chiplet it is
the nearest valid one, which CP-SAT's whole solve confirms. Where it breaks a
chiplet, the windowed re-solve still returns a valid assignment, never nearer
than the exact one.
"""

from __future__ import annotations

import numpy as np
import pytest

from atoll import partition as P
from atoll.partition._cost import is_valid_array
from atoll.partition._nearest import OrderLP
from atoll.partition._repair import Repairer

from .test_partition import random_graph


def _whole(g: P.OpGraph, chips: P.Chiplets, cand: np.ndarray) -> np.ndarray:
    """CP-SAT's nearest valid assignment over the whole graph."""
    out = Repairer(g, chips, time_limit_s=30.0)._cp_sat(cand, cand, None, 30.0)
    assert out is not None
    return out


@pytest.mark.parametrize("seed", range(8))
def test_the_lp_is_the_nearest_under_flow_and_hops(seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = random_graph(rng, 24)
    chips = P.Chiplets(4, sram_bytes=float("inf"), hop_limit=1 + seed % 2)
    cand = rng.integers(0, 4, len(g)).astype(np.int64)
    got = OrderLP(g, chips)(cand)
    assert got is not None
    span = got[g.array("dst")] - got[g.array("src")]
    assert span.min() >= 0 and span.max() <= chips.hop_limit
    if is_valid_array(g, chips, got):  # every chiplet used: the nearest valid one
        assert np.abs(got - cand).sum() == np.abs(_whole(g, chips, cand) - cand).sum()
    else:  # an LP relaxes: nothing valid is nearer
        assert np.abs(got - cand).sum() <= np.abs(_whole(g, chips, cand) - cand).sum()


@pytest.mark.parametrize("seed", range(4))
def test_on_a_ring_the_lp_keeps_each_edge_on_its_side(seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = random_graph(rng, 24)
    chips = P.Chiplets(6, sram_bytes=float("inf"), topology="ring", hop_limit=1)
    cand = np.sort(rng.integers(0, 6, len(g))).astype(np.int64)
    cand[-3:] = 5  # the last nodes on the last chiplet: edges into them may wrap
    got = OrderLP(g, chips)(cand)
    assert got is not None  # the candidate is sorted: every edge keeps its own side
    span = got[g.array("dst")] - got[g.array("src")]
    assert span.min() >= 0 and chips.hops(span).max() <= chips.hop_limit
    if is_valid_array(g, chips, got):  # valid, not always the nearest
        assert np.abs(got - cand).sum() >= np.abs(_whole(g, chips, cand) - cand).sum()


@pytest.mark.parametrize("seed", range(6))
def test_windows_around_broken_chiplets_give_a_valid_partition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = random_graph(rng, 60)
    chips = P.Chiplets(8, sram_bytes=float(g.total_weight_bytes) / 6.0)
    repairer = Repairer(g, chips)
    exact = Repairer(g, chips, exact=True)
    for _ in range(4):
        cand = np.sort(rng.integers(0, 8, len(g))).astype(np.int64)
        got = repairer(cand)
        assert is_valid_array(g, chips, got)
        assert np.abs(got - cand).sum() >= np.abs(exact(cand) - cand).sum()
    assert repairer.solved["window"] >= 1  # SRAM binds: some LP assignments overfill a chiplet
    assert exact.solved["window"] == 0  # exact: the LP or the whole graph only


def test_a_large_graph_repairs_in_well_under_a_second_where_the_lp_holds() -> None:
    """The point of the LP: at 900 nodes CP-SAT's whole solve took seconds."""
    g = P.decoder_graph(80)
    chips = P.Chiplets(8, sram_bytes=float("inf"))
    split = np.minimum(np.arange(len(g)) * 8 // len(g), 7)
    cand = split.copy()
    cand[::7] = np.maximum(cand[::7] - 1, 0)  # some nodes a chiplet early
    repairer = Repairer(g, chips)
    got = repairer(cand)
    assert is_valid_array(g, chips, got) and repairer.solved == {"lp": 1, "window": 0, "whole": 0}


@pytest.mark.parametrize(
    ("seed", "topology"), [(0, "chain"), (1, "chain"), (2, "ring"), (3, "ring")]
)
def test_a_model_of_the_free_nodes_solves_as_the_whole_model_with_pins(
    seed: int, topology: str
) -> None:
    """An LNS step's model holds only the free nodes (the pinned ones are
    constants); its optimum is that of the whole model with the pins as
    constraints, as before."""
    from ortools.sat.python import cp_model

    from atoll.partition._cpmodel import chip_bounds
    from atoll.partition._solver import bottleneck_model, solve_bottleneck

    rng = np.random.default_rng(seed)
    g = random_graph(rng, 40)
    chips = P.Chiplets.default_for(g, 6, topology=topology)
    start = P.repair(g, chips, np.sort(rng.integers(0, 6, len(g))))
    keep = ~np.isin(start, (2, 3))
    _, small = solve_bottleneck(g, chips, 30.0, hint=start, keep=keep)
    whole = bottleneck_model(g, chips, start)
    for i in np.flatnonzero(keep).tolist():
        whole.sm.model.add(whole.sm.x[i][int(start[i])] == 1)
    whole.sm.model.minimize(whole.bottleneck)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    assert solver.solve(whole.sm.model) == cp_model.OPTIMAL and small["optimal"]
    assert small["objective_s"] == pytest.approx(solver.objective_value * whole.unit)
    # the hint's stage times count the pinned nodes' traffic too (a complete, valid hint)
    bounds = chip_bounds(g, chips, start, keep)
    hinted = bottleneck_model(g, chips, start, bounds)
    want = P.stage_times(g, chips, start) / hinted.unit
    assert np.allclose(hinted.hinted, want, rtol=1e-3, atol=len(g))


def test_chip_bounds_follow_flow_and_hops_from_the_pins() -> None:
    from atoll.partition._cpmodel import chip_bounds

    g = P.OpGraph.build(
        "line", [P.Op(f"n{i}") for i in range(5)], [(i, i + 1, 1.0) for i in range(4)]
    )
    chips = P.Chiplets(6, hop_limit=1)
    at = np.array([1, 0, 0, 0, 3])
    bounds = chip_bounds(g, chips, at, np.array([True, False, False, False, True]))
    assert bounds is not None
    lo, hi = bounds
    assert lo.tolist() == [1, 1, 1, 2, 3] and hi.tolist() == [1, 2, 3, 3, 3]
    assert chip_bounds(g, chips, np.array([0, 0, 0, 0, 5]), np.array([1, 0, 0, 0, 1], bool)) is None
