"""``@program``: trace a Python function over virtual slices into a dataflow graph.

Inside a program, jitted JAX functions placed on virtual slices
(``slice.jit(fn, in_specs=..., out_specs=...)``) are called on *traced*
values. Each call adds one node (one sharded computation) to a
:class:`~atoll.runtime.graph.Graph`, and a value used on another slice than
the one that made it becomes a transfer edge. Output shapes and dtypes come
from ``jax.eval_shape``: nothing runs while tracing. Traces are cached by the
shapes and dtypes of the arguments, so a program is traced once per
signature.

JAX is imported lazily, so ``import atoll`` stays light.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..devices import Aval, JaxKernel
from ..devices._jax_kernel import fn_key
from ..kernel import AtollError, UsageError
from ..transports.dtypes import dtype_name
from .graph import Graph, GraphBuilder, SliceSpec, ValueRef

__all__ = [
    "NotAProgram",
    "PlacedFunction",
    "Program",
    "Trace",
    "Traced",
    "VirtualSlice",
    "aval_of",
    "program",
]

_TRACE: contextvars.ContextVar[GraphBuilder | None] = contextvars.ContextVar(
    "atoll_trace", default=None
)


class NotAProgram(AtollError, TypeError):
    """``run`` was given something that is neither a Computation, a Program nor
    a placed function."""


@dataclass(frozen=True)
class VirtualSlice(SliceSpec):
    """Virtual devices a client got from the resource manager (no physical ids)."""

    island: int = 0

    def jit(
        self,
        fn: Callable[..., Any],
        *,
        in_specs: Sequence[Any] | None = None,
        out_specs: Any = None,
        name: str | None = None,
    ) -> PlacedFunction:
        """Place ``fn`` on this slice.

        ``in_specs``: one ``PartitionSpec`` (or None: replicated) per positional
        argument, applied to all of its leaves. ``out_specs``: one spec for all
        outputs, or a tuple with one per element of a tuple output.
        """
        return PlacedFunction(fn, self, in_specs, out_specs, name or _name(fn))


class Traced:
    """A value inside a program being traced: its producer and its aval."""

    __slots__ = ("aval", "ref")

    def __init__(self, ref: ValueRef, aval: Aval) -> None:
        self.ref = ref
        self.aval = aval

    @property
    def shape(self) -> tuple[int, ...]:
        return self.aval.shape

    @property
    def dtype(self) -> str:
        return self.aval.dtype

    def __repr__(self) -> str:
        return f"Traced({self.aval.shape}, {self.aval.dtype}, from {self.ref})"


class PlacedFunction:
    """A function placed on a virtual slice; one node each time a program calls it.

    Calling it outside a program is an error; ``client.run(placed, *args)``
    runs it as a one-node program (OpByOp).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        slice_: VirtualSlice,
        in_specs: Sequence[Any] | None,
        out_specs: Any,
        name: str,
    ) -> None:
        self.fn = fn
        self.slice = slice_
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.name = name
        self._program = Program(lambda *args: self(*args), name)

    def as_program(self) -> Program:
        return self._program

    def __call__(self, *args: Any) -> Any:
        builder = _TRACE.get()
        if builder is None:
            raise AtollError(
                f"{self.name} is placed on a virtual slice: call it inside an "
                "@atoll.program, or run it with client.run(f, *args)"
            )
        return _add_node(builder, self, args)


def _add_node(builder: GraphBuilder, placed: PlacedFunction, args: tuple[Any, ...]) -> Any:
    import jax

    leaves, in_tree = jax.tree_util.tree_flatten(args)
    for leaf in leaves:
        if not isinstance(leaf, Traced):
            raise AtollError(
                f"{placed.name}: inside a program, arguments must be program values, "
                f"got {type(leaf).__name__} (close over constants instead)"
            )
    structs = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in leaves]  # type: ignore[no-untyped-call]

    flat = _FlatCall(placed.fn, in_tree)
    out_shape = jax.eval_shape(flat.nested, *structs)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    in_specs, out_specs = _in_specs(placed, args), _out_specs(placed, out_shape)
    _check_divisible(placed, "argument", [t.shape for t in leaves], in_specs)
    _check_divisible(placed, "output", [tuple(s.shape) for s in out_leaves], out_specs)
    kernel = JaxKernel(flat, placed.name, tuple(in_specs), tuple(out_specs))
    avals = [Aval(tuple(s.shape), dtype_name(s.dtype)) for s in out_leaves]
    refs = builder.add(kernel, placed.slice, [t.ref for t in leaves], avals, placed.name)
    return jax.tree_util.tree_unflatten(
        out_tree, [Traced(r, a) for r, a in zip(refs, avals, strict=True)]
    )


