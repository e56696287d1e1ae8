"""Re-splitting a partition along its own order: the polish's escape from a drained chiplet.

A valid partition lists its nodes chiplet by chiplet, each chiplet's in the
graph's order; that list is a topological order in which the partition is a
contiguous split, so every other split of it keeps the flow forward. Moving
a cut moves nodes between two neighbouring chiplets, and a walk over the cuts
passes load along the whole chain in steps of a node or a few, where the
solver's windows and bands need every boundary freed at once.

The walk is annealed on the exact cost model. It scores a split by its
slowest stage plus a twentieth of the stages' root mean square, so that among
equally slow splits the more even one wins, and at a temperature that starts
at :data:`TEMPERATURE` of the slowest stage and falls to nothing.

On a 1,000-op GRU on a ring of 16 (2026-12-08) the windows had drained the
last chiplet down to one node: taking the gather of the 72 steps' outputs
onto it, so as to fill it, sends those outputs back past the first chiplet,
which is tied for the slowest. Every band and window stayed there, at 8,511.6
and 8,269.6 (seed 0, with the bands of now and of before), 4.4% and 7.1%
short of the best known. The walk over the cuts (3 s each) filled the last
chiplet and reached 8,783 to 8,814 from the first and 8,382 to 8,740 from
the second (four seeds each). Started at 2% of the slowest stage, 3 of the
8 runs stayed put; with no heat, every run stayed within 0.3%.
It is plain numpy in the caller's thread: nothing asynchronous.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ._cost import IntArray, stage_times
from ._graph import OpGraph
from ._hardware import Chiplets

__all__ = ["TEMPERATURE", "resplit"]

TEMPERATURE = 0.005  # the first temperature, as a share of the slowest stage
EVEN = 0.05  # the weight of the stages' root mean square beside the slowest
STEPS_PER_NODE = 30  # moves of the walk per node of the graph
MOST = 3  # the most nodes one move passes across a cut


def resplit(graph: OpGraph, chiplets: Chiplets, a: IntArray, rng: np.random.Generator) -> IntArray:
    """The best split of ``a``'s own order (see the module) that an annealed walk
    over its cuts from ``a`` finds: its slowest stage first, then its score
    (``a`` itself when nothing is faster)."""
    count = chiplets.count
    order = np.lexsort((np.arange(len(graph)), a))
    cuts = np.concatenate([[0], np.cumsum(np.bincount(a, minlength=count))])
    times = stage_times(graph, chiplets, a)
    now, steps = _score(times), STEPS_PER_NODE * len(graph)
    best, best_key = cuts, (float(times.max()), now)
    heat = TEMPERATURE * float(times.max())
    for i in range(steps):
        moved = _moved(cuts, rng)
        if moved is None:
            continue
        candidate = _split(order, moved)
        if not _fits(graph, chiplets, candidate):
            continue
        new_times = stage_times(graph, chiplets, candidate)
        new = _score(new_times)
        cool = heat * (1 - i / steps)
        if new <= now or (cool > 0 and rng.random() < np.exp((now - new) / cool)):
            cuts, now = moved, new
            if (float(new_times.max()), new) < best_key:
                best, best_key = moved, (float(new_times.max()), new)
    return _split(order, best)


def _moved(cuts: NDArray[np.int64], rng: np.random.Generator) -> NDArray[np.int64] | None:
    """``cuts`` with one inner cut moved 1 to :data:`MOST` nodes either way, or
    None where that would empty a chiplet."""
    k = int(rng.integers(1, len(cuts) - 1))
    moved = cuts.copy()
    moved[k] += int(rng.choice((-1, 1))) * int(rng.integers(1, MOST + 1))
    return moved if cuts[k - 1] < moved[k] < cuts[k + 1] else None


def _split(order: NDArray[np.int64], cuts: NDArray[np.int64]) -> IntArray:
    """The assignment that puts ``order[cuts[k]:cuts[k + 1]]`` on chiplet ``k``."""
    out = np.empty(len(order), dtype=np.int64)
    out[order] = np.repeat(np.arange(len(cuts) - 1), np.diff(cuts))
    return out


def _fits(graph: OpGraph, chiplets: Chiplets, a: IntArray) -> bool:
    """Whether a split of the order keeps to the hop limit and the SRAM (the
    flow is forward and every chiplet used by construction): what
    :func:`._cost.is_valid_array` checks besides, at a third of its time."""
    span = a[graph.array("dst")] - a[graph.array("src")]
    if int(chiplets.hops(span).max(initial=0)) > chiplets.hop_limit:
        return False
    weights = np.bincount(a, weights=graph.array("weights"), minlength=chiplets.count)
    return bool(weights.max() <= chiplets.sram_bytes)


def _score(times: NDArray[np.float64]) -> float:
    """What the walk lowers: the slowest stage, plus :data:`EVEN` of the root mean square."""
    return float(times.max() + EVEN * np.sqrt(np.mean(times * times)))
