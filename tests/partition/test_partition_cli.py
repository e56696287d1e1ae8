"""The partition commands, the pictures and the small benchmark configuration."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import types
from pathlib import Path

import pytest

from atoll import partition as P
from atoll.benchmarks import partition as bench
from atoll.benchmarks._common import Row
from atoll.partition import cli


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


def test_unknown_training_families_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run_cli(["partition-train", "--families", "mlp,gru", "--save", "x.npz"])
    assert exc.value.code == 2 and "unknown graph families ['gru']" in capsys.readouterr().err


@pytest.mark.slow
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
            "--families",
            "all",
            "--save",
            str(ckpt),
            "--curve",
            str(tmp_path / "train.png"),
        ]
    )
    assert rc == 0 and ckpt.exists() and (tmp_path / "train.png").exists()
    module = tmp_path / "mymodel.py"
    module.write_text(
        "from atoll.partition._models import mlp_graph\n\n\n"
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
            "--lns-share",  # the whole budget fine-tunes: no CP-SAT windows
            "0",
            "--json",
        ]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["valid"] and result["method"] == "rl"
    assert P.Policy.load(tuned).trained_evaluations > P.Policy.load(ckpt).trained_evaluations


def test_bad_share_is_an_error_from_cli(capsys: pytest.CaptureFixture[str]) -> None:
    rc = run_cli(["partition", "mlp", "--chiplets", "2", "--lns-share", "1.5"])
    assert rc == 2
    assert "share of the budget" in capsys.readouterr().err


def test_infeasible_from_cli(capsys: pytest.CaptureFixture[str]) -> None:
    rc = run_cli(["partition", "mlp", "--chiplets", "2", "--method", "dp", "--sram-mib", "1"])
    assert rc == 1
    assert "infeasible" in capsys.readouterr().err


def test_unknown_graph_is_an_error() -> None:
    with pytest.raises(SystemExit, match="built-in"):
        cli.load_graph_arg("no_such_graph")


@pytest.mark.slow
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
            hinted = ours[f"{case}_solver_hinted"]  # hinted with the policy's greedy assignment
            assert 0 < ours[f"{case}_solver_hint"] <= hinted * 1.001
            if ours[f"{case}_solver_optimal"] and ours[f"{case}_solver_hinted_optimal"]:
                assert hinted == pytest.approx(ours[f"{case}_solver"], rel=1e-3)
            rl = ours[f"{case}_b{max(small.heldout_budgets)}_rl"]  # started from RL's best
            assert ours[f"{case}_solver_rlhinted"] >= rl * 0.99
            assert ours[f"section_heldout_{name}_c{count}_wall_s"] > 0
            for shipped, seeds in (
                (f"{case}_rl_seeded", small.seeded_seeds),  # over seeds
                (f"{case}_windows_alone", small.seeded_seeds[:1]),
            ):
                per_seed = [ours[f"{shipped}_s{s}"] for s in seeds]
                assert ours[f"{shipped}_min"] == min(per_seed) <= ours[shipped] <= max(per_seed)
                assert ours[f"{shipped}_of_solver"] == pytest.approx(
                    ours[shipped] / ours[f"{case}_solver"]
                )
    assert ours["transfer_scratch_s"] > 0 and ours["transfer_scratch_rises_after_1s"] in (0.0, 1.0)
    for name, count in small.transfer_cases:  # one row set per case and seed, then medians
        for seed in small.transfer_seeds:
            case = f"transfer_{name}_c{count}_s{seed}"
            assert ours[f"{case}_scratch_at_1s"] <= ours[f"{case}_scratch_best"]
            assert ours[f"{case}_tuned_s"] == -1 or ours[f"{case}_speedup"] > 0
    sections = [k for k in ours if k.startswith("section_")]
    assert ours["total_wall_s"] >= max(ours[k] for k in sections) > 0
    # the table shows the measured value and the paper's beside it
    text = bench.format_table([Row(**r) for r in rows])
    line = next(x for x in text.splitlines() if x.startswith("finetune_"))
    assert (
        f"{ours['finetune_speedup']:.3f}" in line
        and f"{bench.PAPER['finetune_speedup']:.2f}" in line
    )


@pytest.mark.timeout(120)
def test_benchmark_sections_run_in_worker_processes() -> None:
    small = dataclasses.replace(bench.Config.small(), validity_chiplets=(4,), validity_samples=5)
    jobs = [(f"validity{i}", bench._validity, (P.bert_graph(), small)) for i in range(2)]
    log: list[str] = []
    here = bench._run_jobs(jobs, 1, log)
    there = bench._run_jobs(jobs, 2, log)  # spawned processes give the same rows, in job order
    assert [s.name for s in there] == ["validity0", "validity1"]
    assert [s.rows for s in there] == [s.rows for s in here]
    assert all(s.wall_s > 0 for s in there) and "[validity1: " in " ".join(log)


def test_benchmark_sections_can_be_chosen() -> None:
    """The held-out rows at 8 chiplets and the largest budget, which the full run
    leaves out for its wall time, run on their own from the command line."""
    parser = bench._parser()
    args = parser.parse_args(["--heldout-only", "--heldout-chiplets", "8", "--top-chiplets", "8"])
    cfg = bench._configure(bench.Config(), args)
    assert cfg.chiplets == () and cfg.transfer_cases == () and cfg.validity_chiplets == ()
    assert cfg.heldout_chiplets == (8,) and cfg.heldout_top_chiplets == 8
    jobs = [name for name, _, _ in bench._jobs(cfg, P.Policy())]
    assert all(n.startswith("heldout_") and n.endswith("_c8") for n in jobs if n != "validity")
    assert bench._transfer_summary([], cfg, None, []) == []
    assert bench._configure(bench.Config(), parser.parse_args([])) == bench.Config()
    full = bench.Config()  # the full run leaves out the ablations and budget 1000 (wall time)
    assert not full.ablation and full.heldout_top_chiplets == 0
    assert bench._configure(bench.Config(), parser.parse_args(["--ablation"])).ablation


@pytest.mark.slow
def test_benchmark_heldout_rows_on_a_ring() -> None:
    parser = bench._parser()
    args = parser.parse_args(["--heldout-only", "--heldout", "unet", "--topology", "ring"])
    cfg = bench._configure(bench.Config.small(), args)
    assert cfg.heldout == ("unet",) and cfg.heldout_topology == "ring"
    assert [n for n, _, _ in bench._jobs(cfg, P.Policy())] == ["heldout_ring_unet_c4", "validity"]
    with pytest.raises(SystemExit, match="no held-out graph"):
        bench._configure(cfg, parser.parse_args(["--heldout", "bert"]))
    log: list[str] = []
    rows = {r.case: r.value for r in bench._heldout("unet", 4, cfg, P.Policy.pretrained(), log)}
    assert rows and all(case.startswith("heldout_ring_unet_c4_") for case in rows)
    seeded, solver = rows["heldout_ring_unet_c4_rl_seeded"], rows["heldout_ring_unet_c4_solver"]
    assert seeded is not None and solver is not None and seeded >= 0.99 * solver


def test_rl_as_shipped_over_seeds_gives_median_worst_and_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    got = {0: 30.0, 1: 10.0, 2: 11.0, 3: 40.0}  # median 11, mean 17, worst 10

    def fake(*args: object, seed: int, **kwargs: object) -> object:
        return types.SimpleNamespace(throughput=got[seed], wall_s=float(seed))

    monkeypatch.setattr(bench, "search", fake)
    cfg = bench.Config.small()
    rows = bench._over_seeds(P.bert_graph(), P.Chiplets(4), (0, 1, 2), cfg, P.Policy(), "x", 40.0)
    values = {r.case: r.value for r in rows}
    assert values == {
        "x": 11.0,
        "x_min": 10.0,
        "x_wall_s": 1.0,
        "x_of_solver": 11.0 / 40.0,
        "x_s0": 30.0,
        "x_s1": 10.0,
        "x_s2": 11.0,
    }


def test_no_background_turns_the_solve_beside_the_windows_off(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from atoll.partition import _search

    class Refused:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("a background solve was started")

    monkeypatch.setattr(_search, "BackgroundSolve", Refused)
    monkeypatch.setattr(_search, "spare_cores", lambda: 1)
    argv = ["partition", "mlp", "--chiplets", "2", "--budget", "12", "--solver-seed", "0.2"]
    assert run_cli([*argv, "--no-background", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["valid"]
    with pytest.raises(AssertionError, match="background solve was started"):
        run_cli(argv)
