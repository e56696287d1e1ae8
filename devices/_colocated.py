"""Colocated functions: a user's Python on each host of a slice, over its shards.

``cluster.colocated(fn, slice_, *args)`` (``runtime/client/colocated.py``)
sends one :class:`ColocatedCall` to every host that holds a device of the
slice. Each host runs it here: it reads its own block of each array
argument (the shards of its devices, put together; a value split the same
way is read from this host's store alone, so no byte crosses hosts, and none
passes through the client), calls the function (a plain one on a worker
thread; an ``async`` one on the host's event loop, where it may await calls
to the session's actors on this host), and
stores its block of each output as one buffer per device of the slice on
this host: the shards of a :class:`~atoll.devices._shards.ShardedHandle`
that runs read like any value.

What is asynchronous: inputs are awaited here, each once it exists (a
run's output may still be computing), so a colocated call that reads a
run's output waits for it; the call's answer (the outputs' handles) comes
once they are stored, so a run that reads them waits for that. The host
answers other calls meanwhile (its message loop never waits for this).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import numpy as np

from ..kernel import ActorRef, Promise, UsageError
from ._shards import Index, Layout, ShardedHandle, read_whole
from ._values import BufferHandle

__all__ = ["ArrayArg", "ColocatedCall", "HostBlocks", "Shard", "run_on_host"]


@dataclass(frozen=True)
class Shard:
    """What a colocated function may ask about where it runs (a parameter
    named ``shard``): this host, its place among the slice's hosts, its
    devices of the slice, and the block of each output it makes
    (``blocks[i]``: one ``slice`` per dimension)."""

    host_id: int
    position: int
    devices: tuple[int, ...]
    blocks: tuple[Index, ...]


@dataclass(frozen=True)
class ArrayArg:
    """An argument that is an array on the cluster: each host reads its block
    of it under ``spec`` (over the call's slice)."""

    spec: tuple[Any, ...]
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ColocatedCall:
    """One colocated function call, as every host of the slice runs it.

    ``arrays``: per positional argument, an :class:`ArrayArg` where it is an
    array on the cluster (its value comes beside, as a handle), else None
    (the value itself, as it was given). ``outputs``: each output's global
    shape, dtype and spec. ``hosts``: the slice's hosts in order.
    """

    fn: Callable[..., Any]
    name: str
    devices: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    arrays: tuple[ArrayArg | None, ...]
    outputs: tuple[ArrayArg, ...]
    hosts: tuple[int, ...] = field(default=())
    takes_shard: bool = False  # ``fn`` has a parameter named ``shard``

    def layout(self, spec: tuple[Any, ...]) -> Layout:
        return Layout(self.devices, self.mesh_shape, self.axis_names, spec)


class HostBlocks(Protocol):
    """What :func:`run_on_host` needs of its host (``Host`` is one)."""

    host_id: int
    device_ids: list[int]

    async def bytes_of(self, handle: BufferHandle, owner: str) -> np.ndarray:
        """A buffer's bytes, once it exists: from this host's store, or its holder."""
        ...

    async def store_shard(self, array: np.ndarray, owner: str, device: int) -> BufferHandle:
        """Keep ``array`` as a buffer of ``device`` here, for ``owner``; its
        handle carries no value (it is read where it is)."""
        ...

    def drop_shard(self, handle: BufferHandle) -> None:
        """Free a shard :meth:`store_shard` kept (its call failed after)."""
        ...


async def run_on_host(
    host: HostBlocks, call: ColocatedCall, args: Sequence[Any], owner: str
) -> list[list[tuple[int, BufferHandle]]]:
    """This host's part of ``call``: per output, ``(position, handle)`` for
    each device of the slice here (position: its place in the slice)."""
    mine = [p for p, d in enumerate(call.devices) if d in host.device_ids]
    if not mine:
        raise UsageError(f"host {host.host_id} holds no device of the slice {list(call.devices)}")
    values = [
        await _block(host, call, spec, value, mine, owner) if spec is not None else value
        for spec, value in zip(call.arrays, args, strict=True)
    ]
    boxes = [call.layout(out.spec).block(out.shape, mine) for out in call.outputs]
    kwargs: dict[str, Any] = {}
    if call.takes_shard:
        where = call.hosts.index(host.host_id) if host.host_id in call.hosts else 0
        devices = tuple(call.devices[p] for p in mine)
        kwargs["shard"] = Shard(host.host_id, where, devices, tuple(boxes))
    if inspect.iscoroutinefunction(call.fn):  # on this loop: it may await the session's actors
        made = await call.fn(*values, **kwargs)
    else:
        _refuse_references(call, values)
        made = await anyio.to_thread.run_sync(_called, call.fn, values, kwargs)
    blocks = _checked(call, made, boxes)
    kept: list[BufferHandle] = []  # so far: a failure part way frees them
    try:
        return [
            await _stored(host, call, out, block, box, mine, owner, kept)
            for out, block, box in zip(call.outputs, blocks, boxes, strict=True)
        ]
    except BaseException:
        for shard in kept:
            host.drop_shard(shard)  # nobody will ever hold a reference to it
        raise


def _refuse_references(call: ColocatedCall, values: Sequence[Any]) -> None:
    """A plain function runs on a worker thread, where no reference to an
    actor (a Cap'n Proto object, over host processes) may be touched."""
    for value in values:
        inside = value.values() if isinstance(value, dict) else value
        if not isinstance(value, (dict, list, tuple)):
            inside = [value]
        if any(isinstance(v, (ActorRef, Promise, BufferHandle)) for v in inside):
            raise UsageError(
                f"{call.name} runs on a worker thread: it cannot take actor references, "
                "promises or handles; make it an async function (it then runs on the "
                "host's event loop, where it may call the session's actors)"
            )


def _called(fn: Callable[..., Any], values: list[Any], kwargs: dict[str, Any]) -> Any:
    return fn(*values, **kwargs)


def _checked(call: ColocatedCall, made: Any, boxes: list[Index]) -> list[np.ndarray]:
    """The function's outputs as host arrays, each its host's block."""
    outs = list(made) if len(call.outputs) > 1 or isinstance(made, list) else [made]
    if len(outs) != len(call.outputs):
        raise UsageError(f"{call.name} returned {len(outs)} outputs, not {len(call.outputs)}")
    arrays = []
    for i, (out, spec, box) in enumerate(zip(outs, call.outputs, boxes, strict=True)):
        array = np.asarray(out)
        want = tuple(s.stop - s.start for s in box)
        if array.shape != want or str(array.dtype) != spec.dtype:
            raise UsageError(
                f"{call.name}: output {i} here must be {want} {spec.dtype} (this host's block "
                f"of {spec.shape}), not {array.shape} {array.dtype}"
            )
        arrays.append(array)
    return arrays


async def _block(
    host: HostBlocks,
    call: ColocatedCall,
    arg: ArrayArg,
    value: Any,
    mine: list[int],
    owner: str,
) -> np.ndarray:
    """This host's block of an array argument: from its own shards when the
    value is split as the call reads it, else cut from the whole."""
    layout = call.layout(arg.spec)
    box = layout.block(arg.shape, mine)
    if isinstance(value, ShardedHandle) and value.layout == layout:
        out = np.empty(tuple(s.stop - s.start for s in box), np.dtype(arg.dtype))
        for p in sorted(set(layout.holders(arg.shape, mine))):  # this host's own copies
            out[_within(layout.index(arg.shape, p), box)] = await host.bytes_of(
                value.parts[p], owner
            )
        return out
    whole = await _whole(host, value, owner)
    return np.ascontiguousarray(whole[box])


async def _whole(host: HostBlocks, value: Any, owner: str) -> np.ndarray:
    if isinstance(value, ShardedHandle):
        return await read_whole(value, lambda part: host.bytes_of(part, owner), host.host_id)
    if isinstance(value, BufferHandle):
        return await host.bytes_of(value, owner)
    return np.asarray(value)


async def _stored(
    host: HostBlocks,
    call: ColocatedCall,
    out: ArrayArg,
    block: np.ndarray,
    box: Index,
    mine: list[int],
    owner: str,
    kept: list[BufferHandle],
) -> list[tuple[int, BufferHandle]]:
    """One output's shards of this host's devices, each a buffer of its
    device (also added to ``kept``), and each a copy: the function may fill
    the same array again for its next call (a loader's buffer)."""
    layout = call.layout(out.spec)
    stored = []
    for p in mine:
        shard = np.array(block[_within(layout.index(out.shape, p), box)], order="C", copy=True)
        handle = await host.store_shard(shard, owner, call.devices[p])
        kept.append(handle)
        stored.append((p, handle))
    return stored


def _within(index: Index, box: Index) -> Index:
    """``index`` counted from the corner of ``box``, which holds it."""
    return tuple(
        slice(i.start - b.start, i.stop - b.start) for i, b in zip(index, box, strict=True)
    )
