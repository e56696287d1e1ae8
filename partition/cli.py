"""The ``atoll partition`` and ``atoll partition-train`` commands.

Wire them into a parser with :func:`add_commands`, then dispatch with
:func:`run` (it returns the exit status)::

    atoll partition bert --chiplets 4 --method rl --policy p.npz --picture bert.png
    atoll partition-train --evaluations 2000 --save p.npz --curve train.png
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._cost import Partition
from ._errors import InfeasibleError
from ._graph import OpGraph, load_graph
from ._hardware import Chiplets, MiB
from ._models import builtin_graph, builtin_names
from ._policy import Policy
from ._progress import ProgressBar
from ._rl import TrainLog
from ._search import METHODS, SECONDS_PER_OP, search
from ._synthetic import FAMILIES, SHARED_FAMILIES, check_families, synthetic_cases

__all__ = ["add_commands", "format_partition", "load_graph_arg", "run"]

COMMANDS = ("partition", "partition-train")


def add_commands(subparsers: Any) -> None:
    """Add ``partition`` and ``partition-train`` to an argparse subparsers object."""
    p = subparsers.add_parser("partition", help="place a graph's operations onto chiplets")
    p.add_argument("graph", help=f"a JSON file, module.py:function, or one of {builtin_names()}")
    p.add_argument("--chiplets", type=int, default=4)
    p.add_argument("--method", choices=METHODS, default="rl")
    p.add_argument(
        "--budget",
        type=int,
        default=None,
        help=(
            "evaluated partitions (default: 64, more on graphs past 192 ops: default_budget;"
            f" rl's windows then end at {SECONDS_PER_OP:g} s a node, running on past the"
            " budget while they still gain)"
        ),
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sram-mib",
        type=float,
        default=None,
        help="SRAM per chiplet (default: sized to the graph)",
    )
    p.add_argument("--hop-limit", type=int, default=None, help="default: 1, or the least that fits")
    p.add_argument("--topology", choices=("chain", "ring"), default="chain")
    p.add_argument("--time-limit", type=float, default=30.0, help="solver seconds")
    p.add_argument(
        "--solver-seed",
        type=float,
        default=2.0,
        help="rl: CP-SAT deterministic seconds that seed the search (0: none)",
    )
    p.add_argument(
        "--lns-share",
        type=float,
        default=0.5,
        help="rl: share of the budget for CP-SAT's window-by-window polish (0: none)",
    )
    p.add_argument(
        "--no-background",
        action="store_true",
        help="rl: no whole-graph CP-SAT solve on a spare core beside the windows "
        "(results then repeat run to run)",
    )
    p.add_argument(
        "--policy", type=Path, help="load this .npz policy (default: the better of the shipped set)"
    )
    p.add_argument("--save-policy", type=Path, help="save the fine-tuned policy (.npz)")
    p.add_argument("--picture", type=Path, help="write a PNG of the partition")
    p.add_argument("--curve", type=Path, help="write a PNG of the search curve")
    p.add_argument("--save-graph", type=Path, help="write the graph as JSON")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    t = subparsers.add_parser("partition-train", help="pre-train a policy on synthetic graphs")
    t.add_argument("--evaluations", type=int, default=2000, help="RL: repaired samples in all")
    t.add_argument("--graphs", type=int, default=24, help="synthetic graphs in the set")
    t.add_argument(
        "--imitation-steps",
        type=int,
        default=0,
        help="first imitate CP-SAT's partitions of the set for this many steps",
    )
    t.add_argument(
        "--solver-s",
        type=float,
        default=1.0,
        help="CP-SAT deterministic seconds per imitation label",
    )
    t.add_argument(
        "--families",
        type=_families,
        default=None,
        help="comma-separated graph families of the set (default: "
        + ",".join(FAMILIES)
        + "; 'all' adds "
        + ",".join(SHARED_FAMILIES)
        + ")",
    )
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--policy", type=Path, help="start from this .npz policy")
    t.add_argument("--save", type=Path, required=True, help="write the policy (.npz)")
    t.add_argument("--curve", type=Path, help="write a PNG of the training curve")


def _families(text: str) -> tuple[str, ...]:
    """``--families``: names from FAMILIES and SHARED_FAMILIES, or ``all``."""
    try:
        return check_families(FAMILIES + SHARED_FAMILIES if text == "all" else text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} or all") from None


_RETURNS = (
    "it must return an atoll.partition.OpGraph, e.g. from_jax(fn, *example_args) "
    "(docs/partition.md, 'Your own model')"
)


def load_graph_arg(text: str) -> OpGraph:
    """A graph from a JSON path, a built-in name or ``path/to/module.py:function``."""
    if ":" in text and text.split(":", 1)[0].endswith(".py"):
        path, func = text.rsplit(":", 1)
        return _from_module(path, func)
    if text.endswith(".py"):
        raise SystemExit(
            f"atoll partition: {text} is a Python file: name the function that builds the "
            f"graph, as {text}:function; {_RETURNS}"
        )
    if Path(text).is_file():
        try:
            return load_graph(text)
        except (ValueError, KeyError, TypeError) as exc:
            raise SystemExit(
                f"atoll partition: {text} is not a graph file (JSON as --save-graph writes "
                f"it): {type(exc).__name__}: {exc}"
            ) from None
    if text in builtin_names():
        return builtin_graph(text)
    raise SystemExit(
        f"atoll partition: {text!r} is no file, module.py:function or built-in "
        f"({', '.join(builtin_names())})"
    )


def _from_module(path: str, func: str) -> OpGraph:
    """``func()`` of the Python file ``path``, checked to be a graph."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or spec.loader is None or not Path(path).is_file():
        raise SystemExit(f"atoll partition: cannot import {path}: no such Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    build = getattr(module, func, None)
    if not callable(build):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise SystemExit(
            f"atoll partition: {path} has no function {func!r} (it has: {', '.join(names)}); "
            + _RETURNS
        )
    graph = build()
    if not isinstance(graph, OpGraph):
        raise SystemExit(
            f"atoll partition: {path}:{func} returned {type(graph).__name__}; {_RETURNS}"
        )
    return graph


def format_partition(graph: OpGraph, part: Partition) -> str:
    """A short human-readable report of a partition."""
    lines = [
        f"{graph.name}: {len(graph)} nodes on {len(part.stages)} chiplets by {part.method}",
        f"throughput {part.throughput:,.1f} steps/s  valid={part.valid}  "
        f"evaluations={part.evaluations}  wall {part.wall_s:.1f} s",
        "chip  nodes  weights MiB  compute us  links us  stage us",
    ]
    for s in part.stages:
        lines.append(
            f"{s.chip:4d}  {len(s.nodes):5d}  {s.weight_bytes / MiB:11.1f}  "
            f"{s.compute_s * 1e6:10.1f}  {s.comm_s * 1e6:8.1f}  {s.time_s * 1e6:8.1f}"
        )
    return "\n".join(lines)


def _chiplets(graph: OpGraph, args: argparse.Namespace) -> Chiplets:
    """``Chiplets.default_for`` the graph, or the SRAM given by ``--sram-mib``."""
    if args.sram_mib:
        hop = args.hop_limit or 1
        mib = args.sram_mib * MiB
        return Chiplets(args.chiplets, sram_bytes=mib, hop_limit=hop, topology=args.topology)
    return Chiplets.default_for(graph, args.chiplets, args.hop_limit, args.topology)


def _run_search(
    graph: OpGraph,
    chips: Chiplets,
    policy: list[Policy] | None,
    args: argparse.Namespace,
    bar: ProgressBar,
) -> Partition:
    """``search`` as the command line asks for it; the bar's line ends however it ends."""
    try:
        return search(
            graph,
            chips,
            args.method,
            args.budget,
            policy,
            args.seed,
            progress=bar,
            time_limit_s=args.time_limit,
            rl_solver_s=args.solver_seed,
            rl_lns=args.lns_share,
            rl_background=not args.no_background,
        )
    finally:
        bar.finish()


def _partition(args: argparse.Namespace) -> int:
    graph = load_graph_arg(args.graph)
    if args.save_graph:
        from ._graph import save_graph

        save_graph(graph, args.save_graph)
    chips = _chiplets(graph, args)
    policy: list[Policy] | None = [Policy.load(args.policy)] if args.policy else None
    if args.method == "rl" and policy is None:
        policy = Policy.pretrained_set()  # the first is trained, from the best of them
    bar = ProgressBar(f"{args.method:>6}")
    try:
        part = _run_search(graph, chips, policy, args, bar)
    except InfeasibleError as e:
        print(f"atoll partition: infeasible: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # bad arguments (a budget below 1, a share outside [0, 1])
        print(f"atoll partition: error: {e}", file=sys.stderr)
        return 2
    if args.save_policy and policy is not None:
        policy[0].save(args.save_policy)
    if args.json:
        print(
            json.dumps(
                {
                    "graph": graph.name,
                    "method": part.method,
                    "throughput": part.throughput,
                    "valid": part.valid,
                    "assignment": list(part.assignment),
                }
            )
        )
    else:
        print(format_partition(graph, part))
    if args.picture:
        from ._plot import plot_partition

        plot_partition(graph, part, args.picture)
        print(f"picture: {args.picture}", file=sys.stderr)
    if args.curve:
        from ._plot import plot_curves

        plot_curves({part.method: part.history}, args.curve)
        print(f"search curve: {args.curve}", file=sys.stderr)
    return 0


def _train(args: argparse.Namespace) -> int:
    from ._rl import pretrain

    policy = Policy.load(args.policy) if args.policy else Policy(seed=args.seed)
    cases = synthetic_cases(args.graphs, args.seed, families=args.families or FAMILIES)
    start = time.perf_counter()
    if args.imitation_steps > 0:
        log = _imitate(policy, cases, args)
        print(f"imitation: {log.evaluations[-1]} steps, node agreement {log.best[-1]:.3f}")
        beside = args.curve is not None and args.evaluations > 0  # RL's curve takes --curve
        path = args.curve.with_suffix(".imitation.png") if beside else args.curve
        _curve(path, log, "nodes on the solver's chiplet")
    if args.evaluations > 0:
        log = pretrain(
            policy,
            cases,
            args.evaluations,
            args.seed,
            progress=ProgressBar("train", unit="", fmt=".2f", name="sample/best"),
        )
        print(f"RL: {log.evaluations[-1]} evaluations")
        _curve(args.curve, log, "mean sample / best seen")
    policy.save(args.save)
    wall = time.perf_counter() - start
    print(f"trained on {len(cases)} graphs in {wall:.1f} s; saved {args.save}")
    return 0


def _imitate(
    policy: Policy, cases: Sequence[tuple[OpGraph, Chiplets]], args: argparse.Namespace
) -> TrainLog:
    from ._imitate import imitate, solver_labels

    bar = ProgressBar("label", unit="", fmt=".2f", name="proved")
    labels = solver_labels(cases, args.solver_s, args.seed, progress=bar)
    bar = ProgressBar("imitate", unit="", fmt=".2f", name="agree")
    return imitate(policy, cases, labels, args.imitation_steps, seed=args.seed, progress=bar)


def _curve(path: Path | None, log: TrainLog, ylabel: str) -> None:
    """Plot ``log`` with a moving mean to ``path`` (the RL phase's curve goes to
    ``--curve`` itself, the imitation's to ``<stem>.imitation.png`` beside it)."""
    if path is None:
        return
    from ._plot import plot_curves

    window = 10
    smooth = [
        sum(log.best[max(0, i - window + 1) : i + 1]) / min(i + 1, window)
        for i in range(len(log.best))
    ]
    curves = {"step": log.best, f"moving mean ({window})": smooth}
    plot_curves(curves, path, ylabel, x=log.evaluations)


def run(args: argparse.Namespace) -> int:
    """Run the parsed ``partition`` or ``partition-train`` command; returns the exit status."""
    return _train(args) if args.command == "partition-train" else _partition(args)
