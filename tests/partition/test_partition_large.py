"""``atoll bench partition --large`` (issue 39): the tiny run, cases, and the reference file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atoll.benchmarks import partition as bench
from atoll.benchmarks import partition_large as large


def test_the_tiny_large_run_gives_every_method_a_gap_to_its_reference(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench.main(["--large", "--tiny", "--transfer", "16", "--json"]) == 0
    rows = {r["case"]: r["value"] for r in map(json.loads, capsys.readouterr().out.splitlines())}
    for method in ("rl", "sa", "random", "solver"):
        assert rows[f"tiny_c4_{method}"] > 0 and rows[f"tiny_c4_{method}_s"] >= 0
        # the reference is CP-SAT from the best of RL and SA: nothing beats it
        assert rows[f"tiny_c4_{method}_gap_pct"] >= -1e-6
    assert rows["tiny_c4_rl_gap_pct"] <= 1.0  # a 37-op graph: RL as shipped finds the best
    assert rows["tiny_c4_rl_to_1pct_s"] is not None
    assert rows["tiny_c4_rl_vs_best_baseline"] >= 1.0
    assert rows["tiny_c4_transfer_scratch_best"] > 0 and rows["tiny_c4_transfer_scratch_s"] >= 0
    assert rows["tiny_c4_transfer_tuned_best"] > 0  # scratch's best where it got there
    assert "tiny_c4_transfer_speedup" in rows and "tiny_c4_transfer_speedup_1pct" in rows


def test_cases_parse_and_unknown_ones_are_refused() -> None:
    assert large.Case.parse("gpt1000_c16") == large.Case("gpt1000", 16)
    assert large.Case.parse("bert_large_c8_ring") == large.Case("bert_large", 8, "ring")
    assert large.Case("moe", 16, "ring").name == "moe_c16_ring"
    for bad in ("gpt1000", "nope_c8", "gpt1000_16"):
        with pytest.raises(ValueError):
            large.Case.parse(bad)
    with pytest.raises(SystemExit, match="no graph"):
        large.main(["--cases", "nope_c8"])


def test_references_merge_into_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ref.json"
    large.store_references({"a_c8": {"throughput": 1.0}}, path)
    large.store_references({"b_c8": {"throughput": 2.0}}, path)
    assert large.load_references(path) == {"a_c8": {"throughput": 1.0}, "b_c8": {"throughput": 2.0}}
    assert "how" in json.loads(path.read_text())


def test_the_stored_references_name_known_cases() -> None:
    for name, entry in large.load_references().items():
        large.Case.parse(name)
        assert entry["throughput"] > 0 and entry["cpsat"][0] <= entry["throughput"]
        # a bound on the rounded model (node times in 1/200,000 of the total): 0.1% slack
        assert entry["bound"] is None or entry["bound"] >= entry["throughput"] * (1 - 1e-3)


def test_the_default_budget_grows_with_the_graph_and_then_shrinks() -> None:
    from atoll.partition._search import default_budget

    def ops(n: int) -> object:
        return type("G", (), {"__len__": lambda self: n})()

    sizes = (28, 256, 301, 1000, 1500, 2996)
    got = [default_budget(ops(n)) for n in sizes]  # type: ignore[arg-type]
    assert got == [64, 85, 100, 333, 222, 111]
