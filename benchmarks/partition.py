"""``atoll bench partition``: every method on BERT and on the held-out graphs, and transfer.

On BERT (4 and 8 chiplets) every method runs at one budget, beside the solver
and the DP, and the benchmark counts how many random assignments are valid.
On the held-out graphs (``_heldout.py``: architectures the shipped policy never
trained on, each on ``Chiplets.default_for``) RL, random search and simulated
annealing run at budgets of 100, 300 and 1000 evaluated partitions, with the
comparison at equal wall time too; a long CP-SAT run gives the gap to the
optimum. Transfer is the wall time a fine-tuned pre-trained policy needs to
reach what training from scratch reaches, against the time scratch needs.

Prints a table with the paper's figures beside ours, or with ``--json`` one
JSON object per line (``bench``, ``case``, ``system``, ``value``, ``unit``).
``--small`` is the configuration the test suite runs.

Run it as ``atoll bench partition [--small] [--json]``,
``python benchmarks/partition.py`` or ``python -m atoll.benchmarks.partition``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from atoll.benchmarks._common import Row, emit, system_column, table, unit_column
from atoll.schedulers.partition import (
    METHODS,
    Chiplets,
    OpGraph,
    Partition,
    Policy,
    bert_graph,
    is_valid,
    pretrain,
    search,
    synthetic_cases,
)
from atoll.schedulers.partition._heldout import heldout_graph, heldout_names
from atoll.schedulers.partition._plot import plot_wall_curves

__all__ = ["Config", "format_table", "main", "run_bench", "valid_counts"]

PAPER = {"rl_vs_random_pct": 6.11, "rl_vs_sa_pct": 5.85, "finetune_speedup": 20.0}


@dataclass(frozen=True)
class Config:
    """Sizes of one benchmark run.

    ``pretrain_evaluations = 0`` uses the shipped pre-trained policy
    (``Policy.pretrained()``); more trains a fresh one on the synthetic set.
    """

    chiplets: tuple[int, ...] = (4, 8)
    budget: int = 96
    seeds: int = 3
    pretrain_graphs: int = 24
    pretrain_evaluations: int = 0
    solver_s: float = 60.0
    validity_chiplets: tuple[int, ...] = (4, 8, 16)
    validity_samples: int = 10_000
    heldout: tuple[str, ...] = tuple(heldout_names())
    heldout_chiplets: tuple[int, ...] = (4, 8)
    heldout_budgets: tuple[int, ...] = (100, 300, 1000)
    heldout_top_chiplets: int = 4  # the largest budget runs at this count only (wall time)
    heldout_solver_s: float = 10.0
    transfer_graph: str = "wavenet"
    transfer_chiplets: int = 4
    transfer_budget: int = 400

    @classmethod
    def small(cls) -> Config:
        """A configuration that runs in well under a minute."""
        return cls(
            budget=8,
            seeds=1,
            pretrain_graphs=4,
            pretrain_evaluations=48,
            solver_s=5.0,
            validity_samples=200,
            heldout=("unet", "densenet"),
            heldout_chiplets=(4,),
            heldout_budgets=(4, 8),
            heldout_top_chiplets=4,
            heldout_solver_s=2.0,
            transfer_graph="unet",
            transfer_chiplets=4,
            transfer_budget=16,
        )


class Log(list[str]):
    """Log lines, echoed to stderr as they come when ``echo`` is set."""

    def __init__(self, echo: bool = False) -> None:
        super().__init__()
        self.echo = echo

    def append(self, line: str) -> None:
        """Keep ``line`` (and print it at once when echoing)."""
        super().append(line)
        if self.echo:
            print(line, file=sys.stderr, flush=True)


def _row(case: str, value: float, unit: str, system: str = "atoll") -> Row:
    return Row("partition", case, system, value, unit)


def valid_counts(graph: OpGraph, count: int, samples: int, seed: int = 0) -> tuple[int, int]:
    """How many of ``samples`` random assignments to ``Chiplets(count)`` are valid.

    Returns the count among uniformly random assignments, then among random
    contiguous splits of the node order (``count - 1`` distinct cut points
    drawn uniformly), both from one generator seeded with ``seed``.
    """
    rng = np.random.default_rng(seed)
    chips, n = Chiplets(count), len(graph)
    uniform = sum(is_valid(graph, chips, rng.integers(0, count, n)) for _ in range(samples))
    contiguous = 0
    for _ in range(samples):
        cuts = np.sort(rng.choice(np.arange(1, n), count - 1, replace=False))
        contiguous += is_valid(graph, chips, np.searchsorted(cuts, np.arange(n), side="right"))
    return uniform, contiguous


def _validity(g: OpGraph, cfg: Config, log: list[str]) -> list[Row]:
    rows: list[Row] = []
    unit = f"valid of {cfg.validity_samples}"
    for count in cfg.validity_chiplets:
        uniform, contiguous = valid_counts(g, count, cfg.validity_samples)
        rows.append(_row(f"bert_c{count}_valid_uniform", float(uniform), unit))
        rows.append(_row(f"bert_c{count}_valid_contiguous", float(contiguous), unit))
        log.append(f"  c{count} valid: {uniform} uniform, {contiguous} contiguous ({unit})")
    return rows


def _methods(g: OpGraph, cfg: Config, policy: Policy, log: list[str]) -> list[Row]:
    rows: list[Row] = []
    for count in cfg.chiplets:
        chips = Chiplets(count)
        best: dict[str, float] = {}
        for method in METHODS:
            runs = 1 if method in ("dp", "solver") else cfg.seeds
            parts = [
                search(
                    g,
                    chips,
                    method,
                    cfg.budget,
                    copy.deepcopy(policy),
                    seed,
                    time_limit_s=cfg.solver_s,
                )
                for seed in range(runs)
            ]
            best[method] = statistics.median(p.throughput for p in parts)
            rows.append(_row(f"bert_c{count}_{method}", best[method], "1/s"))
            log.append(f"  c{count} {method:>6}: {best[method]:10.1f} /s over {runs} run(s)")
            if method == "solver":
                (solved,) = parts
                optimal = bool(solved.extra["optimal"])
                rows.append(_row(f"bert_c{count}_solver_wall_s", solved.wall_s, "s"))
                rows.append(_row(f"bert_c{count}_solver_optimal", float(optimal), "bool"))
                log.append(f"  c{count} solver took {solved.wall_s:.2f} s, optimal: {optimal}")
        for method in METHODS:
            frac = best[method] / best["solver"]
            rows.append(_row(f"bert_c{count}_{method}_of_solver", frac, "fraction"))
        for other in ("random", "sa"):
            pct = 100.0 * (best["rl"] / best[other] - 1.0)
            rows.append(_row(f"rl_vs_{other}_pct_c{count}", pct, "%"))
            rows.append(
                _row(f"rl_vs_{other}_pct_c{count}", PAPER[f"rl_vs_{other}_pct"], "%", "paper")
            )
    return rows


def _first_reach(part: Partition, target: float) -> float | None:
    """The wall time at which ``part``'s search first reached ``target`` (None: never)."""
    walls = part.extra["history_wall_s"]
    return next((t for t, tp in zip(walls, part.history, strict=True) if tp >= target), None)


