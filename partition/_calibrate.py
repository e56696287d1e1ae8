"""``Chiplets.default_for``: a chiplet module sized to one graph so the constraints bind.

The paper calibrates its hardware so that random assignments are almost never
valid while a valid partition still exists. For a graph of any absolute size:

1. **Hop limit.** The given one, or (``hop_limit=None``) the smallest ``h`` for
   which some contiguous split is valid with unbounded SRAM: a U-Net's skip
   connections, for one, span the whole network and need ``h = count - 1``.
2. **Link speed.** One cut costs ``link_share`` (0.3) of a balanced stage's
   compute: the median bytes crossing a cut of the node order, sent and
   received, over 0.3 x (total compute time / count).
3. **SRAM.** ``s_min`` is the least SRAM under which the DP still finds a valid
   contiguous split (bisection); ``w_free`` is the heaviest stage of the best
   split when memory is unbounded. SRAM is ``max(1.1 s_min, (s_min + w_free) / 2)``:
   halfway between "barely feasible" and "memory does not matter", so the
   best memory-free split is invalid whenever memory can bind at all, and a
   valid partition exists by construction (the DP found one).

``docs/partition.md`` tabulates what this gives on the held-out graphs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import numpy as np

from ._cost import node_times
from ._dp import cut_traffic, dp_split
from ._errors import GraphError, InfeasibleError
from ._graph import OpGraph

if TYPE_CHECKING:
    from ._hardware import Chiplets

__all__ = ["LINK_SHARE", "calibrated"]

LINK_SHARE = 0.3  # a typical cut costs this share of a balanced stage's compute


@functools.lru_cache(maxsize=256)
def calibrated(graph: OpGraph, unbounded: Chiplets, hop_limit: int | None) -> Chiplets:
    """``unbounded`` (chiplets with unbounded SRAM) sized to ``graph`` (see the
    module docstring); cached per (graph, chiplets, hop limit)."""
    count, base = unbounded.count, unbounded
    base = dataclasses.replace(base, link_bytes_per_s=_link_speed(graph, base))
    hop = hop_limit if hop_limit is not None else _least_hop(graph, base)
    free = dataclasses.replace(base, hop_limit=hop)
    split = dp_split(graph, free)
    if split is None:
        raise InfeasibleError(
            f"graph {graph.name!r} ({len(graph)} nodes) has no contiguous split onto "
            f"{count} chiplets with hop limit {hop}"
        )
    weights = graph.array("weights")
    if not weights.sum() > 0:
        raise GraphError(
            f"graph {graph.name!r} holds no weights, so chiplets cannot be sized to it "
            "(memory would never bind): import it with its parameters as weights "
            "(from_jax's weight_argnums), or give Chiplets(count, sram_bytes=...) yourself"
        )
    w_free = float(np.bincount(split, weights=weights, minlength=count).max())
    s_min = _least_sram(graph, free, lo=max(float(weights.max()), weights.sum() / count), hi=w_free)
    sram = max(1.1 * s_min, (s_min + w_free) / 2, 1.0)
    return dataclasses.replace(free, sram_bytes=sram)


def _link_speed(graph: OpGraph, chips: Chiplets) -> float:
    stage_s = float(node_times(graph, chips).sum()) / chips.count
    cuts = cut_traffic(graph)[1:-1]
    cut = float(np.median(cuts)) if cuts.size else 1.0
    return max(2 * cut, 1.0) / max(LINK_SHARE * stage_s, 1e-12)


def _least_hop(graph: OpGraph, chips: Chiplets) -> int:
    for hop in range(1, max(chips.count, 2)):
        if dp_split(graph, dataclasses.replace(chips, hop_limit=hop)) is not None:
            return hop
    return max(chips.count - 1, 1)


def _least_sram(graph: OpGraph, chips: Chiplets, lo: float, hi: float, steps: int = 14) -> float:
    """The least SRAM (to ~0.01%) under which the DP finds a valid split; ``hi`` is feasible."""
    lo = min(lo, hi)
    if dp_split(graph, dataclasses.replace(chips, sram_bytes=lo)) is not None:
        return lo
    for _ in range(steps):
        mid = (lo + hi) / 2
        if dp_split(graph, dataclasses.replace(chips, sram_bytes=mid)) is not None:
            hi = mid
        else:
            lo = mid
    return hi
