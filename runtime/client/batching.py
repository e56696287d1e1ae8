"""Batching of ``cluster.run`` calls: the calls of one loop turn leave as one graph.

``cluster.run`` returns at once, whether it runs a program, a placed
function or a low-level ``Computation``, so a client usually issues a whole
chain (or fan-out) of runs before it awaits anything. A :class:`RunBatcher`
collects the runs a client makes in one turn of the event loop, each as the
graph it traced to (a low-level call is a graph of one node), and, at the
end of that turn, sends them through the controller's ``run_graph``, the
one path every run takes: planned once per shape of graph (the controller
caches plans), compiled, and run with one message per device
(``docs/performance.md``).

What is asynchronous about it: each call returns a promise of its own at
once; the batch leaves in a callback at the end of the loop turn (asyncio
or trio), after the code that made the calls yielded to the loop, and each
promise then follows its output. Anything else the client sends the
controller first flushes the batch, so the controller sees calls in the
order they were made. When some runs of a batch read others' outputs, the
batch goes as one graph, their graphs joined where one reads another (a
low-level call runs on a one-device slice pinned to its device: negative
slice ids, never allocated), and counts as one program for the session's
quota and share. Runs of which none reads another's output go one by one,
each its own graph, as they would unbatched.

Which outputs are kept: a run's output stays in its device's store (until
the client drops or frees it, or closes) only if the caller can still reach
its promise when the batch leaves. An intermediate value the caller dropped,
such as every link but the last of ``x = cluster.run(f, d, [x])`` in a
loop, is freed by the plan once its readers ran. ``ATOLL_BATCH_RUNS=0``
sends every call at once, each on its own (for A/B runs).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...devices import BufferHandle, Computation
from ...kernel import Promise
from ...kernel.config import settings
from ...kernel.lowlevel import call_soon
from ...transports.oneway import writes_together
from ..calls import call_graph
from ..graph import Graph, GraphBuilder, ValueRef

__all__ = ["RunBatcher"]


@dataclass(frozen=True)
class _Made:
    """An input that is output ``output`` of the batch's run ``run``."""

    run: int
    output: int


@dataclass
class _Run:
    made_graph: Graph | None  # None: a low-level call's, made when needed (see graph)
    inputs: list[Any]  # values, handles, outside promises, or _Made
    outputs: list[weakref.ref[Promise[BufferHandle]]]  # one per graph output
    call: tuple[Computation, int] | None = None  # a low-level call: (computation, device)
    args: Sequence[Any] = ()  # a low-level call's arguments' arrays (None for the others)

    @property
    def graph(self) -> Graph:
        """The run's graph. A low-level call's is made only for a batch that
        joins it to others: one that goes on its own sends only the call."""
        if self.made_graph is None:
            assert self.call is not None
            self.made_graph = call_graph(*self.call, self.args)
        return self.made_graph


@dataclass
class _Batch:
    owner: str
    runs: list[_Run] = field(default_factory=list)
    made: weakref.WeakKeyDictionary[Promise[Any], tuple[int, int]] = field(
        default_factory=weakref.WeakKeyDictionary
    )


# What sends a batch: (graph, inputs, owner, the promises that are to follow
# the graph's outputs).
SendGraph = Callable[[Graph, list[Any], str, Sequence[Promise[Any]]], None]
# What sends one low-level call on its own: (computation, device, inputs,
# owner, the promise of its output); the controller makes its graph.
SendCall = Callable[[Computation, int, list[Any], str, Promise[Any]], None]


def _batching() -> bool:
    """Whether runs wait for the end of the loop turn (``ATOLL_BATCH_RUNS``)."""
    return settings().batch_runs


