"""The solver-only reference: CP-SAT minimizes the slowest stage directly.

The model adds to the constraint model of :mod:`._repair` one boolean
``z[u][k]`` per node output and link: "the tensor of ``u`` crosses link ``k``",
forced on when ``u`` sits at or before ``k`` and some consumer after it. Stage
``k`` costs its compute plus the bytes on links ``k - 1`` and ``k``, in integer
time units of 1/200,000 of the total compute time; the objective is the
largest stage. This is the cost model of :mod:`._cost`, exactly, up to rounding.
On a ring it solves the chain of the same chiplets (so ``optimal`` is False):
its answer is valid on the ring and no slower there, but not the ring's optimum.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._cost import IntArray, node_times
from ._graph import OpGraph
from ._hardware import Chiplets
from ._repair import InfeasibleError, build_model, describe_infeasible

__all__ = ["solve_bottleneck"]

RESOLUTION = 200_000


def solve_bottleneck(
    graph: OpGraph,
    chiplets: Chiplets,
    time_limit_s: float = 30.0,
    seed: int = 0,
) -> tuple[IntArray, dict[str, Any]]:
    """The best assignment CP-SAT finds within ``time_limit_s``, and solve statistics."""
    from ortools.sat.python import cp_model

    ring = chiplets.topology == "ring"
    if ring:  # the chain model: its answers are valid on the ring, and no slower there
        chiplets = dataclasses.replace(chiplets, topology="chain")
    sm = build_model(graph, chiplets)
    model, x, c = sm.model, sm.x, chiplets.count
    times = node_times(graph, chiplets)
    unit = max(float(times.sum()), 1e-30) / RESOLUTION
    tc = [round(float(t) / unit) for t in times]
    consumers: dict[int, list[int]] = {}
    for e in graph.edges:
        consumers.setdefault(e.src, []).append(e.dst)
    link: list[list[tuple[int, Any]]] = [[] for _ in range(c - 1)]
    for u, vs in consumers.items():
        cost = round(float(graph.nodes[u].output_bytes) / chiplets.link_bytes_per_s / unit)
        if cost == 0:
            continue
        for k in range(c - 1):
            z = model.new_bool_var(f"z{u}_{k}")
            for v in vs:  # u at or before k, v after k: the tensor crosses link k
                model.add(z >= sm.ge[v][k + 1] - sm.ge[u][k + 1])
            link[k].append((cost, z))
    bottleneck = model.new_int_var(0, sum(tc) + sum(w for lk in link for w, _ in lk), "T")
    for k in range(c):
        stage = [t * x[i][k] for i, t in enumerate(tc) if t]
        for side in (k - 1, k):
            if 0 <= side < c - 1:
                stage += [w * z for w, z in link[side]]
        model.add(bottleneck >= sum(stage))
    model.minimize(bottleneck)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise InfeasibleError(describe_infeasible(graph, chiplets))
    stats = {
        "optimal": status == cp_model.OPTIMAL and not ring,
        "bound_s": solver.best_objective_bound * unit,
        "objective_s": solver.objective_value * unit,
    }
    return sm.chips(solver), stats
