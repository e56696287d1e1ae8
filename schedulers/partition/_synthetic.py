"""Synthetic training graphs for pre-training the policy.

Each case is a graph (an MLP, a CNN-like chain, or a transformer of another
depth and width than BERT-base) and a chiplet module scaled to it, so that
memory binds and links matter on every case, whatever its absolute size.
"""

from __future__ import annotations

import numpy as np

from ._cost import node_times
from ._dp import cut_traffic, dp_split
from ._graph import OpGraph
from ._hardware import Chiplets
from ._models import cnn_graph, mlp_graph, transformer_graph

__all__ = ["scaled_chiplets", "synthetic_cases", "synthetic_graph"]


def synthetic_graph(rng: np.random.Generator) -> OpGraph:
    """One random graph: MLP, CNN-like chain or small transformer."""
    family = int(rng.integers(3))
    if family == 0:
        widths = [int(rng.choice([256, 512, 1024, 2048])) for _ in range(int(rng.integers(12, 49)))]
        return mlp_graph(widths, batch=int(rng.choice([64, 256])))
    if family == 1:
        chans = [int(rng.choice([32, 64, 128])) for _ in range(int(rng.integers(12, 49)))]
        return cnn_graph(chans, size=int(rng.choice([16, 32])))
    heads = int(rng.choice([2, 4, 8]))
    return transformer_graph(
        layers=int(rng.integers(2, 9)),
        hidden=heads * int(rng.choice([32, 64])),
        heads=heads,
        seq=int(rng.choice([32, 64, 128])),
        vocab=int(rng.choice([1000, 8000])),
    )


def scaled_chiplets(
    graph: OpGraph, count: int, slack: float = 1.3, link_share: float = 0.3, hop_limit: int = 1
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
    return Chiplets(count, sram_bytes=sram, link_bytes_per_s=link, hop_limit=hop_limit)


def synthetic_cases(count: int, seed: int = 0) -> list[tuple[OpGraph, Chiplets]]:
    """``count`` random (graph, chiplets) cases with 2 to 8 chiplets."""
    rng = np.random.default_rng(seed)
    cases: list[tuple[OpGraph, Chiplets]] = []
    while len(cases) < count:
        g = synthetic_graph(rng)
        chips = int(rng.choice([2, 3, 4, 6, 8]))
        slack = float(rng.uniform(1.15, 1.8))
        share = float(rng.uniform(0.1, 0.6))
        chiplets = scaled_chiplets(g, chips, slack, share)
        if len(g) >= 3 * chips and dp_split(g, chiplets) is not None:  # keep feasible cases
            cases.append((g, chiplets))
    return cases
