"""Values split over a slice's devices: where each shard lies, and its handle.

A :class:`Layout` says how a value is split over the devices of a slice:
the devices in mesh order (row-major over ``mesh_shape``), the mesh's axis
names, and a partition spec, as JAX's ``PartitionSpec`` says it (per
dimension: ``None``, an axis name, or a tuple of them), kept here as a plain
tuple so that nothing below the runtime needs JAX. A
:class:`ShardedHandle` is such a value in the hosts' stores: one
:class:`~atoll.devices.BufferHandle` per device, each that device's shard,
made where the device is (colocated Python, ``docs/colocated.md``). A run
reads it as one array: a JAX gang over the same layout takes the shards as
they are, on their devices; anything else gets them assembled
(:func:`read_whole`, which awaits each read; nothing else here waits).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._values import BufferHandle

__all__ = ["Layout", "ShardedHandle", "normal_spec", "read_whole"]

Index = tuple[slice, ...]


def normal_spec(spec: Any, ndim: int) -> tuple[Any, ...]:
    """``spec`` (a ``PartitionSpec``, a tuple, or None: replicated) as a
    plain tuple of ``ndim`` entries, each None or a tuple of axis names."""
    entries = list(spec) if spec is not None else []
    if len(entries) > ndim:
        raise ValueError(f"partition spec {spec!r} has more entries than {ndim} dimensions")
    out: list[Any] = []
    for entry in [*entries, *[None] * (ndim - len(entries))]:
        if entry is None or entry == ():
            out.append(None)
        else:
            out.append((entry,) if isinstance(entry, str) else tuple(entry))
    return tuple(out)


@dataclass(frozen=True)
class Layout:
    """How a value is split over a slice: see the module docstring."""

    devices: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    spec: tuple[Any, ...]  # normal_spec's form

    def __post_init__(self) -> None:
        if math.prod(self.mesh_shape) != len(self.devices):
            raise ValueError(f"mesh {self.mesh_shape} does not hold {len(self.devices)} devices")
        named = {a for entry in self.spec if entry is not None for a in entry}
        unknown = named - set(self.axis_names)
        if unknown:
            raise ValueError(f"spec names axes {sorted(unknown)} the mesh {self.axis_names} lacks")

    @classmethod
    def of(
        cls,
        devices: Sequence[int],
        mesh_shape: Sequence[int],
        axis_names: Sequence[str],
        spec: Any,
        ndim: int,
    ) -> Layout:
        return cls(tuple(devices), tuple(mesh_shape), tuple(axis_names), normal_spec(spec, ndim))

    def check(self, shape: Sequence[int]) -> None:
        """Refuse a shape whose split dimensions do not divide evenly."""
        for dim, entry in enumerate(self.spec):
            ways = self._ways(entry)
            if shape[dim] % ways:
                raise ValueError(
                    f"dimension {dim} of {tuple(shape)} does not split {ways} ways ({entry})"
                )

    def index(self, shape: Sequence[int], position: int) -> Index:
        """The part of an array of ``shape`` that the device at ``position``
        (in mesh order) holds."""
        coords = dict(
            zip(self.axis_names, np.unravel_index(position, self.mesh_shape), strict=True)
        )
        out = []
        for dim, entry in enumerate(self.spec):
            if entry is None:
                out.append(slice(0, shape[dim]))
                continue
            k = 0
            for axis in entry:  # mixed radix, the first axis major (as JAX's)
                k = k * self.mesh_shape[self.axis_names.index(axis)] + int(coords[axis])
            size = shape[dim] // self._ways(entry)
            out.append(slice(k * size, (k + 1) * size))
        return tuple(out)

    def holders(self, shape: Sequence[int], among: Sequence[int] | None = None) -> list[int]:
        """Per position, the first position that holds the same part (a
        replica's original); ``among``: only those positions, each then
        mapped to the first of them with its part (a host's own copies)."""
        first: dict[tuple[tuple[int, int], ...], int] = {}
        positions = range(len(self.devices)) if among is None else among
        return [first.setdefault(_key(self.index(shape, p)), p) for p in positions]

    def block(self, shape: Sequence[int], positions: Sequence[int]) -> Index:
        """The box the parts at ``positions`` tile exactly (a host's devices'
        parts, say); a ValueError when they do not tile one."""
        parts = {_key(self.index(shape, p)) for p in positions}
        box = tuple(
            slice(min(p[d][0] for p in parts), max(p[d][1] for p in parts))
            for d in range(len(shape))
        )
        covered = sum(math.prod(stop - start for start, stop in p) for p in parts)
        if covered != math.prod(s.stop - s.start for s in box):
            raise ValueError(
                f"the shards of devices at {list(positions)} do not form one block of "
                f"{tuple(shape)} under {self.spec}"
            )
        return box

    def _ways(self, entry: tuple[str, ...] | None) -> int:
        if entry is None:
            return 1
        return math.prod(self.mesh_shape[self.axis_names.index(a)] for a in entry)


def _key(index: Index) -> tuple[tuple[int, int], ...]:
    """An index as something hashable (slices are not, before Python 3.12)."""
    return tuple((s.start, s.stop) for s in index)


@dataclass(frozen=True)
class ShardedHandle:
    """A value split over a slice's devices, one handle per device in
    ``layout.devices`` order (see the module docstring)."""

    parts: tuple[BufferHandle, ...]
    layout: Layout
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if len(self.parts) != len(self.layout.devices):
            raise ValueError(f"{len(self.parts)} parts for {len(self.layout.devices)} devices")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def distinct(self, near: int | None = None) -> list[tuple[Index, BufferHandle]]:
        """The parts that differ (replicas skipped), with where each lies;
        of a part's copies, one on host ``near`` where there is one."""
        mine = [p for p, part in enumerate(self.parts) if part.host_id == near]
        others = [p for p in range(len(self.parts)) if p not in mine]
        chosen = set(self.layout.holders(self.shape, mine + others))
        return [(self.layout.index(self.shape, p), self.parts[p]) for p in sorted(chosen)]


async def read_whole(
    handle: ShardedHandle,
    read: Callable[[BufferHandle], Awaitable[Any]],
    near: int | None = None,
) -> np.ndarray:
    """The whole array of a sharded value: each distinct part read with
    ``read`` (the copy on host ``near``, where it has one) and put in place."""
    out = np.empty(handle.shape, np.dtype(handle.dtype))
    for index, part in handle.distinct(near):
        out[index] = np.asarray(await read(part))
    return out
