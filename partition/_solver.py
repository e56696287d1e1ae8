"""The solver-only reference: CP-SAT minimizes the slowest stage directly.

The model adds to the constraint model of :mod:`._repair` one boolean
``z[u][k]`` per node output and link: "the tensor of ``u`` crosses link ``k``",
forced on when ``u`` sits at or before ``k`` and some consumer after it. Stage
``k`` costs its compute plus the bytes on links ``k - 1`` and ``k``, in integer
time units of 1/200,000 of the total compute time; the objective is the
largest stage. This is the cost model of :mod:`._cost`, exactly, up to rounding.
On a ring the model routes each tensor as the cost model does (the shorter
way, forward on a tie: see :func:`_ring_crossings`) and the hop limit counts
the shorter way (:func:`._cpmodel.build_model`), so the ring is solved exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._cost import IntArray, node_times
from ._cpmodel import SolverModel, build_model, chip_bounds
from ._errors import InfeasibleError, RepairTimeout
from ._graph import OpGraph
from ._hardware import Chiplets
from ._repair import describe_infeasible

__all__ = ["BottleneckModel", "bottleneck_model", "solve_bottleneck", "solver_step"]

RESOLUTION = 200_000


@dataclass
class BottleneckModel:
    """The constraint model of :mod:`._repair` plus the cost model: ``stages[k]``
    is stage ``k``'s time as a linear expression in integer ``unit``s (seconds),
    ``bottleneck`` an integer variable at least every stage's time, and
    ``hinted[k]`` stage ``k``'s time under the hint (empty without one);
    ``top`` bounds every stage's time."""

    sm: SolverModel
    stages: list[Any]
    bottleneck: Any
    unit: float
    hinted: list[int]
    top: int


def bottleneck_model(
    graph: OpGraph,
    chiplets: Chiplets,
    hint: IntArray | None = None,
    bounds: tuple[IntArray, IntArray] | None = None,
) -> BottleneckModel:
    """Build the bottleneck model (see the module's docstring), hinted at ``hint``
    when given: every variable, the bottleneck, the ring's routing and wrap
    literals too (a complete hint, which CP-SAT takes as a first solution
    when it is valid). ``bounds``: each node's least and most chiplet
    (:func:`._cpmodel.chip_bounds`; a pinned node adds no variable, and a
    tensor whose nodes are all pinned only adds a constant to the links it
    crosses, on a chain summed with numpy: a window's model is built in time
    that grows with its free nodes, not with the graph; on a ring, before
    2026-12-07, every tensor was routed in the model, and a window step of a
    1,000-op graph at 16 chiplets took three times its solver time)."""
    c, n = chiplets.count, len(graph)
    sm = build_model(graph, chiplets, bounds)
    times = node_times(graph, chiplets)
    unit = max(float(times.sum()), 1e-30) / RESOLUTION
    tc = np.rint(times / unit).astype(np.int64)
    cost = np.rint(graph.array("out") / chiplets.link_bytes_per_s / unit).astype(np.int64)
    lo, hi = bounds if bounds is not None else (np.zeros(n, np.int64), np.full(n, c - 1))
    links = _Links(chiplets.links, hint)
    pinned = np.ones(n, dtype=bool)  # the pinned nodes' compute, per chiplet: constants
    pinned[np.asarray(sm.free, dtype=np.int64)] = False
    fixed = np.bincount(np.asarray(lo)[pinned], weights=tc[pinned], minlength=c)
    _add_tensors(sm, graph, chiplets, cost, (np.asarray(lo), np.asarray(hi)), links)
    top = int(tc.sum()) + chiplets.links * int(cost[_has_consumers(graph, n)].sum())
    bottleneck = sm.model.new_int_var(0, top, "T")
    own = np.bincount(hint, weights=tc, minlength=c) if hint is not None else None
    stages, hinted = [], []
    for k in range(c):
        ends = {(k - 1) % c, k} if chiplets.topology == "ring" else {k - 1, k}
        sides = sorted(s for s in ends if 0 <= s < chiplets.links)  # links k - 1 and k
        stage = _stage(sm, tc, int(fixed[k]), k, links, sides)
        sm.model.add(bottleneck >= stage)
        stages.append(stage)
        if own is not None:
            hinted.append(int(own[k]) + sum(int(links.hinted[s]) for s in sides))
    if hint is not None:
        sm.hint(hint)
        sm.model.add_hint(bottleneck, max(hinted))
    return BottleneckModel(sm, stages, bottleneck, unit, hinted, top)


