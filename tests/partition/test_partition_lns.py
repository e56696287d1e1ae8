"""The solver's large-neighbourhood polish: windows of chiplets re-solved by CP-SAT."""

from __future__ import annotations

import io
import itertools

import numpy as np
import pytest

from atoll import partition as P
from atoll.partition import _cpmodel, _heldout, _lns, _solver
from atoll.partition._baselines import STALLED, Stall, Tracker
from atoll.partition._cost import IntArray
from atoll.partition._progress import ProgressBar
from atoll.partition._repair import Repairer


def test_windows_touch_the_slowest_stage_or_a_neighbour() -> None:
    assert _lns.windows(8, 0, 3) == [(0, 1, 2), (1, 2, 3)]
    assert _lns.windows(8, 5, 3) == [(2, 3, 4), (3, 4, 5), (4, 5, 6), (5, 6, 7)]
    assert _lns.windows(8, 7, 4) == [(3, 4, 5, 6), (4, 5, 6, 7)]
    assert _lns.windows(3, 1, 5) == [(0, 1, 2)]  # clipped: the whole chain
    # on a ring they wrap round: chiplet 0's neighbours are 7 and 1
    assert _lns.windows(8, 0, 3, ring=True) == [
        (0, 1, 2),
        (1, 2, 3),
        (5, 6, 7),
        (6, 7, 0),
        (7, 0, 1),
    ]
    assert _lns.windows(4, 2, 4, ring=True) == [(0, 1, 2, 3)]


def test_keep_pins_nodes_and_needs_a_hint() -> None:
    g = _heldout.heldout_graph("mixer")
    chips = P.Chiplets.default_for(g, 4)
    start = _solver.solve_bottleneck(g, chips, 60.0, deterministic_s=0.2)[0]
    keep = start != 1  # only the nodes on chiplet 1 may move
    new, _ = _solver.solve_bottleneck(g, chips, 60.0, hint=start, deterministic_s=0.5, keep=keep)
    np.testing.assert_array_equal(new[keep], start[keep])
    assert set(new[~keep].tolist()) <= {0, 1, 2}  # hop limit 1 and forward flow
    with pytest.raises(ValueError, match="hint"):
        _solver.solve_bottleneck(g, chips, 1.0, keep=keep)


def _chain(n: int = 60) -> P.OpGraph:
    """A chain of matmuls of uneven cost, with skip edges two ahead."""
    rng = np.random.default_rng(1)
    nodes = [P.Op(f"n{i}", "matmul", float(rng.uniform(1e9, 8e9)), 0.0, 1e6) for i in range(n)]
    edges = [(i, i + 1, 1e6) for i in range(n - 1)] + [(i, i + 2, 5e5) for i in range(n - 2)]
    return P.OpGraph.build("chain", nodes, edges)


