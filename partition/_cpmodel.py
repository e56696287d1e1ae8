"""The CP-SAT model of the constraints, built only over the nodes that may move.

Repair and the solver share this model. Each node may be given a range of
chiplets (``lo``, ``hi``): the order literals outside it are the constants 0
and 1, so a node pinned to one chiplet adds no variable at all, and a
constraint whose literals are all constants adds nothing (or makes the model
infeasible, when the constants break it). A large-neighbourhood step over
200 free nodes of a 1,000-node graph is then a model of about 200 nodes:
CP-SAT's presolve of the whole graph took about a second a step.

:func:`chip_bounds` gives those ranges: the chiplets each node can reach
with some nodes pinned, by forward flow and (on a chain) the hop limit.
Nothing here is asynchronous.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ._cost import IntArray
from ._graph import OpGraph
from ._hardware import Chiplets

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

__all__ = ["Lit", "SolverModel", "build_model", "chip_bounds", "clause", "value"]

Lit = Any  # a CP-SAT boolean variable, or the constant 0 or 1


@dataclass
class SolverModel:
    """A CP-SAT model of the constraints, in the order encoding.

    ``ge[i][k]`` is "node i sits on chip k or later" (``ge[i][0]`` is the
    constant 1, and so is every ``k`` up to the node's least chiplet; past
    its most chiplet it is 0), ``x[i][k]`` is "node i sits on chip k" (a
    constant where both of its ``ge`` are). Forward flow and the hop limit
    become two-literal implications between ``ge`` literals, which propagate
    (and relax) far better than integer differences. On a ring, ``wraps``
    holds each edge's wrap literal as ``(u, v, span, literal)``: true forces
    ``chip(v) - chip(u) >= span`` (the edge goes round the wrap link); a hint
    sets it from the hinted chips.
    """

    model: cp_model.CpModel
    x: list[list[Lit]]
    ge: list[list[Lit]]
    wraps: list[tuple[int, int, int, Any]] = field(default_factory=list)
    free: list[int] = field(default_factory=list)  # the nodes with a variable

    def chips(self, solver: cp_model.CpSolver) -> IntArray:
        """The assignment in ``solver``'s solution."""
        return np.array([sum(value(solver, v) for v in row[1:]) for row in self.ge], dtype=np.int64)

    def hint(self, assignment: IntArray) -> None:
        """Hint every ``ge``, ``x`` and wrap literal at ``assignment``."""
        add = self.model.add_hint
        chips = assignment.tolist()
        for i in self.free:  # (a pinned node's literals are all constants)
            chip = chips[i]
            for k, var in enumerate(self.ge[i]):
                if not isinstance(var, int):
                    add(var, k <= chip)
            for k, var in enumerate(self.x[i]):
                if not isinstance(var, int):
                    add(var, k == chip)
        for u, v, span, wrap in self.wraps:
            if not isinstance(wrap, int):
                add(wrap, int(assignment[v]) - int(assignment[u]) >= span)


def value(solver: cp_model.CpSolver, lit: Lit) -> int:
    """A literal's value in ``solver``'s solution (a constant's own)."""
    return lit if isinstance(lit, int) else int(solver.value(lit))


def _is_one(lit: Lit) -> bool:
    return isinstance(lit, int) and lit == 1


def negate(lit: Lit) -> Lit:
    """The literal's negation."""
    return 1 - lit if isinstance(lit, int) else lit.Not()


def clause(model: cp_model.CpModel, lits: list[Lit]) -> None:
    """At least one of ``lits`` holds: nothing when a constant 1 is among them,
    the variables alone otherwise (none: the model is infeasible)."""
    if any(_is_one(lit) for lit in lits):
        return
    model.add_bool_or([lit for lit in lits if not isinstance(lit, int)])


def chip_bounds(
    graph: OpGraph, chiplets: Chiplets, at: IntArray, pinned: Any
) -> tuple[IntArray, IntArray] | None:
    """Each node's least and most chiplet with the nodes where ``pinned`` is true
    held at ``at``: forward flow (``chip(dst) >= chip(src)``) and, on a chain,
    the hop limit, propagated along the edges both ways (two rounds; bounds
    that are implied, so they exclude no valid assignment). None when the
    pins leave some node no chiplet."""
    c, h = chiplets.count, chiplets.hop_limit
    hop = h if chiplets.topology != "ring" else c  # a ring's hop limit is no interval
    lo = np.where(pinned, at, 0).astype(np.int64).tolist()
    hi = np.where(pinned, at, c - 1).astype(np.int64).tolist()
    src, dst = graph.array("src").tolist(), graph.array("dst").tolist()
    forward = sorted(zip(dst, src, strict=True))  # by destination: sources settled first
    backward = sorted(zip(src, dst, strict=True), reverse=True)
    for _ in range(2):
        for v, u in forward:
            lo[v] = max(lo[v], lo[u])
            hi[v] = min(hi[v], hi[u] + hop)
        for u, v in backward:
            hi[u] = min(hi[u], hi[v])
            lo[u] = max(lo[u], lo[v] - hop)
    low, high = np.array(lo, dtype=np.int64), np.array(hi, dtype=np.int64)
    return None if bool((low > high).any()) else (low, high)


