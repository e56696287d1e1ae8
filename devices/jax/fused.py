"""Consecutive gangs of a compiled plan as one XLA computation: fused segments.

When a device runs several gangs in a row, each a JAX kernel on that device
alone that reads only the run's inputs and outputs made earlier on this
device, and pushes nothing anywhere (the layers of a model on one slice, the
steps of a chain), it need not dispatch each on its own: it composes their
functions, in the plan's order, into one function and compiles that once. A
run then costs one dispatch per segment instead of one per gang, and XLA
optimizes across the gangs' boundaries: values used only inside a segment
never exist as buffers. Identical segments (the same kernels, wired the same
way: the blocks of a long chain) share one executable.

A :class:`FusedSegment` is that function, with what it reads from outside
(the run's inputs, outputs of earlier gangs), what it gives back (the
program's outputs among its gangs', and what later gangs read), and the
shardings each has when run gang by gang, so that the two ways trade arrays
without a copy.

What a segment gives up, and why it holds at most ``FUSE_MAX`` gangs: the
timeline shows one gang for it; a computation that fails after it was
enqueued fails every output of the segment; and a plan's first run compiles
each new kind of segment. A segment that fails as it is enqueued (a kernel
that raises, an input that failed) runs again gang by gang, so that errors
reach only the gangs that read them. ``ATOLL_FUSE=0`` turns fusing off (for
A/B runs).

Nothing here is asynchronous: ``JaxDevice.run_segment`` carries it out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Sharding, SingleDeviceSharding

from ...kernel.config import settings
from .._jax_kernel import JaxKernel
from .._plan import DeviceProgram, PlannedGang
from .compiled import Meshes

__all__ = ["FUSE_MAX", "FusedSegment", "fusing", "segments"]

FUSE_MAX = 64  # gangs a fused segment holds at most

# where a segment input comes from: ("input", program input) or ("made", (node, output))
Source = tuple[str, Any]


def fusing() -> bool:
    """Whether devices fuse what they can (``ATOLL_FUSE``, on by default)."""
    return settings().fuse


def segments(
    program: DeviceProgram, eligible: Callable[[PlannedGang], bool]
) -> list[tuple[int, int]]:
    """The ``(start, end)`` ranges of ``program``'s gangs to fuse: runs of at
    least two consecutive ``eligible`` gangs, cut every ``FUSE_MAX``."""
    out: list[tuple[int, int]] = []
    start = None
    for index, gang in enumerate([*program.gangs, None]):
        if gang is not None and eligible(gang) and (start is None or index - start < FUSE_MAX):
            start = index if start is None else start
            continue
        if start is not None and index - start >= 2:
            out.append((start, index))
        start = index if gang is not None and eligible(gang) else None
    return out


class FusedSegment:
    """Gangs ``start`` to ``end`` of ``program`` composed into one function
    over its ``sources``, returning the values in ``exported``."""

    def __init__(
        self, program: DeviceProgram, start: int, end: int, device: jax.Device, meshes: Meshes
    ) -> None:
        self.start, self.end = start, end
        self.gangs = program.gangs[start:end]
        inside = {gang.node for gang in self.gangs}
        self.sources: list[Source] = []
        for gang in self.gangs:
            for i, src in enumerate(gang.inputs):
                source: Source = ("input", src) if src >= 0 else ("made", gang.local[i])
                if source[0] == "made" and source[1][0] in inside:
                    continue
                if source not in self.sources:
                    self.sources.append(source)
        later = {s for gang in program.gangs[end:] for s in gang.local if s is not None}
        self.exported = [
            (gang.node, o)
            for gang in self.gangs
            for o, keep in enumerate(gang.keep)
            if keep or (gang.node, o) in later
        ]
        self.kept = {(gang.node, o) for gang in self.gangs for o, k in enumerate(gang.keep) if k}
        self.name = f"{len(self.gangs)} gangs, fused"
        self.kernel = self  # what a timeline names a gang by (``.name``)
        self.in_shardings, self.out_shardings = _shardings(self, device, meshes)
        self.shape = self._shape()
        self.kernels = [gang.kernel for gang in self.gangs]  # held while compiled: see key

    def key(self, arrays: Sequence[Any]) -> tuple[Any, ...]:
        """What its executable is cached under: its shape (identical segments
        share one) and its inputs' shapes and dtypes."""
        return ("segment", self.shape, tuple((a.shape, a.dtype) for a in arrays))

    def lowered(self, arrays: Sequence[Any]) -> Any:
        """This segment, jitted with its shardings and lowered for ``arrays``."""
        jitted = jax.jit(self, in_shardings=self.in_shardings, out_shardings=self.out_shardings)
        return jitted.lower(*arrays)

    def __call__(self, *arrays: Any) -> list[Any]:
        """The gangs in order, on traced values (inside ``jax.jit``)."""
        values: dict[Any, Any] = {}  # by Source, and by (node, output) once made here
        values.update(zip(self.sources, arrays, strict=True))
        for gang in self.gangs:
            args = [
                _value(values, src, gang.local[i] if src < 0 else None)
                for i, src in enumerate(gang.inputs)
            ]
            values.update(((gang.node, o), out) for o, out in enumerate(_call(gang, args)))
        return [values[key] for key in self.exported]

    def _shape(self) -> tuple[Any, ...]:
        """What makes two segments the same function: their kernels (by
        object), how each gang's inputs are wired (a source's place, or an
        earlier gang's output by distance), and which outputs leave."""
        position = {gang.node: k for k, gang in enumerate(self.gangs)}
        wiring: list[tuple[Any, ...]] = []
        for gang in self.gangs:
            for i, src in enumerate(gang.inputs):
                local = gang.local[i] if src < 0 else None
                if local is not None and local[0] in position:
                    wiring.append(("gang", position[local[0]], local[1]))
                else:
                    source = ("input", src) if src >= 0 else ("made", local)
                    wiring.append(("source", self.sources.index(source)))
        leaving = tuple((position[node], o) for node, o in self.exported)
        return (tuple(id(g.kernel) for g in self.gangs), tuple(wiring), leaving)


