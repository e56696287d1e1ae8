"""``atoll bench partition``: every method on BERT at 4 and 8 chiplets, and transfer.

Prints a table with the paper's figures beside ours, or with ``--json`` one
JSON object per line (``bench``, ``case``, ``system``, ``value``, ``unit``).
``--small`` is the configuration the test suite runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ._graph import Graph
from ._hardware import Chiplets
from ._models import bert_graph
from ._policy import Policy
from ._rl import pretrain
from ._search import METHODS, search
from ._synthetic import synthetic_cases

__all__ = ["Config", "main", "run_bench"]

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

    @classmethod
    def small(cls) -> Config:
        """A configuration that runs in well under a minute."""
        return cls((4, 8), 8, 1, 4, 48, 24, 5.0)


Row = dict[str, object]


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
    return {"bench": "partition", "case": case, "system": system, "value": value, "unit": unit}


def _methods(g: Graph, cfg: Config, policy: Policy, log: list[str]) -> list[Row]:
    rows: list[Row] = []
    for count in cfg.chiplets:
        chips = Chiplets(count)
        best: dict[str, float] = {}
        for method in METHODS:
            runs = 1 if method in ("dp", "solver") else cfg.seeds
            tps = [
                search(
                    g,
                    chips,
                    method,
                    cfg.budget,
                    copy.deepcopy(policy),
                    seed,
                    time_limit_s=cfg.solver_s,
                ).throughput
                for seed in range(runs)
            ]
            best[method] = statistics.median(tps)
            rows.append(_row(f"bert_c{count}_{method}", best[method], "1/s"))
            log.append(f"  c{count} {method:>6}: {best[method]:10.1f} /s over {runs} run(s)")
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


def _transfer(g: Graph, cfg: Config, policy: Policy, log: list[str]) -> list[Row]:
    """Wall time for the fine-tuned policy to reach what training from scratch reaches."""
    chips = Chiplets(cfg.chiplets[0])
    search(g, chips, "rl", 9, Policy(seed=2), seed=2)  # compile once, for neither run to pay
    scratch = search(g, chips, "rl", cfg.transfer_budget, Policy(seed=1), seed=1)
    tuned = search(g, chips, "rl", cfg.transfer_budget, copy.deepcopy(policy), seed=1)
    walls = tuned.extra["history_wall_s"]
    reached = [t for t, tp in zip(walls, tuned.history, strict=True) if tp >= scratch.throughput]
    # scratch's time is when it *first* reached its final best, not its whole run
    scratch_walls = scratch.extra["history_wall_s"]
    wall_scratch = next(
        t for t, tp in zip(scratch_walls, scratch.history, strict=True) if tp >= scratch.throughput
    )
    speedup = wall_scratch / max(reached[0], 1e-6) if reached else 0.0
    log.append(
        f"  scratch reaches {scratch.throughput:.1f}/s in {wall_scratch:.2f} s; fine-tuned "
        + (
            f"reaches it in {reached[0]:.2f} s"
            if reached
            else f"ends at {tuned.throughput:.1f}/s without reaching it"
        )
    )
    return [_row("finetune_speedup", speedup, "x"), _row("finetune_speedup", 20.0, "x", "paper")]


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
    rows = _methods(g, cfg, policy, log) + _transfer(g, cfg, policy, log)
    log.append(f"  total wall time {time.perf_counter() - start:.1f} s")
    return rows, log


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a table: case, atoll's value, the paper's where it has one."""
    paper = {r["case"]: r["value"] for r in rows if r["system"] == "paper"}
    lines = [f"{'case':<28} {'atoll':>12} {'paper':>8}  unit"]
    for r in rows:
        if r["system"] != "atoll":
            continue
        ref = paper.get(r["case"])
        ref_text = f"{ref:>8.2f}" if isinstance(ref, float) else " " * 8
        value = r["value"]
        assert isinstance(value, float)
        lines.append(f"{r['case']!s:<28} {value:>12.3f} {ref_text}  {r['unit']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python benchmarks/partition.py [--small] [--json]``."""
    parser = argparse.ArgumentParser(prog="atoll bench partition", description=__doc__)
    parser.add_argument("--small", action="store_true", help="the quick configuration")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--policy", type=Path, help="use this pre-trained policy (.npz)")
    args = parser.parse_args(argv)
    rows, _ = run_bench(Config.small() if args.small else Config(), args.policy, echo=True)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(format_table(rows))
    return 0
