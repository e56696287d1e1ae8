"""Colocated functions, the client's side: ``@atoll.colocated`` and ``ShardedRef``.

A :class:`ColocatedFunction` is a Python function that runs on the hosts of
a slice, beside their devices (``docs/colocated.md``):
``cluster.colocated(fn, slice_, *args)`` sends it to every host that holds
a device of the slice; each host gives it its own block of each array
argument and keeps its block of each output as shards on its devices
(``devices/_colocated.py``). What comes back at once is a
:class:`ShardedRef` per output: an :class:`~atoll.ArrayRef` whose value is
split over the slice, which runs read like any other (a JAX program over the
same slice, reading it with the same partition spec, takes each shard where
it is). No byte of the arrays passes through the client.

What is asynchronous: the call returns once the hosts have the call, not
once it ran; the outputs' promises settle when the hosts stored them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

from ...devices import Aval, BufferHandle
from ...devices._colocated import ArrayArg, ColocatedCall
from ...devices._shards import Layout, normal_spec
from ...kernel import Promise, UsageError, then
from ..tracing import VirtualSlice, aval_of
from .refs import ArrayRef, ShardedRef

if TYPE_CHECKING:
    from .client import Cluster

__all__ = ["ColocatedFunction", "colocated", "dispatch"]

# an output's global aval (anything with shape and dtype), a sequence of
# them, or a function of the arguments (arrays as their avals) to those
Out = Any


@dataclass(frozen=True)
class ColocatedFunction:
    """A function for ``cluster.colocated``: see :func:`colocated`."""

    fn: Callable[..., Any]
    out: Out
    in_specs: Sequence[Any] | None = None
    out_specs: Any = None
    name: str = ""

    @functools.cached_property
    def takes_shard(self) -> bool:
        """Whether ``fn`` has a parameter named ``shard`` (where it runs)."""
        try:
            return "shard" in inspect.signature(self.fn).parameters
        except (TypeError, ValueError):
            return False

    def avals(self, args: Sequence[Any]) -> list[Aval]:
        """The outputs' global avals, for these arguments."""
        out = (
            self.out(*[a.aval if isinstance(a, ArrayRef) else a for a in args])
            if callable(self.out)
            else self.out
        )
        many = isinstance(out, (list, tuple))
        return [aval_of(o) for o in (out if many else [out])]

    def specs(self, count: int, slice_: VirtualSlice) -> list[Any]:
        """One partition spec per output (default: split the first
        dimension along the slice's first axis)."""
        if self.out_specs is None:
            return [(slice_.axis_names[0],)] * count
        if type(self.out_specs) in (list, tuple):  # one per output (a PartitionSpec is one)
            if len(self.out_specs) != count:
                raise UsageError(
                    f"{self.name}: {len(self.out_specs)} out_specs for {count} outputs"
                )
            return list(self.out_specs)
        return [self.out_specs] * count


@overload
def colocated(
    fn: Callable[..., Any],
    *,
    out: Out,
    in_specs: Sequence[Any] | None = ...,
    out_specs: Any = ...,
    name: str | None = ...,
) -> ColocatedFunction: ...


@overload
def colocated(
    fn: None = ...,
    *,
    out: Out,
    in_specs: Sequence[Any] | None = ...,
    out_specs: Any = ...,
    name: str | None = ...,
) -> Callable[[Callable[..., Any]], ColocatedFunction]: ...


def colocated(
    fn: Callable[..., Any] | None = None,
    *,
    out: Out,
    in_specs: Sequence[Any] | None = None,
    out_specs: Any = None,
    name: str | None = None,
) -> ColocatedFunction | Callable[[Callable[..., Any]], ColocatedFunction]:
    """Make ``fn`` a function to run on each host of a slice
    (``cluster.colocated(fn, slice_, *args)``; ``docs/colocated.md``).

    ``out``: each output's global shape and dtype (anything with ``shape``
    and ``dtype``: ``jax.ShapeDtypeStruct``, an ``Aval``, an array), one or
    a tuple of them, or a function of the arguments (array arguments as
    their avals) to that. ``out_specs``: how each output splits over the
    slice, a ``PartitionSpec`` for all or a tuple of one per output
    (default: the first dimension along the slice's first axis). ``in_specs``:
    per positional argument, how a host reads an array argument (default: a
    value made by ``colocated`` over the same slice as it is split; any
    other array whole). ``fn`` gets each array argument as this host's
    block (numpy), any other argument as it was given, and, when it has a
    parameter named ``shard``, a :class:`~atoll.devices.Shard` saying where
    it runs; it returns this host's block of each output (numpy or JAX
    arrays). A plain function runs on a worker thread of the host's
    process; an ``async`` one on its event loop, where it may await the
    session's actors on that host (pass their references as an argument).
    """

    def wrap(f: Callable[..., Any]) -> ColocatedFunction:
        label = name or str(getattr(f, "__name__", type(f).__name__))
        return ColocatedFunction(f, out, in_specs, out_specs, label)

    return wrap if fn is None else wrap(fn)


