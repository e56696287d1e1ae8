"""The held-out graphs, chiplets sized to a graph, the DP's hop limits and the shipped policy."""

from __future__ import annotations

import dataclasses
import itertools
import tomllib
import types
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from atoll import partition as P
from atoll.partition import _heldout, _policy, _rl, _synthetic
from atoll.partition._baselines import Tracker
from atoll.partition._models import rnn_graph, tied_transformer_graph, transformer_graph
from atoll.partition._policy import PRETRAINED, PRETRAINED_SET, init_params
from atoll.partition._repair import Repairer


def test_heldout_set_is_real_architectures_apart_from_training() -> None:
    names = _heldout.heldout_names()
    assert len(names) >= 5
    for name in names:
        g = _heldout.heldout_graph(name)
        assert g.name == name and 25 <= len(g) <= 300
        assert g.total_flops > 1e9 and g.total_weight_bytes > 1e5
    # training draws from its own families, none of them held out
    assert not set(names) & set(_synthetic.FAMILIES + _synthetic.SHARED_FAMILIES)
    assert "from ._heldout" not in Path(_synthetic.__file__).read_text()
    trained = {g.name.split("_")[0] for g, _ in P.synthetic_cases(12, seed=0)}
    assert not trained & set(names) and "bert" not in trained


def test_synthetic_set_spans_the_new_families() -> None:
    rng = np.random.default_rng(1)
    seen = {_synthetic.synthetic_graph(rng).name.split("_")[0] for _ in range(30)}
    assert seen == set(_synthetic.FAMILIES)  # the shipped policy's set: no shared weights
    every = _synthetic.FAMILIES + _synthetic.SHARED_FAMILIES
    seen = {_synthetic.synthetic_graph(rng, every).name.split("_")[0] for _ in range(40)}
    assert seen == set(every)
    cases = P.synthetic_cases(4, seed=0, families=_synthetic.SHARED_FAMILIES)
    assert {g.name.split("_")[0] for g, _ in cases} <= set(_synthetic.SHARED_FAMILIES)
    with pytest.raises(ValueError, match="families"):
        _synthetic.synthetic_graph(rng, ("gru",))  # a held-out graph is no family


def test_weight_tied_families_hold_every_weight_on_the_first_reader() -> None:
    tied = tied_transformer_graph(6, 128, 4, 32, 1000)
    untied = transformer_graph(6, 128, 4, 32, 1000)
    assert len(tied) == len(untied)  # the same computation, six layers
    assert np.flatnonzero(tied.array("weights")).max() < 2 * len(tied) / 6  # the first layer's
    assert np.flatnonzero(untied.array("weights")).max() > 5 * len(untied) / 6
    assert tied.total_weight_bytes < untied.total_weight_bytes / 3
    rnn = rnn_graph(steps=10, hidden=64, layers=2, batch=4)
    elements = 2 * (2 * 64 * 64 + 64) + 64 * 64  # two cells and the read-out, bf16
    assert rnn.total_weight_bytes == 2 * elements
    assert np.flatnonzero(rnn.array("weights")).max() < len(rnn) / 10  # all read at step 0
    assert rnn.total_flops >= 10 * 3 * 2 * 4 * 64 * 64  # each step: three products of 4 x 64


@pytest.mark.parametrize("name", ["mixer", "densenet", "t5"])
@pytest.mark.parametrize("count", [4, 8])
def test_default_for_binds_yet_stays_feasible(name: str, count: int) -> None:
    g = _heldout.heldout_graph(name)
    chips = P.Chiplets.default_for(g, count)
    split = P.dp_split(g, chips)
    assert split is not None and P.is_valid(g, chips, split)  # a valid partition exists
    rng = np.random.default_rng(0)
    assert not any(P.is_valid(g, chips, rng.integers(0, count, len(g))) for _ in range(500))
    # memory binds: the best split with unbounded SRAM does not fit
    free = P.dp_split(g, dataclasses.replace(chips, sram_bytes=float("inf")))
    assert free is not None
    assert not P.is_valid(g, chips, free) or P.throughput(g, chips, free) == pytest.approx(
        P.throughput(g, chips, split)
    )


def test_search_with_a_bare_count_sizes_the_chiplets_to_the_graph() -> None:
    g = _heldout.heldout_graph("densenet")
    bare = P.search(g, 4, "dp")
    sized = P.search(g, P.Chiplets.default_for(g, 4), "dp")
    assert bare.assignment == sized.assignment and bare.throughput == sized.throughput
    assert max(s.weight_bytes for s in bare.stages) <= P.Chiplets.default_for(g, 4).sram_bytes


def _contiguous_best(g: P.OpGraph, chips: P.Chiplets) -> float:
    best, n = 0.0, len(g)
    for cuts in itertools.combinations(range(1, n), chips.count - 1):
        split = np.searchsorted(np.array(cuts), np.arange(n), side="right")
        best = max(best, P.throughput(g, chips, split))
    return best


@pytest.mark.parametrize("seed", range(4))
def test_dp_with_hop_limits_above_one(seed: int) -> None:
    """Valid for every hop limit; exact over contiguous splits when the limit cannot bind."""
    rng = np.random.default_rng(seed)
    n = 11
    nodes = [P.Op(f"n{i}", "op", float(rng.uniform(1e9, 1e10)), 1.0, 1e5) for i in range(n)]
    edges = [(i, i + 1, 1e5) for i in range(n - 1)]
    edges += [(i, min(i + int(rng.integers(2, 6)), n - 1), 1e5) for i in range(0, n - 2, 2)]
    g = P.OpGraph.build("skips", nodes, edges)
    for hop in (2, 3):
        chips = P.Chiplets(4, sram_bytes=1e9, hop_limit=hop, link_bytes_per_s=1e9)
        a = P.dp_split(g, chips)
        best = _contiguous_best(g, chips)
        if a is None:
            assert hop == 2  # the path-dependent check may miss; h >= count - 1 never does
            continue
        assert P.is_valid(g, chips, a)
        if hop >= chips.count - 1:
            assert P.throughput(g, chips, a) == pytest.approx(best)


