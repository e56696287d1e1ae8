"""``atoll bench partition``: every method on BERT and on the held-out graphs, and transfer.

On BERT (4 and 8 chiplets) every method runs at one budget, beside the solver
and the DP, and the benchmark counts how many random assignments are valid.
On the held-out graphs (``_heldout.py``: architectures the shipped policy never
trained on, each on ``Chiplets.default_for``) RL, random search and simulated
annealing run at budgets of 100 and 300 evaluated partitions (1000 too with
``--top-chiplets K``), with the comparison at equal wall time too; a CP-SAT run
gives the gap to the optimum. Transfer is the wall time a fine-tuned
pre-trained policy needs to reach what training from scratch reaches, against
the time scratch needs.

Prints a table with the paper's figures beside ours, or with ``--json`` one
JSON object per line (``bench``, ``case``, ``system``, ``value``, ``unit``).
``--small`` is the configuration the test suite runs.

Run it as ``atoll bench partition [--small] [--json]``,
``python benchmarks/partition.py`` or ``python -m atoll.benchmarks.partition``.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import multiprocessing
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import suppress
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import numpy as np

from atoll.benchmarks._common import (
    Log,
    Row,
    emit,
    first_reach,
    system_column,
    table,
    unit_column,
)
from atoll.partition import (
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
    throughput,
)
from atoll.partition._heldout import heldout_graph, heldout_names
from atoll.partition._plot import plot_wall_curves
from atoll.partition._solver import solve_bottleneck

__all__ = ["Config", "format_table", "main", "run_bench", "valid_counts"]

Policies = Policy | list[Policy]  # one policy, or the shipped set (Policy.pretrained_set)

PAPER = {"rl_vs_random_pct": 6.11, "rl_vs_sa_pct": 5.85, "finetune_speedup": 20.0}


@dataclass(frozen=True)
class Config:
    """Sizes of one benchmark run.

    ``pretrain_evaluations = 0`` uses the shipped pre-trained policy
    (``Policy.pretrained_set()``); more trains a fresh one on the synthetic set.
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
    # the largest budget runs at this count only; 0: at none (the full run's wall time),
    # so the budget-1000 rows come from ``--heldout-only --top-chiplets K``
    heldout_top_chiplets: int = 0
    heldout_solver_s: float = 10.0
    heldout_topology: str = "chain"  # "ring": the held-out rows on a ring of chiplets
    transfer_cases: tuple[tuple[str, int], ...] = (("wavenet", 4), ("gru", 4))
    transfer_seeds: tuple[int, ...] = (1,)  # (1, 2) until the full run's wall time
    transfer_budget: int = 1000
    seeded_budget: int = 100  # RL as shipped (seeded by CP-SAT) in the solver-gap rows
    seeded_seeds: tuple[int, ...] = (0, 1, 2)  # its seeds (median, worst); the ablation: the first
    # the ablations too (``--ablation``; off for the full run's wall time): the solver
    # steps without fine-tuning, and CP-SAT hinted by the policy or by RL's best
    ablation: bool = False
    workers: int = 2  # sections run in this many processes (1: in this one)

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
            transfer_cases=(("unet", 4),),
            transfer_seeds=(1,),
            transfer_budget=16,
            seeded_budget=8,
            seeded_seeds=(0,),
            ablation=True,
            workers=1,
        )


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


def _bert(count: int, cfg: Config, policy: Policies, log: list[str]) -> list[Row]:
    """Every method on BERT-base at ``count`` chiplets (the BERT-calibrated defaults)."""
    g, chips = bert_graph(), Chiplets(count)
    rows: list[Row] = []
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
                rl_solver_s=0.0,  # as in the held-out rows: no CP-SAT seed for RL
            )
            for seed in range(runs)
        ]
        best[method] = statistics.median(p.throughput for p in parts)
        rows.append(_row(f"bert_c{count}_{method}", best[method], "1/s"))
        log.append(f"  c{count} {method:>6}: {best[method]:10.1f} /s over {runs} run(s)")
        if method == "solver":
            solver_parts = (solved,) = parts
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
        rows.append(_row(f"rl_vs_{other}_pct_c{count}", PAPER[f"rl_vs_{other}_pct"], "%", "paper"))
    (solved,) = solver_parts
    return rows + _hinted_solver(g, chips, f"bert_c{count}", policy, solved, cfg.solver_s, log)


