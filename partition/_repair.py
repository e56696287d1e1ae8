"""Repair: the valid assignment nearest to any candidate.

Every method shares this step. The metric is the **total displacement**
``sum_i |a[i] - candidate[i]|`` (an L1 distance along the chain): moving a node
two chiplets costs twice as much as moving it one. A valid candidate is
returned unchanged. Otherwise, in order:

1. an LP gives the nearest assignment under forward flow and the hop limit
   (:mod:`._nearest`, milliseconds); when it also fits every chiplet's SRAM
   and uses every chiplet, it is the nearest valid assignment;
2. otherwise CP-SAT re-solves the nodes the LP put on or next to the
   chiplets it breaks (a window of ``r`` chiplets either side, ``r`` = 1, 2,
   4, ...), every other node pinned where the LP put it: a valid assignment
   near the candidate, not always the nearest;
3. when no window has one, CP-SAT solves the whole graph from a valid
   partition known (the last repair, else the best contiguous split), so it
   has one at once (seconds at 1,000 nodes; a quarter of the time limit
   unless ``exact``).

Every CP-SAT model here holds only the nodes free to move
(:mod:`._cpmodel`). Nothing here is asynchronous.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._cost import IntArray, as_assignment, is_valid_array
from ._cpmodel import SolverModel, build_model, chip_bounds
from ._errors import InfeasibleError, RepairTimeout
from ._graph import OpGraph
from ._hardware import Chiplets
from ._nearest import OrderLP

__all__ = ["Repairer", "repair"]

WINDOW_TIME = 0.25  # a window's solve may take this share of the repair's time limit
WINDOW_SHARE = 0.5  # windows stop growing past this share of the nodes


def describe_infeasible(graph: OpGraph, chiplets: Chiplets) -> str:
    """Explain, as far as cheap checks can, why nothing is valid."""
    n, c = len(graph), chiplets.count
    w = graph.array("weights")
    why = [f"graph {graph.name!r} ({n} nodes) has no valid partition on {c} chiplets"]
    if n < c:
        why.append(f"{n} nodes cannot use all {c} chiplets")
    if w.sum() > c * chiplets.sram_bytes:
        why.append(f"{w.sum():.0f} B of weights exceed {c} x {chiplets.sram_bytes:.0f} B of SRAM")
    if w.size and w.max() > chiplets.sram_bytes:
        why.append(f"node {int(w.argmax())} alone needs {w.max():.0f} B > SRAM")
    if len(why) == 1:
        why.append("the chain constraints (forward flow, hop limit) leave no room")
    return "; ".join(why)


def repair_time_limit(graph: OpGraph) -> float:
    """The default time one repair may take: 5 s, more for large graphs
    (15 ms a node: 15 s at 1,000 nodes), where CP-SAT needs it."""
    return max(5.0, 0.015 * len(graph))


class Repairer:
    """Repairs candidates for one (graph, chiplets) pair, reusing its LP and CP-SAT model.

    The LP's assignment, when valid, is the nearest; otherwise ``exact``
    solves the whole graph (the nearest, in seconds at 1,000 nodes), and
    by default the windows around the chiplets the LP breaks come first (a
    valid assignment near the candidate in a fraction of that; see the
    module's docstring). ``solved`` counts which step found each repair.
    ``time_limit_s`` bounds each solve (None: :func:`repair_time_limit`);
    when it runs out, the nearest valid assignment found so far is returned.
    A solve that finds none in time falls back to a valid partition known
    already (the last one this repairer returned, else the best contiguous
    split), so a search never ends on a timeout where a valid partition
    exists. Raises :class:`InfeasibleError` only when the solver proves that
    none exists, and :class:`RepairTimeout` when time ran out with none
    known (saying so, and how to give it more).
    """

    def __init__(
        self,
        graph: OpGraph,
        chiplets: Chiplets,
        time_limit_s: float | None = None,
        exact: bool = False,
    ) -> None:
        self.graph, self.chiplets, self.exact = graph, chiplets, exact
        self.time_limit_s = repair_time_limit(graph) if time_limit_s is None else time_limit_s
        self._sm: SolverModel | None = None
        self._cache: dict[bytes, IntArray] = {}
        self._known: IntArray | None = None  # a valid assignment: the fallback
        self._split_tried = False
        self._lp: OrderLP | None = None
        self.fallbacks = 0  # solves that ran out of time and fell back
        self.solved = {"lp": 0, "window": 0, "whole": 0}  # how each repair was found

    def __call__(self, candidate: Any) -> IntArray:
        """A valid assignment near ``candidate``: the one with the least total
        displacement from it, where the LP finds it or ``exact`` is set."""
        cand = as_assignment(self.graph, self.chiplets, candidate)
        if is_valid_array(self.graph, self.chiplets, cand):
            self._known = cand
            return cand
        key = cand.tobytes()
        if key not in self._cache:
            if len(self._cache) > 4096:
                self._cache.clear()
            found = self._solve(cand)
            if found is None:  # out of time: a valid one known (cached: asked again, the
                # same candidate would only spend the time again)
                self._cache[key] = self.fallback()
                return self._cache[key].copy()
            self._cache[key] = self._known = found
        return self._cache[key].copy()

    def _known_valid(self) -> IntArray | None:
        """A valid partition known already: the last one returned, else the best
        contiguous split (None when there is neither)."""
        if self._known is None and not self._split_tried:
            from ._dp import dp_split

            self._split_tried = True
            split = dp_split(self.graph, self.chiplets)
            if split is not None and is_valid_array(self.graph, self.chiplets, split):
                self._known = split
        return self._known

    def fallback(self) -> IntArray:
        """A valid partition known already, for a solve that ran out of time
        (counted in ``fallbacks``); :class:`RepairTimeout` when none is known."""
        known = self._known_valid()
        if known is None:
            n, c = len(self.graph), self.chiplets.count
            raise RepairTimeout(
                f"graph {self.graph.name!r} ({n} nodes) on {c} chiplets: the repair found no "
                f"valid partition within {self.time_limit_s:g} s, and none is known yet; "
                "the solver did not rule one out: give it more time "
                f"(repair_time_limit_s={2 * self.time_limit_s:g}, say)"
            )
        self.fallbacks += 1
        return known.copy()

    def _solve(self, cand: IntArray) -> IntArray | None:
        """A valid assignment near ``cand`` (the nearest, where the LP's is valid
        or the whole graph is solved); None when time ran out with none."""
        if self._lp is None:
            self._lp = OrderLP(self.graph, self.chiplets)
        base = self._lp(cand)
        if base is not None:
            bad = self._broken_chips(base)
            if not bad.size:
                self.solved["lp"] += 1
                return base
            found = None if self.exact else self._around(cand, base, bad)
            if found is not None:
                self.solved["window"] += 1
                return found
        self.solved["whole"] += 1  # from a valid partition: it has one at once
        known = self._known_valid()
        # not exact: the search wants a valid partition near the candidate, not the proof
        # that none is nearer, which for a far candidate takes the whole time limit
        time_s = self.time_limit_s * (1.0 if self.exact or known is None else WINDOW_TIME)
        return self._cp_sat(cand, cand if known is None else known, None, time_s)

    def _broken_chips(self, a: IntArray) -> IntArray:
        """The chiplets ``a`` (valid but for SRAM and use) overfills or leaves empty."""
        c = self.chiplets.count
        mem = np.bincount(a, weights=self.graph.array("weights"), minlength=c)
        empty = np.bincount(a, minlength=c) == 0
        return np.flatnonzero((mem > self.chiplets.sram_bytes) | empty)

    def _around(self, cand: IntArray, base: IntArray, bad: IntArray) -> IntArray | None:
        """CP-SAT over the nodes ``base`` puts within ``r`` chiplets of a broken one,
        every other node pinned to ``base``; ``r`` doubles until a window has a
        valid assignment (None when none has, or time ran out)."""
        c, ring = self.chiplets.count, self.chiplets.topology == "ring"
        near = np.abs(base[:, None] - bad[None, :])
        if ring:
            near = np.minimum(near, c - near)
        dist, r = near.min(axis=1), 1
        # a window of every chiplet, or of most nodes, is the whole solve (from a valid hint)
        while r < (c // 2 if ring else c - 1) and (dist <= r).mean() <= WINDOW_SHARE:
            try:
                found = self._cp_sat(cand, base, dist > r, self.time_limit_s * WINDOW_TIME)
            except InfeasibleError:  # infeasible with these pins only: widen
                found = None
            else:
                if found is None:  # out of time: a wider window would be slower
                    return None
            if found is not None and is_valid_array(self.graph, self.chiplets, found):
                return found
            r *= 2
        return None

    def _cp_sat(
        self, cand: IntArray, hint: IntArray, pinned: Any, time_s: float
    ) -> IntArray | None:
        """CP-SAT's nearest valid assignment to ``cand`` within ``time_s``, hinted at
        ``hint``, with the nodes where ``pinned`` is true held at ``hint`` (None:
        none held; the whole graph's model is kept for the next call); None
        when time ran out with none. Raises :class:`InfeasibleError` when none
        exists (under the pins: only then is it not a proof)."""
        from ortools.sat.python import cp_model

        if pinned is None:
            if self._sm is None:
                self._sm = build_model(self.graph, self.chiplets)
            sm = self._sm
            sm.model.clear_hints()  # type: ignore[no-untyped-call]
        else:  # a model of the free nodes only
            bounds = chip_bounds(self.graph, self.chiplets, hint, pinned)
            if bounds is None:
                raise InfeasibleError("the pins leave a node no chiplet")
            sm = build_model(self.graph, self.chiplets, bounds)
        sm.hint(hint)
        sm.model.minimize(_displacement(sm, cand))
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = time_s
        solver.parameters.num_workers = 1
        solver.parameters.linearization_level = 2
        status = solver.solve(sm.model)
        if status == cp_model.INFEASIBLE:  # proven (with no pins): nothing is valid
            raise InfeasibleError(describe_infeasible(self.graph, self.chiplets))
        if status == cp_model.MODEL_INVALID:  # a bug of ours, not a slow solve
            raise RuntimeError(f"the repair model of {self.graph.name!r} is invalid")
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        return sm.chips(solver)


def _displacement(sm: SolverModel, cand: IntArray) -> Any:
    """``sum_i |chip(i) - cand[i]|`` as the ``ge`` literals that disagree with it."""
    terms: list[Any] = []
    for row, want in zip(sm.ge, cand.tolist(), strict=True):
        for k in range(1, len(row) - 1):
            var = row[k]
            if not isinstance(var, int):  # a constant's disagreement is the same for all
                terms.append(1 - var if k <= want else var)
    return sum(terms)


def repair(
    graph: OpGraph, chiplets: Chiplets, candidate: Any, time_limit_s: float | None = None
) -> IntArray:
    """One-shot exact :class:`Repairer`: the valid assignment nearest to ``candidate``
    (the search's repairer trades that for speed: see :class:`Repairer`)."""
    return Repairer(graph, chiplets, time_limit_s, exact=True)(candidate)
