"""A dynamic-programming split of the topological order into contiguous stages.

Chiplet ``k`` gets nodes ``[s_k, s_{k+1})`` of the graph's node order, so data
always flows forward. For contiguous splits the cost model decomposes: the
bytes on the link at cut ``p`` are the outputs of nodes before ``p`` read at or
after ``p``, whatever the other cuts are. A stage is checked for the SRAM limit
and for being skipped by an edge (an edge from before it to after it), which is
exactly the hop limit of 1; for larger hop limits the split is still valid,
only more restricted than necessary. The DP minimizes the slowest stage
exactly over all such splits, in ``O(count * n^2)``.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ._cost import IntArray, node_times
from ._graph import OpGraph
from ._hardware import Chiplets

__all__ = ["cut_traffic", "dp_split"]

F = NDArray[np.float64]


def cut_traffic(graph: OpGraph) -> F:
    """Bytes crossing a cut before node ``p``, for ``p = 0..n`` (0 at both ends)."""
    n = len(graph)
    last, out = graph.array("last"), graph.array("out")
    diff = np.zeros(n + 2)
    np.add.at(diff, np.arange(n) + 1, out)
    np.add.at(diff, last + 1, -out)
    traffic: F = np.cumsum(diff)[: n + 1]
    traffic[0] = traffic[n] = 0.0
    return traffic


def _stage_costs(graph: OpGraph, chiplets: Chiplets) -> F:
    """``cost[s, e]``: the time of a stage of nodes ``[s, e)``, inf where it is not allowed."""
    n = len(graph)
    times = np.concatenate([[0.0], np.cumsum(node_times(graph, chiplets))])
    weights = np.concatenate([[0.0], np.cumsum(graph.array("weights"))])
    link = cut_traffic(graph) / chiplets.link_bytes_per_s
    reach = np.concatenate([[-1], np.maximum.accumulate(graph.array("last"))])[: n + 1]
    s, e = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    cost = times[e] - times[s] + link[s] + link[e]
    ok = (e > s) & (weights[e] - weights[s] <= chiplets.sram_bytes) & (reach[s] < e)
    result: F = np.where(ok, cost, np.inf)
    return result


def dp_split(graph: OpGraph, chiplets: Chiplets) -> IntArray | None:
    """The best valid contiguous split, or ``None`` when no contiguous split is valid."""
    n, c = len(graph), chiplets.count
    if n < c:
        return None
    cost = _stage_costs(graph, chiplets)
    best = np.full((c + 1, n + 1), np.inf)
    arg = np.zeros((c + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, c + 1):
        for e in range(k, n + 1):
            cand = np.maximum(best[k - 1, :e], cost[:e, e])
            s = int(np.argmin(cand))
            best[k, e], arg[k, e] = cand[s], s
    if not np.isfinite(best[c, n]):
        return None
    a = np.zeros(n, dtype=np.int64)
    e = n
    for k in range(c, 0, -1):
        s = int(arg[k, e])
        a[s:e] = k - 1
        e = s
    return a