def _hinted_solver(
    g: OpGraph,
    chips: Chiplets,
    case: str,
    policy: Policies,
    plain: Partition,
    limit_s: float,
    log: list[str],
) -> list[Row]:
    """The solver hinted with the policy's greedy assignment, against ``plain`` (the
    solver alone): results and the seconds CP-SAT took (the hint's repair not counted)."""
    hinted = search(
        g, chips, "solver", policy=copy.deepcopy(policy), time_limit_s=limit_s, solver_hint=True
    )
    hint = float(hinted.extra.get("hint_throughput", 0.0))  # 0: its repair timed out
    log.append(
        f"  {case} solver: {plain.throughput:.1f} in {plain.extra['solve_s']:.2f} s "
        f"(optimal: {plain.extra['optimal']}); hinted with the policy's greedy "
        f"({hint:.1f}): {hinted.throughput:.1f} in "
        f"{hinted.extra['solve_s']:.2f} s (optimal: {hinted.extra['optimal']})"
    )
    return [
        _row(f"{case}_solver_solve_s", plain.extra["solve_s"], "s"),
        _row(f"{case}_solver_hint", hint, "1/s"),
        _row(f"{case}_solver_hinted", hinted.throughput, "1/s"),
        _row(f"{case}_solver_hinted_optimal", float(bool(hinted.extra["optimal"])), "bool"),
        _row(f"{case}_solver_hinted_solve_s", hinted.extra["solve_s"], "s"),
    ]


def _best_by(part: Partition, wall_s: float) -> float:
    """The best throughput ``part``'s search had reached by ``wall_s`` seconds (0: none yet)."""
    walls = part.extra["history_wall_s"]
    return max((tp for t, tp in zip(walls, part.history, strict=True) if t <= wall_s), default=0.0)


def _heldout_pair(
    name: str, count: int, cfg: Config, policy: Policies, log: list[str]
) -> tuple[list[Row], Partition]:
    """RL, random search and SA on one held-out graph at every budget; returns the
    rows and RL's best at the largest budget (for the solver gap)."""
    g, rows = heldout_graph(name), []
    chips = Chiplets.default_for(g, count, topology=cfg.heldout_topology)
    budgets = cfg.heldout_budgets
    if count != cfg.heldout_top_chiplets:
        budgets = budgets[:-1]
    top, case = max(budgets), _heldout_case(name, count, cfg)
    # random search does not depend on its budget: one long run, read at each budget.
    # SA and RL do (their annealing schedules span the budget): one run per budget.
    # RL runs without the solver's seed (a short CP-SAT run the baselines do not get).
    random = search(g, chips, "random", top, seed=0)
    rl: Partition | None = None
    for b in budgets:
        sa = search(g, chips, "sa", b, seed=0)
        rl = search(g, chips, "rl", b, copy.deepcopy(policy), seed=0, rl_solver_s=0.0)
        got = {"random": random.history[b - 1], "rl": rl.throughput, "sa": sa.throughput}
        walls = {"random": random.extra["history_wall_s"][b - 1], "rl": rl.wall_s}
        walls["sa"] = sa.wall_s
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
            for m, part in (("random", random), ("sa", sa)):
                rows.append(_row(f"{case}_eqwall_{m}", _best_by(part, walls["rl"]), "1/s"))
            rows.append(_row(f"{case}_eqwall_rl", got["rl"], "1/s"))
    assert rl is not None  # budgets is never empty
    return rows, rl


def _heldout_case(name: str, count: int, cfg: Config) -> str:
    """The prefix of a held-out section's rows: ``heldout_<graph>_c<k>``, with
    ``_ring`` after ``heldout`` on a ring."""
    ring = "_ring" if cfg.heldout_topology == "ring" else ""
    return f"heldout{ring}_{name}_c{count}"


