"""Batching of ``cluster.run`` calls: the calls of one loop turn leave as one graph.

``cluster.run(computation, device, inputs)`` returns at once, so a client
usually issues a whole chain (or fan-out) of such calls before it awaits
anything. A :class:`RunBatcher` collects the calls a client makes in one
turn of the event loop and, at the end of that turn, sends them through the
controller's ``run_graph``, the one path every run takes: planned once per
shape of graph (the controller caches plans), compiled, and run with one
message per device (``docs/performance.md``).

What is asynchronous about it: each call returns a promise of its own at
once; the batch leaves in a callback at the end of the loop turn (asyncio
or trio), after the code that made the calls yielded to the loop, and each
promise then follows its output. Anything else the client sends the
controller first flushes the batch, so the controller sees calls in the
order they were made. When some calls of a batch read others' outputs, the
batch goes as one graph, on one-device slices pinned to the named devices
(negative slice ids, never allocated), and counts as one program for the
session's quota and share. Calls of which none reads another's output go
one by one, each a one-node graph of its own, as they would unbatched.

Which outputs are kept: a call's output stays in its device's store (until
the client drops or frees it, or closes) only if the caller can still reach
its promise when the batch leaves. An intermediate value the caller dropped,
such as every link but the last of ``x = cluster.run(f, d, [x])`` in a
loop, is freed by the plan once its readers ran. ``ATOLL_BATCH_RUNS=0``
sends every call at once, each on its own (for A/B runs).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..devices import Aval, BufferHandle, Computation
from ..kernel import Promise
from ..kernel.lowlevel import call_soon
from .graph import GraphBuilder, SliceSpec, ValueRef

__all__ = ["UNKNOWN_AVAL", "RunBatcher", "device_of_slice", "device_slice"]

# A run's output has no shape known ahead: its placeholder in a batch's graph.
UNKNOWN_AVAL = Aval((0,), "uint8")


def device_slice(device: int) -> SliceSpec:
    """The one-device slice that pins a batched call to physical ``device``
    (negative ids: never allocated, never released; see ``device_of_slice``)."""
    return SliceSpec(-1 - device, (1,), ("x",))


def device_of_slice(slice_id: int) -> int | None:
    """The physical device a batch's slice id pins, or None for a real slice."""
    return -1 - slice_id if slice_id < 0 else None


@dataclass(frozen=True)
class _Made:
    """An input that is the output of an earlier call in the same batch."""

    call: int


@dataclass
class _Call:
    computation: Computation
    device: int
    args: list[Any]  # values, handles, outside promises, or _Made
    promise: weakref.ref[Promise[BufferHandle]]
    temporary: list[bool]  # per arg: put only for this call, freed after it


@dataclass
class _Batch:
    owner: str
    calls: list[_Call] = field(default_factory=list)
    made: weakref.WeakKeyDictionary[Promise[Any], int] = field(
        default_factory=weakref.WeakKeyDictionary
    )


# What sends a batch: (graph, inputs, temporary, owner, the promises that are
# to follow the graph's outputs).
SendGraph = Callable[[Any, list[Any], list[int], str, Sequence[Promise[Any]]], None]


def _batching() -> bool:
    """Whether calls wait for the end of the loop turn (``ATOLL_BATCH_RUNS``)."""
    return os.environ.get("ATOLL_BATCH_RUNS", "1") != "0"


class RunBatcher:
    """Collects one client's ``run`` calls per loop turn (see the module docstring).

    ``send_graph`` is the client's way to the controller.
    """

    def __init__(self, send_graph: SendGraph, batching: bool | None = None) -> None:
        self._send_graph = send_graph
        self._batch: _Batch | None = None
        self._batching = batching if batching is not None else _batching()

    def add(
        self,
        computation: Computation,
        device: int,
        args: Sequence[Any],
        owner: str,
        temporary: Sequence[bool],
    ) -> Promise[BufferHandle]:
        """Queue one call (``args`` as the client resolved them); its promise."""
        if self._batch is not None and self._batch.owner != owner:
            self.flush()
        if self._batch is None:
            self._batch = _Batch(owner)
            if self._batching:
                call_soon(self.flush)  # at the end of this loop turn
        batch = self._batch
        promise: Promise[BufferHandle] = Promise(f"run {computation.name}")
        mine = [
            _Made(batch.made[a]) if isinstance(a, Promise) and a in batch.made else a for a in args
        ]
        batch.calls.append(_Call(computation, device, mine, weakref.ref(promise), list(temporary)))
        batch.made[promise] = len(batch.calls) - 1
        if not self._batching:
            self.flush()
        return promise

    def flush(self) -> None:
        """Send what was collected (a no-op when nothing was)."""
        batch, self._batch = self._batch, None
        if batch is None or not batch.calls:
            return
        if any(isinstance(a, _Made) for call in batch.calls for a in call.args):
            self._send(batch.calls, batch.owner)
            return
        for call in batch.calls:  # no chain: one by one, as they came
            self._send([call], batch.owner)

    def _send(self, calls: Sequence[_Call], owner: str) -> None:
        """``calls`` as one graph; the promises still held follow their outputs."""
        alive = [(i, p) for i, call in enumerate(calls) if (p := call.promise()) is not None]
        try:
            graph, inputs, temporary = _graph_of(calls, [i for i, _ in alive])
            self._send_graph(graph, inputs, temporary, owner, [p for _, p in alive])
        except Exception as exc:  # nothing was sent: every call fails with why
            for _, promise in alive:
                promise.set_exception(exc)


def _graph_of(calls: Sequence[_Call], kept: Sequence[int]) -> tuple[Any, list[Any], list[int]]:
    """A batch as a graph: one node per call, pinned to its device; every
    argument that is not an earlier call's output is a program input (the
    ones put only for a call are ``temporary``: the plan frees them)."""
    builder = GraphBuilder()
    inputs: list[Any] = []
    temporary: list[int] = []
    outputs: list[ValueRef] = []
    for call in calls:
        refs = []
        for arg, temp in zip(call.args, call.temporary, strict=True):
            if isinstance(arg, _Made):
                refs.append(outputs[arg.call])
                continue
            refs.append(builder.input(_aval(arg)))
            if temp:
                temporary.append(len(inputs))
            inputs.append(arg)
        name = call.computation.name
        [out] = builder.add(call.computation, device_slice(call.device), refs, [UNKNOWN_AVAL], name)
        outputs.append(out)
    return builder.build([outputs[i] for i in kept]), inputs, temporary


def _aval(value: Any) -> Aval:
    """An input's aval in a batch's graph: a value's own; unknown for a handle
    or a promise (the graph only needs its inputs' count to be planned)."""
    if isinstance(value, np.ndarray):
        return Aval(tuple(value.shape), str(value.dtype))
    return UNKNOWN_AVAL