class RunBatcher:
    """Collects one client's runs per loop turn (see the module docstring).

    ``send_graph`` is the client's way to the controller; ``send_call`` its
    way for a low-level call that goes on its own (the controller builds, and
    keeps, its one-node graph: nothing but the call crosses the wire).
    """

    def __init__(
        self, send_graph: SendGraph, send_call: SendCall, batching: bool | None = None
    ) -> None:
        self._send_graph = send_graph
        self._send_call = send_call
        self._batch: _Batch | None = None
        self._batching = batching if batching is not None else _batching()

    def add(
        self,
        computation: Computation,
        device: int,
        args: Sequence[Any],
        owner: str,
    ) -> Promise[BufferHandle]:
        """Queue one low-level call (``args`` as the client resolved them): a
        graph of one node on a slice pinned to ``device``; its promise."""
        promise: Promise[BufferHandle] = Promise(f"run {computation.name}")
        self._add(None, list(args), owner, [promise], (computation, device))
        return promise

    def add_graph(
        self,
        graph: Graph,
        inputs: list[Any],
        owner: str,
        outputs: Sequence[Promise[BufferHandle]],
    ) -> None:
        """Queue one run of ``graph``; ``outputs`` (a promise per graph output)
        follow its outputs once it is sent."""
        self._add(graph, inputs, owner, outputs)

    def _add(
        self,
        graph: Graph | None,
        inputs: list[Any],
        owner: str,
        outputs: Sequence[Promise[BufferHandle]],
        call: tuple[Computation, int] | None = None,
    ) -> None:
        """Queue a run: of ``graph``, or the low-level ``call`` reading ``inputs``."""
        if self._batch is not None and self._batch.owner != owner:
            self.flush()
        if self._batch is None:
            self._batch = _Batch(owner)
            if self._batching:
                call_soon(self.flush)  # at the end of this loop turn
        batch = self._batch
        mine = [self._made_by(batch, x) for x in inputs]
        index = len(batch.runs)
        refs = [weakref.ref(p) for p in outputs]
        # (a call keeps its arrays for its graph, not its promises: an earlier
        # run's output it reads must still go once nobody else holds it)
        args = [x if isinstance(x, np.ndarray) else None for x in inputs] if call else ()
        batch.runs.append(_Run(graph, mine, refs, call, args))
        for k, promise in enumerate(outputs):
            batch.made[promise] = (index, k)
        if not self._batching:
            self.flush()

    @staticmethod
    def _made_by(batch: _Batch, value: Any) -> Any:
        """``value``, or, when it is the promise of an earlier run's output in
        the batch, which output it is."""
        found = batch.made.get(value) if isinstance(value, Promise) else None
        return value if found is None else _Made(*found)

    def flush(self) -> None:
        """Send what was collected (a no-op when nothing was); what goes by
        lane leaves as it ends (``oneway.writes_together``)."""
        batch, self._batch = self._batch, None
        if batch is None or not batch.runs:
            return
        with writes_together():
            self._send_batch(batch)

    def _send_batch(self, batch: _Batch) -> None:
        if any(isinstance(x, _Made) for run in batch.runs for x in run.inputs):
            self._send(*_joined(batch.runs), batch.owner)
            return
        for run in batch.runs:  # no chain: one by one, as they came
            promise = run.outputs[0]() if run.call is not None else None
            if run.call is not None and promise is not None:
                self._call(run.call, run.inputs, batch.owner, promise)
            else:
                self._send(*_alone(run), batch.owner)

    def _call(
        self,
        call: tuple[Computation, int],
        inputs: list[Any],
        owner: str,
        promise: Promise[BufferHandle],
    ) -> None:
        try:
            self._send_call(*call, inputs, owner, promise)
        except Exception as exc:  # nothing was sent: the call fails with why
            promise.set_exception(exc)

    def _send(
        self,
        graph: Graph,
        inputs: list[Any],
        outputs: list[Promise[BufferHandle]],
        owner: str,
    ) -> None:
        """One graph; ``outputs`` (the promises still held) follow its outputs."""
        try:
            self._send_graph(graph, inputs, owner, outputs)
        except Exception as exc:  # nothing was sent: every run fails with why
            for promise in outputs:
                promise.set_exception(exc)


Sent = tuple[Graph, list[Any], list[Promise[BufferHandle]]]


def _alone(run: _Run) -> Sent:
    """A run as it goes on its own: its graph, with only the outputs someone
    still holds (the others are freed by the plan once made)."""
    pairs = zip(run.graph.outputs, run.outputs, strict=True)
    held = [(ref, p) for ref, out in pairs if (p := out()) is not None]
    graph = run.graph
    if len(held) != len(graph.outputs):
        graph = Graph(graph.inputs, graph.nodes, tuple(ref for ref, _ in held))
    return graph, list(run.inputs), [p for _, p in held]


def _joined(runs: Sequence[_Run]) -> Sent:
    """A batch as one graph: each run's nodes, reading the outputs of the runs
    before it where it reads them (``_Made``); every other input is an input
    of the whole; its outputs are those someone still holds."""
    builder = GraphBuilder()
    inputs: list[Any] = []
    made: dict[tuple[int, int], ValueRef] = {}
    kept: list[ValueRef] = []
    held: list[Promise[BufferHandle]] = []
    for index, run in enumerate(runs):
        local: dict[ValueRef, ValueRef] = {}
        for i, (aval, value) in enumerate(zip(run.graph.inputs, run.inputs, strict=True)):
            if isinstance(value, _Made):
                local[ValueRef(-1, i)] = made[value.run, value.output]
                continue
            local[ValueRef(-1, i)] = builder.input(aval)
            inputs.append(value)
        for node in run.graph.nodes:
            refs = [local[ref] for ref in node.inputs]
            outs = builder.add(node.kernel, node.slice, refs, node.outputs, node.name)
            local.update((ValueRef(node.id, o), ref) for o, ref in enumerate(outs))
        for k, (ref, out) in enumerate(zip(run.graph.outputs, run.outputs, strict=True)):
            made[index, k] = local[ref]
            if (promise := out()) is not None:
                kept.append(local[ref])
                held.append(promise)
    return builder.build(kept), inputs, held