def _heldout(name: str, count: int, cfg: Config, policy: Policies, log: list[str]) -> list[Row]:
    """One held-out graph at one chiplet count: every budget, then the gap to the solver."""
    rows, rl = _heldout_pair(name, count, cfg, policy, log)
    return rows + _solver_gap(name, count, rl, cfg, policy, log)


def _solver_gap(
    name: str, count: int, rl_part: Partition, cfg: Config, policy: Policies, log: list[str]
) -> list[Row]:
    """CP-SAT alone and the DP against RL at its largest budget (unseeded) and RL as
    shipped (seeded by a short CP-SAT run) at ``seeded_budget``, over
    ``seeded_seeds``; with ``ablation`` also :func:`_ablation`."""
    g = heldout_graph(name)
    chips = Chiplets.default_for(g, count, topology=cfg.heldout_topology)
    solved = search(g, chips, "solver", time_limit_s=cfg.heldout_solver_s)
    dp = search(g, chips, "dp")
    case, rl = _heldout_case(name, count, cfg), rl_part.throughput
    # RL as shipped
    seeds = cfg.seeded_seeds
    shipped = _over_seeds(g, chips, seeds, cfg, policy, f"{case}_rl_seeded", solved.throughput)
    log.append(
        f"  {case}: solver {solved.throughput:.1f} in {solved.wall_s:.1f} s "
        f"(optimal: {solved.extra['optimal']}), dp {dp.throughput:.1f}, rl/solver "
        f"{rl / solved.throughput:.3f}; seeded rl (budget {cfg.seeded_budget}), median (worst) "
        f"over seeds {seeds}: {shipped[0].value:.1f} ({shipped[1].value:.1f}) in "
        f"{shipped[2].value:.1f} s"
    )
    return [
        _row(f"{case}_solver", solved.throughput, "1/s"),
        _row(f"{case}_solver_optimal", float(bool(solved.extra["optimal"])), "bool"),
        _row(f"{case}_dp", dp.throughput, "1/s"),
        _row(f"{case}_rl_of_solver", rl / solved.throughput, "fraction"),
        *shipped,
        *(_ablation(g, chips, case, cfg, policy, solved, rl_part, log) if cfg.ablation else []),
    ]


def _ablation(
    g: OpGraph,
    chips: Chiplets,
    case: str,
    cfg: Config,
    policy: Policies,
    solved: Partition,
    rl: Partition,
    log: list[str],
) -> list[Row]:
    """What the solver does without the policy, and with it: RL as shipped's solver
    steps with only the policy's greedy assignment (``rl_lns=1.0``: no fine-tuning),
    on the first of ``seeded_seeds`` (rows ``<case>_windows_alone...``), and CP-SAT
    hinted by the policy's greedy assignment and by RL's best (``rl``). Off in the
    full run (its wall time): ``--ablation``."""
    seed, limit_s = cfg.seeded_seeds[0], cfg.heldout_solver_s
    rows = _over_seeds(
        g, chips, (seed,), cfg, policy, f"{case}_windows_alone", solved.throughput, rl_lns=1.0
    )
    log.append(
        f"  {case}: solver steps alone, seed {seed}: {rows[0].value:.1f} in {rows[2].value:.1f} s"
    )
    return [
        *rows,
        *_hinted_solver(g, chips, case, policy, solved, limit_s, log),
        *_rl_hinted_solver(g, chips, case, rl, limit_s, log),
    ]


def _over_seeds(
    g: OpGraph,
    chips: Chiplets,
    seeds: Sequence[int],
    cfg: Config,
    policy: Policies,
    prefix: str,
    solver_tp: float,
    **options: Any,
) -> list[Row]:
    """RL as shipped (with ``options``) at ``seeded_budget`` on each of ``seeds``:
    rows ``<prefix>`` (the median), ``_min``, ``_wall_s`` (the median),
    ``_of_solver`` (the median's share of ``solver_tp``) and ``_s<seed>``."""
    runs = {
        s: search(g, chips, "rl", cfg.seeded_budget, copy.deepcopy(policy), seed=s, **options)
        for s in seeds
    }
    median = statistics.median(p.throughput for p in runs.values())
    return [
        _row(prefix, median, "1/s"),
        _row(f"{prefix}_min", min(p.throughput for p in runs.values()), "1/s"),
        _row(f"{prefix}_wall_s", statistics.median(p.wall_s for p in runs.values()), "s"),
        _row(f"{prefix}_of_solver", median / solver_tp, "fraction"),
        *(_row(f"{prefix}_s{s}", p.throughput, "1/s") for s, p in runs.items()),
    ]


