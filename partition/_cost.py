"""Constraints and the cost model: is an assignment valid, and how fast is it?

An assignment maps node ``i`` to chiplet ``a[i]``. The chiplets run as a
pipeline; the slowest stage sets the throughput. ``docs/partition.md`` writes
the model down; this module is its only implementation, shared by every method.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from ._graph import OpGraph

if TYPE_CHECKING:
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


def as_assignment(graph: OpGraph, chiplets: Chiplets, a: Any) -> IntArray:
    """Check and convert an assignment to an int64 array."""
    arr = np.asarray(a, dtype=np.int64)
    if arr.shape != (len(graph),):
        raise ValueError(f"assignment has shape {arr.shape}, graph has {len(graph)} nodes")
    if arr.size and (arr.min() < 0 or arr.max() >= chiplets.count):
        raise ValueError(f"assignment uses chiplets outside 0..{chiplets.count - 1}")
    return arr


def node_times(graph: OpGraph, chiplets: Chiplets) -> NDArray[np.float64]:
    """Per-node compute time: a roofline of FLOPs and bytes touched in SRAM."""
    touched = graph.array("weights") + graph.array("out") + graph.array("in")
    t: NDArray[np.float64] = np.maximum(
        graph.array("flops") / chiplets.flops_per_s, touched / chiplets.mem_bytes_per_s
    )
    return t


def link_traffic(graph: OpGraph, chiplets: Chiplets, a: IntArray) -> NDArray[np.float64]:
    """Bytes crossing each of the ``chiplets.links`` links per pipeline step.

    A node's output travels once from its own chiplet to its farthest
    consumer's, crossing every link in between (multicast: consumers on the way
    read it as it passes). On a ring it may instead go backwards, through the
    wrap link, to its nearest consumer on a later chiplet (which passes every
    later consumer too); it takes the way with fewer links (forward on a tie).
    """
    c = chiplets.count
    src, dst, out = graph.array("src"), graph.array("dst"), graph.array("out")
    hi = a.copy()
    np.maximum.at(hi, src, a[dst])
    diff = np.zeros(c + 1)
    if chiplets.topology != "ring":
        np.add.at(diff, a, out)
        np.add.at(diff, hi, -out)
        chain: NDArray[np.float64] = np.cumsum(diff)[: c - 1]
        return chain
    later = a[dst] > a[src]
    near = np.full_like(a, c)  # nearest later consumer's chiplet (c: none)
    np.minimum.at(near, src[later], a[dst][later])
    back = (near < c) & (a + c - near < hi - a)
    fwd = ~back
    np.add.at(diff, a[fwd], out[fwd])
    np.add.at(diff, hi[fwd], -out[fwd])
    diff[0] += out[back].sum()  # backwards: links 0 .. a - 1, then near .. c - 1 (wrap)
    np.add.at(diff, a[back], -out[back])
    np.add.at(diff, near[back], out[back])
    ring: NDArray[np.float64] = np.cumsum(diff)[:c]
    return ring


def _stage_parts(
    graph: OpGraph, chiplets: Chiplets, arr: IntArray
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Per stage: compute seconds and link seconds (bytes on its two links)."""
    c = chiplets.count
    compute = np.asarray(
        np.bincount(arr, weights=node_times(graph, chiplets), minlength=c), dtype=np.float64
    )
    traffic = link_traffic(graph, chiplets, arr)
    comm = np.zeros(c)
    comm[: chiplets.links] += traffic  # link k touches chiplets k and k + 1 (mod count)
    comm[1:] += traffic[: c - 1]
    if chiplets.links == c:
        comm[0] += traffic[c - 1]
    return compute, comm / chiplets.link_bytes_per_s


def stage_times(graph: OpGraph, chiplets: Chiplets, a: Any) -> NDArray[np.float64]:
    """Time of each stage: its compute plus the bytes on its two links."""
    compute, comm = _stage_parts(graph, chiplets, as_assignment(graph, chiplets, a))
    result: NDArray[np.float64] = compute + comm
    return result


def _violations(graph: OpGraph, chiplets: Chiplets, arr: IntArray, limit: int) -> Iterator[str]:
    """Every broken constraint, lazily (at most ``limit`` edges of each kind)."""
    span = arr[graph.array("dst")] - arr[graph.array("src")]
    for i in np.flatnonzero(span < 0)[:limit]:
        e = graph.edges[int(i)]
        yield f"edge {e.src}->{e.dst} flows backward ({arr[e.src]} -> {arr[e.dst]})"
    for i in np.flatnonzero(chiplets.hops(np.maximum(span, 0)) > chiplets.hop_limit)[:limit]:
        e = graph.edges[int(i)]
        yield f"edge {e.src}->{e.dst} skips chips ({arr[e.src]} -> {arr[e.dst]})"
    mem = np.bincount(arr, weights=graph.array("weights"), minlength=chiplets.count)
    for chip in np.flatnonzero(mem > chiplets.sram_bytes):
        yield f"chip {chip} holds {mem[chip]:.0f} B of weights > {chiplets.sram_bytes:.0f}"
    for chip in np.flatnonzero(np.bincount(arr, minlength=chiplets.count) == 0):
        yield f"chip {chip} is unused"


def is_valid_array(graph: OpGraph, chiplets: Chiplets, arr: IntArray) -> bool:
    """:func:`is_valid` of an array :func:`as_assignment` already checked."""
    return next(_violations(graph, chiplets, arr, 1), None) is None


def violations(graph: OpGraph, chiplets: Chiplets, a: Any, limit: int = 5) -> list[str]:
    """Human-readable reasons why ``a`` is invalid (empty when it is valid)."""
    return list(_violations(graph, chiplets, as_assignment(graph, chiplets, a), limit))


def is_valid(graph: OpGraph, chiplets: Chiplets, a: Any) -> bool:
    """Whether ``a`` meets every constraint (forward, hop limit, SRAM, all chips used)."""
    return is_valid_array(graph, chiplets, as_assignment(graph, chiplets, a))


def valid_throughput(graph: OpGraph, chiplets: Chiplets, arr: IntArray) -> float:
    """:func:`throughput` of an assignment already known valid (a repaired one), unchecked."""
    compute, comm = _stage_parts(graph, chiplets, arr)
    return float(1.0 / (compute + comm).max())


def throughput(graph: OpGraph, chiplets: Chiplets, a: Any) -> float:
    """Pipeline steps per second: 1 / the slowest stage (0.0 when invalid)."""
    arr = as_assignment(graph, chiplets, a)
    return valid_throughput(graph, chiplets, arr) if is_valid_array(graph, chiplets, arr) else 0.0


def evaluate(graph: OpGraph, chiplets: Chiplets, a: Any, **info: Any) -> Partition:
    """Build the :class:`Partition` record for assignment ``a``."""
    arr = as_assignment(graph, chiplets, a)
    compute, comm = _stage_parts(graph, chiplets, arr)
    mem = np.bincount(arr, weights=graph.array("weights"), minlength=chiplets.count)
    stages = tuple(
        Stage(
            chip=c,
            nodes=tuple(int(i) for i in np.flatnonzero(arr == c)),
            weight_bytes=float(mem[c]),
            compute_s=float(compute[c]),
            comm_s=float(comm[c]),
        )
        for c in range(chiplets.count)
    )
    valid = is_valid_array(graph, chiplets, arr)
    tp = float(1.0 / (compute + comm).max()) if valid else 0.0
    return Partition(tuple(int(x) for x in arr), tp, valid, stages, **info)