def test_pretrained_policy_ships_and_loads() -> None:
    ref = resources.files("atoll.partition") / PRETRAINED
    assert ref.is_file() and len(ref.read_bytes()) < 4 << 20
    policy = P.Policy.pretrained()
    assert set(policy.params) == set(init_params())
    assert policy.trained_evaluations >= 1000
    fresh = P.Policy(seed=0)
    assert any(not np.allclose(policy.params[k], fresh.params[k]) for k in fresh.params)
    assert P.Policy.pretrained() is not policy  # a fresh copy each time: fine-tuning is in place


def test_the_shipped_set_is_two_different_policies() -> None:
    first, shared = P.Policy.pretrained_set()
    assert set(first.params) == set(shared.params) == set(init_params())
    assert any(not np.allclose(first.params[k], shared.params[k]) for k in first.params)
    for k in first.params:  # the first of the set is the one Policy.pretrained() gives
        np.testing.assert_array_equal(first.params[k], P.Policy.pretrained().params[k])


@pytest.mark.parametrize("count", [4, 8])
def test_fine_tuning_starts_from_the_best_greedy_assignment_of_the_set(count: int) -> None:
    g = _heldout.heldout_graph("gru")
    chips = P.Chiplets.default_for(g, count)
    fresh, shipped = P.Policy(seed=3), P.Policy.pretrained()
    enc = _policy.encode(g, chips)
    repair = Repairer(g, chips)
    scores = [
        P.throughput(g, chips, repair(np.argmax(p.logits(enc), axis=-1))) for p in (fresh, shipped)
    ]
    assert scores[0] != scores[1]  # else the test could not tell which one was taken
    winner = (fresh, shipped)[int(np.argmax(scores))]
    kept = {k: v.copy() for k, v in winner.params.items()}
    tracker = Tracker(g, chips, Repairer(g, chips), budget=2)  # the two greedy ones only
    P.finetune(fresh, tracker, np.random.default_rng(0), rivals=[shipped])
    assert len(tracker.history) == 2 and tracker.best_tp == pytest.approx(max(scores))
    for k, v in kept.items():
        np.testing.assert_array_equal(fresh.params[k], v)


class _FallingBack:
    """What ``_take_best_greedy`` reads of a tracker: each evaluation scores the
    next of ``scores``; the ones in ``fell_back`` are a repair that ran out of
    time and returned a partition known already."""

    def __init__(self, scores: list[float], fell_back: set[int]) -> None:
        self.scores, self.fell_back = scores, fell_back
        self.history: list[float] = []
        self.repairer = types.SimpleNamespace(fallbacks=0)

    @property
    def left(self) -> int:
        return len(self.scores) - len(self.history)

    def evaluate(self, candidate: object) -> tuple[object, float]:
        i = len(self.history)
        self.history.append(self.scores[i])
        self.repairer.fallbacks += i in self.fell_back
        return candidate, self.scores[i]


def test_a_greedy_assignment_whose_repair_fell_back_is_not_chosen() -> None:
    g = _heldout.heldout_graph("gru")
    enc = _policy.encode(g, P.Chiplets.default_for(g, 4))
    first, rival = P.Policy(seed=1), P.Policy(seed=2)
    own = {k: v.copy() for k, v in first.params.items()}
    tracker = _FallingBack([10.0, 50.0], fell_back={1})  # the rival "scores" a known partition
    _rl._take_best_greedy(first, [rival], enc, tracker)  # type: ignore[arg-type]
    assert all(np.array_equal(first.params[k], v) for k, v in own.items())
    tracker = _FallingBack([10.0, 50.0], fell_back=set())  # its own repair: it is taken
    _rl._take_best_greedy(first, [rival], enc, tracker)  # type: ignore[arg-type]
    assert all(np.array_equal(first.params[k], v) for k, v in rival.params.items())


def test_a_budget_of_one_is_one_evaluation() -> None:
    g = _heldout.heldout_graph("gru")  # the solver's seed, the set, the DP's split: no room
    assert P.search(g, 4, "rl", budget=1).evaluations == 1


def test_pyproject_ships_the_checkpoint_in_the_wheel() -> None:
    root = Path(P.__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["atoll.partition"]
    for name in (PRETRAINED, *PRETRAINED_SET):
        assert any(Path(name).match(p) for p in patterns)


def test_training_is_reproducible_with_a_seed() -> None:
    cases = P.synthetic_cases(2, seed=3)
    a, b = P.Policy(seed=5), P.Policy(seed=5)
    P.pretrain(a, cases, evaluations=16, seed=7, batch=4)
    P.pretrain(b, cases, evaluations=16, seed=7, batch=4)
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], b.params[k])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pretrained_rl_beats_random_on_a_heldout_graph() -> None:
    """Fixed seed, equal budget, a graph the policies never saw: RL (the shipped set,
    the better one fine-tuned) returns a valid partition better than random search's,
    with and without the DP's split among its first evaluations."""
    g = _heldout.heldout_graph("t5")
    chips = P.Chiplets.default_for(g, 4)
    rnd = P.search(g, chips, "random", budget=24, seed=0)
    # without the DP's hint too, so the policy itself has to do better
    for hint in (True, False):
        rl = P.search(g, chips, "rl", budget=24, seed=0, rl_hint=hint)
        assert rl.valid and P.is_valid(g, chips, rl.assignment)
        assert rl.throughput > rnd.throughput, hint