def _rl_hinted_solver(
    g: OpGraph, chips: Chiplets, case: str, rl: Partition, limit_s: float, log: list[str]
) -> list[Row]:
    """CP-SAT started from RL's best partition: does the learned result help the solver?"""
    hint = np.asarray(rl.assignment, dtype=np.int64)
    assignment, stats = solve_bottleneck(g, chips, limit_s, hint=hint)
    tp = throughput(g, chips, assignment)
    log.append(
        f"  {case} solver hinted with RL's best ({rl.throughput:.1f}): {tp:.1f} in "
        f"{stats['solve_s']:.2f} s (optimal: {stats['optimal']})"
    )
    return [
        _row(f"{case}_solver_rlhinted", tp, "1/s"),
        _row(f"{case}_solver_rlhinted_optimal", float(bool(stats["optimal"])), "bool"),
        _row(f"{case}_solver_rlhinted_solve_s", stats["solve_s"], "s"),
    ]


Curve = tuple[list[float], list[float]]


def _transfer(
    name: str, count: int, seed: int, cfg: Config, policy: Policies, log: list[str]
) -> tuple[list[Row], dict[str, Curve]]:
    """Wall time for the fine-tuned policy to reach what training from scratch reaches.

    Scratch (a fresh ``Policy(seed)``) trains for ``transfer_budget`` evaluations;
    its time is when it *first* reached its final best. The fine-tuned shipped
    policy then runs with the same budget until it reaches that value. Neither
    gets the DP hint, the solver's seed or the local moves: this measures the policy. Returns
    the rows and both curves, relative to scratch's final best.
    """
    g = heldout_graph(name)
    chips = Chiplets.default_for(g, count)
    # the policy alone: no DP hint (it would hand both the same partition at once)
    # and no local moves beside it
    alone: dict[str, Any] = {"rl_hint": False, "rl_local": 0, "rl_solver_s": 0.0}
    search(g, chips, "rl", 9, Policy(seed=99), seed=99, **alone)  # compile for neither
    budget = cfg.transfer_budget
    scratch = search(g, chips, "rl", budget, Policy(seed=seed), seed=seed, **alone)
    target = scratch.throughput
    tuned = search(g, chips, "rl", budget, copy.deepcopy(policy), seed, stop_at=target, **alone)
    wall_scratch = first_reach(scratch, target)
    assert wall_scratch is not None  # its history ends at its throughput
    wall_tuned = first_reach(tuned, target)
    speedup = _speedup(scratch, tuned, target)
    at_1s = _best_by(scratch, 1.0)
    near = _speedup(scratch, tuned, NEAR * target)
    case = f"transfer_{name}_c{count}_s{seed}"
    log.append(
        f"  {case}: scratch reaches {target:.1f}/s in {wall_scratch:.2f} s "
        f"(evaluation {scratch.history.index(target) + 1} of {budget}; at 1 s it had "
        f"{at_1s:.1f}/s); "
        + (
            f"fine-tuned reaches it in {wall_tuned:.2f} s (evaluation {len(tuned.history)}): "
            f"{speedup:.1f}x"
            if wall_tuned is not None
            else f"fine-tuned ends at {tuned.throughput:.1f}/s without reaching it"
        )
        + f"; to {NEAR:.0%} of it: {near:.1f}x"
    )
    rows = [
        _row(f"{case}_scratch_best", target, "1/s"),
        _row(f"{case}_scratch_s", wall_scratch, "s"),
        _row(f"{case}_scratch_at_1s", at_1s, "1/s"),
        _row(f"{case}_tuned_s", wall_tuned if wall_tuned is not None else -1.0, "s"),
        _row(f"{case}_speedup", speedup, "x"),
        _row(f"{case}_speedup_99", near, "x"),
    ]
    curves = {
        f"{name} c{count} seed {seed}, {kind}": _curve(part, target)
        for kind, part in (("scratch", scratch), ("fine-tuned", tuned))
    }
    return rows, curves


