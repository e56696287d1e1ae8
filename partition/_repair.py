"""Solver repair: the valid assignment nearest to any candidate, by OR-Tools CP-SAT.

Every method shares this step. The metric is the **total displacement**
``sum_i |a[i] - candidate[i]|`` (an L1 distance along the chain): moving a node
two chiplets costs twice as much as moving it one. The candidate is also given
to the solver as a hint. A valid candidate is returned unchanged without
calling the solver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ._cost import IntArray, as_assignment, is_valid_array
from ._errors import InfeasibleError, RepairTimeout
from ._graph import OpGraph
from ._hardware import Chiplets

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

__all__ = ["Repairer", "SolverModel", "build_model", "repair"]


@dataclass
class SolverModel:
    """A CP-SAT model of the constraints, in the order encoding.

    ``ge[i][k]`` is "node i sits on chip k or later" (``ge[i][0]`` is the
    constant 1), ``x[i][k]`` is "node i sits on chip k". Forward flow and the
    hop limit become two-literal implications between ``ge`` variables, which
    propagate (and relax) far better than integer differences. On a ring,
    ``wraps`` holds each edge's wrap literal as ``(u, v, span, literal)``:
    true forces ``chip(v) - chip(u) >= span`` (the edge goes round the wrap
    link); a hint sets it from the hinted chips.
    """

    model: cp_model.CpModel
    x: list[list[cp_model.IntVar]]
    ge: list[list[cp_model.IntVar | int]]
    wraps: list[tuple[int, int, int, cp_model.IntVar]] = field(default_factory=list)

    def chips(self, solver: cp_model.CpSolver) -> IntArray:
        """The assignment in ``solver``'s solution."""
        return np.array(
            [sum(int(solver.value(v)) for v in row[1:]) for row in self.ge], dtype=np.int64
        )


def build_model(graph: OpGraph, chiplets: Chiplets) -> SolverModel:
    """Encode the four constraints of ``docs/partition.md`` as a CP-SAT model
    (on a ring, the hop limit counts links the shorter way round)."""
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    n, c, h = len(graph), chiplets.count, chiplets.hop_limit
    ge: list[list[cp_model.IntVar | int]] = [
        [1, *(model.new_bool_var(f"ge{i}_{k}") for k in range(1, c)), 0] for i in range(n)
    ]
    x = [[model.new_bool_var(f"x{i}_{k}") for k in range(c)] for i in range(n)]
    for i in range(n):
        for k in range(1, c - 1):
            model.add_implication(ge[i][k + 1], ge[i][k])
        for k in range(c):
            model.add(x[i][k] == ge[i][k] - ge[i][k + 1])
    ring = chiplets.topology == "ring"
    wraps: list[tuple[int, int, int, cp_model.IntVar]] = []
    for e in graph.edges:
        # on a ring an edge may instead span c - h chips or more: it wraps round
        wrap = _wrap_literal(model, ge, e.src, e.dst, c, h) if ring and c - h > h else None
        if wrap is not None:
            wraps.append((e.src, e.dst, c - h, wrap))
        for k in range(1, c):  # forward: chip(dst) >= chip(src)
            model.add_implication(ge[e.src][k], ge[e.dst][k])
            if k + h < c and not (ring and c - h <= h):
                # hop limit: chip(dst) <= chip(src) + h (or the edge wraps)
                clause = [ge[e.dst][k + h].Not(), ge[e.src][k]]  # type: ignore[union-attr]
                model.add_bool_or(clause if wrap is None else [*clause, wrap])
    weights = [int(np.ceil(w)) for w in graph.array("weights")]
    for k in range(c):
        heavy = [(w, x[i][k]) for i, w in enumerate(weights) if w > 0]
        if heavy:  # the weights on a chiplet fit its SRAM
            model.add(sum(w * v for w, v in heavy) <= int(chiplets.sram_bytes))
        model.add_at_least_one([x[i][k] for i in range(n)])  # every chiplet used
    return SolverModel(model, x, ge, wraps)


