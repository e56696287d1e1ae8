"""The JAX side of the partitioner: from_jax coarsening and the RL policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atoll import partition as P


def test_from_jax_fuses_elementwise_and_keeps_anchors() -> None:
    import jax
    import jax.numpy as jnp

    def block(w: Any, x: Any) -> Any:
        h = jax.nn.gelu(x @ w["a"] + w["b"])  # matmul + bias + gelu: one node
        y = h @ w["c"]
        return x + y  # residual add: its own node

    spec: Any = jax.ShapeDtypeStruct
    w = {
        "a": spec((64, 256), jnp.float32),
        "b": spec((256,), jnp.float32),
        "c": spec((256, 64), jnp.float32),
    }
    g = P.from_jax(block, w, spec((16, 64), jnp.float32), weight_argnums=(0,))
    assert [n.kind for n in g.nodes] == ["input", "matmul", "matmul", "add"]
    assert g.nodes[1].weight_bytes == (64 * 256 + 256) * 4
    assert g.nodes[1].flops >= 2 * 16 * 64 * 256
    assert (0, 3) in {(e.src, e.dst) for e in g.edges}  # the residual edge


def test_from_jax_takes_the_first_argument_as_weights_by_default() -> None:
    """``fn(params, x)``, called the common way, gets a graph with weights
    that chiplets can be sized to; one with no weights says why it cannot."""
    import jax
    import jax.numpy as jnp

    def mlp(params: Any, x: Any) -> Any:
        for w in params:
            x = jnp.tanh(x @ w)
        return x

    spec: Any = jax.ShapeDtypeStruct
    params = [spec((128, 128), jnp.float32)] * 4
    x = spec((16, 128), jnp.float32)
    g = P.from_jax(mlp, params, x)
    assert g.total_weight_bytes == 4 * 128 * 128 * 4
    assert P.Chiplets.default_for(g, 2).sram_bytes > 0
    assert P.from_jax(mlp, params, x, weight_argnums=(-2,)) == g
    assert P.from_jax(lambda x: jnp.tanh(x @ x.T), x).total_weight_bytes == 0
    weightless = P.from_jax(mlp, params, x, weight_argnums=())
    with pytest.raises(P.GraphError, match="holds no weights"):
        P.Chiplets.default_for(weightless, 2)
    with pytest.raises(P.GraphError, match="name no argument"):
        P.from_jax(mlp, params, x, weight_argnums=(2,))


def test_bert_layer_structure() -> None:
    g = P.bert_graph()
    kinds = [n.kind for n in g.nodes]
    assert kinds.count("softmax") == 12 and kinds.count("attention") == 24
    assert kinds.count("add") == 24 and kinds.count("matmul") == 72
    assert g.total_weight_bytes == pytest.approx(217.19e6, rel=0.01)


@pytest.mark.slow
def test_policy_handles_any_size_and_count(tmp_path: Path) -> None:
    policy = P.Policy(seed=3)
    for g, chips in P.synthetic_cases(3, seed=1):
        from atoll.partition._policy import encode

        lg = policy.logits(encode(g, chips))
        assert lg.shape == (len(g), chips.count) and np.isfinite(lg).all()


def test_the_solvers_hint_is_the_best_greedy_assignment_of_the_set() -> None:
    from atoll.partition._cost import valid_throughput
    from atoll.partition._policy import encode
    from atoll.partition._repair import Repairer
    from atoll.partition._search import policy_hint

    g, chips = P.synthetic_cases(1, seed=4)[0]
    enc = encode(g, chips)

    def greedy(pol: P.Policy) -> float:
        return valid_throughput(g, chips, Repairer(g, chips)(np.argmax(pol.logits(enc), -1)))

    pols = [P.Policy(seed=s) for s in range(4)]
    values = [greedy(pol) for pol in pols]
    assert len(set(values)) > 1  # the set disagrees, so the choice is tested
    for order in (pols, pols[::-1]):
        hint = policy_hint(order, Repairer(g, chips))
        assert hint is not None and valid_throughput(g, chips, hint) == max(values)
    shipped = [greedy(pol) for pol in P.Policy.pretrained_set()]
    hint = policy_hint(None, Repairer(g, chips))  # None: the shipped set
    assert hint is not None and valid_throughput(g, chips, hint) == max(shipped)


@pytest.mark.slow
def test_checkpoint_save_load_and_finetune(tmp_path: Path) -> None:
    cases = P.synthetic_cases(2, seed=0)
    policy = P.Policy(seed=0)
    log = P.pretrain(policy, cases, evaluations=16, seed=0, batch=4)
    assert log.evaluations[-1] >= 16 and policy.trained_evaluations >= 16
    path = tmp_path / "policy.npz"
    policy.save(path)
    loaded = P.Policy.load(path)
    assert loaded.trained_evaluations == policy.trained_evaluations
    for k, v in policy.params.items():
        np.testing.assert_allclose(loaded.params[k], v)
    g, chips = P.synthetic_cases(1, seed=5)[0]
    before = {k: v.copy() for k, v in loaded.params.items()}
    part = P.search(g, chips, "rl", budget=12, policy=loaded, seed=1, rl_lns=0.0)
    assert part.valid and part.evaluations == 12
    assert any(not np.allclose(before[k], loaded.params[k]) for k in before)


def test_load_rejects_other_files(tmp_path: Path) -> None:
    path = tmp_path / "x.npz"
    np.savez(path, a=np.zeros(2), __evaluations__=np.array(0))
    with pytest.raises(ValueError, match="not a partition policy"):
        P.Policy.load(path)


def test_pretrain_scores_repairs_that_time_out_as_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every repair timing out: rewards are floored, nothing divides by zero or warns."""
    from atoll.partition import _rl

    class Slow:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def __call__(self, candidate: object) -> object:
            raise P.RepairTimeout("slow solver")

    monkeypatch.setattr(_rl, "Repairer", Slow)
    log = P.pretrain(P.Policy(seed=0), P.synthetic_cases(1, seed=0), evaluations=4, batch=4)
    assert log.best == [0.0] and np.isfinite(log.mean_reward).all()


