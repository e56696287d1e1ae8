"""The partition commands, the pictures and the small benchmark configuration."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from atoll.benchmarks import partition as bench
from atoll.benchmarks._common import Row
from atoll.schedulers import partition as P
from atoll.schedulers.partition import cli


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="atoll")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_commands(sub)
    return cli.run(parser.parse_args(argv))


def test_partition_json_graph_with_picture_and_curve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    g, _ = P.synthetic_cases(1, seed=2)[0]
    P.save_graph(g, tmp_path / "g.json")
    rc = run_cli(
        [
            "partition",
            str(tmp_path / "g.json"),
            "--chiplets",
            "2",
            "--method",
            "sa",
            "--budget",
            "6",
            "--picture",
            str(tmp_path / "p.png"),
            "--curve",
            str(tmp_path / "c.png"),
            "--sram-mib",
            "1e6",
        ]
    )
    assert rc == 0
    out = capsys.readouterr()
    assert "throughput" in out.out and "6/6" in out.err  # result and progress bar
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_pretrain_save_load_finetune_from_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, tuned = tmp_path / "p.npz", tmp_path / "tuned.npz"
    rc = run_cli(
        [
            "partition-train",
            "--evaluations",
            "16",
            "--graphs",
            "2",
            "--save",
            str(ckpt),
            "--curve",
            str(tmp_path / "train.png"),
        ]
    )
    assert rc == 0 and ckpt.exists() and (tmp_path / "train.png").exists()
    module = tmp_path / "mymodel.py"
    module.write_text(
        "from atoll.schedulers.partition._models import mlp_graph\n\n\n"
        "def build():\n    return mlp_graph([256] * 12, batch=64)\n"
    )
    rc = run_cli(
        [
            "partition",
            f"{module}:build",
            "--chiplets",
            "3",
            "--method",
            "rl",
            "--budget",
            "8",
            "--policy",
            str(ckpt),
            "--save-policy",
            str(tuned),
            "--sram-mib",
            "1e6",
            "--json",
        ]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["valid"] and result["method"] == "rl"
    assert P.Policy.load(tuned).trained_evaluations > P.Policy.load(ckpt).trained_evaluations


def test_infeasible_from_cli(capsys: pytest.CaptureFixture[str]) -> None:
    rc = run_cli(["partition", "mlp", "--chiplets", "2", "--method", "dp", "--sram-mib", "1"])
    assert rc == 1
    assert "infeasible" in capsys.readouterr().err


def test_unknown_graph_is_an_error() -> None:
    with pytest.raises(SystemExit, match="built-in"):
        cli.load_graph_arg("no_such_graph")


@pytest.mark.timeout(120)
def test_small_benchmark(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    curves = tmp_path / "transfer.png"
    assert bench.main(["--small", "--json", "--curves", str(curves)]) == 0
    assert curves.read_bytes()[:4] == b"\x89PNG"
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    cases = {r["case"] for r in rows}
    for count in (4, 8):
        for method in P.METHODS:
            assert f"bert_c{count}_{method}" in cases
        assert f"rl_vs_random_pct_c{count}" in cases and f"rl_vs_sa_pct_c{count}" in cases
    assert "finetune_speedup" in cases
    assert {"bench", "case", "system", "value", "unit"} <= set(rows[0])
    assert {r["system"] for r in rows} == {"atoll", "paper"}
    ours = {r["case"]: r["value"] for r in rows if r["system"] == "atoll"}
    assert all(isinstance(v, float) and math.isfinite(v) for v in ours.values())
    for count in (4, 8):
        for method in P.METHODS:  # every method found a valid partition
            assert ours[f"bert_c{count}_{method}"] > 0
            assert ours[f"bert_c{count}_{method}_of_solver"] > 0
        assert ours[f"bert_c{count}_solver_of_solver"] == 1.0
        assert ours[f"bert_c{count}_dp_of_solver"] == pytest.approx(
            ours[f"bert_c{count}_dp"] / ours[f"bert_c{count}_solver"]
        )
        rl, sa = ours[f"bert_c{count}_rl"], ours[f"bert_c{count}_sa"]
        assert ours[f"rl_vs_sa_pct_c{count}"] == pytest.approx(100.0 * (rl / sa - 1.0))
        assert 0 < ours[f"bert_c{count}_solver_wall_s"] < 2 * bench.Config.small().solver_s
        assert ours[f"bert_c{count}_solver_optimal"] in (0.0, 1.0)
    for count in (4, 8, 16):  # random assignments are never valid; contiguous splits can be
        assert ours[f"bert_c{count}_valid_uniform"] == 0
        assert 0 <= ours[f"bert_c{count}_valid_contiguous"] <= 200
    assert ours["finetune_speedup"] >= 0
    small = bench.Config.small()
    for name in small.heldout:  # held-out rows at every budget, and the gap to the solver
        for count in small.heldout_chiplets:
            case = f"heldout_{name}_c{count}"
            for b in small.heldout_budgets:
                got = {m: ours[f"{case}_b{b}_{m}"] for m in ("rl", "random", "sa")}
                assert min(got.values()) > 0
                pct = ours[f"{case}_b{b}_rl_vs_best_baseline_pct"]
                assert pct == pytest.approx(100.0 * (got["rl"] / max(got["random"], got["sa"]) - 1))
            assert 0 < ours[f"{case}_rl_of_solver"] <= 1.001 or not ours[f"{case}_solver_optimal"]
            assert ours[f"{case}_eqwall_rl"] == ours[f"{case}_b{max(small.heldout_budgets)}_rl"]
    assert ours["transfer_scratch_s"] > 0 and ours["transfer_scratch_rises_after_1s"] in (0.0, 1.0)
    # the table shows the measured value and the paper's beside it
    text = bench.format_table([Row(**r) for r in rows])
    line = next(x for x in text.splitlines() if x.startswith("finetune_"))
    assert (
        f"{ours['finetune_speedup']:.3f}" in line
        and f"{bench.PAPER['finetune_speedup']:.2f}" in line
    )