def _call(gang: PlannedGang, args: Sequence[Any]) -> list[Any]:
    """A gang's function on traced values: its flat outputs (a JAX kernel's
    list, or a ``Computation``'s one output)."""
    if isinstance(gang.kernel, JaxKernel):
        outs: list[Any] = gang.kernel.fn(*args)
        return outs
    return [gang.kernel.fn(*args)]


def _value(values: dict[Any, Any], src: int, local: tuple[int, int] | None) -> Any:
    """An input of a gang inside a segment: a program input, an output made
    inside the segment, or one made before it (a source)."""
    if src >= 0:
        return values["input", src]
    return values[local] if local in values else values["made", local]


def _shardings(
    segment: FusedSegment, device: jax.Device, meshes: Meshes
) -> tuple[list[Sharding], list[Sharding]]:
    """Each source's sharding as its first reader takes it, each exported
    output's as its gang makes it (on this one device, all are the same
    placement)."""
    alone = SingleDeviceSharding(device)  # a Computation's, in and out

    def shardings(gang: PlannedGang, specs: Sequence[Any]) -> list[Sharding]:
        if not isinstance(gang.kernel, JaxKernel):
            return [alone] * len(specs)
        mesh = meshes.mesh([device], gang.mesh_shape, gang.axis_names)
        return list(meshes.shardings(mesh, specs))

    first: dict[Source, Sharding] = {}
    made: dict[tuple[int, int], Sharding] = {}
    for gang in segment.gangs:
        kernel = gang.kernel
        jax_kernel = isinstance(kernel, JaxKernel)
        ins = shardings(gang, kernel.in_specs if jax_kernel else gang.inputs)
        outs = shardings(gang, kernel.out_specs if jax_kernel else gang.outputs)
        for i, (src, sharding) in enumerate(zip(gang.inputs, ins, strict=True)):
            source: Source = ("input", src) if src >= 0 else ("made", gang.local[i])
            first.setdefault(source, sharding)
        made.update(((gang.node, o), sharding) for o, sharding in enumerate(outs))
    return [first[s] for s in segment.sources], [made[key] for key in segment.exported]
