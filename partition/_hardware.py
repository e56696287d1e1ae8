"""The hardware model: a chain or a ring of chiplets with SRAM, compute and slow links."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from ._graph import OpGraph

__all__ = ["Chiplets"]

MiB = 1 << 20
TOPOLOGIES = ("chain", "ring")


@dataclass(frozen=True)
class Chiplets:
    """A multi-chip module: ``count`` identical chiplets joined in a chain or a ring.

    ``topology="chain"``: link ``k`` joins chiplets ``k`` and ``k + 1`` (``count - 1``
    links). ``topology="ring"`` adds link ``count - 1``, joining the last chiplet
    to the first (``count`` links; needs at least 3 chiplets). The pipeline
    runs in chiplet order on both; ``docs/partition.md`` gives the constraints
    and the cost model of each.

    The defaults are calibrated on BERT-base in bfloat16 (about 218 MB of
    weights, 47 MB of them in the word embedding): 64 MiB of SRAM per chiplet
    makes memory bind at 4 chiplets and still fits the embedding at 8 and 16;
    a 20 GB/s link makes one activation crossing cost about half a layer of
    compute, so where the cuts fall matters. See ``docs/partition.md``.

    ``hop_limit`` is how many chiplets apart two communicating operations may
    be (1: no skipping chips). ``mem_bytes_per_s`` is the SRAM bandwidth used
    by the roofline in the per-node compute time.
    """

    count: int = 4
    sram_bytes: float = 64 * MiB
    flops_per_s: float = 50e12
    link_bytes_per_s: float = 20e9
    topology: str = "chain"
    hop_limit: int = 1
    mem_bytes_per_s: float = 1e12

    @classmethod
    def default_for(
        cls, graph: OpGraph, count: int, hop_limit: int | None = None, topology: str = "chain"
    ) -> Chiplets:
        """Chiplets sized to ``graph`` so that memory and links bind but a valid
        partition exists (see :mod:`._calibrate`). ``hop_limit=None`` picks the
        least hop limit under which the graph fits at all."""
        from ._calibrate import calibrated  # the cost model, which reads Chiplets

        return calibrated(graph, cls(count, sram_bytes=float("inf"), topology=topology), hop_limit)

    @property
    def links(self) -> int:
        """How many links join the chiplets: ``count - 1`` on a chain, ``count`` on a ring."""
        return self.count if self.topology == "ring" else self.count - 1

    def hops(self, span: NDArray[np.int64]) -> NDArray[np.int64]:
        """Links a tensor crosses between chiplets ``span`` apart (``span >= 0``):
        ``span`` on a chain, the shorter way round on a ring."""
        if self.topology == "ring":
            out: NDArray[np.int64] = np.minimum(span, self.count - span)
            return out
        return span

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"need at least one chiplet, got {self.count}")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if self.topology == "ring" and self.count < 3:
            raise ValueError(f"a ring needs at least 3 chiplets, got {self.count}")
        if self.hop_limit < 1:
            raise ValueError(f"hop_limit must be at least 1, got {self.hop_limit}")
        for name in ("sram_bytes", "flops_per_s", "link_bytes_per_s", "mem_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
