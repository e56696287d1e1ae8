"""References to arrays on the cluster, as a client hands them out.

An :class:`ArrayRef` is a value that lives (or will live) in a host's store:
a promise of its handle, and its aval. A :class:`ShardedRef` is one split
over a slice's devices, a shard on each (colocated Python,
``runtime/client/colocated.py``). Both pass into runs as they are, before
they exist. Nothing here is asynchronous.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...devices import Aval, BufferHandle
from ...devices._shards import Layout, ShardedHandle
from ...kernel import Promise, when_settled

__all__ = ["ArrayRef", "ShardedRef"]


class ArrayRef:
    """A value that lives (or will live) on the cluster: a handle's promise and an aval.

    Pass it to another ``run`` to chain without fetching; ``await
    client.fetch(ref)`` reads it.
    """

    __slots__ = ("aval", "promise")

    def __init__(self, promise: Promise[BufferHandle], aval: Aval) -> None:
        self.promise = promise
        self.aval = aval

    @property
    def shape(self) -> tuple[int, ...]:
        return self.aval.shape

    def __repr__(self) -> str:
        return f"ArrayRef({self.aval.shape}, {self.aval.dtype}, {self.promise!r})"


class ShardedRef(ArrayRef):
    """An array split over a slice's devices, each shard on its device's
    host. Its promise settles with a
    :class:`~atoll.devices._shards.ShardedHandle` once every shard exists;
    ``parts`` are the shards' own promises, in the slice's mesh order."""

    __slots__ = ("layout", "parts")

    def __init__(self, parts: Sequence[Promise[BufferHandle]], aval: Aval, layout: Layout) -> None:
        self.parts = list(parts)
        self.layout = layout
        shards = self.parts

        def whole() -> Any:  # raises the first shard's failure
            return ShardedHandle(tuple(p.result() for p in shards), layout, aval.shape, aval.dtype)

        promise: Promise[Any] = when_settled(shards, whole, "sharded")
        super().__init__(promise, aval)

    def __repr__(self) -> str:
        return f"ShardedRef({self.aval.shape}, {self.aval.dtype}, over {list(self.layout.devices)})"