def test_finetuning_heats_up_while_every_sample_scores_the_same() -> None:
    from atoll.partition._rl import MAX_TEMPERATURE, _next_temperature

    same, spread = np.full(8, 2.0), np.linspace(1.0, 2.0, 8)
    temps = [1.0]
    for _ in range(6):
        temps.append(_next_temperature(temps[-1], same))
    assert temps[:4] == [1.0, 2.0, 4.0, 8.0] and temps[-1] == MAX_TEMPERATURE
    assert _next_temperature(8.0, spread) == 4.0 and _next_temperature(1.0, spread) == 1.0


def _collapsed() -> P.Policy:
    """A near-deterministic policy: its bumps so sharp that every sample of a batch
    is the same assignment (as a confident pre-trained policy can be)."""
    policy = P.Policy(seed=0)
    policy.params["log_precision"] = np.full(1, 5.0, np.float32)
    return policy


# the policy's samples only: no DP hint, no local moves, no solver seed
ALONE: dict[str, Any] = {"rl_hint": False, "rl_local": 0, "rl_solver_s": 0.0}


@pytest.mark.slow
def test_rl_escapes_a_collapsed_policy_on_a_heldout_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """When a policy is near-deterministic on a graph, the temperature lets
    fine-tuning leave the few partitions its samples repair to."""
    from atoll.partition import _rl
    from atoll.partition._heldout import heldout_graph

    g = heldout_graph("unet")
    chips = P.Chiplets.default_for(g, 8)
    heated = P.search(g, chips, "rl", budget=100, policy=_collapsed(), seed=0, **ALONE)
    monkeypatch.setattr(_rl, "MAX_TEMPERATURE", 1.0)
    cold = P.search(g, chips, "rl", budget=100, policy=_collapsed(), seed=0, **ALONE)
    assert heated.valid and cold.valid
    assert heated.throughput > cold.throughput


def test_local_moves_beside_the_policy_count_in_the_budget() -> None:
    """Neighbours of the best partition (``rl_local``) find what the collapsed
    policy's own samples take longer to reach, within the same budget."""
    from atoll.partition._heldout import heldout_graph

    g = heldout_graph("unet")
    chips = P.Chiplets.default_for(g, 8)
    alone = P.search(g, chips, "rl", budget=60, policy=_collapsed(), seed=0, **ALONE)
    local_moves = ALONE | {"rl_local": 2}
    local = P.search(g, chips, "rl", budget=60, policy=_collapsed(), seed=0, **local_moves)
    assert alone.evaluations == local.evaluations == 60
    assert local.valid and local.throughput > alone.throughput