def _best_by(part: Partition, wall_s: float) -> float:
    """The best throughput ``part``'s search had reached by ``wall_s`` seconds (0: none yet)."""
    walls = part.extra["history_wall_s"]
    return max((tp for t, tp in zip(walls, part.history, strict=True) if t <= wall_s), default=0.0)


def _heldout_pair(
    name: str, count: int, cfg: Config, policy: Policy, log: list[str]
) -> tuple[list[Row], float]:
    """RL, random search and SA on one held-out graph at every budget; returns the
    rows and RL's best at the largest budget (for the solver gap)."""
    g, rows = heldout_graph(name), []
    chips = Chiplets.default_for(g, count)
    budgets = cfg.heldout_budgets
    if count != cfg.heldout_top_chiplets:
        budgets = budgets[:-1]
    top, case = max(budgets), f"heldout_{name}_c{count}"
    # random search and RL do not depend on their budget: one long run, read at each budget
    long = {
        "random": search(g, chips, "random", top, seed=0),
        "rl": search(g, chips, "rl", top, copy.deepcopy(policy), seed=0),
    }
    for b in budgets:
        sa = search(g, chips, "sa", b, seed=0)
        got = {m: p.history[b - 1] for m, p in long.items()} | {"sa": sa.throughput}
        walls = {m: p.extra["history_wall_s"][b - 1] for m, p in long.items()} | {"sa": sa.wall_s}
        for m in ("rl", "random", "sa"):
            rows.append(_row(f"{case}_b{b}_{m}", got[m], "1/s"))
            rows.append(_row(f"{case}_b{b}_{m}_wall_s", walls[m], "s"))
        pct = 100.0 * (got["rl"] / max(got["random"], got["sa"]) - 1.0)
        rows.append(_row(f"{case}_b{b}_rl_vs_best_baseline_pct", pct, "%"))
        log.append(
            f"  {case} b{b}: rl {got['rl']:.1f} ({walls['rl']:.1f} s) random {got['random']:.1f}"
            f" ({walls['random']:.1f} s) sa {got['sa']:.1f} ({walls['sa']:.1f} s): {pct:+.2f}%"
        )
        if b == top:  # equal wall time: what the baselines reached in RL's time
            for m in ("random", "sa"):
                at = _best_by(long[m] if m == "random" else sa, walls["rl"])
                rows.append(_row(f"{case}_eqwall_{m}", at, "1/s"))
            rows.append(_row(f"{case}_eqwall_rl", got["rl"], "1/s"))
    return rows, long["rl"].throughput