class _Links:
    """What each link carries in the model: a constant (tensors whose nodes are
    all pinned) and ``(cost, literal)`` terms; and the hint's load on it."""

    def __init__(self, count: int, hint: IntArray | None) -> None:
        self.const = np.zeros(count, dtype=np.int64)
        self.terms: list[list[tuple[int, Any]]] = [[] for _ in range(count)]
        self.hint = hint
        self.hinted = np.zeros(count, dtype=np.int64)  # the hint's load, in time units


def _has_consumers(graph: OpGraph, n: int) -> NDArray[np.bool_]:
    has = np.zeros(n, dtype=bool)
    has[graph.array("src")] = True
    return has


def _add_tensors(
    sm: SolverModel,
    graph: OpGraph,
    chiplets: Chiplets,
    cost: IntArray,
    bounds: tuple[IntArray, IntArray],
    links: _Links,
) -> None:
    """Each tensor's crossing literals on the links (see the module's docstring),
    and, with a hint, the hint's load on each link and each literal's hint."""
    ring, c, n = chiplets.topology == "ring", chiplets.count, len(graph)
    src, dst = graph.array("src"), graph.array("dst")
    lo, hi = bounds
    pinned = lo == hi
    free_readers = np.zeros(n, dtype=np.int64)
    np.add.at(free_readers, src, ~pinned[dst])
    far = np.full(n, -1, dtype=np.int64)
    np.maximum.at(far, src, lo[dst])
    paid = _has_consumers(graph, n) & (cost > 0)
    settled = paid & pinned & (free_readers == 0)
    if links.hint is not None and not ring:  # the chain: from the chip to the farthest reader
        hfar = np.full(n, -1, dtype=np.int64)
        np.maximum.at(hfar, src, links.hint[dst])
        links.hinted += _spans(links.hint[paid], hfar[paid], cost[paid], len(links.const))
    if not ring:
        links.const += _spans(lo[settled], far[settled], cost[settled], len(links.const))
    consumers: dict[int, list[int]] = {}
    for u, v in zip(src.tolist(), dst.tolist(), strict=True):
        if paid[u] and (ring or not settled[u]):
            consumers.setdefault(u, []).append(v)
    hint = links.hint
    for u, vs in consumers.items():
        w = int(cost[u])
        if settled[u]:  # on a ring, all pinned: its route is settled, a constant
            route = list(_links_crossed(lo, u, vs, c, ring))
            links.const[route] += w
            if hint is not None:
                links.hinted[route] += w
            continue
        crossings = _ring_crossings(sm, u, vs, c, hint) if ring else _chain_crossings(sm, u, vs, c)
        crossed = _links_crossed(hint, u, vs, c, ring) if hint is not None else set()
        for k, z in enumerate(crossings):
            if ring and k in crossed:
                links.hinted[k] += w
            if isinstance(z, int):
                links.const[k] += w * z
                continue
            if hint is not None:
                sm.model.add_hint(z, k in crossed)
            links.terms[k].append((w, z))


def _spans(start: IntArray, end: IntArray, weight: IntArray, count: int) -> IntArray:
    """Per link ``k``: the sum of ``weight`` over spans with ``start <= k < end``."""
    diff = np.zeros(count + 1, dtype=np.int64)
    keep = end > start
    np.add.at(diff, start[keep], weight[keep])
    np.add.at(diff, end[keep], -weight[keep])
    return np.cumsum(diff)[:count]


def _stage(
    sm: SolverModel, tc: IntArray, fixed: int, k: int, links: _Links, sides: list[int]
) -> Any:
    """Stage ``k``'s time as one linear expression: the compute of the nodes on
    it (``fixed``: the pinned ones') and the traffic on its links ``sides``,
    constants summed apart."""
    from ortools.sat.python import cp_model

    const, lits, coefs = fixed, [], []
    for i in sm.free:
        x = sm.x[i][k]
        if isinstance(x, int):
            const += int(tc[i]) * x
        elif tc[i]:
            lits.append(x)
            coefs.append(int(tc[i]))
    for side in sides:
        const += int(links.const[side])
        for w, z in links.terms[side]:
            lits.append(z)
            coefs.append(w)
    return cp_model.LinearExpr.weighted_sum(lits, coefs) + const


