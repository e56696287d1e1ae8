"""``atoll bench partition --large``: the partitioner on graphs of 300 to 3,000 ops.

Graphs traced by ``from_jax`` from real model families: GPT-style decoders
of about 300, 1,000 and 3,000 ops (``decoder_graph``), BERT-large, a
mixture-of-experts encoder (branches: eight experts a layer), and two
architectures of the held-out set at this scale: a GRU unrolled over 72
steps (1,000 ops), a T5-like encoder-decoder of 24 + 24 layers and a
WaveNet of 20 stacks (1,003 ops). Each case is a
graph on ``Chiplets.default_for`` at a chiplet count and topology. Every
method runs on it:

- ``rl``: RL as shipped, the plain call ``search(graph, chiplets)``;
- ``sa`` and ``random`` at RL's budget (an equal budget: the plain call's
  ``default_budget``, 64 up to 192 ops, 333 at 1,000 ops, 111 at 3,000, or
  the evaluations RL took past it in overtime while its windows gained);
- ``solver``: CP-SAT on the bottleneck for as long as RL took (an equal time).

Each gets its throughput, its wall time, and its gap to the case's
reference: the best partition known, from ``benchmarks/partition_reference.json``
(made by ``--make-reference``: RL at twice its default budget and a long
SA, then CP-SAT warm-started from the better for a generous time; the file says what each
took, and whether CP-SAT proved the value optimal). RL also gets the time its
search first came within 1% (``rl_to_1pct_s``) and 2% of the reference.
``--transfer BUDGET`` adds the paper's transfer: the time the fine-tuned
shipped policy takes to reach what training from scratch reaches in BUDGET
evaluations, against scratch's own (:func:`run_transfer`).

``--tiny`` is the version the test suite runs: a 3-layer decoder on 4
chiplets, its reference made on the spot. Nothing here is asynchronous;
cases run one after the other, each search on one core.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from atoll.benchmarks._common import Log, Row, emit, first_reach, system_column, table, unit_column
from atoll.partition import Chiplets, OpGraph, Partition, decoder_graph, search
from atoll.partition._cost import valid_throughput
from atoll.partition._heldout import gru_graph, t5_graph, wavenet_graph
from atoll.partition._models import moe_graph, transformer_graph
from atoll.partition._search import default_budget
from atoll.partition._solver import solve_bottleneck

__all__ = ["CASES", "GRAPHS", "Case", "main", "make_reference", "run_case", "run_transfer"]

REFERENCE = Path(__file__).with_name("partition_reference.json")
NEAR = (0.01, 0.02)  # "within 1% / 2% of the reference"
METHODS = ("rl", "sa", "random", "solver")

GRAPHS: dict[str, Callable[[], OpGraph]] = {
    "gpt300": lambda: decoder_graph(27, name="gpt300"),
    "gpt1000": lambda: decoder_graph(90, name="gpt1000"),
    "gpt3000": lambda: decoder_graph(272, name="gpt3000"),
    "bert_large": lambda: transformer_graph(24, 1024, 16, 128, name="bert_large"),
    "moe": lambda: moe_graph(16, 768, 8),
    # architectures the policy never trained on, at this scale: a GRU unrolled over
    # 72 steps (its recurrent weights shared by every step) and an encoder-decoder
    # whose encoder output feeds every decoder layer (edges that span the graph)
    "gru1000": lambda: gru_graph(steps=72),
    "t5_large": lambda: t5_graph(layers=24),
    # 20 stacks of 10 gated dilated convolutions: its windows are cheap, so on a
    # ring of 32 the default budget's evaluations ended before its gains did
    "wavenet1000": lambda: wavenet_graph(stacks=20),
    "tiny": lambda: decoder_graph(3, 128, 4, 32, 1000, name="gpt_tiny"),
}


@dataclass(frozen=True)
class Case:
    """One graph on ``chiplets`` chiplets of a ``topology``, sized by ``Chiplets.default_for``."""

    graph: str
    chiplets: int
    topology: str = "chain"

    @property
    def name(self) -> str:
        """``gpt1000_c16``, ``gpt300_c32_ring``: the rows' prefix and the reference's key."""
        ring = "_ring" if self.topology == "ring" else ""
        return f"{self.graph}_c{self.chiplets}{ring}"

    @classmethod
    def parse(cls, text: str) -> Case:
        """``gpt1000_c16`` or ``gpt300_c32_ring`` back into a case."""
        parts = text.split("_")
        ring = parts[-1] == "ring"
        parts = parts[:-1] if ring else parts
        if len(parts) < 2 or not parts[-1].startswith("c") or not parts[-1][1:].isdigit():
            raise ValueError(f"a case is GRAPH_cCOUNT[_ring], e.g. gpt1000_c16; got {text!r}")
        graph = "_".join(parts[:-1])
        if graph not in GRAPHS:
            raise ValueError(f"no graph {graph!r}; choose from {sorted(GRAPHS)}")
        return cls(graph, int(parts[-1][1:]), "ring" if ring else "chain")

    def build(self) -> tuple[OpGraph, Chiplets]:
        """The graph, and the chiplets sized to it."""
        graph = GRAPHS[self.graph]()
        return graph, Chiplets.default_for(graph, self.chiplets, topology=self.topology)


CASES = (  # the default run: the targets first
    Case("gpt1000", 8),
    Case("gpt1000", 16),
    Case("gpt300", 16),
    Case("gpt300", 32, "ring"),
    Case("bert_large", 16),
    Case("moe", 8),
    Case("moe", 16, "ring"),
    Case("gpt3000", 16),
    Case("gru1000", 8),
    Case("t5_large", 16),
    Case("gru1000", 16, "ring"),
    Case("wavenet1000", 32, "ring"),
)
EVERY = tuple(
    Case(g, c, t) for g in GRAPHS if g != "tiny" for c in (8, 16, 32) for t in ("chain", "ring")
)


def _row(case: str, value: float | None, unit: str, system: str = "atoll") -> Row:
    return Row("partition_large", case, system, value, unit)


def load_references(path: Path = REFERENCE) -> dict[str, dict[str, Any]]:
    """The stored reference of every case made so far, by case name."""
    if not path.exists():
        return {}
    data: dict[str, dict[str, Any]] = json.loads(path.read_text())["cases"]
    return data


def run_case(
    case: Case,
    reference: float | None,
    budget: int | None = None,
    log: list[str] | None = None,
    methods: Sequence[str] = METHODS,
) -> list[Row]:
    """Every method of ``methods`` on ``case``, with gaps to ``reference`` (None:
    no gap rows); SA and random at ``budget`` (None: RL's: its default budget,
    and any overtime RL took past it), the solver for RL's wall time
    (RL runs whatever ``methods`` says)."""
    graph, chips = case.build()
    log = log if log is not None else []
    log.append(f"  {case.name}: {len(graph)} ops, {chips.count} chiplets ({chips.topology})")
    parts: dict[str, Partition] = {}
    parts["rl"] = search(graph, chips)  # as shipped: the plain call
    rl_budget = max(parts["rl"].evaluations, default_budget(graph))  # RL stops early on a proof
    equal = rl_budget if budget is None else budget
    for method in ("sa", "random"):
        if method in methods:
            parts[method] = search(graph, chips, method, equal)
    if "solver" in methods:
        limit = max(parts["rl"].wall_s, 1.0)
        parts["solver"] = search(graph, chips, "solver", time_limit_s=limit)
    rows: list[Row] = []
    for method, part in parts.items():
        gap = None if reference is None else 100.0 * (1.0 - part.throughput / reference)
        rows += [
            _row(f"{case.name}_{method}", part.throughput, "1/s"),
            _row(f"{case.name}_{method}_s", part.wall_s, "s"),
            _row(f"{case.name}_{method}_gap_pct", gap, "%"),
        ]
        log.append(
            f"    {method:>6}: {part.throughput:10.2f} /s in {part.wall_s:7.1f} s"
            + ("" if gap is None else f", {gap:+.2f}% from the reference")
        )
    if reference is not None:
        for near in NEAR:
            at = first_reach(parts["rl"], (1.0 - near) * reference)
            rows.append(_row(f"{case.name}_rl_to_{round(100 * near)}pct_s", at, "s"))
            when = "never" if at is None else f"after {at:.1f} s"
            log.append(f"    rl within {near:.0%} of the reference: {when}")
    others = max((parts[m].throughput for m in ("sa", "random") if m in parts), default=0.0)
    if others > 0:
        vs = parts["rl"].throughput / others
        rows.append(_row(f"{case.name}_rl_vs_best_baseline", vs, "x"))
    return rows


def run_transfer(case: Case, budget: int, seed: int = 1, log: list[str] | None = None) -> list[Row]:
    """The paper's transfer on a large graph: the policy alone (no DP hint, no
    solver, no local moves) trained from scratch for ``budget`` evaluations,
    then the shipped pre-trained set fine-tuned until it reaches scratch's
    best. Rows: scratch's best and when it first got there, the fine-tuned
    policy's best (scratch's, where it stopped there), when it got there
    (strictly, and to within 1%), and the ratios."""
    from atoll.partition import Policy

    graph, chips = case.build()
    log = log if log is not None else []
    alone: dict[str, Any] = {"rl_hint": False, "rl_local": 0, "rl_solver_s": 0.0}
    search(graph, chips, "rl", 9, Policy(seed=99), seed=99, **alone)  # compile for neither
    scratch = search(graph, chips, "rl", budget, Policy(seed=seed), seed=seed, **alone)
    best = scratch.throughput
    tuned = search(graph, chips, "rl", budget, None, seed, stop_at=best, **alone)  # the shipped set
    rows = [
        _row(f"{case.name}_transfer_scratch_best", best, "1/s"),
        _row(f"{case.name}_transfer_tuned_best", tuned.throughput, "1/s"),
    ]
    for label, level in (("", best), ("_1pct", 0.99 * best)):
        at_scratch, at_tuned = first_reach(scratch, level), first_reach(tuned, level)
        ratio = None if at_scratch is None or at_tuned is None else at_scratch / max(at_tuned, 1e-6)
        rows += [
            _row(f"{case.name}_transfer_scratch{label}_s", at_scratch, "s"),
            _row(f"{case.name}_transfer_tuned{label}_s", at_tuned, "s"),
            _row(f"{case.name}_transfer_speedup{label}", ratio, "x"),
        ]
        log.append(
            f"    transfer{label or ' (strict)'}: scratch {at_scratch} s, fine-tuned {at_tuned} s"
            + ("" if ratio is None else f": {ratio:.1f}x")
        )
    return rows


def make_reference(
    case: Case, solver_s: float, sa_budget: int = 300, log: list[str] | None = None
) -> dict[str, Any]:
    """A best-known value for ``case``: RL at twice its default budget and a long
    SA, then CP-SAT warm-started from the better for ``solver_s`` seconds. Returns the entry
    stored in the reference file (the value, CP-SAT's bound, and what each took)."""
    graph, chips = case.build()
    log = log if log is not None else []
    start = time.perf_counter()
    rl_budget = 2 * default_budget(graph)  # twice the plain call's
    rl = search(graph, chips, budget=rl_budget)
    sa = search(graph, chips, "sa", sa_budget)
    best = max((rl, sa), key=lambda p: p.throughput)
    hint = np.array(best.assignment, dtype=np.int64)
    assignment, stats = solve_bottleneck(graph, chips, solver_s, hint=hint)
    dp = search(graph, chips, "dp").throughput  # only to say how the contiguous split compares
    value = max(valid_throughput(graph, chips, assignment), best.throughput)
    entry = {
        "throughput": value,
        "bound": 1.0 / stats["bound_s"] if stats["bound_s"] > 0 else None,
        "optimal": bool(stats["optimal"]),
        "ops": len(graph),
        "rl": [rl.throughput, rl.wall_s, rl_budget],
        "sa": [sa.throughput, sa.wall_s, sa_budget],
        "dp": dp,
        "cpsat": [valid_throughput(graph, chips, assignment), stats["solve_s"], solver_s],
        "seconds": time.perf_counter() - start,
        "made": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": _commit(),
    }
    log.append(f"  {case.name}: reference {value:.2f} /s (optimal: {entry['optimal']}) {entry}")
    return entry


def _commit() -> str:
    """The checkout's commit, or '' outside one."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return ""
    return out.stdout.strip()


def store_references(entries: dict[str, dict[str, Any]], path: Path = REFERENCE) -> None:
    """Merge ``entries`` into the reference file (written sorted, one case a key)."""
    cases = {**load_references(path), **entries}
    doc = {
        "how": (
            "atoll bench partition --large --make-reference CASE...: RL at twice its "
            "default budget ('rl': value, seconds, budget; the entries made before "
            "63a8beb ran it at 64) and SA (likewise, 'sa'), then CP-SAT on the "
            "bottleneck warm-started from the better for the seconds in 'cpsat' (value, "
            "seconds taken, limit); 'throughput' is the best of them, 'bound' CP-SAT's "
            "proven upper bound (on its model, whose node times are rounded to 1/200,000 "
            "of the total), 'optimal' whether it proved the value optimal, 'dp' the "
            "contiguous split's value"
        ),
        "cases": dict(sorted(cases.items())),
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")


COLUMNS = [system_column("atoll", 12, ".2f"), unit_column(0)]


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a table: case and value."""
    return table(rows, COLUMNS, keep=lambda group: "atoll" in group)


def _cases(args: argparse.Namespace) -> tuple[Case, ...]:
    if args.tiny:
        return (Case("tiny", 4),)
    if args.cases:
        try:
            return tuple(Case.parse(c) for c in args.cases)
        except ValueError as exc:
            raise SystemExit(f"atoll bench partition --large: {exc}") from None
    return EVERY if args.every else CASES


def _run(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    cases, log, rows = _cases(args), Log(echo=True), list[Row]()
    refs = load_references()
    for case in cases:
        log.append(f"[{case.name}]")
        if args.make_reference:
            refs[case.name] = make_reference(case, args.reference_s, args.sa_budget, log)
            if not args.tiny:
                store_references({case.name: refs[case.name]})
        ref = refs.get(case.name, {}).get("throughput")
        if (not args.make_reference or args.tiny) and not args.transfer_only:
            rows += run_case(case, ref, args.budget, log, args.methods.split(","))
        if args.transfer:
            rows += run_transfer(case, args.transfer, log=log)
    return rows, log


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atoll bench partition --large",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--large", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--tiny", action="store_true", help="a 3-layer decoder: the tests' run")
    parser.add_argument("--cases", nargs="+", help="only these cases (GRAPH_cCOUNT[_ring])")
    parser.add_argument("--every", action="store_true", help="every graph x 8/16/32 x chain/ring")
    parser.add_argument(
        "--budget", type=int, help="SA's and random's budget (default: RL's, by the graph)"
    )
    parser.add_argument(
        "--transfer",
        type=int,
        default=0,
        metavar="BUDGET",
        help="also the transfer rows: scratch trains for BUDGET evaluations (0: none)",
    )
    parser.add_argument(
        "--methods", default=",".join(METHODS), help="which methods (default: all; RL always)"
    )
    parser.add_argument(
        "--transfer-only", action="store_true", help="only the transfer rows (with --transfer)"
    )
    parser.add_argument(
        "--make-reference",
        action="store_true",
        help="make the cases' references (stored in benchmarks/partition_reference.json)",
    )
    parser.add_argument("--reference-s", type=float, default=900.0, help="CP-SAT's time for one")
    parser.add_argument("--sa-budget", type=int, default=300, help="the reference's long SA")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``atoll bench partition --large [--cases ...] [--json]``."""
    args = _parser().parse_args(argv)
    if args.tiny:  # the tiny case's reference is made on the spot, and not stored
        args.make_reference = True
        args.reference_s, args.sa_budget = min(args.reference_s, 10.0), 16
    rows, _ = _run(args)
    emit(rows, args.json, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