NEAR = 0.99  # the secondary transfer rows: time to within 1% of scratch's final best


def _speedup(scratch: Partition, tuned: Partition, level: float) -> float:
    """Scratch's time to ``level`` over the fine-tuned policy's (0: it never got there)."""
    wall_scratch, wall_tuned = first_reach(scratch, level), first_reach(tuned, level)
    if wall_scratch is None or wall_tuned is None:
        return 0.0
    return wall_scratch / max(wall_tuned, 1e-6)


def _transfer_summary(
    sections: Sequence[Section], cfg: Config, curves: Path | None, log: list[str]
) -> list[Row]:
    """The medians over every transfer case and seed, and the PNG of all curves."""
    got = {
        r.case: float(r.value or 0.0)
        for sec in sections
        for r in sec.rows
        if r.case.startswith("transfer_")
    }
    cases = [f"transfer_{n}_c{c}_s{s}" for n, c in cfg.transfer_cases for s in cfg.transfer_seeds]
    if not cases:
        return []
    speedups = [got[f"{c}_speedup"] for c in cases]
    near = [got[f"{c}_speedup_99"] for c in cases]
    rising = sum(got[f"{c}_scratch_at_1s"] < got[f"{c}_scratch_best"] for c in cases)
    tuned = [got[f"{c}_tuned_s"] for c in cases]
    median, median_near = statistics.median(speedups), statistics.median(near)
    log.append(
        f"  transfer: speedups {', '.join(f'{x:.1f}x' for x in speedups)}; median {median:.1f}x; "
        f"scratch still rising after 1 s in {rising} of {len(cases)}; to {NEAR:.0%} of "
        f"scratch's best: {', '.join(f'{x:.1f}x' for x in near)}, "
        f"median {median_near:.1f}x"
    )
    if curves is not None:
        drawn = {k: v for sec in sections for k, v in sec.curves.items()}
        plot_wall_curves(drawn, curves, ylabel="best throughput / scratch's final best")
        log.append(f"  transfer curves: {curves}")
    return [
        _row("transfer_scratch_s", statistics.median(got[f"{c}_scratch_s"] for c in cases), "s"),
        _row("transfer_tuned_s", statistics.median([t for t in tuned if t >= 0] or [-1.0]), "s"),
        _row("transfer_scratch_rises_after_1s", float(rising == len(cases)), "bool"),
        _row("transfer_cases_rising_after_1s", float(rising), "cases"),
        _row("transfer_cases_reached", float(sum(t >= 0 for t in tuned)), "cases"),
        _row("transfer_speedup_min", min(speedups), "x"),
        _row("finetune_speedup", median, "x"),
        _row("finetune_speedup_99", median_near, "x"),
        _row("finetune_speedup", PAPER["finetune_speedup"], "x", "paper"),
    ]


def _curve(part: Partition, scale: float) -> Curve:
    return list(part.extra["history_wall_s"]), [tp / scale for tp in part.history]


@dataclass
class Section:
    """One independent part of the benchmark, as run (maybe in another process)."""

    name: str
    rows: list[Row]
    log: list[str]
    wall_s: float
    cpu_s: float  # this process's CPU time: the load-independent cost
    curves: dict[str, Curve] = field(default_factory=dict)


Job = tuple[str, Callable[..., Any], tuple[Any, ...]]


def _timed(name: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Section:
    """Run one job, ``fn(*args, log)``, and time it (wall and CPU)."""
    log: list[str] = []
    start, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, log)
    rows, curves = out if isinstance(out, tuple) else (out, {})
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return Section(name, rows, log, wall, cpu, curves)