def build_model(
    graph: OpGraph,
    chiplets: Chiplets,
    bounds: tuple[IntArray, IntArray] | None = None,
) -> SolverModel:
    """Encode the four constraints of ``docs/partition.md`` as a CP-SAT model
    (on a ring, the hop limit counts links the shorter way round), each node
    within its ``bounds`` (least and most chiplet; None: every chiplet)."""
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    n, c, h = len(graph), chiplets.count, chiplets.hop_limit
    lo, hi = bounds if bounds is not None else ([0] * n, [c - 1] * n)
    spans = list(zip(np.asarray(lo).tolist(), np.asarray(hi).tolist(), strict=True))
    ge = [
        [1] * (low + 1) + [0] * (c - low)  # pinned: constants only
        if low == high
        else _order_literals(model, i, low, high, c)
        for i, (low, high) in enumerate(spans)
    ]
    x = [
        [0] * low + [1] + [0] * (c - low - 1)
        if low == high
        else [_on_chip(model, ge[i][k], ge[i][k + 1]) for k in range(c)]
        for i, (low, high) in enumerate(spans)
    ]
    ring = chiplets.topology == "ring"
    wraps: list[tuple[int, int, int, Any]] = []
    for e in graph.edges:
        u, v = e.src, e.dst
        # on a ring an edge may instead span c - h chips or more: it wraps round
        wrap = _wrap_literal(model, ge, u, v, c, h) if ring and c - h > h else None
        if wrap is not None:
            wraps.append((u, v, c - h, wrap))
        # forward: chip(v) >= chip(u), for each k where the clause is not settled true
        for k in range(max(1, int(lo[v]) + 1), min(c - 1, int(hi[u])) + 1):
            clause(model, [negate(ge[u][k]), ge[v][k]])
        if ring and c - h <= h:
            continue
        # hop limit: chip(v) <= chip(u) + h (or the edge wraps), likewise
        for k in range(max(1, int(lo[u]) + 1), min(c - 1 - h, int(hi[v]) - h) + 1):
            lits = [negate(ge[v][k + h]), ge[u][k]]
            clause(model, lits if wrap is None else [*lits, wrap])
    _add_sram(model, graph, chiplets, x)
    for k in range(c):  # every chiplet used
        clause(model, [x[i][k] for i in range(n)])
    free = [i for i, (low, high) in enumerate(spans) if low < high]
    return SolverModel(model, x, ge, wraps, free)


def _order_literals(model: cp_model.CpModel, i: int, lo: int, hi: int, c: int) -> list[Lit]:
    """``ge[i][0..c]`` for a node within chiplets ``lo..hi``: 1 up to ``lo``, 0
    past ``hi``, ordered variables between."""
    row: list[Lit] = [
        1 if k <= lo else 0 if k > hi else model.new_bool_var(f"ge{i}_{k}") for k in range(c + 1)
    ]
    for k in range(lo + 1, hi):  # ge[k + 1] => ge[k]
        model.add_implication(row[k + 1], row[k])
    return row


def _on_chip(model: cp_model.CpModel, ge_k: Lit, ge_next: Lit) -> Lit:
    """``x = ge[k] - ge[k + 1]``: a constant where both are, else a variable."""
    if isinstance(ge_k, int) and isinstance(ge_next, int):
        return ge_k - ge_next
    var = model.new_bool_var("")
    model.add(var == ge_k - ge_next)
    return var


def _add_sram(
    model: cp_model.CpModel, graph: OpGraph, chiplets: Chiplets, x: list[list[Lit]]
) -> None:
    """The weights on each chiplet fit its SRAM (nothing when all of them fit one)."""
    weights = [int(np.ceil(w)) for w in graph.array("weights")]
    if sum(weights) <= chiplets.sram_bytes:
        return
    for k in range(chiplets.count):
        fixed = sum(w for i, w in enumerate(weights) if w > 0 and _is_one(x[i][k]))
        free = [(w, v) for w, row in zip(weights, x, strict=True) if w > 0 for v in (row[k],)]
        free = [(w, v) for w, v in free if not isinstance(v, int)]
        room = int(chiplets.sram_bytes) - fixed
        if free:
            model.add(sum(w * v for w, v in free) <= room)
        elif room < 0:
            model.add_bool_or([])  # the pinned weights alone overfill it


def _wrap_literal(
    model: cp_model.CpModel, ge: list[list[Lit]], u: int, v: int, c: int, h: int
) -> Lit:
    """A boolean that, when true, forces ``chip(v) - chip(u) >= c - h``: the edge
    ``u -> v`` goes the short way round the ring, through the wrap link (a
    constant where both nodes are pinned)."""
    if all(isinstance(lit, int) for lit in (*ge[u], *ge[v])):
        return int(sum(ge[v][1:c]) - sum(ge[u][1:c]) >= c - h)
    wrap = model.new_bool_var(f"wrap{u}_{v}")
    model.add(sum(ge[v][1:c]) - sum(ge[u][1:c]) >= c - h).only_enforce_if(wrap)
    return wrap