@dataclass(frozen=True, eq=False)
class _FlatCall:
    """``fn`` over flat array inputs, returning its flat outputs.

    A plain module-level value (not a closure), so a node's kernel pickles
    and can travel to host processes; equal calls compare equal, which keeps
    compile caches warm across copies: ``fn`` is compared by
    :func:`~atoll.devices._jax_kernel.fn_key`, so a ``functools.partial``
    that comes over the wire again (a new object) still matches.
    """

    fn: Callable[..., Any]
    in_tree: Any  # a jax PyTreeDef

    def _key(self) -> tuple[Any, Any]:
        return fn_key(self.fn), self.in_tree

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _FlatCall) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def nested(self, *xs: Any) -> Any:
        import jax

        return self.fn(*jax.tree_util.tree_unflatten(self.in_tree, xs))

    def __call__(self, *xs: Any) -> list[Any]:
        import jax

        return list(jax.tree_util.tree_leaves(self.nested(*xs)))


def _check_divisible(
    placed: PlacedFunction, what: str, shapes: Sequence[tuple[int, ...]], specs: Sequence[Any]
) -> None:
    """Each sharded dimension must split evenly over its mesh axes: checked
    here, where the shapes are known, not on a host at run time."""
    mesh = dict(zip(placed.slice.axis_names, placed.slice.shape, strict=True))
    for index, (shape, spec) in enumerate(zip(shapes, specs, strict=True)):
        for dim, axes in enumerate(tuple(spec)):
            names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            unknown = [name for name in names if name not in mesh]
            if unknown:
                raise UsageError(
                    f"{placed.name}: {what} {index}'s spec {spec} names mesh axes {unknown}; "
                    f"the slice's mesh has {mesh}"
                )
            ways = 1
            for name in names:
                ways *= mesh[name]
            if dim >= len(shape) or shape[dim] % ways:
                size = shape[dim] if dim < len(shape) else "no such dimension"
                raise UsageError(
                    f"{placed.name}: {what} {index} has shape {shape}; its spec {spec} splits "
                    f"dimension {dim} ({size}) {ways} ways over mesh axes {names} of {mesh}: "
                    f"make that dimension a multiple of {ways} (pad it), or do not shard it"
                )


def _in_specs(placed: PlacedFunction, args: tuple[Any, ...]) -> list[Any]:
    specs = placed.in_specs if placed.in_specs is not None else [None] * len(args)
    if len(specs) != len(args):
        raise AtollError(f"{placed.name}: {len(specs)} in_specs for {len(args)} arguments")
    return _per_leaf(args, specs)


def _out_specs(placed: PlacedFunction, out_shape: Any) -> list[Any]:
    from jax.sharding import PartitionSpec

    spec = placed.out_specs
    if spec is None or isinstance(spec, PartitionSpec):
        return _per_leaf([out_shape], [spec])
    if not isinstance(out_shape, (tuple, list)) or len(out_shape) != len(spec):
        raise AtollError(f"{placed.name}: out_specs must match the output tuple")
    return _per_leaf(out_shape, spec)


def _per_leaf(values: Sequence[Any], specs: Sequence[Any]) -> list[Any]:
    """One spec per pytree leaf: each value's spec (None: replicated) for all its leaves."""
    import jax

    out: list[Any] = []
    for value, spec in zip(values, specs, strict=True):
        n = len(jax.tree_util.tree_leaves(value))
        out.extend([spec if spec is not None else _replicated()] * n)
    return out


@dataclass(frozen=True)
class Trace:
    """A traced program: its graph and the pytree structure of its outputs."""

    graph: Graph
    out_tree: Any


class Program:
    """A function traced into a :class:`Graph` per argument signature."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn = fn
        self.name = name
        self._traces: dict[tuple[Any, ...], Trace] = {}

    def trace(self, avals: Sequence[Aval], in_tree: Any) -> Trace:
        """The graph for these input avals (traced once, then cached)."""
        import jax

        key = (in_tree, tuple(avals))
        cached = self._traces.get(key)
        if cached is not None:
            return cached
        builder = GraphBuilder()
        inputs = [Traced(builder.input(a), a) for a in avals]
        token = _TRACE.set(builder)
        try:
            result = self.fn(*jax.tree_util.tree_unflatten(in_tree, inputs))
        finally:
            _TRACE.reset(token)
        leaves, out_tree = jax.tree_util.tree_flatten(result)
        if not all(isinstance(leaf, Traced) for leaf in leaves):
            raise AtollError(f"program {self.name} must return program values only")
        trace = Trace(builder.build([leaf.ref for leaf in leaves]), out_tree)
        self._traces[key] = trace
        return trace

    def __call__(self, *args: Any) -> Any:
        raise AtollError(f"run a program with client.run({self.name}, *args)")


def program(fn: Callable[..., Any]) -> Program:
    """Decorator: make ``fn`` a program that ``client.run`` dispatches as a whole."""
    return Program(fn, _name(fn))


def aval_of(value: Any) -> Aval:
    """The aval of an array-like (numpy, JAX, scalar, or anything with one)."""
    aval = getattr(value, "aval", None)
    if isinstance(aval, Aval):
        return aval
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return Aval(tuple(value.shape), dtype_name(value.dtype))
    import numpy as np

    array = np.asarray(value)
    return Aval(tuple(array.shape), dtype_name(array.dtype))


def _replicated() -> Any:
    from jax.sharding import PartitionSpec

    return PartitionSpec()  # type: ignore[no-untyped-call]


def _name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__name__", type(fn).__name__))
