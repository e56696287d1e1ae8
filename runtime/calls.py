"""A low-level call as a graph: ``cluster.run(computation, device, inputs)``
becomes one node on a slice pinned to a physical device. The client's
batcher makes such graphs when it joins calls into one run, and the
controller makes them for calls that come on their own (``run_call``); so
this lives beside both, not in either. Nothing here is asynchronous."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..devices import Aval, Computation
from ..transports.dtypes import dtype_name
from .graph import Graph, GraphBuilder, SliceSpec

__all__ = [
    "UNKNOWN_AVAL",
    "call_graph",
    "device_of_slice",
    "device_slice",
    "input_kinds",
    "kinds_graph",
]

# A run's output has no shape known ahead: its placeholder in a batch's graph.
UNKNOWN_AVAL = Aval((0,), "uint8")


def device_slice(device: int) -> SliceSpec:
    """The one-device slice that pins a batched call to physical ``device``
    (negative ids: never allocated, never released; see ``device_of_slice``)."""
    return SliceSpec(-1 - device, (1,), ("x",))


def device_of_slice(slice_id: int) -> int | None:
    """The physical device a batch's slice id pins, or None for a real slice."""
    return -1 - slice_id if slice_id < 0 else None


def call_graph(computation: Computation, device: int, args: Sequence[Any]) -> Graph:
    """A low-level call as a graph: one node on a slice pinned to ``device``,
    reading ``args`` (values, handles or promises) as the graph's inputs."""
    return kinds_graph(computation, device, input_kinds(args))


def kinds_graph(computation: Computation, device: int, kinds: Sequence[tuple[Any, ...]]) -> Graph:
    """:func:`call_graph` of a call whose inputs are of these ``kinds``
    (:func:`input_kinds`): all its graph depends on."""
    builder = GraphBuilder()
    refs = [builder.input(_aval(kind)) for kind in kinds]
    [out] = builder.add(computation, device_slice(device), refs, [UNKNOWN_AVAL], computation.name)
    return builder.build([out])


def input_kinds(args: Sequence[Any]) -> tuple[tuple[Any, ...], ...]:
    """What of a call's inputs its graph depends on: an array's shape and
    dtype; nothing of a handle or a promise (only their count matters)."""
    return tuple(
        (tuple(arg.shape), dtype_name(arg.dtype)) if isinstance(arg, np.ndarray) else ()
        for arg in args
    )


def _aval(kind: tuple[Any, ...]) -> Aval:
    """An input's aval in a call's graph, from its kind."""
    return Aval(*kind) if kind else UNKNOWN_AVAL
