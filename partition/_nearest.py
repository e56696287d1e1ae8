"""The repair's fast path: the nearest assignment under the chain constraints, by LP.

Forward flow (``chip(dst) >= chip(src)``) and the hop limit
(``chip(dst) - chip(src) <= h``) are difference constraints. Minimizing the
total displacement ``sum_i |a[i] - candidate[i]|`` under them, with
``a = candidate + up - down`` and ``up, down >= 0``, is a linear program
whose constraint matrix is a network matrix beside its negation, so it is
totally unimodular: a simplex vertex is an integral assignment. HiGHS's dual
simplex finds it in milliseconds where CP-SAT took seconds at 1,000 nodes.

The LP leaves out the two constraints that are not differences (the weights
on a chiplet fit its SRAM; every chiplet is used). When its assignment meets
them too, it is the nearest valid assignment: nothing valid is nearer, since
every valid assignment is feasible for the LP. When it does not,
:class:`._repair.Repairer` re-solves around the chiplets it breaks.

On a ring the hop limit counts the shorter way round, a choice of two
intervals per edge; the LP keeps each edge on the side its candidate took
(through the wrap link when the candidate's span is that long), so there its
assignment is valid and near, not always the nearest.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ._cost import IntArray
from ._graph import OpGraph
from ._hardware import Chiplets

__all__ = ["OrderLP"]


class OrderLP:
    """The LP of one (graph, chiplets) pair, built once, solved per candidate.

    Calling it is synchronous and takes milliseconds; it needs scipy (a
    dependency of JAX).
    """

    def __init__(self, graph: OpGraph, chiplets: Chiplets) -> None:
        from scipy.sparse import coo_matrix, hstack, vstack

        n, m = len(graph), len(graph.edges)
        self.count, self.hop = chiplets.count, chiplets.hop_limit
        self.ring = chiplets.topology == "ring"
        src, dst = graph.array("src").astype(np.int64), graph.array("dst").astype(np.int64)
        rows = np.repeat(np.arange(m), 2)
        cols = np.stack([dst, src], axis=1).ravel()
        diff = coo_matrix((np.tile([1.0, -1.0], m), (rows, cols)), shape=(m, n)).tocsr()
        self._diff = diff  # edge e: chip(dst) - chip(src)
        moved = hstack([diff, -diff]).tocsr()  # the same, in (up, down)
        self._a_ub = vstack([-moved, moved]).tocsr()  # lo <= span <= hi, as two rows
        self._cost = np.ones(2 * n)

    def __call__(self, candidate: IntArray) -> IntArray | None:
        """The nearest assignment to ``candidate`` under forward flow and the hop
        limit (None when the LP has none: a ring's sides chosen badly)."""
        from scipy.optimize import linprog

        span = self._diff @ candidate  # each edge's span as the candidate has it
        lo, hi = self._spans(span)
        b_ub = np.concatenate([span - lo, hi - span])
        top = self.count - 1
        bounds = np.stack(
            [np.zeros(2 * len(candidate)), np.concatenate([top - candidate, candidate])], axis=1
        )
        res = linprog(self._cost, A_ub=self._a_ub, b_ub=b_ub, bounds=bounds, method="highs-ds")
        if res.status != 0:
            return None
        n = len(candidate)
        moved: NDArray[np.float64] = res.x[:n] - res.x[n:]
        out: IntArray = (candidate + np.rint(moved)).astype(np.int64)
        return out

    def _spans(self, span: NDArray[np.float64]) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Per edge, the least and the most span allowed (``span``: the candidate's)."""
        m, c, h = len(span), self.count, self.hop
        lo, hi = np.zeros(m), np.full(m, float(min(h, c - 1)))
        if self.ring:
            if c - h <= h + 1:  # every span is at most h links the shorter way
                hi[:] = c - 1
            else:  # the side each edge's candidate took
                wraps = span >= c - h
                lo[wraps], hi[wraps] = c - h, c - 1
        return lo, hi
