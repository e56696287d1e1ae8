"""The op-graph model: operations with FLOPs and bytes, joined by tensor edges.

An :class:`OpGraph` is what every partitioning method reads. Its ops
(``OpGraph.nodes``) are kept in a topological order (every edge goes from a
lower index to a higher one), which the cost model, the dynamic-programming
split and the policy features all rely on. Op graphs read and write a small
JSON format. (They are unrelated to the runtime's dataflow ``Graph``.)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._errors import GraphError

__all__ = ["Edge", "Op", "OpGraph", "load_graph", "save_graph"]

FORMAT = "atoll.partition.graph/1"


@dataclass(frozen=True)
class Op:
    """One operation: its work, the weights it keeps resident and its output size."""

    name: str
    kind: str = "op"
    flops: float = 0.0
    weight_bytes: float = 0.0
    output_bytes: float = 0.0


@dataclass(frozen=True)
class Edge:
    """A tensor flowing from op ``src`` to op ``dst`` (indices into ``OpGraph.nodes``)."""

    src: int
    dst: int
    bytes: float


@dataclass(frozen=True)
class OpGraph:
    """A computation graph of :class:`Op` in topological order, ready to be partitioned.

    Construction checks the order: an edge must go from a lower op index to
    a higher one, so ``range(len(nodes))`` is a valid schedule.
    """

    name: str
    nodes: tuple[Op, ...]
    edges: tuple[Edge, ...]
    _arrays: dict[str, NDArray[Any]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.nodes)
        if n == 0:
            raise GraphError(f"graph {self.name!r} has no nodes")
        for e in self.edges:
            if not (0 <= e.src < e.dst < n):
                raise GraphError(
                    f"graph {self.name!r}: edge {e.src}->{e.dst} is not forward in node order"
                )

    @classmethod
    def build(
        cls, name: str, nodes: Iterable[Op], edges: Iterable[tuple[int, int, float]]
    ) -> OpGraph:
        """Make a graph from ops and ``(src, dst, bytes)`` triples, merging duplicates."""
        merged: dict[tuple[int, int], float] = {}
        for s, d, b in edges:
            merged[(s, d)] = merged.get((s, d), 0.0) + float(b)
        return cls(name, tuple(nodes), tuple(Edge(s, d, b) for (s, d), b in sorted(merged.items())))

    def __len__(self) -> int:
        return len(self.nodes)

    def array(self, key: str) -> NDArray[Any]:
        """Cached numpy views of the graph: ``flops``, ``weights``, ``out``, ``src``,
        ``dst``, ``ebytes``, ``in`` (input bytes per node) and ``last`` (index of
        each node's last consumer, itself when it has none)."""
        if not self._arrays:
            self._arrays.update(_arrays(self))
        return self._arrays[key]

    @property
    def total_flops(self) -> float:
        """Sum of all nodes' FLOPs."""
        return float(self.array("flops").sum())

    @property
    def total_weight_bytes(self) -> float:
        """Sum of all nodes' resident weights."""
        return float(self.array("weights").sum())

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form (see :func:`save_graph`)."""
        return {
            "format": FORMAT,
            "name": self.name,
            "nodes": [
                {
                    "name": n.name,
                    "kind": n.kind,
                    "flops": n.flops,
                    "weight_bytes": n.weight_bytes,
                    "output_bytes": n.output_bytes,
                }
                for n in self.nodes
            ],
            "edges": [[e.src, e.dst, e.bytes] for e in self.edges],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OpGraph:
        """Inverse of :meth:`to_dict`; edges may name ops by index or by name."""
        if data.get("format", FORMAT) != FORMAT:
            raise ValueError(f"unknown graph format {data.get('format')!r}")
        nodes = [
            Op(
                name=str(n["name"]),
                kind=str(n.get("kind", "op")),
                flops=float(n.get("flops", 0.0)),
                weight_bytes=float(n.get("weight_bytes", 0.0)),
                output_bytes=float(n.get("output_bytes", 0.0)),
            )
            for n in data["nodes"]
        ]
        index = {n.name: i for i, n in enumerate(nodes)}

        def ref(x: Any) -> int:
            return index[x] if isinstance(x, str) else int(x)

        edges = [(ref(e[0]), ref(e[1]), float(e[2])) for e in data.get("edges", [])]
        return cls.build(str(data.get("name", "graph")), nodes, edges)


def _arrays(g: OpGraph) -> dict[str, NDArray[Any]]:
    n = len(g.nodes)
    src = np.array([e.src for e in g.edges], dtype=np.int64)
    dst = np.array([e.dst for e in g.edges], dtype=np.int64)
    ebytes = np.array([e.bytes for e in g.edges], dtype=np.float64)
    inb = np.zeros(n)
    np.add.at(inb, dst, ebytes)
    last = np.arange(n, dtype=np.int64)
    np.maximum.at(last, src, dst)
    return {
        "flops": np.array([x.flops for x in g.nodes], dtype=np.float64),
        "weights": np.array([x.weight_bytes for x in g.nodes], dtype=np.float64),
        "out": np.array([x.output_bytes for x in g.nodes], dtype=np.float64),
        "src": src,
        "dst": dst,
        "ebytes": ebytes,
        "in": inb,
        "last": last,
    }


def save_graph(graph: OpGraph, path: str | Path) -> None:
    """Write ``graph`` as JSON: ``{"format", "name", "nodes": [...], "edges": [[s, d, bytes]]}``."""
    Path(path).write_text(json.dumps(graph.to_dict(), indent=1))


def load_graph(path: str | Path) -> OpGraph:
    """Read a graph written by :func:`save_graph` (or by hand in the same format)."""
    return OpGraph.from_dict(json.loads(Path(path).read_text()))
