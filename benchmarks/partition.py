"""``atoll bench partition``: every method on BERT at 4 and 8 chiplets, and transfer.

It also counts how many random assignments of BERT are valid, and reports the
solver's wall time and whether it proved its answer optimal.

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

__all__ = ["Config", "format_table", "main", "run_bench", "valid_counts"]

PAPER = {"rl_vs_random_pct": 6.11, "rl_vs_sa_pct": 5.85, "finetune_speedup": 20.0}


@dataclass(frozen=True)
class Config:
    """Sizes of one benchmark run."""

    chiplets: tuple[int, ...] = (4, 8)
    budget: int = 96
    seeds: int = 3
    pretrain_graphs: int = 24
    pretrain_evaluations: int = 3000
    transfer_budget: int = 192
    solver_s: float = 60.0
    validity_chiplets: tuple[int, ...] = (4, 8, 16)
    validity_samples: int = 10_000

    @classmethod
    def small(cls) -> Config:
        """A configuration that runs in well under a minute."""
        return cls((4, 8), 8, 1, 4, 48, 24, 5.0, validity_samples=200)


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


def _transfer(g: OpGraph, cfg: Config, policy: Policy, log: list[str]) -> list[Row]:
    """Wall time for the fine-tuned policy to reach what training from scratch reaches."""
    chips = Chiplets(cfg.chiplets[0])
    search(g, chips, "rl", 9, Policy(seed=2), seed=2)  # compile once, for neither run to pay
    scratch = search(g, chips, "rl", cfg.transfer_budget, Policy(seed=1), seed=1)
    tuned = search(g, chips, "rl", cfg.transfer_budget, copy.deepcopy(policy), seed=1)
    # scratch's time is when it *first* reached its final best, not its whole run
    wall_scratch = _first_reach(scratch, scratch.throughput)
    assert wall_scratch is not None  # its history ends at its throughput
    wall_tuned = _first_reach(tuned, scratch.throughput)
    speedup = wall_scratch / max(wall_tuned, 1e-6) if wall_tuned is not None else 0.0
    log.append(
        f"  scratch reaches {scratch.throughput:.1f}/s in {wall_scratch:.2f} s; fine-tuned "
        + (
            f"reaches it in {wall_tuned:.2f} s"
            if wall_tuned is not None
            else f"ends at {tuned.throughput:.1f}/s without reaching it"
        )
    )
    return [
        _row("finetune_speedup", speedup, "x"),
        _row("finetune_speedup", PAPER["finetune_speedup"], "x", "paper"),
    ]


def run_bench(
    cfg: Config, policy_path: Path | None = None, echo: bool = False
) -> tuple[list[Row], list[str]]:
    """Run the benchmark; returns the JSON rows and the log lines."""
    log = Log(echo)
    start = time.perf_counter()
    if policy_path is not None:
        policy = Policy.load(policy_path)
    else:
        policy = Policy(seed=0)
        cases = synthetic_cases(cfg.pretrain_graphs, seed=0)
        train = pretrain(policy, cases, cfg.pretrain_evaluations, seed=0)
        log.append(
            f"  pre-trained on {len(cases)} synthetic graphs: "
            f"{train.evaluations[-1]} evaluations in {train.wall_s[-1]:.1f} s"
        )
    g = bert_graph()
    rows = _validity(g, cfg, log) + _methods(g, cfg, policy, log) + _transfer(g, cfg, policy, log)
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
    args = parser.parse_args(argv)
    rows, _ = run_bench(Config.small() if args.small else Config(), args.policy, echo=True)
    emit(rows, args.json, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
