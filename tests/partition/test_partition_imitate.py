"""Pre-training from the solver's partitions, the policy's spectral and ring features,
and the short CP-SAT run that seeds RL."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from atoll import partition as P
from atoll.partition import _heldout, _imitate, _policy, _solver
from atoll.partition._models import rnn_graph


@pytest.fixture(scope="module")
def cases() -> list[tuple[P.OpGraph, P.Chiplets]]:
    return P.synthetic_cases(3, seed=11)


def test_solver_labels_are_valid_and_reproducible(
    cases: list[tuple[P.OpGraph, P.Chiplets]],
) -> None:
    first = _imitate.solver_labels(cases, deterministic_s=0.5)
    again = _imitate.solver_labels(cases, deterministic_s=0.5)
    for (g, chips), a, b in zip(cases, first, again, strict=True):
        assert P.is_valid(g, chips, a)
        np.testing.assert_array_equal(a, b)


def test_a_case_the_solver_cannot_solve_in_its_time_is_labelled_with_the_dp_split() -> None:
    g = rnn_graph(22, 256, 3, 16)  # too large for CP-SAT to find a partition in 0.001 s
    chips = P.Chiplets.default_for(g, 6)
    with pytest.raises(P.RepairTimeout):
        _solver.solve_bottleneck(g, chips, 3600.0, 0, None, deterministic_s=0.001)
    (label,) = _imitate.solver_labels([(g, chips)], deterministic_s=0.001)
    split = P.dp_split(g, chips)
    assert split is not None and P.is_valid(g, chips, label)
    assert P.throughput(g, chips, label) >= P.throughput(g, chips, split)


@pytest.mark.parametrize("proved", [False, True])
def test_an_unproved_solver_partition_slower_than_the_dp_split_is_not_the_label(
    monkeypatch: pytest.MonkeyPatch, proved: bool
) -> None:
    g = P.bert_graph()
    chips = P.Chiplets.default_for(g, 4)
    split = P.dp_split(g, chips)
    assert split is not None
    slow = P.repair(g, chips, [0] * len(g))  # valid, and slower than the split
    assert P.throughput(g, chips, slow) < P.throughput(g, chips, split)

    def found(*args: object, **kwargs: object) -> tuple[np.ndarray, dict[str, object]]:
        return np.asarray(slow, dtype=np.int64), {"optimal": proved}

    monkeypatch.setattr(_imitate, "solve_bottleneck", found)
    (label,) = _imitate.solver_labels([(g, chips)], deterministic_s=0.5)
    # proved optimal, CP-SAT's partition stands (here a stub's); else the faster split
    np.testing.assert_array_equal(label, slow if proved else split)


@pytest.mark.slow
def test_imitation_moves_the_policy_towards_the_labels(
    cases: list[tuple[P.OpGraph, P.Chiplets]],
) -> None:
    labels = _imitate.solver_labels(cases, deterministic_s=0.5)
    policy = P.Policy(seed=0)

    def agreement() -> float:
        encs = [_policy.encode(g, c) for g, c in cases]
        pairs = zip(encs, labels, strict=True)
        hits = [np.argmax(policy.logits(e), axis=-1) == lab for e, lab in pairs]
        return float(np.mean(np.concatenate(hits)))

    before = agreement()
    log = _imitate.imitate(policy, cases, labels, steps=150, lr=1e-2, seed=0)
    assert len(log.evaluations) == 150
    assert np.mean(log.mean_reward[-30:]) > np.mean(log.mean_reward[:30])  # the loss fell
    assert agreement() > before


def test_imitation_needs_one_label_per_case(cases: list[tuple[P.OpGraph, P.Chiplets]]) -> None:
    with pytest.raises(ValueError, match="labels"):
        _imitate.imitate(P.Policy(), cases, [], steps=1)


def test_a_checkpoint_of_other_shapes_is_a_clear_error(tmp_path: Path) -> None:
    old = P.Policy(seed=0)
    old.params["w_in"] = old.params["w_in"][:-3]  # as if written with fewer node features
    old.save(tmp_path / "old.npz")
    with pytest.raises(ValueError, match="partition-train"):
        P.Policy.load(tmp_path / "old.npz")


def test_spectral_features_are_scaled_and_oriented() -> None:
    g = _heldout.heldout_graph("unet")
    spec = _policy._spectral(g)
    assert spec.shape == (len(g), _policy.SPECTRAL)
    np.testing.assert_allclose(np.sqrt(np.mean(spec**2, axis=0)), 1.0, rtol=1e-6)
    order = np.arange(len(g)) - (len(g) - 1) / 2
    assert np.all(spec.T @ order >= 0)  # each rises along the node order


def test_the_policy_sees_the_ring() -> None:
    g = _heldout.heldout_graph("unet")
    chain = _policy.encode(g, P.Chiplets.default_for(g, 4))
    ring = _policy.encode(g, P.Chiplets.default_for(g, 4, topology="ring"))
    assert not chain.pairs[..., 5].any()
    # links from chiplet k back to chiplet 0 the short way, over the count: 0, 1, 2, 1
    np.testing.assert_allclose(ring.pairs[0, :, 5], [0.0, 0.25, 0.5, 0.25])
    ring_flag = 8  # the node feature after memory tightness
    assert not chain.nodes[: chain.n, ring_flag].any() and ring.nodes[: ring.n, ring_flag].all()


def test_synthetic_cases_include_rings() -> None:
    cases = P.synthetic_cases(40, seed=0)
    assert any(c.topology == "ring" for _, c in cases)
    assert any(c.topology == "chain" for _, c in cases)


def test_a_solver_that_runs_out_of_time_is_a_timeout_not_infeasible() -> None:
    g = _heldout.heldout_graph("wavenet")
    chips = P.Chiplets.default_for(g, 8)
    with pytest.raises(P.RepairTimeout):
        _solver.solve_bottleneck(g, chips, 60.0, deterministic_s=1e-6)
    assert _solver.solver_step(g, chips, 1e-6) == (None, False)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rl_seeded_by_the_solver_is_at_least_the_seed() -> None:
    g = _heldout.heldout_graph("mixer")
    chips = P.Chiplets.default_for(g, 4)
    (seed, _), (again, _) = _solver.solver_step(g, chips, 0.5), _solver.solver_step(g, chips, 0.5)
    assert seed is not None and again is not None
    np.testing.assert_array_equal(seed, again)  # deterministic time: the same however busy
    rl = P.search(g, chips, "rl", budget=12, seed=0, rl_solver_s=0.5, rl_lns=0.0)
    assert rl.valid and rl.throughput >= P.throughput(g, chips, seed)
    assert rl.evaluations == 12  # the seed counts in the budget