def _jobs(cfg: Config, policy: Policies) -> list[Job]:
    """Every section, the longest first (they are handed out in this order)."""
    heldout = sorted(  # a rough cost: nodes x chiplets, twice more at 8 (slower repairs)
        ((n, c) for n in cfg.heldout for c in cfg.heldout_chiplets),
        key=lambda nc: -len(heldout_graph(nc[0])) * nc[1] * (2 if nc[1] == 8 else 1),
    )
    jobs: list[Job] = [(f"bert_c{c}", _bert, (c, cfg, policy)) for c in sorted(cfg.chiplets)[::-1]]
    jobs += [(_heldout_case(n, c, cfg), _heldout, (n, c, cfg, policy)) for n, c in heldout]
    jobs += [
        (f"transfer_{n}_c{c}_s{s}", _transfer, (n, c, s, cfg, policy))
        for n, c in cfg.transfer_cases
        for s in cfg.transfer_seeds
    ]
    return [*jobs, ("validity", _validity, (bert_graph(), cfg))]


def _run_jobs(jobs: Sequence[Job], workers: int, log: list[str]) -> list[Section]:
    """Run the jobs, in ``workers`` processes (spawned) or here; sections in job order."""

    def done(sec: Section) -> None:
        log.append(f"[{sec.name}: {sec.wall_s:.1f} s, {sec.cpu_s:.1f} s of CPU]")
        for line in sec.log:
            log.append(line)

    if workers <= 1:
        out = []
        for job in jobs:
            out.append(_timed(*job))
            done(out[-1])
        return out
    with _pool(workers) as pool:
        try:
            futures = [pool.submit(_timed, *job) for job in jobs]
            for fut in as_completed(futures):
                done(fut.result())
        except BaseException:  # Ctrl-C, a failed section: end the others now, not at their end
            for proc in list(pool._processes.values()):
                proc.kill()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        return [f.result() for f in futures]


def _pool(workers: int) -> ProcessPoolExecutor:
    """``workers`` spawned processes, each of which ends when this one does, however.

    Submit from a thread that outlives the pool: the kernel's parent-death
    signal follows the *thread* that started a worker (started on submit).
    """
    ctx = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(workers, mp_context=ctx, initializer=_exit_with_parent)