def prepare(
    function: ColocatedFunction,
    slice_: VirtualSlice,
    devices: Sequence[int],
    hosts: Sequence[int],
    args: Sequence[Any],
) -> tuple[ColocatedCall, list[Any], list[Layout], list[Aval]]:
    """The call every host runs, the values sent beside it, and each
    output's layout and aval."""
    if function.in_specs is not None and len(function.in_specs) != len(args):
        raise UsageError(
            f"{function.name}: {len(function.in_specs)} in_specs for {len(args)} arguments"
        )
    arrays: list[ArrayArg | None] = []
    values: list[Any] = []
    for i, arg in enumerate(args):
        if not isinstance(arg, ArrayRef):
            arrays.append(None)
            values.append(arg)
            continue
        given = (
            function.in_specs[i] if function.in_specs is not None else _default_spec(arg, devices)
        )
        spec = normal_spec(given, len(arg.aval.shape))
        Layout(tuple(devices), slice_.shape, slice_.axis_names, spec).check(arg.aval.shape)
        arrays.append(ArrayArg(spec, arg.aval.shape, arg.aval.dtype))
        values.append(arg.promise)
    avals = function.avals(args)
    layouts = []
    outputs = []
    for aval, given in zip(avals, function.specs(len(avals), slice_), strict=True):
        layout = Layout.of(devices, slice_.shape, slice_.axis_names, given, len(aval.shape))
        try:
            layout.check(aval.shape)
        except ValueError as exc:
            raise UsageError(f"{function.name}: output {aval.shape}: {exc}") from None
        layouts.append(layout)
        outputs.append(ArrayArg(layout.spec, aval.shape, aval.dtype))
    call = ColocatedCall(
        function.fn,
        function.name,
        tuple(devices),
        slice_.shape,
        slice_.axis_names,
        tuple(arrays),
        tuple(outputs),
        tuple(hosts),
        function.takes_shard,
    )
    return call, values, layouts, avals


def _default_spec(arg: ArrayRef, devices: Sequence[int]) -> Any:
    """A value split over these devices is read as it is split; any other whole."""
    if isinstance(arg, ShardedRef) and arg.layout.devices == tuple(devices):
        return arg.layout.spec
    return None


async def dispatch(
    cluster: Cluster, function: ColocatedFunction, slice_: VirtualSlice, args: Sequence[Any]
) -> list[ShardedRef]:
    """``cluster.colocated``: send the call to each host of the slice; the
    outputs' references, at once."""
    if not isinstance(function, ColocatedFunction):
        raise UsageError(
            f"colocated takes a function made with @atoll.colocated(out=...), not {function!r}"
        )
    devices: tuple[int, ...] = await cluster.controller.slice_devices(
        slice_.slice_id, cluster.owner
    )
    host_of = {d: cluster.topology.device(d).host for d in devices}
    hosts = list(dict.fromkeys(host_of.values()))
    call, values, layouts, avals = prepare(function, slice_, devices, hosts, args)
    shards: dict[tuple[int, int], Promise[BufferHandle]] = {}  # (output, position)
    for host in hosts:  # each host's shards are this client's from its call on
        answer = (await cluster.host_link(host)).run_colocated(call, values, cluster.owner)
        for p, d in enumerate(devices):
            if host_of[d] == host:
                shards.update(
                    ((o, p), cluster.track(_shard(answer, o, p))) for o in range(len(avals))
                )
    return [
        ShardedRef([shards[o, p] for p in range(len(devices))], aval, layout)
        for o, (layout, aval) in enumerate(zip(layouts, avals, strict=True))
    ]


def _shard(answer: Promise[Any], output: int, position: int) -> Promise[BufferHandle]:
    """The handle of shard ``position`` of output ``output``, from its host's answer."""
    return then(answer, lambda made: dict(made[output])[position], "shard")
