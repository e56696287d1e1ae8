"""Sharded dataflow graphs: one node per sharded computation, edges are transfers.

A :class:`Graph` is what the controller dispatches. It is plain data, built
either by tracing a ``@program`` (JAX, :mod:`atoll.runtime.tracing`) or by hand
with :class:`GraphBuilder` (simulated kernels in benchmarks). Every value has a
known shape and dtype (an :class:`~atoll.devices.Aval`) before anything runs,
which is what lets the controller dispatch a whole graph ahead of its data.
Nothing here is asynchronous: a graph is planned by :mod:`atoll.runtime.control.planner`
and dispatched by the controller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..devices import Aval
from ..kernel import AtollError

__all__ = ["Aval", "Graph", "GraphBuilder", "Node", "SliceSpec", "ValueRef"]


@dataclass(frozen=True)
class SliceSpec:
    """A virtual slice as user code sees it: an id and a mesh, no physical device."""

    slice_id: int
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]

    @property
    def size(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n


@dataclass(frozen=True)
class ValueRef:
    """An edge's source: output ``index`` of node ``node`` (node -1: program input)."""

    node: int
    index: int


@dataclass(frozen=True)
class Node:
    """One sharded computation: ``kernel`` run as a gang over ``slice``."""

    id: int
    name: str
    kernel: Any
    slice: SliceSpec
    inputs: tuple[ValueRef, ...]
    outputs: tuple[Aval, ...]


@dataclass(frozen=True)
class Graph:
    """A whole program: its inputs, its nodes in topological order, its outputs."""

    inputs: tuple[Aval, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[ValueRef, ...]

    def __hash__(self) -> int:
        """By structure, computed once per object: the plan cache finds the
        plan of a graph that arrived again, unpickled, from a client."""
        cached: int | None = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.inputs, self.nodes, self.outputs))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the cached hash (functions hash by identity, so
        it holds only in the process that computed it)."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def aval(self, ref: ValueRef) -> Aval:
        if ref.node < 0:
            return self.inputs[ref.index]
        return self.nodes[ref.node].outputs[ref.index]

    def alone(self, node: Node) -> Graph:
        """``node`` as a program of its own: its inputs are the program's, and
        so are its outputs (sequential dispatch runs a graph so, node by node)."""
        inputs = tuple(self.aval(ref) for ref in node.inputs)
        refs = tuple(ValueRef(-1, i) for i in range(len(node.inputs)))
        only = Node(0, node.name, node.kernel, node.slice, refs, node.outputs)
        return Graph(inputs, (only,), tuple(ValueRef(0, i) for i in range(len(node.outputs))))

    def freeable(self) -> dict[ValueRef, list[int]]:
        """The values to free once their readers ran, with those readers: every
        value a node makes that is not an output (program inputs are the
        caller's own). A node's output that nothing reads has no readers: it
        is freed as soon as it exists."""
        kept = set(self.outputs)
        readers = self.consumers()
        unread: dict[ValueRef, list[int]] = {
            ValueRef(node.id, i): []
            for node in self.nodes
            for i in range(len(node.outputs))
            if ValueRef(node.id, i) not in readers
        }
        return {
            ref: nodes
            for ref, nodes in {**readers, **unread}.items()
            if ref not in kept and ref.node >= 0
        }

    def consumers(self) -> dict[ValueRef, list[int]]:
        """For every value, the nodes that read it (a node reading twice counts once)."""
        out: dict[ValueRef, list[int]] = {}
        for node in self.nodes:
            for ref in dict.fromkeys(node.inputs):
                out.setdefault(ref, []).append(node.id)
        return out


class GraphBuilder:
    """Builds a :class:`Graph` node by node; nodes can only read earlier values."""

    def __init__(self) -> None:
        self._inputs: list[Aval] = []
        self._nodes: list[Node] = []

    def input(self, aval: Aval) -> ValueRef:
        self._inputs.append(aval)
        return ValueRef(-1, len(self._inputs) - 1)

    def add(
        self,
        kernel: Any,
        slice_: SliceSpec,
        inputs: Sequence[ValueRef],
        outputs: Sequence[Aval],
        name: str = "",
    ) -> list[ValueRef]:
        """Add one node; returns references to its outputs."""
        for ref in inputs:
            self._check(ref)
        node_id = len(self._nodes)
        node = Node(
            node_id, name or f"node{node_id}", kernel, slice_, tuple(inputs), tuple(outputs)
        )
        self._nodes.append(node)
        return [ValueRef(node_id, i) for i in range(len(outputs))]

    def build(self, outputs: Sequence[ValueRef]) -> Graph:
        for ref in outputs:
            self._check(ref)
        return Graph(tuple(self._inputs), tuple(self._nodes), tuple(outputs))

    def _check(self, ref: ValueRef) -> None:
        ok = (
            0 <= ref.index < len(self._inputs)
            if ref.node < 0
            else ref.node < len(self._nodes) and ref.index < len(self._nodes[ref.node].outputs)
        )
        if not ok:
            raise AtollError(f"{ref} is not a value of this graph")