def test_polish_reaches_the_proved_optimum_from_a_poor_start() -> None:
    g, chips = _chain(), P.Chiplets(6, link_bytes_per_s=5e10)
    best, stats = _solver.solve_bottleneck(g, chips, 60.0)
    assert stats["optimal"]
    optimum = P.throughput(g, chips, best)
    poor = np.minimum(np.arange(len(g)) // 6, 5)  # 6 nodes each, the rest on the last
    assert P.is_valid(g, chips, poor) and P.throughput(g, chips, poor) < 0.6 * optimum
    tracker = Tracker(g, chips, Repairer(g, chips), budget=60)
    tracker.evaluate(poor)
    _lns.lns_polish(tracker, np.random.default_rng(0))
    assert tracker.best is not None and P.is_valid(g, chips, tracker.best)
    assert tracker.best_tp == pytest.approx(optimum, rel=1e-4)
    assert np.all(np.diff(tracker.history) >= 0) and len(tracker.history) <= 60


def test_polish_stops_within_its_budget_and_at_a_local_optimum() -> None:
    g, chips = _chain(), P.Chiplets(6, link_bytes_per_s=5e10)
    best, _ = _solver.solve_bottleneck(g, chips, 60.0)
    tracker = Tracker(g, chips, Repairer(g, chips), budget=1000)
    tracker.evaluate(best)
    _lns.lns_polish(tracker, np.random.default_rng(0))
    # nothing improves an optimum: every window of every size once, then it stops (a
    # re-split of the first windows' partition may even out the stages below the slowest
    # once, and the windows start again)
    sizes = range(_lns.FIRST_WINDOW, chips.count + 1)
    slow = int(np.argmax(P.stage_times(g, chips, best)))
    windows = sum(len(_lns.windows(6, slow, s)) for s in sizes)
    assert len(tracker.history) - 1 <= 2 * windows + 2
    assert tracker.best_tp == pytest.approx(P.throughput(g, chips, best))
    small = Tracker(g, chips, Repairer(g, chips), budget=3)
    small.evaluate(np.minimum(np.arange(len(g)) // 6, 5))
    _lns.lns_polish(small, np.random.default_rng(0))
    assert len(small.history) == 3


def test_stuck_windows_get_more_time_then_kicks(monkeypatch: pytest.MonkeyPatch) -> None:
    """When no window of any size improves, every window is tried again with
    twice the solver time, up to MAX_WINDOW_S; then kicks spend the rest of the
    budget, each one evaluation and a short descent (windows of 3 and 4
    chiplets at 0.5 s). A proof of the whole ends it."""
    g, chips = _chain(), P.Chiplets(6, link_bytes_per_s=5e10)
    start = np.minimum(np.arange(len(g)) // 10, 5)
    asked: list[tuple[float, int]] = []  # (solver time, chiplets freed)

    def stuck(graph, chiplets, step_s, hint, seed, keep, focus):  # type: ignore[no-untyped-def]
        asked.append((step_s, len(set(hint[~keep].tolist()))))
        return hint.copy(), False  # the same partition: nothing improves

    monkeypatch.setattr(_lns, "solver_step", stuck)
    monkeypatch.setattr(_lns, "resplit", lambda graph, chiplets, a, rng: a.copy())
    tracker = Tracker(g, chips, Repairer(g, chips), budget=200)
    tracker.evaluate(start)
    _lns.lns_polish(tracker, np.random.default_rng(0))
    assert _lns.MAX_WINDOW_S == 2.0
    per_round = [t for t, _ in asked].index(1.0)
    first = asked[: 3 * per_round]
    assert [t for t, _ in first] == [t for t in (0.5, 1.0, 2.0) for _ in range(per_round)]
    assert {n for _, n in first} == {3, 4, 5, 6}  # every size, the whole chain too
    kicks = asked[3 * per_round :]
    assert kicks and all(t == 0.5 and n <= 4 for t, n in kicks)
    assert len(tracker.history) == 200  # the whole budget: the steps and one per kick
    assert 200 - 1 - len(asked) >= 2  # kicks

    proved: list[float] = []

    def optimal(graph, chiplets, step_s, hint, seed, keep, focus):  # type: ignore[no-untyped-def]
        proved.append(step_s)
        return hint.copy(), bool(keep.sum() == 0)  # the whole problem: proved

    monkeypatch.setattr(_lns, "solver_step", optimal)
    tracker = Tracker(g, chips, Repairer(g, chips), budget=1000)
    tracker.evaluate(start)
    _lns.lns_polish(tracker, np.random.default_rng(0))
    assert set(proved) == {0.5} and len(proved) == per_round  # no second round


def test_a_walk_resplits_when_the_first_windows_are_stuck_and_every_few_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While a stage is idle, a re-split (one evaluation) when the first windows
    are stuck and every RESPLIT_EVERY window steps, never twice on one
    partition; the steps to the next double after one that finds nothing and
    return after one that finds something. What it finds the windows go on
    from."""
    g, chips = _uniform(), P.Chiplets(6, link_bytes_per_s=1e15)
    start = np.repeat(np.arange(6), [12, 11, 11, 11, 10, 5])
    steps: list[int] = []

    def stuck(graph, chiplets, step_s, hint, seed, keep, focus):  # type: ignore[no-untyped-def]
        steps.append(0)
        return hint.copy(), False

    monkeypatch.setattr(_lns, "solver_step", stuck)
    tracker = Tracker(g, chips, Repairer(g, chips), budget=4)
    tracker.evaluate(start)
    _lns.lns_polish(tracker, np.random.default_rng(0))
    # the two first windows next to stage 0, stuck; the re-split balances the chain
    assert len(steps) == 2 and len(tracker.history) == 4
    assert tracker.best is not None and np.bincount(tracker.best).tolist() == [10] * 6

    walk = _lns._Walk(Tracker(g, chips, Repairer(g, chips), 100), np.random.default_rng(0), 0, None)
    walk.tracker.evaluate(start)
    monkeypatch.setattr(_lns, "resplit", lambda graph, chiplets, a, rng: a.copy())

    def due(a: IntArray, stuck: bool) -> bool:
        return walk.resplit_due(a, P.stage_times(g, chips, a), stuck)

    assert not due(start, stuck=False) and due(start, stuck=True)
    even = np.repeat(np.arange(6), 10)
    assert not due(even, stuck=True)  # no stage idle: no re-split
    walk.steps = _lns.RESPLIT_EVERY
    assert due(start, stuck=False)
    assert walk.resplit(start, P.stage_times(g, chips, start)) is None
    assert len(walk.tracker.history) == 2
    assert walk.every == 2 * _lns.RESPLIT_EVERY and walk.steps == 0
    assert not due(start, stuck=True)  # never twice the same partition
    other = np.repeat(np.arange(6), [11, 12, 11, 11, 10, 5])
    walk.steps = 2 * _lns.RESPLIT_EVERY - 1
    assert not due(other, stuck=False)
    walk.steps += 1
    assert due(other, stuck=False)
    monkeypatch.setattr(_lns, "resplit", lambda graph, chiplets, a, rng: even)
    found = walk.resplit(other, P.stage_times(g, chips, other))
    assert found is not None and np.array_equal(found, even)
    assert walk.every == _lns.RESPLIT_EVERY and walk.tracker.best_tp == P.throughput(g, chips, even)


def test_a_window_step_that_finds_nothing_counts_and_stops_the_growth(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A window whose CP-SAT run returns nothing in its time is one evaluation
    like any step, and no window with as many free nodes is tried at that
    time (here the whole chain, one chiplet wider)."""
    g, chips = _chain(), P.Chiplets(6, link_bytes_per_s=5e10)
    asked: list[tuple[float, int, int]] = []  # (solver time, chiplets freed, evaluations)

    def too_big(graph, chiplets, step_s, hint, seed, keep, focus):  # type: ignore[no-untyped-def]
        size = len(set(hint[~keep].tolist()))
        asked.append((step_s, size, len(tracker.history)))
        return (None, False) if size >= 5 else (hint.copy(), False)

    monkeypatch.setattr(_lns, "solver_step", too_big)
    tracker = Tracker(g, chips, Repairer(g, chips), budget=80)
    tracker.evaluate(np.minimum(np.arange(len(g)) // 10, 5))
    _lns.lns_polish(tracker, np.random.default_rng(0))
    assert len(tracker.history) == 80
    counts = [n for _, _, n in asked]
    assert all(b > a for a, b in itertools.pairwise(counts))  # each step counted
    for t in (0.5, 1.0, 2.0):
        sizes = {n for s, n, _ in asked if s == t}
        assert 5 in sizes and 6 not in sizes  # 5 found nothing: 6 is not tried


def test_windows_proved_optimal_are_not_tried_again_with_more_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A window CP-SAT proved optimal cannot gain from more time: until the
    partition changes, only the unproved windows get the doubled time."""
    g, chips = _chain(), P.Chiplets(6, link_bytes_per_s=5e10)
    asked: list[tuple[float, int]] = []

    def small_proved(graph, chiplets, step_s, hint, seed, keep, focus):  # type: ignore[no-untyped-def]
        asked.append((step_s, int((~keep).sum())))
        return hint.copy(), len(set(hint[~keep].tolist())) == 3  # windows of 3: proved

    monkeypatch.setattr(_lns, "solver_step", small_proved)
    tracker = Tracker(g, chips, Repairer(g, chips), budget=1000)
    tracker.evaluate(np.minimum(np.arange(len(g)) // 10, 5))
    _lns.lns_polish(tracker, np.random.default_rng(0))
    first = [n for t, n in asked if t == 0.5]
    assert 30 in first and len(first) > len([n for t, n in asked if t == 1.0]) > 0
    assert all(n > 30 for t, n in asked if t > 0.5)  # 10 nodes per chiplet: 3 chiplets


def test_stage_times_compare_slowest_first_then_the_next() -> None:
    faster = _lns._faster
    assert faster(np.array([3.0, 1.0, 2.0]), np.array([1.0, 3.1, 2.0]))
    assert faster(np.array([3.0, 2.9, 1.0]), np.array([3.0, 1.0, 3.0]))  # a tie broken
    assert not faster(np.array([3.0, 1.0, 3.0]), np.array([3.0, 2.9, 1.0]))
    assert not faster(np.array([2.0, 2.0]), np.array([2.0, 2.0 * (1 + 1e-12)]))  # equal


def _uniform(n: int = 60) -> P.OpGraph:
    """A chain of equal matmuls with light tensors: stage time ~ nodes per stage."""
    nodes = [P.Op(f"n{i}", "matmul", 1e9, 0.0, 1e3) for i in range(n)]
    return P.OpGraph.build("uniform", nodes, [(i, i + 1, 1e3) for i in range(n - 1)])


def test_a_band_reaches_from_the_slowest_stage_to_slack_no_window_holds() -> None:
    band = _lns.BAND
    times = np.array([5.0, 4.9, 4.9, 4.9, 4.9, 1.0, 4.9, 4.9])
    assert _lns.bands(times, 0) == [(band, 0, 5)]
    assert _lns.bands(times, 7) == []  # slack two chiplets off: a window of 4 holds both
    assert _lns.bands(np.array([5.0, 1.0, 5, 5, 5, 1]), 0) == []  # slack next door
    both = np.array([1.0, 5, 5, 5, 5, 5, 5, 5, 5, 1])
    assert _lns.bands(both, 5) == [(band, 0, 5), (band, 5, 9)]
    assert _lns.bands(both, 5, wide=True) == [(band, 0, 6), (band, 4, 9)]  # 5's two boundaries
    more_past = np.array([5.0, 4.9, 4.9, 4.9, 4.9, 3.0, 4.9, 4.9, 4.9, 1.0])
    assert _lns.bands(more_past, 0) == [(band, 0, 5)]  # the nearest slack
    assert _lns.bands(more_past, 0, wide=True) == [(band, 0, 5), (band, 0, 9)]  # and the most
    assert _lns.bands(times, 0, wide=True) == [(band, 0, 5)]  # the most is the nearest
    assert _lns.chiplets_of((band, 5, 9)) == (5, 6, 7, 8, 9)
    assert _lns.chiplets_of((2, 3, 4)) == (2, 3, 4)


def _bands_offered(per_chip: list[int], size: int) -> list[tuple[int, ...]]:
    """The bands among a walk's steps to try with windows of ``size``, on a chain
    of uniform nodes ``per_chip`` to a chiplet (links too fast to count)."""
    g = _uniform(sum(per_chip))
    chips = P.Chiplets(len(per_chip), link_bytes_per_s=1e15)
    start = np.repeat(np.arange(len(per_chip)), per_chip)
    walk = _lns._Walk(
        Tracker(g, chips, Repairer(g, chips), budget=10), np.random.default_rng(0), 0, None
    )
    todo = walk.todo(start, P.stage_times(g, chips, start), size, _lns.WINDOW_S, set())
    return [w for w in todo if w[0] == _lns.BAND]


def test_bands_come_with_the_first_two_window_sizes_on_long_chains_only() -> None:
    """Slack at the far end of the chain: a band from the slowest stage (0)
    joins the first windows from BAND_CHIPLETS chiplets on; on 8, where the
    growing windows reach it, none does. The next windows get wide bands
    (here the same, as stage 0 has no stage behind it); with slack nearer
    too, one to the farther (and larger) slack as well."""
    first, later = _lns.FIRST_WINDOW, _lns.FIRST_WINDOW + 1
    for count in (8, _lns.BAND_CHIPLETS):
        on = count >= _lns.BAND_CHIPLETS
        per_chip = [7] + [5] * (count - 2) + [1]  # the middle ones above the mean
        far = [(_lns.BAND, 0, count - 1)] if on else []
        assert _bands_offered(per_chip, first) == far
        assert _bands_offered(per_chip, later) == far
        assert _bands_offered(per_chip, later + 1) == []
        per_chip[5] = 3  # nearer slack: a band to it first, to the most with the next windows
        near = [(_lns.BAND, 0, 5)] if on else []
        assert _bands_offered(per_chip, first) == near
        assert _bands_offered(per_chip, later) == near + far


def test_a_band_frees_the_nodes_at_each_boundary_inside_it() -> None:
    current = np.repeat(np.arange(6), 10)
    free = _lns.freed((_lns.BAND, 1, 4), current, 24)  # 3 boundaries: 4 nodes a side
    assert np.flatnonzero(free).tolist() == [16 + i + 10 * k for k in range(3) for i in range(8)]
    fewest = _lns.freed((_lns.BAND, 1, 4), current, 6)  # one a side asked: BAND_SIDE given
    assert int(fewest.sum()) == 3 * 2 * _lns.BAND_SIDE
    np.testing.assert_array_equal(_lns.freed((1, 2), current, 12), np.isin(current, (1, 2)))


def test_a_band_step_moves_load_to_slack_that_no_first_window_reaches() -> None:
    """Stages of 12, 11, 11, 11, 10 and 5 nodes: no window of 3 next to the
    slowest (stage 0) can gain (34 nodes on 3 chiplets need one of 12); the
    band from it to stage 5 passes nodes across each boundary and balances."""
    g, chips = _uniform(), P.Chiplets(6, link_bytes_per_s=1e15)
    start = np.repeat(np.arange(6), [12, 11, 11, 11, 10, 5])
    times = P.stage_times(g, chips, start)
    assert int(np.argmax(times)) == 0
    for window in _lns.windows(6, 0, 3):
        keep = ~np.isin(start, window)
        new, _ = _solver.solver_step(g, chips, 1.0, start, 0, keep, window)
        assert new is not None and P.stage_times(g, chips, new).max() == pytest.approx(times.max())
    (band,) = _lns.bands(times, 0)
    assert band == (_lns.BAND, 0, 5)
    free = _lns.freed(band, start, 60)
    new, _ = _solver.solver_step(g, chips, 1.0, start, 0, ~free, _lns.chiplets_of(band))
    assert new is not None and P.is_valid(g, chips, new)
    assert np.bincount(new, minlength=6).tolist() == [10] * 6


def test_a_window_shortens_its_own_stages_when_another_ties_for_slowest() -> None:
    """Stages 0 and 4 tie for the slowest; a window on chiplets 3 to 5 cannot
    change stage 0, so the throughput cannot rise, but with ``focus`` CP-SAT
    still balances the window (the next step can then work on stage 0)."""
    g, chips = _uniform(), P.Chiplets(6, link_bytes_per_s=1e15)
    start = np.repeat(np.arange(6), [13, 8, 8, 6, 13, 12])
    keep = ~np.isin(start, (3, 4, 5))
    new, stats = _solver.solve_bottleneck(
        g, chips, 60.0, hint=start, deterministic_s=5.0, keep=keep, focus=(2, 3, 4, 5)
    )
    before, after = P.stage_times(g, chips, start), P.stage_times(g, chips, new)
    assert after.max() == pytest.approx(before.max()) and stats["optimal"]
    # the 31 freed nodes may join chiplet 2's 8 as well: 39 nodes on 4 chiplets
    assert np.bincount(new, minlength=6)[2:].max() == 10
    assert _lns._faster(after, before)


@pytest.mark.slow
def test_the_hinted_stage_times_are_the_cost_models() -> None:
    g = _heldout.heldout_graph("wavenet")
    for topology in ("chain", "ring"):
        chips = P.Chiplets.default_for(g, 4, topology=topology)
        start = _solver.solve_bottleneck(g, chips, 60.0, deterministic_s=0.5)[0]
        bm = _solver.bottleneck_model(g, chips, start)
        times = P.stage_times(g, chips, start)
        np.testing.assert_allclose(np.array(bm.hinted) * bm.unit, times, rtol=1e-3)


@pytest.mark.parametrize("topology", ["chain", "ring"])
def test_a_windows_model_routes_only_tensors_with_a_free_node(topology: str) -> None:
    g = _heldout.heldout_graph("wavenet")
    chips = P.Chiplets.default_for(g, 8, topology=topology)
    start = Repairer(g, chips)(np.arange(len(g)) * 8 // len(g))
    window = (7, 0, 1) if topology == "ring" else (3, 4, 5)  # on a ring, across the wrap
    keep = ~np.isin(start, window)
    bounds = _cpmodel.chip_bounds(g, chips, start, keep)
    assert bounds is not None
    bm = _solver.bottleneck_model(g, chips, start, bounds)
    whole = _solver.bottleneck_model(g, chips, start)
    # the pinned tensors are constants on the links: the model grows with the window
    assert len(bm.sm.model.proto.variables) < len(whole.sm.model.proto.variables) / 2
    np.testing.assert_allclose(
        np.array(bm.hinted) * bm.unit, P.stage_times(g, chips, start), rtol=1e-3
    )
    new, stats = _solver.solve_bottleneck(
        g, chips, 60.0, hint=start, deterministic_s=2.0, keep=keep
    )
    np.testing.assert_array_equal(new[keep], start[keep])
    # the model's bottleneck is the cost model's slowest stage, to its rounding
    assert stats["objective_s"] == pytest.approx(P.stage_times(g, chips, new).max(), rel=1e-3)


@pytest.mark.parametrize("topology", ["chain", "ring"])
def test_the_hint_is_complete_and_a_solution(topology: str) -> None:
    from ortools.sat.python import cp_model

    g = _heldout.heldout_graph("wavenet")
    for count in (4, 8):
        chips = P.Chiplets.default_for(g, count, topology=topology)
        start = Repairer(g, chips)(np.arange(len(g)) * count // len(g))
        bm = _solver.bottleneck_model(g, chips, start)
        proto = bm.sm.model.proto
        assert sorted(proto.solution_hint.vars) == list(range(len(proto.variables)))
        if topology == "ring":
            assert bm.sm.wraps  # hop limit 1 on 4 and 8 chiplets: edges may wrap
        # every variable fixed at its hint: CP-SAT must find that one solution
        bm.sm.model.minimize(bm.bottleneck)
        solver = cp_model.CpSolver()
        solver.parameters.fix_variables_to_their_hinted_value = True
        solver.parameters.num_workers = 1
        assert solver.solve(bm.sm.model) == cp_model.OPTIMAL
        assert solver.value(bm.bottleneck) == max(bm.hinted)
        np.testing.assert_array_equal(bm.sm.chips(solver), start)


@pytest.mark.timeout(120)
def test_rl_as_shipped_spends_a_share_on_windows() -> None:
    g = _heldout.heldout_graph("mixer")
    chips = P.Chiplets.default_for(g, 4)
    solved = P.search(g, chips, "solver", time_limit_s=30.0)
    shown: list[tuple[int, int]] = []
    rl = P.search(
        g,
        chips,
        "rl",
        budget=24,
        seed=0,
        rl_solver_s=0.5,
        rl_lns=0.5,
        progress=lambda done, total, _: shown.append((done, total)),
    )
    assert rl.valid and rl.evaluations <= 24
    # progress counts against the whole budget, also while fine-tuning leaves room
    assert shown == [(i + 1, 24) for i in range(rl.evaluations)]
    assert rl.throughput >= 0.99 * solved.throughput
    with pytest.raises(ValueError, match="share"):
        P.search(g, chips, "rl", budget=24, rl_lns=1.5)


@pytest.mark.slow
def test_polish_on_a_ring_stays_valid_and_reaches_the_optimum() -> None:
    g = _chain(30)
    chips = P.Chiplets(5, link_bytes_per_s=5e10, topology="ring")
    best, stats = _solver.solve_bottleneck(g, chips, 60.0)
    assert stats["optimal"]
    poor = np.minimum(np.arange(len(g)) // 4, 4)
    assert P.is_valid(g, chips, poor)
    assert P.throughput(g, chips, poor) < 0.8 * P.throughput(g, chips, best)
    tracker = Tracker(g, chips, Repairer(g, chips), budget=60)
    tracker.evaluate(poor)
    _lns.lns_polish(tracker, np.random.default_rng(0))
    assert tracker.best is not None and P.is_valid(g, chips, tracker.best)
    assert tracker.best_tp == pytest.approx(P.throughput(g, chips, best), rel=1e-4)


def test_a_progress_bar_that_stops_short_ends_its_line() -> None:
    out = io.StringIO()
    bar = ProgressBar("rl", stream=out)
    bar(3, 10, 1.0)
    assert not out.getvalue().endswith("\n")
    bar.finish()
    bar.finish()  # once only
    assert out.getvalue().endswith("\n") and out.getvalue().count("\n") == 1
    bar(10, 10, 2.0)  # a finished bar ends its own line
    bar.finish()
    assert out.getvalue().count("\n") == 2


@pytest.mark.parametrize("topology", ["chain", "ring"])
def test_a_windows_model_prices_each_stage_as_the_cost_model(topology: str) -> None:
    """With most nodes pinned (their compute and the tensors between them are
    constants of the model), each stage's expression at the hint, and the
    hinted stage times, are the cost model's, and the hint is a solution."""
    from ortools.sat.python import cp_model

    g = _heldout.heldout_graph("wavenet")
    chips = P.Chiplets.default_for(g, 8, topology=topology)
    start = Repairer(g, chips)(np.arange(len(g)) * 8 // len(g))
    times = P.stage_times(g, chips, start)
    for window in ((0, 1, 2), (3, 4, 5), (5, 6, 7)):
        keep = ~np.isin(start, window)
        bounds = _cpmodel.chip_bounds(g, chips, start, keep)
        bm = _solver.bottleneck_model(g, chips, start, bounds)
        assert bm.sm.free is not None and set(bm.sm.free) <= set(np.flatnonzero(~keep).tolist())
        np.testing.assert_allclose(np.array(bm.hinted) * bm.unit, times, rtol=1e-3)
        bm.sm.model.minimize(bm.bottleneck)
        solver = cp_model.CpSolver()
        solver.parameters.fix_variables_to_their_hinted_value = True
        solver.parameters.num_workers = 1
        assert solver.solve(bm.sm.model) == cp_model.OPTIMAL
        at_hint = [solver.value(stage) for stage in bm.stages]
        assert at_hint == bm.hinted


def test_an_overtime_grants_until_the_best_stalls_or_time_runs_out() -> None:
    g, chips = _chain(), P.Chiplets(6, link_bytes_per_s=5e10)
    tracker = Tracker(g, chips, Repairer(g, chips), budget=4)
    later = _lns.Overtime(until_s=3600.0, patience=2)
    tracker.history = [2.0]
    stall = Stall(tracker, later.patience)  # the windows' start
    tracker.history += [2.0]
    assert later.grants(tracker, stall)  # one without a gain: under its patience
    tracker.history += [2.0 * (1 + STALLED) * 1.001]
    assert later.grants(tracker, stall)  # a gain: the count starts again
    tracker.history += [tracker.history[-1] * 1.001] * 2
    assert not later.grants(tracker, stall)  # two that rose less than STALLED
    tracker.history = [2.0]
    assert not _lns.Overtime(until_s=0.0, patience=2).grants(tracker, Stall(tracker, 2))


def test_an_overtime_runs_the_windows_past_the_budget_while_they_gain() -> None:
    g, chips = _chain(), P.Chiplets(6, link_bytes_per_s=5e10)
    poor = np.minimum(np.arange(len(g)) // 6, 5)
    runs = {}
    for name, overtime in [("none", None), ("spent", _lns.Overtime(0.0, 4))]:
        runs[name] = Tracker(g, chips, Repairer(g, chips), budget=3)
        runs[name].evaluate(poor)
        _lns.lns_polish(runs[name], np.random.default_rng(0), overtime=overtime)
    assert len(runs["none"].history) == 3  # exact
    assert runs["spent"].history == [runs["spent"].history[0]]  # its time was up: no step
    out = io.StringIO()  # a bar sees its total only at the end: one line, ended once
    longer = Tracker(g, chips, Repairer(g, chips), budget=3, progress=ProgressBar("", out))
    longer.evaluate(poor)
    _lns.lns_polish(longer, np.random.default_rng(0), overtime=_lns.Overtime(3600.0, 4))
    assert out.getvalue().count("\n") == 1 and out.getvalue().endswith("\n")
    best = longer.history
    assert len(best) > 3 and best[-1] > runs["none"].best_tp
    assert longer.budget == len(best)  # the budget grew with each evaluation granted
    # it ended on a stall: asked with one evaluation in hand, it was refused after
    # 4 without a gain (the next to last), then took the one in hand
    assert best[-2] <= best[-6] * (1 + STALLED)


def test_an_overtime_ends_the_windows_within_the_budget_when_its_time_is_up() -> None:
    g, chips = _chain(), P.Chiplets(6, link_bytes_per_s=5e10)

    def clock(done: int, total: int, best: float) -> None:
        if done == 3:  # a deterministic clock: the time is up on the third evaluation
            tracker.started -= 3600.0

    poor = np.minimum(np.arange(len(g)) // 6, 5)
    unclocked = Tracker(g, chips, Repairer(g, chips), budget=50)
    unclocked.evaluate(poor)
    _lns.lns_polish(unclocked, np.random.default_rng(0), overtime=_lns.Overtime(3600.0, 4))
    assert len(unclocked.history) > 3  # the same polish runs on when its time is not up
    tracker = Tracker(g, chips, Repairer(g, chips), budget=50, progress=clock)
    tracker.evaluate(poor)
    _lns.lns_polish(tracker, np.random.default_rng(0), overtime=_lns.Overtime(3600.0, 4))
    assert len(tracker.history) == 3 and tracker.left > 0


def test_only_the_default_budget_gets_an_overtime(monkeypatch: pytest.MonkeyPatch) -> None:
    from atoll.partition import _search

    got: list[_lns.Overtime | None] = []

    def rl(tracker, tune, solver_s, seed, share, background, overtime):  # type: ignore[no-untyped-def]
        got.append(overtime)
        tracker.evaluate(np.zeros(len(tracker.graph), dtype=np.int64))

    monkeypatch.setattr(_search, "_rl_search", rl)
    g, chips = _chain(), P.Chiplets(6, link_bytes_per_s=5e10)
    P.search(g, chips)
    P.search(g, chips, budget=10)
    P.search(g, chips, stop_at=1.0)
    assert got[1:] == [None, None]
    assert _search.default_budget(g) == 64  # a quarter is less than fine-tuning's patience
    assert got[0] == _lns.Overtime(_search.default_seconds(g), _search.PATIENCE)
    assert _search.default_seconds(g) == pytest.approx(0.3 * len(g))
    big = _chain(1000)  # a quarter of the default budget (333) is the patience
    P.search(big, chips)
    assert got[-1] == _lns.Overtime(300.0, 83)
