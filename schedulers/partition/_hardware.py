"""The hardware model: a chain of chiplets with SRAM, compute and slow links."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Chiplets"]

MiB = 1 << 20


@dataclass(frozen=True)
class Chiplets:
    """A multi-chip module: ``count`` identical chiplets joined in a chain.

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

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"need at least one chiplet, got {self.count}")
        if self.topology != "chain":
            raise ValueError(f"only the 'chain' topology is modelled, got {self.topology!r}")
        if self.hop_limit < 1:
            raise ValueError(f"hop_limit must be at least 1, got {self.hop_limit}")
        for name in ("sram_bytes", "flops_per_s", "link_bytes_per_s", "mem_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
