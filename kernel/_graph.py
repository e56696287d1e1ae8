"""Sharded dataflow graphs: one node per sharded computation, edges are transfers.

A :class:`Graph` is what the controller dispatches. It is plain data, built
either by tracing a ``@program`` (JAX) or by hand with :class:`GraphBuilder`
(simulated kernels in benchmarks). Every value has a known shape and dtype
before anything runs, which is what lets the controller dispatch a whole
graph ahead of its data.

The helpers :func:`then` and :func:`flatten` derive promises from promises
without waiting: the controller uses them to hand out one promise per output
of a node whose result is not there yet. The others convert between values
and promises, and join several promises, for code that may be handed either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ._errors import AtollError
from ._promise import Promise

__all__ = [
    "Aval",
    "Graph",
    "GraphBuilder",
    "Node",
    "SliceSpec",
    "ValueRef",
    "all_settled",
    "as_promise",
    "failed",
    "first_settled",
    "flatten",
    "forward",
    "then",
    "value_of",
]

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class Aval:
    """An abstract value: the shape and dtype of an array that may not exist yet."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        import numpy as np

        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


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

    def aval(self, ref: ValueRef) -> Aval:
        if ref.node < 0:
            return self.inputs[ref.index]
        return self.nodes[ref.node].outputs[ref.index]

    def freeable(self, temporary: Sequence[int]) -> dict[ValueRef, list[int]]:
        """The values to free once their readers ran, with those readers: every
        value read and not an output, except program inputs not listed in
        ``temporary`` (the caller's own)."""
        kept, mine = set(self.outputs), set(temporary)
        return {
            ref: readers
            for ref, readers in self.consumers().items()
            if ref not in kept and (ref.node >= 0 or ref.index in mine)
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


def then(promise: Promise[T], fn: Callable[[T], U], label: str = "") -> Promise[U]:
    """A promise of ``fn(value)``; returns at once, settles when ``promise`` does."""
    out: Promise[U] = Promise(label or f"{promise!r}.then")

    def settle(done: Promise[T]) -> None:
        error = done.exception()
        if error is not None:
            out.set_exception(error)
            return
        try:
            out.set_result(fn(done.result()))
        except Exception as exc:
            out.set_exception(exc)

    promise.add_done_callback(settle)
    return out


def flatten(promise: Promise[Promise[T] | T], label: str = "") -> Promise[T]:
    """A promise of the value of the promise that ``promise`` will hold.

    The inner value may also arrive as a plain value: a network transport
    delivers a promise that settled before it was sent as its value.
    """
    out: Promise[T] = Promise(label or f"{promise!r}.flat")

    def outer(done: Promise[Promise[T] | T]) -> None:
        error = done.exception()
        if error is not None:
            out.set_exception(error)
            return
        forward(as_promise(done.result()), out)

    promise.add_done_callback(outer)
    return out


def forward(source: Promise[T], target: Promise[T]) -> None:
    """Settle ``target`` the way ``source`` settles (now or later)."""
    target._follow(source)


def as_promise(value: Promise[T] | T, label: str = "value") -> Promise[T]:
    """``value`` if it is a promise, else a promise already settled with it."""
    if isinstance(value, Promise):
        return value
    promise: Promise[T] = Promise(label)
    promise.set_result(value)
    return promise


def failed(error: BaseException, label: str = "failed") -> Promise[Any]:
    """A promise that already failed with ``error``."""
    promise: Promise[Any] = Promise(label)
    promise.set_exception(error)
    return promise


async def value_of(value: Promise[T] | T) -> T:
    """The value: awaited if it is a promise (raising its error), else itself."""
    return await value if isinstance(value, Promise) else value


def all_settled(promises: Sequence[Promise[Any]], label: str = "all settled") -> Promise[None]:
    """A promise that settles (with None) once every one of ``promises`` has,
    whichever way; callers look at the promises themselves for the outcome."""
    out: Promise[None] = Promise(label)
    left = [len(promises)]

    def one(_: Promise[Any]) -> None:
        left[0] -= 1
        if left[0] == 0:
            out.set_result(None)

    if not promises:
        out.set_result(None)
    for promise in promises:
        promise.add_done_callback(one)
    return out


async def first_settled(*promises: Promise[Any]) -> None:
    """Return when the first of ``promises`` settles (whichever way)."""
    either: Promise[None] = Promise("first settled")
    for promise in promises:
        promise.add_done_callback(lambda _: either.set_result(None))
    await either
