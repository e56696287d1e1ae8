"""Pictures: a partition (which node on which chiplet, and stage times) and curves.

matplotlib is imported lazily, only when a picture is asked for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ._cost import Partition
from ._graph import OpGraph

__all__ = ["plot_curves", "plot_partition", "plot_wall_curves"]


def plot_partition(graph: OpGraph, part: Partition, path: str | Path) -> None:
    """Write a PNG: nodes (in topological order) by chiplet, coloured by kind,
    beside each stage's compute and link time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({n.kind for n in graph.nodes})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), width_ratios=[3, 1])
    for kind in kinds:
        idx = [i for i, n in enumerate(graph.nodes) if n.kind == kind]
        left.scatter(idx, [part.assignment[i] for i in idx], s=12, label=kind)
    left.set_xlabel("node (topological order)")
    left.set_ylabel("chiplet")
    left.set_yticks(range(len(part.stages)))  # whole chiplets, not 0.5 steps
    left.set_title(f"{graph.name}: {part.method}, {part.throughput:,.0f} steps/s")
    left.legend(fontsize=7, loc="upper left")
    chips = [s.chip for s in part.stages]
    right.barh(chips, [s.compute_s * 1e6 for s in part.stages], label="compute")
    right.barh(
        chips,
        [s.comm_s * 1e6 for s in part.stages],
        left=[s.compute_s * 1e6 for s in part.stages],
        label="links",
    )
    right.set_xlabel("stage time (us)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_curves(
    curves: Mapping[str, Sequence[float]],
    path: str | Path,
    ylabel: str = "best throughput (1/s)",
    x: Sequence[float] | None = None,
) -> None:
    """Write a PNG of one or more curves against evaluations (e.g. a training curve).

    ``x`` gives the evaluation count of each point (default: 1, 2, 3, ...).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, ys in curves.items():
        ax.plot(list(x) if x is not None else range(1, len(ys) + 1), list(ys), label=label)
    ax.set_xlabel("evaluated partitions")
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_wall_curves(
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: str | Path,
    ylabel: str = "best throughput (1/s)",
) -> None:
    """Write a PNG of curves against wall time: each label maps to ``(seconds, values)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (xs, ys) in curves.items():
        ax.step(list(xs), list(ys), where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("wall time (s, log scale)")
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
