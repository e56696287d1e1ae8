"""A dynamic-programming split of the topological order into contiguous stages.

Chiplet ``k`` gets nodes ``[s_k, s_{k+1})`` of the graph's node order, so data
always flows forward. For contiguous splits the cost model decomposes: the
bytes on the link at cut ``p`` are the outputs of nodes before ``p`` read at or
after ``p``, whatever the other cuts are. A stage is checked for the SRAM limit
and for the hop limit ``h``: with cuts ``b_0 = 0 < b_1 < ... < b_count = n``, no
edge may leave a node before ``b_{m-h}`` for a node at or after ``b_m``, that is
``reach(b_{m-h}) < b_m`` where ``reach(p)`` is the last consumer of any node
before ``p``.

- ``h = 1`` (a stage may not be skipped) and ``h >= count - 1`` (the limit
  cannot bind) are exact: the DP minimizes the slowest stage over all valid
  contiguous splits, in ``O(count * n^2)``.
- ``1 < h < count - 1`` couples a cut with the cut ``h`` stages back, which the
  DP state (the last cut only) does not hold. The DP checks the constraint
  against the best path into each state, so every split it returns is valid,
  but it may miss a better split (or every valid one) whose earlier cuts lie
  elsewhere: a heuristic, documented as such.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from ._cost import IntArray, node_times
from ._graph import OpGraph

if TYPE_CHECKING:
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
    s, e = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    cost = times[e] - times[s] + link[s] + link[e]
    ok = (e > s) & (weights[e] - weights[s] <= chiplets.sram_bytes)
    if chiplets.hop_limit == 1:
        ok &= reach(graph)[s] < e
    result: F = np.where(ok, cost, np.inf)
    return result


def reach(graph: OpGraph) -> NDArray[np.int64]:
    """``reach[p]``: the last consumer of any node before ``p`` (-1 for ``p = 0``)."""
    last = graph.array("last")
    out: NDArray[np.int64] = np.concatenate([[-1], np.maximum.accumulate(last)])
    return out


def _cut_back(
    arg: NDArray[np.int64], k: int, cuts: NDArray[np.int64], steps: int
) -> NDArray[np.int64]:
    """For each cut ``b_k`` in ``cuts``, the cut ``steps`` stages before it on the
    best path into ``(k, b_k)`` (``arg[k, e]`` is the start of the last of ``k`` stages)."""
    for j in range(steps):
        cuts = arg[k - j, cuts]
    return cuts


def dp_split(graph: OpGraph, chiplets: Chiplets) -> IntArray | None:
    """The best valid contiguous split, or ``None`` when no contiguous split is valid.

    On a ring it is the best split that is valid on the chain of the same
    chiplets (such a split is valid on the ring, and no slower there): not
    exact for the ring, which may allow more.
    """
    if chiplets.topology == "ring":
        chiplets = dataclasses.replace(chiplets, topology="chain")
    n, c = len(graph), chiplets.count
    if n < c:
        return None
    cost = _stage_costs(graph, chiplets)
    h = chiplets.hop_limit
    path_check = 1 < h < c - 1  # h = 1 is in the costs; h >= c - 1 cannot bind
    far = reach(graph)
    best = np.full((c + 1, n + 1), np.inf)
    arg = np.zeros((c + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, c + 1):
        starts = np.arange(n + 1)
        back = _cut_back(arg, k - 1, starts, h - 1) if path_check and k - 1 >= h else None
        for e in range(k, n + 1):
            cand = np.maximum(best[k - 1, :e], cost[:e, e])
            if back is not None:  # the cut h stages back must not reach e
                cand = np.where(far[back[:e]] < e, cand, np.inf)
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
