"""Synthetic training graphs for pre-training the policy.

Each case is a graph from one of the families and a chiplet module scaled to
it, so that memory binds and links matter on every case, whatever its absolute
size. The default families (:data:`FAMILIES`, the first shipped policy's): MLPs,
pre-norm residual MLPs, CNN-like chains of 3x3 convolutions with residual adds,
branchy inception-style CNNs (parallel 1x1, 3x3 and 5x5 branches,
concatenated), transformer encoders of other depths and widths than BERT-base,
and mixture-of-experts encoders (a router and parallel expert MLPs).
:data:`SHARED_FAMILIES` adds two with weights shared across the graph, on
request: ALBERT-style encoders (one layer's weights applied at every layer) and
stacked Elman RNNs unrolled in time. :func:`from_jax` counts a shared weight on
its first reader, so in those every weight sits at the graph's start, and
CP-SAT's partitions of a stacked RNN spread each step over several chiplets,
far from a contiguous split (49% and 12% faster than the DP's on two of three
cases tried, the DP's own split on the third). The held-out graphs of
:mod:`._heldout` are never drawn here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._cost import node_times
from ._dp import cut_traffic, dp_split
from ._errors import InfeasibleError
from ._graph import OpGraph
from ._hardware import Chiplets
from ._models import (
    cnn_graph,
    inception_graph,
    mlp_graph,
    moe_graph,
    residual_mlp_graph,
    rnn_graph,
    tied_transformer_graph,
    transformer_graph,
)

__all__ = [
    "FAMILIES",
    "SHARED_FAMILIES",
    "check_families",
    "scaled_chiplets",
    "synthetic_cases",
    "synthetic_graph",
]


FAMILIES = ("mlp", "cnn", "transformer", "resmlp", "inception", "moe")
SHARED_FAMILIES = ("tied", "rnn")


def check_families(families: Sequence[str]) -> tuple[str, ...]:
    """``families`` as a tuple; ``ValueError`` naming the unknown ones (or none given)."""
    unknown = sorted(set(families) - set(FAMILIES + SHARED_FAMILIES))
    if unknown or not families:
        known = ", ".join(FAMILIES + SHARED_FAMILIES)
        raise ValueError(f"unknown graph families {unknown} (or none); choose from {known}")
    return tuple(families)


def synthetic_graph(rng: np.random.Generator, families: Sequence[str] = FAMILIES) -> OpGraph:
    """One random graph from one of ``families`` (of :data:`FAMILIES` and
    :data:`SHARED_FAMILIES`), of random depth and width."""
    families = check_families(families)
    family = families[int(rng.integers(len(families)))]
    if family == "mlp":
        widths = [int(rng.choice([256, 512, 1024, 2048])) for _ in range(int(rng.integers(12, 49)))]
        return mlp_graph(widths, batch=int(rng.choice([64, 256])))
    if family == "cnn":
        chans = [int(rng.choice([32, 64, 128])) for _ in range(int(rng.integers(12, 49)))]
        return cnn_graph(chans, size=int(rng.choice([16, 32])))
    if family == "resmlp":
        return residual_mlp_graph(int(rng.integers(6, 25)), int(rng.choice([256, 512, 1024])))
    if family == "inception":
        return inception_graph(int(rng.integers(3, 9)), int(rng.choice([64, 128, 256])))
    if family == "rnn":
        steps, layers = int(rng.integers(6, 25)), int(rng.integers(1, 4))
        width, batch = int(rng.choice([256, 512, 1024])), int(rng.choice([16, 64]))
        return rnn_graph(steps, width, layers, batch)
    heads = int(rng.choice([2, 4, 8]))
    hidden = heads * int(rng.choice([32, 64]))
    if family == "tied":
        layers, seq = int(rng.integers(4, 17)), int(rng.choice([32, 64, 128]))
        return tied_transformer_graph(layers, hidden, heads, seq, int(rng.choice([1000, 8000])))
    if family == "moe":
        return moe_graph(int(rng.integers(2, 5)), hidden, int(rng.choice([2, 4, 8])))
    return transformer_graph(
        layers=int(rng.integers(2, 9)),
        hidden=hidden,
        heads=heads,
        seq=int(rng.choice([32, 64, 128])),
        vocab=int(rng.choice([1000, 8000])),
    )


def scaled_chiplets(
    graph: OpGraph,
    count: int,
    slack: float = 1.3,
    link_share: float = 0.3,
    hop_limit: int = 1,
    topology: str = "chain",
) -> Chiplets:
    """Chiplets sized to ``graph``: SRAM = ``slack`` x its fair share of the weights
    (at least the largest node's), link speed such that a typical cut costs
    ``link_share`` of a balanced stage's compute."""
    base = Chiplets(count)
    w = graph.array("weights")
    sram = max(slack * float(w.sum()) / count, 1.05 * float(w.max()), 1.0)
    stage_s = float(node_times(graph, base).sum()) / count
    cut = float(np.median(cut_traffic(graph)[1:-1])) if len(graph) > 2 else 1.0
    link = max(2 * cut, 1.0) / max(link_share * stage_s, 1e-12)
    return Chiplets(
        count, sram_bytes=sram, link_bytes_per_s=link, hop_limit=hop_limit, topology=topology
    )


def _default_or_none(graph: OpGraph, count: int, topology: str) -> Chiplets | None:
    try:
        return Chiplets.default_for(graph, count, topology=topology)
    except InfeasibleError:
        return None


def synthetic_cases(
    count: int, seed: int = 0, ring_share: float = 0.2, families: Sequence[str] = FAMILIES
) -> list[tuple[OpGraph, Chiplets]]:
    """``count`` random (graph, chiplets) cases with 2 to 8 chiplets, graphs of
    ``families``: half on :meth:`Chiplets.default_for`, half on
    :func:`scaled_chiplets` of random slack and link share; about
    ``ring_share`` of those with 3 or more chiplets are rings, the rest chains."""
    rng = np.random.default_rng(seed)
    cases: list[tuple[OpGraph, Chiplets]] = []
    while len(cases) < count:
        g = synthetic_graph(rng, families)
        chips = int(rng.choice([2, 3, 4, 6, 8]))
        slack = float(rng.uniform(1.15, 1.8))
        share = float(rng.uniform(0.1, 0.6))
        ring = rng.random() < ring_share and chips >= 3
        topology = "ring" if ring else "chain"
        if len(g) < 3 * chips:
            continue
        if rng.random() < 0.5:  # half sized as users get them by default
            chiplets = _default_or_none(g, chips, topology)
        else:
            chiplets = scaled_chiplets(g, chips, slack, share, topology=topology)
        if chiplets is not None and dp_split(g, chiplets) is not None:  # keep feasible cases
            cases.append((g, chiplets))
    return cases