def _wrap_literal(
    model: cp_model.CpModel, ge: list[list[cp_model.IntVar | int]], u: int, v: int, c: int, h: int
) -> cp_model.IntVar:
    """A boolean that, when true, forces ``chip(v) - chip(u) >= c - h``: the edge
    ``u -> v`` goes the short way round the ring, through the wrap link."""
    wrap = model.new_bool_var(f"wrap{u}_{v}")
    model.add(sum(ge[v][1:c]) - sum(ge[u][1:c]) >= c - h).only_enforce_if(wrap)
    return wrap


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
    """Repairs candidates for one (graph, chiplets) pair, reusing its CP-SAT model.

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
        self, graph: OpGraph, chiplets: Chiplets, time_limit_s: float | None = None
    ) -> None:
        self.graph, self.chiplets = graph, chiplets
        self.time_limit_s = repair_time_limit(graph) if time_limit_s is None else time_limit_s
        self._sm: SolverModel | None = None
        self._cache: dict[bytes, IntArray] = {}
        self._known: IntArray | None = None  # a valid assignment: the fallback
        self._split_tried = False
        self.fallbacks = 0  # solves that ran out of time and fell back

    def __call__(self, candidate: Any) -> IntArray:
        """The valid assignment with the least total displacement from ``candidate``."""
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
                self._cache[key] = self._fallback(cand)
                return self._cache[key].copy()
            self._cache[key] = self._known = found
        return self._cache[key].copy()

    def _fallback(self, cand: IntArray) -> IntArray:
        """A valid partition known already, for a solve that ran out of time."""
        if self._known is None and not self._split_tried:
            from ._dp import dp_split

            self._split_tried = True
            split = dp_split(self.graph, self.chiplets)
            if split is not None and is_valid_array(self.graph, self.chiplets, split):
                self._known = split
        if self._known is None:
            n, c = len(self.graph), self.chiplets.count
            raise RepairTimeout(
                f"graph {self.graph.name!r} ({n} nodes) on {c} chiplets: the repair found no "
                f"valid partition within {self.time_limit_s:g} s, and none is known yet; "
                "the solver did not rule one out: give it more time "
                f"(repair_time_limit_s={2 * self.time_limit_s:g}, say)"
            )
        self.fallbacks += 1
        return self._known.copy()

    def _solve(self, cand: IntArray) -> IntArray | None:
        """The nearest valid assignment; None when time ran out with none."""
        from ortools.sat.python import cp_model

        if self._sm is None:
            self._sm = build_model(self.graph, self.chiplets)
        sm = self._sm
        sm.model.clear_hints()  # type: ignore[no-untyped-call]
        terms: list[Any] = []
        for i, want in enumerate(cand.tolist()):
            row = sm.ge[i]
            for k in range(1, self.chiplets.count):  # |chip - want| = sum of wrong ge bits
                var = row[k]
                assert not isinstance(var, int)  # only ge[i][0] and ge[i][count] are constants
                sm.model.add_hint(var, k <= want)
                terms.append(1 - var if k <= want else var)
        sm.model.minimize(sum(terms))
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = self.time_limit_s
        solver.parameters.num_workers = 1
        solver.parameters.linearization_level = 2
        status = solver.solve(sm.model)
        if status == cp_model.INFEASIBLE:  # proven: nothing is valid
            raise InfeasibleError(describe_infeasible(self.graph, self.chiplets))
        if status == cp_model.MODEL_INVALID:  # a bug of ours, not a slow solve
            raise RuntimeError(f"the repair model of {self.graph.name!r} is invalid")
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        return sm.chips(solver)


def repair(
    graph: OpGraph, chiplets: Chiplets, candidate: Any, time_limit_s: float | None = None
) -> IntArray:
    """One-shot :class:`Repairer`: the valid assignment nearest to ``candidate``."""
    return Repairer(graph, chiplets, time_limit_s)(candidate)