def _heldout(cfg: Config, policy: Policy, log: list[str]) -> list[Row]:
    """Every held-out graph at every chiplet count, plus the gap to a long solver run."""
    rows: list[Row] = []
    for name in cfg.heldout:
        for count in cfg.heldout_chiplets:
            pair, rl = _heldout_pair(name, count, cfg, policy, log)
            rows += pair
            rows += _solver_gap(name, count, rl, cfg, log)
    return rows


def _solver_gap(name: str, count: int, rl: float, cfg: Config, log: list[str]) -> list[Row]:
    g = heldout_graph(name)
    chips = Chiplets.default_for(g, count)
    solved = search(g, chips, "solver", time_limit_s=cfg.heldout_solver_s)
    dp = search(g, chips, "dp")
    case = f"heldout_{name}_c{count}"
    log.append(
        f"  {case}: solver {solved.throughput:.1f} in {solved.wall_s:.1f} s "
        f"(optimal: {solved.extra['optimal']}), dp {dp.throughput:.1f}, rl/solver "
        f"{rl / solved.throughput:.3f}"
    )
    return [
        _row(f"{case}_solver", solved.throughput, "1/s"),
        _row(f"{case}_solver_optimal", float(bool(solved.extra["optimal"])), "bool"),
        _row(f"{case}_dp", dp.throughput, "1/s"),
        _row(f"{case}_rl_of_solver", rl / solved.throughput, "fraction"),
    ]