def _exit_with_parent() -> None:
    """In a pool worker: end as soon as the parent process ends (even by SIGKILL).

    Linux: the kernel kills it (``PR_SET_PDEATHSIG``), even inside C code that
    holds the GIL. Everywhere: a daemon thread waits on the parent's sentinel (a
    pipe that only the parent holds open) and exits, which also covers a parent
    gone before the ``prctl``.
    """
    with suppress(OSError, AttributeError):  # not Linux: the thread alone
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = multiprocessing.parent_process()
    if parent is None:  # not a spawned child
        return
    sentinel = parent.sentinel

    def watch() -> None:
        wait([sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _policy(cfg: Config, policy_path: Path | None, log: list[str]) -> Policies:
    """The policy under test: a file, the shipped set, or one pre-trained here."""
    if policy_path is not None:
        return Policy.load(policy_path)
    if cfg.pretrain_evaluations == 0:
        return Policy.pretrained_set()
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
    """Run the benchmark; returns the JSON rows and the log lines.

    The sections (BERT at each count, each held-out graph at each count, each
    transfer case and seed, the validity counts) are independent and run in
    ``cfg.workers`` processes; each search inside them is single-threaded, so
    with one process per core their wall times are those of a lone run (on an
    otherwise idle machine). Each section's wall time and CPU time are rows:
    on a shared machine the CPU time is the figure that does not depend on
    the other jobs.
    """
    log = Log(echo)
    start = time.perf_counter()
    policy = _policy(cfg, policy_path, log)
    sections = _run_jobs(_jobs(cfg, policy), cfg.workers, log)
    order = {"validity": 0, "bert": 1, "heldout": 2, "transfer": 3}
    sections = sorted(sections, key=lambda sec: order[sec.name.split("_")[0]])
    rows = [r for sec in sections for r in sec.rows]
    rows += _transfer_summary(
        [sec for sec in sections if sec.name.startswith("transfer_")], cfg, curves, log
    )
    for sec in sections:
        rows.append(_row(f"section_{sec.name}_wall_s", sec.wall_s, "s"))
        rows.append(_row(f"section_{sec.name}_cpu_s", sec.cpu_s, "s"))
    total, cpu = time.perf_counter() - start, sum(sec.cpu_s for sec in sections)
    rows.append(_row("total_wall_s", total, "s"))
    rows.append(_row("total_section_cpu_s", cpu, "s"))
    log.append(
        f"  total wall time {total:.1f} s ({cfg.workers} worker(s)); the sections took "
        f"{cpu:.1f} s of CPU (an idle machine with {cfg.workers} cores: about "
        f"{cpu / cfg.workers:.0f} s of wall time)"
    )
    return rows, log


COLUMNS = [
    system_column("atoll", 12, ".3f"),
    system_column("paper", 8, ".2f", missing=""),
    unit_column(0),
]


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a table: case, atoll's value, the paper's where it has one."""
    return table(rows, COLUMNS, keep=lambda group: "atoll" in group)


def _configure(cfg: Config, args: argparse.Namespace) -> Config:
    """``cfg`` with the command line's choices of sections applied. For example
    the held-out rows at 8 chiplets and budget 1000, which the full run leaves
    out for its wall time: ``--heldout-only --heldout-chiplets 8 --top-chiplets 8``."""
    if args.heldout_only:
        cfg = replace(cfg, chiplets=(), transfer_cases=(), validity_chiplets=())
    if args.heldout_chiplets:
        cfg = replace(cfg, heldout_chiplets=tuple(args.heldout_chiplets))
    if args.top_chiplets:
        cfg = replace(cfg, heldout_top_chiplets=args.top_chiplets)
    if args.heldout:
        unknown = sorted(set(args.heldout) - set(heldout_names()))
        if unknown:
            raise SystemExit(
                f"atoll bench partition: no held-out graph {unknown}; choose from {heldout_names()}"
            )
        cfg = replace(cfg, heldout=tuple(args.heldout))
    if args.ablation:
        cfg = replace(cfg, ablation=True)
    return replace(cfg, heldout_topology=args.topology)


def _parser() -> argparse.ArgumentParser:
    """The command line of ``atoll bench partition``."""
    parser = argparse.ArgumentParser(prog="atoll bench partition", description=__doc__)
    parser.add_argument("--small", action="store_true", help="the quick configuration")
    parser.add_argument(
        "--large",
        action="store_true",
        help="graphs of 300 to 3,000 ops instead (atoll bench partition --large --help)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--policy", type=Path, help="use this pre-trained policy (.npz)")
    parser.add_argument(
        "--curves", type=Path, default=Path("partition_transfer.png"), help="transfer curves (PNG)"
    )
    parser.add_argument(
        "--heldout-only", action="store_true", help="only the held-out graphs (no BERT, transfer)"
    )
    parser.add_argument(
        "--heldout-chiplets", type=int, nargs="+", help="held-out chiplet counts (default 4 8)"
    )
    parser.add_argument(
        "--top-chiplets",
        type=int,
        help="also run the largest budget (1000 by default) at this count (default: at none)",
    )
    parser.add_argument("--heldout", nargs="+", help="only these held-out graphs (default all)")
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="also the ablations: RL as shipped without fine-tuning (rows ..._windows_alone)"
        " and CP-SAT hinted by the policy or by RL (..._solver_hinted, ..._solver_rlhinted)",
    )
    parser.add_argument(
        "--topology",
        choices=("chain", "ring"),
        default="chain",
        help="the held-out graphs' chiplets: a chain (default) or a ring (rows heldout_ring_...)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python benchmarks/partition.py [--small] [--json]``; with
    ``--large``, the large graphs (:mod:`atoll.benchmarks.partition_large`)."""
    given = list(sys.argv[1:] if argv is None else argv)
    if "--large" in given:
        from atoll.benchmarks import partition_large

        return partition_large.main([a for a in given if a != "--large"])
    args = _parser().parse_args(argv)
    cfg = _configure(Config.small() if args.small else Config(), args)
    rows, _ = run_bench(cfg, args.policy, echo=True, curves=args.curves)
    emit(rows, args.json, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
