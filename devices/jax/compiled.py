"""What a JAX device compiles and builds once: its executables and its meshes.

Every way work reaches a :class:`~atoll.devices.jax.JaxDevice` (a plain
computation, a gang's kernel over its mesh, a fused segment of a plan)
ends in an XLA executable, compiled the first time its key is seen: one
:class:`Executables` cache holds them all, each under a key that says
what was compiled (the function, the mesh, the inputs' shapes and
dtypes), and counts the compilations. The meshes those run over, and the
shardings on them, come from one :class:`Meshes`.

Nothing here is asynchronous; compiling blocks the caller (the device
compiles on its loop, the first time only).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

__all__ = ["Executable", "Executables", "Meshes"]


@dataclass(frozen=True, slots=True)
class Executable:
    """A compiled computation, with what its outputs will be (shape, dtype
    name, bytes each, and in all), known before it runs."""

    compiled: Any
    outputs: tuple[tuple[tuple[int, ...], str, int], ...]
    nbytes: int

    @classmethod
    def of(cls, compiled: Any) -> Executable:
        outputs = tuple(
            (tuple(x.shape), str(x.dtype), int(np.prod(x.shape, dtype=np.int64)) * x.dtype.itemsize)
            for x in jax.tree_util.tree_leaves(compiled.out_info)
        )
        return cls(compiled, outputs, sum(n for *_, n in outputs))

    def __call__(self, *arrays: Any) -> Any:
        return self.compiled(*arrays)


class Executables:
    """A device's executables by key, the ``kept`` most recently compiled.

    ``hold``: objects kept alive with an executable, when its key names them
    by id (a fused segment's kernels), so that an id in a key is never
    another object's while the entry lives."""

    def __init__(self, kept: int = 1024) -> None:
        self._kept = kept
        self._found: dict[Hashable, tuple[Any, Executable]] = {}
        self.compilations = 0

    def get(self, key: Hashable, lower: Callable[[], Any], hold: Any = None) -> Executable:
        """The executable under ``key``; on first use, ``lower()`` (a lowered
        JAX computation) compiled."""
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = (hold, Executable.of(lower().compile()))
            self.compilations += 1
            while len(self._found) > self._kept:
                del self._found[next(iter(self._found))]
        return found[1]

    def __len__(self) -> int:
        return len(self._found)


class Meshes:
    """The meshes a device's gangs run over, and shardings on them, each built once."""

    def __init__(self) -> None:
        self._meshes: dict[tuple[Any, ...], Mesh] = {}
        self._shardings: dict[tuple[Any, ...], list[NamedSharding]] = {}

    def mesh(
        self, devices: Sequence[jax.Device], shape: tuple[int, ...], axes: tuple[str, ...]
    ) -> Mesh:
        """``devices`` laid out as ``shape``, named ``axes``."""
        key = (tuple(d.id for d in devices), shape, axes)
        found = self._meshes.get(key)
        if found is None:
            found = self._meshes[key] = Mesh(np.array(devices).reshape(shape), axes)
        return found

    def shardings(self, mesh: Mesh, specs: Sequence[Any]) -> list[NamedSharding]:
        """One sharding over ``mesh`` per partition spec in ``specs``."""
        key = (mesh, tuple(specs))
        found = self._shardings.get(key)
        if found is None:
            found = self._shardings[key] = [NamedSharding(mesh, spec) for spec in specs]
        return found