def _transfer(cfg: Config, policy: Policy, log: list[str], curves: Path | None) -> list[Row]:
    """Wall time for the fine-tuned policy to reach what training from scratch reaches.

    Both run ``transfer_budget`` evaluations on a held-out graph; scratch's time
    is when it *first* reached its final best, the fine-tuned policy's is when
    it first reached that same value.
    """
    g = heldout_graph(cfg.transfer_graph)
    chips = Chiplets.default_for(g, cfg.transfer_chiplets)
    # no DP hint here: the hint would hand both runs the same partition at once
    search(g, chips, "rl", 9, Policy(seed=2), seed=2, rl_hint=False)  # compile for neither to pay
    scratch = search(g, chips, "rl", cfg.transfer_budget, Policy(seed=1), seed=1, rl_hint=False)
    tuned = search(
        g, chips, "rl", cfg.transfer_budget, copy.deepcopy(policy), seed=1, rl_hint=False
    )
    wall_scratch = _first_reach(scratch, scratch.throughput)
    assert wall_scratch is not None  # its history ends at its throughput
    wall_tuned = _first_reach(tuned, scratch.throughput)
    speedup = wall_scratch / max(wall_tuned, 1e-6) if wall_tuned is not None else 0.0
    rises = _best_by(scratch, 1.0) < scratch.throughput
    log.append(
        f"  transfer on {g.name} c{cfg.transfer_chiplets}: scratch reaches "
        f"{scratch.throughput:.1f}/s in {wall_scratch:.2f} s (still rising after 1 s: {rises}); "
        + (
            f"fine-tuned reaches it in {wall_tuned:.2f} s"
            if wall_tuned is not None
            else f"fine-tuned ends at {tuned.throughput:.1f}/s without reaching it"
        )
        + f", and ends at {tuned.throughput:.1f}/s"
    )
    if curves is not None:
        plot_wall_curves(
            {
                f"from scratch ({scratch.throughput:,.0f}/s)": _curve(scratch),
                f"fine-tuned pre-trained ({tuned.throughput:,.0f}/s)": _curve(tuned),
            },
            curves,
        )
        log.append(f"  transfer curves: {curves}")
    return [
        _row("transfer_scratch_s", wall_scratch, "s"),
        _row("transfer_tuned_s", wall_tuned if wall_tuned is not None else -1.0, "s"),
        _row("transfer_scratch_rises_after_1s", float(rises), "bool"),
        _row("transfer_tuned_of_scratch", tuned.throughput / scratch.throughput, "fraction"),
        _row("finetune_speedup", speedup, "x"),
        _row("finetune_speedup", PAPER["finetune_speedup"], "x", "paper"),
    ]


def _curve(part: Partition) -> tuple[list[float], list[float]]:
    return list(part.extra["history_wall_s"]), list(part.history)


def _policy(cfg: Config, policy_path: Path | None, log: list[str]) -> Policy:
    """The policy under test: a file, the shipped one, or one pre-trained here."""
    if policy_path is not None:
        return Policy.load(policy_path)
    if cfg.pretrain_evaluations == 0:
        return Policy.pretrained()
    policy = Policy(seed=0)
    cases = synthetic_cases(cfg.pretrain_graphs, seed=0)
    train = pretrain(policy, cases, cfg.pretrain_evaluations, seed=0)
    log.append(
        f"  pre-trained on {len(cases)} synthetic graphs: "
        f"{train.evaluations[-1]} evaluations in {train.wall_s[-1]:.1f} s"
    )
    return policy


def run_bench(
    cfg: Config,
    policy_path: Path | None = None,
    echo: bool = False,
    curves: Path | None = None,
) -> tuple[list[Row], list[str]]:
    """Run the benchmark; returns the JSON rows and the log lines."""
    log = Log(echo)
    start = time.perf_counter()
    policy = _policy(cfg, policy_path, log)
    g = bert_graph()
    rows = _validity(g, cfg, log) + _methods(g, cfg, policy, log)
    rows += _heldout(cfg, policy, log) + _transfer(cfg, policy, log, curves)
    log.append(f"  total wall time {time.perf_counter() - start:.1f} s")
    return rows, log


COLUMNS = [
    system_column("atoll", 12, ".3f"),
    system_column("paper", 8, ".2f", missing=""),
    unit_column(0),
]


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a table: case, atoll's value, the paper's where it has one."""
    return table(rows, COLUMNS, keep=lambda group: "atoll" in group)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python benchmarks/partition.py [--small] [--json]``."""
    parser = argparse.ArgumentParser(prog="atoll bench partition", description=__doc__)
    parser.add_argument("--small", action="store_true", help="the quick configuration")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--policy", type=Path, help="use this pre-trained policy (.npz)")
    parser.add_argument(
        "--curves", type=Path, default=Path("partition_transfer.png"), help="transfer curves (PNG)"
    )
    args = parser.parse_args(argv)
    cfg = Config.small() if args.small else Config()
    rows, _ = run_bench(cfg, args.policy, echo=True, curves=args.curves)
    emit(rows, args.json, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
