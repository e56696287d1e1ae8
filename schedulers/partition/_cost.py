"""Constraints and the cost model: is an assignment valid, and how fast is it?

An assignment maps node ``i`` to chiplet ``a[i]``. The chiplets run as a
pipeline; the slowest stage sets the throughput. ``docs/partition.md`` writes
the model down; this module is its only implementation, shared by every method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._graph import Graph
from ._hardware import Chiplets

__all__ = ["Partition", "Stage", "evaluate", "is_valid", "stage_times", "violations"]

IntArray = NDArray[np.int64]


@dataclass(frozen=True)
class Stage:
    """One chiplet's share: its nodes, weights, and time per pipeline step."""

    chip: int
    nodes: tuple[int, ...]
    weight_bytes: float
    compute_s: float
    comm_s: float

    @property
    def time_s(self) -> float:
        """Compute plus link time: how long this stage holds the pipeline."""
        return self.compute_s + self.comm_s


@dataclass(frozen=True)
class Partition:
    """The result of a search: an assignment and what it costs.

    ``throughput`` is in pipeline steps per second (1 / slowest stage).
    ``history`` is the best valid throughput after each evaluated partition.
    """

    assignment: tuple[int, ...]
    throughput: float
    valid: bool
    stages: tuple[Stage, ...]
    method: str = ""
    evaluations: int = 0
    wall_s: float = 0.0
    history: tuple[float, ...] = field(default=(), repr=False)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)


def as_assignment(graph: Graph, chiplets: Chiplets, a: Any) -> IntArray:
    """Check and convert an assignment to an int64 array."""
    arr = np.asarray(a, dtype=np.int64)
    if arr.shape != (len(graph),):
        raise ValueError(f"assignment has shape {arr.shape}, graph has {len(graph)} nodes")
    if arr.size and (arr.min() < 0 or arr.max() >= chiplets.count):
        raise ValueError(f"assignment uses chiplets outside 0..{chiplets.count - 1}")
    return arr


def node_times(graph: Graph, chiplets: Chiplets) -> NDArray[np.float64]:
    """Per-node compute time: a roofline of FLOPs and bytes touched in SRAM."""
    touched = graph.array("weights") + graph.array("out") + graph.array("in")
    t: NDArray[np.float64] = np.maximum(
        graph.array("flops") / chiplets.flops_per_s, touched / chiplets.mem_bytes_per_s
    )
    return t


def link_traffic(graph: Graph, chiplets: Chiplets, a: IntArray) -> NDArray[np.float64]:
    """Bytes crossing each of the ``count - 1`` links per pipeline step.

    A node's output travels once along the chain from its own chiplet to its
    farthest consumer's, crossing every link in between (multicast: consumers
    on the way read it as it passes).
    """
    c = chiplets.count
    lo = a.copy()
    hi = a.copy()
    src, dst = graph.array("src"), graph.array("dst")
    np.maximum.at(hi, src, a[dst])
    np.minimum.at(lo, src, a[dst])
    diff = np.zeros(c + 1)
    out = graph.array("out")
    np.add.at(diff, lo, out)
    np.add.at(diff, hi, -out)
    traffic: NDArray[np.float64] = np.cumsum(diff)[: c - 1]
    return traffic


def stage_times(graph: Graph, chiplets: Chiplets, a: Any) -> NDArray[np.float64]:
    """Time of each stage: its compute plus the bytes on its two links."""
    arr = as_assignment(graph, chiplets, a)
    c = chiplets.count
    compute = np.bincount(arr, weights=node_times(graph, chiplets), minlength=c)
    traffic = link_traffic(graph, chiplets, arr)
    comm = np.zeros(c)
    comm[:-1] += traffic
    comm[1:] += traffic
    result: NDArray[np.float64] = compute + comm / chiplets.link_bytes_per_s
    return result


def violations(graph: Graph, chiplets: Chiplets, a: Any, limit: int = 5) -> list[str]:
    """Human-readable reasons why ``a`` is invalid (empty when it is valid)."""
    arr = as_assignment(graph, chiplets, a)
    out: list[str] = []
    span = arr[graph.array("dst")] - arr[graph.array("src")]
    for i in np.flatnonzero(span < 0)[:limit]:
        e = graph.edges[int(i)]
        out.append(f"edge {e.src}->{e.dst} flows backward ({arr[e.src]} -> {arr[e.dst]})")
    for i in np.flatnonzero(span > chiplets.hop_limit)[:limit]:
        e = graph.edges[int(i)]
        out.append(f"edge {e.src}->{e.dst} skips chips ({arr[e.src]} -> {arr[e.dst]})")
    mem = np.bincount(arr, weights=graph.array("weights"), minlength=chiplets.count)
    for chip in np.flatnonzero(mem > chiplets.sram_bytes):
        out.append(f"chip {chip} holds {mem[chip]:.0f} B of weights > {chiplets.sram_bytes:.0f}")
    for chip in np.flatnonzero(np.bincount(arr, minlength=chiplets.count) == 0):
        out.append(f"chip {chip} is unused")
    return out


def is_valid(graph: Graph, chiplets: Chiplets, a: Any) -> bool:
    """Whether ``a`` meets every constraint (forward, hop limit, SRAM, all chips used)."""
    arr = as_assignment(graph, chiplets, a)
    span = arr[graph.array("dst")] - arr[graph.array("src")]
    if span.size and (span.min() < 0 or span.max() > chiplets.hop_limit):
        return False
    if np.bincount(arr, minlength=chiplets.count).min() == 0:
        return False
    mem = np.bincount(arr, weights=graph.array("weights"), minlength=chiplets.count)
    return bool(mem.max() <= chiplets.sram_bytes)


def throughput(graph: Graph, chiplets: Chiplets, a: Any) -> float:
    """Pipeline steps per second: 1 / the slowest stage (0.0 when invalid)."""
    if not is_valid(graph, chiplets, a):
        return 0.0
    return float(1.0 / stage_times(graph, chiplets, a).max())


def evaluate(graph: Graph, chiplets: Chiplets, a: Any, **info: Any) -> Partition:
    """Build the :class:`Partition` record for assignment ``a``."""
    arr = as_assignment(graph, chiplets, a)
    compute = np.bincount(arr, weights=node_times(graph, chiplets), minlength=chiplets.count)
    total = stage_times(graph, chiplets, arr)
    mem = np.bincount(arr, weights=graph.array("weights"), minlength=chiplets.count)
    stages = tuple(
        Stage(
            chip=c,
            nodes=tuple(int(i) for i in np.flatnonzero(arr == c)),
            weight_bytes=float(mem[c]),
            compute_s=float(compute[c]),
            comm_s=float(total[c] - compute[c]),
        )
        for c in range(chiplets.count)
    )
    valid = is_valid(graph, chiplets, arr)
    tp = float(1.0 / total.max()) if valid else 0.0
    return Partition(tuple(int(x) for x in arr), tp, valid, stages, **info)
