"""``from_jax``: trace a JAX function through its jaxpr, by shapes only, and coarsen it.

Coarsening rules, applied in program order:

- matmuls (``dot_general``), convolutions, embedding lookups (a ``gather`` from
  a weight) and control flow (``scan``, ``while``, ``cond``) start a new node;
  a matmul between two activations is kind ``attention``;
- a reduction starts a new node unless its input already sits in one (so a
  softmax or a layer norm becomes one node, renamed ``softmax`` / ``norm``);
- an elementwise or shape op with one activation input fuses into its producer;
  with several, it fuses into the newest producer when the others feed that
  producer directly (``x - mean(x)``), and otherwise starts a node: that is a
  residual ``add``;
- ops on weights and constants alone (a reshape of a weight, ``iota``) are free.

Weights are the arguments named by ``weight_argnums``; their bytes count on the
first node that reads them. Other arguments become ``input`` nodes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._errors import GraphError
from ._graph import Op, OpGraph

__all__ = ["from_jax"]

CONTROL_FLOW = {"scan", "while", "cond"}  # opaque: costed by their bodies
ANCHORS = {"dot_general", "conv_general_dilated", *CONTROL_FLOW}
REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"}
FREE = {
    "reshape",
    "transpose",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "convert_element_type",
    "slice",
    "stop_gradient",
    "copy",
    "copy_p",
    "iota",
    "rev",
}
INLINE = {
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "remat",
    "checkpoint",
    "remat2",
}


@dataclass
class _Group:
    kind: str
    flops: float = 0.0
    weight_bytes: float = 0.0
    prims: set[str] = field(default_factory=set)
    preds: set[int] = field(default_factory=set)
    outputs: set[int] = field(default_factory=set)


@dataclass
class _State:
    """Where each traced value lives: a group (activation), a weight root or a constant."""

    nbytes: list[float] = field(default_factory=list)
    group: dict[int, int] = field(default_factory=dict)
    weight: dict[int, int] = field(default_factory=dict)
    claimed: set[int] = field(default_factory=set)
    alias: dict[int, int] = field(default_factory=dict)
    groups: list[_Group] = field(default_factory=list)
    edges: dict[tuple[int, int], set[int]] = field(default_factory=dict)

    def new_value(self, aval: Any) -> int:
        size = math.prod(getattr(aval, "shape", ())) * aval.dtype.itemsize
        self.nbytes.append(float(size))
        return len(self.nbytes) - 1


def _flops(eqn: Any) -> float:
    name = eqn.primitive.name
    outs = sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        shape = eqn.invars[0].aval.shape
        return float(2.0 * outs * math.prod(shape[d] for d in lhs_contract))
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        out_feat = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
        return float(2.0 * outs * math.prod(rhs) / max(out_feat, 1))
    if name in REDUCTIONS:
        return float(math.prod(eqn.invars[0].aval.shape))
    if name in FREE:
        return 0.0
    return float(outs)


def _sub_jaxpr(eqn: Any) -> tuple[Any, list[Any]] | None:
    """The jaxpr to inline for call-like primitives, with its constants."""
    from jax.extend import core as jc

    if eqn.primitive.name not in INLINE:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if isinstance(sub, jc.ClosedJaxpr):
            return sub.jaxpr, list(sub.consts)
        if isinstance(sub, jc.Jaxpr):
            return sub, []
    return None


def _inner_flops(eqn: Any) -> float:
    """FLOPs of an opaque control-flow op: its body, times the trip count if known."""
    from jax.extend import core as jc

    total = 0.0
    for sub in eqn.params.values():
        for j in sub if isinstance(sub, tuple) else (sub,):
            inner = j.jaxpr if isinstance(j, jc.ClosedJaxpr) else j
            if isinstance(inner, jc.Jaxpr):
                total += sum(_flops(e) for e in inner.eqns)
    return total * float(eqn.params.get("length", 1))


def _target(st: _State, eqn: Any, acts: list[int], has_weight: bool) -> int:
    """Pick (or create) the group that ``eqn`` joins."""
    name = eqn.primitive.name
    newest = max(acts)
    if name in ANCHORS or (name == "gather" and has_weight):
        kind = {
            "dot_general": "matmul" if has_weight else "attention",
            "conv_general_dilated": "conv",
            "gather": "embed",
        }.get(name, name)
    elif name in REDUCTIONS:
        if len(acts) == 1 and st.groups[newest].kind == "reduce":
            return newest
        kind = "reduce"
    elif len(acts) == 1 or all(g in st.groups[newest].preds for g in acts if g != newest):
        return newest
    else:
        kind = "add" if name in ("add", "sub") else "elementwise"
    st.groups.append(_Group(kind))
    return len(st.groups) - 1


def _apply(st: _State, eqn: Any, ins: list[int | None]) -> list[int | None]:
    """Place one equation; returns the value ids of its outputs."""
    outs: list[int | None] = [st.new_value(v.aval) for v in eqn.outvars]
    acts = sorted({st.group[v] for v in ins if v is not None and v in st.group})
    roots = {st.weight[v] for v in ins if v is not None and v in st.weight}
    if not acts:  # weights and constants only: free, and still a weight if it came from one
        for o in outs:
            if roots and o is not None:
                st.weight[o] = min(roots)
        return outs
    g = _target(st, eqn, acts, bool(roots))
    grp = st.groups[g]
    grp.prims.add(eqn.primitive.name)
    opaque = eqn.primitive.name in CONTROL_FLOW
    grp.flops += _inner_flops(eqn) if opaque else _flops(eqn)
    for r in roots - st.claimed:
        st.claimed.add(r)
        grp.weight_bytes += st.nbytes[r]
    for v in ins:
        if v is not None and v in st.group and st.group[v] != g:
            src, tensor = st.group[v], st.alias.get(v, v)
            grp.preds.add(src)
            st.groups[src].outputs.add(tensor)
            st.edges.setdefault((src, g), set()).add(tensor)
    for o in outs:
        if o is not None:
            st.group[o] = g
    if eqn.primitive.name in FREE and len(acts) == 1 and len(outs) == 1:
        first = next(v for v in ins if v is not None and v in st.group)
        if outs[0] is not None:  # a cast or reshape is the same tensor on the wire
            st.alias[outs[0]] = st.alias.get(first, first)
    return outs


def _walk(st: _State, jaxpr: Any, env: dict[Any, int | None]) -> None:
    from jax.extend import core as jc

    def read(v: Any) -> int | None:
        return None if isinstance(v, jc.Literal) else env.get(v)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = _sub_jaxpr(eqn)
        if sub is not None:
            inner, consts = sub
            inner_env: dict[Any, int | None] = {v: None for v in inner.constvars[: len(consts)]}
            inner_env.update(zip(inner.invars, ins, strict=False))
            _walk(st, inner, inner_env)
            for outer, v in zip(eqn.outvars, inner.outvars, strict=True):
                env[outer] = None if isinstance(v, jc.Literal) else inner_env.get(v)
            continue
        env.update(zip(eqn.outvars, _apply(st, eqn, ins), strict=True))


def _kind(g: _Group) -> str:
    if g.kind == "reduce":
        return "norm" if "rsqrt" in g.prims else "softmax" if "exp" in g.prims else "reduce"
    return g.kind


def from_jax(
    fn: Callable[..., Any],
    *example_args: Any,
    weight_argnums: Sequence[int] | None = None,
    name: str | None = None,
) -> OpGraph:
    """Trace ``fn(*example_args)`` by shapes and coarsen its jaxpr into a :class:`OpGraph`.

    ``example_args`` may be arrays or ``jax.ShapeDtypeStruct`` pytrees: nothing
    is computed and no weights need exist. Arguments whose index is in
    ``weight_argnums`` hold weights (resident in SRAM); the others are inputs.
    By default the first argument holds the weights when ``fn`` takes more
    than one (``fn(params, x)``, as JAX models are written), and none does
    when it takes one; ``weight_argnums=()`` says there are none.
    """
    import jax

    weight_argnums = _weight_argnums(weight_argnums, len(example_args))
    closed = jax.make_jaxpr(fn)(*example_args)
    st = _State()
    env: dict[Any, int | None] = {v: None for v in closed.jaxpr.constvars}
    flat_args = [jax.tree_util.tree_leaves(a) for a in example_args]
    invars = iter(closed.jaxpr.invars)
    for argnum, leaves in enumerate(flat_args):
        for _ in leaves:
            var = next(invars)
            vid = st.new_value(var.aval)
            env[var] = vid
            if argnum in weight_argnums:
                st.weight[vid] = vid
            else:
                st.groups.append(_Group("input"))
                st.group[vid] = len(st.groups) - 1
    _walk(st, closed.jaxpr, env)
    for v in closed.jaxpr.outvars:
        out = env.get(v)
        if out is not None and out in st.group:
            st.groups[st.group[out]].outputs.add(st.alias.get(out, out))
    return _to_graph(st, str(name or getattr(fn, "__name__", "jax")))


def _weight_argnums(given: Sequence[int] | None, count: int) -> tuple[int, ...]:
    """The indices of the arguments that hold weights (see :func:`from_jax`)."""
    if given is None:
        return (0,) if count > 1 else ()
    argnums = tuple(given)
    if not all(isinstance(i, int) and -count <= i < count for i in argnums):
        raise GraphError(
            f"weight_argnums {argnums} name no argument: from_jax was given {count} "
            f"example argument(s)"
        )
    return tuple(i % count for i in argnums)


def _to_graph(st: _State, name: str) -> OpGraph:
    nodes = [
        Op(
            name=f"{i}:{_kind(g)}",
            kind=_kind(g),
            flops=g.flops,
            weight_bytes=g.weight_bytes,
            output_bytes=sum(st.nbytes[v] for v in g.outputs),
        )
        for i, g in enumerate(st.groups)
    ]
    edges = [(s, d, sum(st.nbytes[v] for v in vs)) for (s, d), vs in st.edges.items()]
    return OpGraph.build(name, nodes, edges)