def solve_bottleneck(
    graph: OpGraph,
    chiplets: Chiplets,
    time_limit_s: float = 30.0,
    seed: int = 0,
    hint: IntArray | None = None,
    deterministic_s: float | None = None,
    keep: NDArray[np.bool_] | None = None,
    focus: Sequence[int] = (),
) -> tuple[IntArray, dict[str, Any]]:
    """The best assignment CP-SAT finds within ``time_limit_s``, and solve statistics.

    ``hint`` (an assignment, e.g. the policy's greedy one, repaired) is given to
    CP-SAT as its solution hint: where it is valid, the search starts from it.
    ``deterministic_s`` also stops the search after that much of CP-SAT's
    deterministic time (work units of roughly a second each, which do not
    depend on the machine's load), so a short solve gives the same result
    however busy the machine is. ``keep`` (with a ``hint``) pins every node
    where it is true to its chiplet in the hint, so CP-SAT re-solves only the
    others (a large-neighbourhood step, :mod:`._lns`). ``focus`` (stages)
    adds a second objective: after the slowest stage, the slowest of these
    (a window's own stages: a step can then shorten one of two tied slowest
    stages, which leaves the throughput as it is but lets the next step
    shorten the other). Raises :class:`RepairTimeout` when no partition was
    found in time, :class:`InfeasibleError` when none exists.
    """
    from ortools.sat.python import cp_model

    if keep is not None and hint is None:
        raise ValueError("keep pins nodes to the hint's chiplets: give a hint too")
    bounds = None
    if keep is not None and hint is not None:  # a model of the free nodes only
        bounds = chip_bounds(graph, chiplets, hint, keep)
        if bounds is None:
            raise InfeasibleError(f"the pinned nodes of {graph.name!r} leave a node no chiplet")
    bm = bottleneck_model(graph, chiplets, hint, bounds)
    model, scale = bm.sm.model, 1
    if focus:  # lexicographic: bottleneck first, then the focus stages' slowest
        scale = bm.top + 1
        local = model.new_int_var(0, scale - 1, "L")
        for k in focus:
            model.add(local >= bm.stages[k])
        if hint is not None:
            model.add_hint(local, max(bm.hinted[k] for k in focus))
        model.minimize(scale * bm.bottleneck + local)
    else:
        model.minimize(bm.bottleneck)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    if deterministic_s is not None:
        solver.parameters.max_deterministic_time = deterministic_s
    if keep is not None:  # pinned nodes leave little to probe; probing ate most of a window's time
        solver.parameters.cp_model_probing_level = 0
    status = solver.solve(model)
    if status == cp_model.UNKNOWN:
        raise RepairTimeout(f"CP-SAT found no partition of {graph.name!r} in its time limit")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise InfeasibleError(describe_infeasible(graph, chiplets))
    stats = {
        "optimal": status == cp_model.OPTIMAL,
        "bound_s": (solver.best_objective_bound // scale) * bm.unit,
        "objective_s": solver.value(bm.bottleneck) * bm.unit,
        "solve_s": solver.wall_time,
        "deterministic_s": solver.deterministic_time,
    }
    return bm.sm.chips(solver), stats


def solver_step(
    graph: OpGraph,
    chips: Chiplets,
    deterministic_s: float,
    hint: IntArray | None = None,
    seed: int = 0,
    keep: NDArray[np.bool_] | None = None,
    focus: Sequence[int] = (),
) -> tuple[IntArray | None, bool]:
    """The best partition a short CP-SAT run on the bottleneck finds (RL's seed,
    polish and windows), or None when it finds none in time; and whether
    CP-SAT proved it optimal (over the nodes it was free to move).

    The run stops after ``deterministic_s`` of CP-SAT's deterministic time, so
    its result does not depend on the machine's load (wall time: about that
    many seconds on an idle core, more on a busy one). ``hint`` is the
    solver's own starting point; ``keep`` pins nodes to it and ``focus``
    adds a second objective, as in :func:`solve_bottleneck`.
    """
    try:
        assignment, stats = solve_bottleneck(
            graph, chips, 3600.0, seed, hint, deterministic_s, keep, focus
        )
    except RepairTimeout:
        return None, False
    return assignment, bool(stats["optimal"])


def _chain_crossings(sm: SolverModel, u: int, vs: list[int], c: int) -> list[Any]:
    """Per chain link ``k``: a literal forced on when the tensor of ``u`` crosses it
    (``u`` at or before ``k``, some consumer after it); a constant where the
    nodes' pins settle it."""
    rows = [sm.ge[u], *(sm.ge[v] for v in vs)]
    if all(isinstance(lit, int) for row in rows for lit in row):  # all pinned: settled
        s, far = sum(sm.ge[u][1:c]), max(sum(sm.ge[v][1:c]) for v in vs)
        return [int(s <= k < far) for k in range(c - 1)]
    out: list[Any] = []
    for k in range(c - 1):
        below = sm.ge[u][k + 1]  # 0: u sits at or before k
        after = [sm.ge[v][k + 1] for v in vs]  # 1: v sits after k
        fixed = [a for a in after if isinstance(a, int)]
        if isinstance(below, int) and (below == 1 or 1 in fixed or len(fixed) == len(after)):
            out.append(int(below == 0 and 1 in fixed))  # settled by the pins
            continue
        z = sm.model.new_bool_var(f"z{u}_{k}")
        for a in after:
            if not isinstance(a, int) or a == 1:
                sm.model.add(z >= a - below)
        out.append(z)
    return out


def _chip(sm: SolverModel, i: int, c: int) -> Any:
    """Node ``i``'s chiplet as a linear expression of its ``ge`` literals."""
    return sum(sm.ge[i][1:c])


def _ring_crossings(
    sm: SolverModel, u: int, vs: list[int], c: int, hint: IntArray | None = None
) -> list[Any]:
    """Per ring link ``k`` (``c - 1`` is the wrap link): a literal forced on when the
    tensor of ``u`` crosses it, routed as the cost model routes it.

    With ``s`` the chip of ``u``, ``hi`` its farthest consumer's and ``near`` its
    nearest consumer's on a later chip (``c`` if none), the tensor goes backwards
    (``back``) exactly when ``s + c - near < hi - s``. Forwards it crosses links
    ``s .. hi - 1``; backwards links ``0 .. s - 1`` and ``near .. c - 1``. With
    a ``hint`` the routing variables are hinted at it (the caller hints the
    returned literals).
    """
    m, s = sm.model, _chip(sm, u, c)
    chips = [m.new_int_var(0, c - 1, f"chip{u}_{v}") for v in vs]
    later = [m.new_bool_var(f"later{u}_{v}") for v in vs]
    ends = [m.new_int_var(0, c, f"end{u}_{v}") for v in vs]
    for v, chip, lat, end in zip(vs, chips, later, ends, strict=True):
        m.add(chip == _chip(sm, v, c))
        m.add(chip >= s + 1).only_enforce_if(lat)
        m.add(chip <= s).only_enforce_if(lat.Not())
        m.add(end == chip).only_enforce_if(lat)
        m.add(end == c).only_enforce_if(lat.Not())
    hi, near = m.new_int_var(0, c - 1, f"hi{u}"), m.new_int_var(0, c, f"near{u}")
    m.add_max_equality(hi, chips)
    m.add_min_equality(near, ends)
    back = m.new_bool_var(f"back{u}")
    m.add(2 * s + c <= hi + near - 1).only_enforce_if(back)
    m.add(2 * s + c >= hi + near).only_enforce_if(back.Not())
    if hint is not None:
        _hint_route(sm, hint, u, vs, (chips, later, ends, hi, near, back))
    out = []
    for k in range(c):
        z = m.new_bool_var(f"z{u}_{k}")
        if k < c - 1:  # forwards: u at or before k, some consumer after k
            for v in vs:
                m.add(z >= sm.ge[v][k + 1] - sm.ge[u][k + 1] - back)
            m.add(z >= back + sm.ge[u][k + 1] - 1)  # backwards: k < s
        for v, lat in zip(vs, later, strict=True):  # backwards: near <= k
            m.add(z >= back + lat - sm.ge[v][k + 1] - 1)
        out.append(z)
    return out


def _hint_route(
    sm: SolverModel, hint: IntArray, u: int, vs: list[int], route: tuple[Any, ...]
) -> None:
    """Hint :func:`_ring_crossings`' routing variables ``route`` (the consumers'
    chips, whether each is later, their ends, ``hi``, ``near``, ``back``) at ``hint``."""
    chips, later, ends, hi, near, back = route
    c, s = len(sm.x[u]), int(hint[u])
    for chip, lat, end, v in zip(chips, later, ends, vs, strict=True):
        h = int(hint[v])
        sm.model.add_hint(chip, h)
        sm.model.add_hint(lat, h > s)
        sm.model.add_hint(end, h if h > s else c)
    for var, value in zip((hi, near, back), _route(hint, u, vs, c), strict=True):
        sm.model.add_hint(var, value)


def _route(hint: IntArray, u: int, vs: list[int], c: int) -> tuple[int, int, bool]:
    """Under ``hint``: the chip of ``u``'s farthest consumer (``hi``), of its nearest
    consumer on a later chip (``near``, ``c`` if none), and whether on a ring
    its tensor goes backwards (``back``: ``s + c - near < hi - s``)."""
    s, at = int(hint[u]), [int(hint[v]) for v in vs]
    hi, near = max(at), min((h for h in at if h > s), default=c)
    return hi, near, near < c and s + c - near < hi - s


def _links_crossed(hint: IntArray, u: int, vs: list[int], c: int, ring: bool) -> set[int]:
    """The links the tensor of ``u`` crosses under the assignment ``hint``."""
    s = int(hint[u])
    hi, near, back = _route(hint, u, vs, c)
    if ring and back:
        return set(range(s)) | set(range(near, c))
    return set(range(s, hi))
