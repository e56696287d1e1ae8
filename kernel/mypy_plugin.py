"""A mypy plugin that types actor calls: ``ref.method`` as ``EndpointRef[P, R]``.

``ActorRef.__getattr__`` serves every endpoint, so without help mypy sees
``ref.method`` as ``EndpointRef[..., Any]`` and checks no call. With this
plugin (``plugins = ["atoll.kernel.mypy_plugin"]`` in mypy's configuration),
on an ``ActorRef[SomeActor]``:

* ``ref.method`` is ``EndpointRef[P, R]``: ``P`` are the method's parameters
  (less ``self``) and ``R`` what the call's promise gives: the method's
  return value, a coroutine's result, or a returned promise's value. So
  ``ref.method(x)`` is ``Promise[R]`` and its arguments are checked.
* An endpoint that resolves its arguments (the default) accepts a promise
  wherever it takes a value, and sequences and mappings with promises in
  them, as the runtime awaits them before the method runs
  (``Promise[T]`` for ``T``, ``Sequence[...]`` for ``list``, ``Mapping`` for
  ``dict``, element by element). ``@endpoint(resolve_args=False)`` takes its
  parameters as written.
* A name that is not an endpoint of the actor's class (missing, or a method
  that neither it nor a base marks ``@endpoint``) is an error. As at run
  time, an override without the decorator stays an endpoint when a base
  marks it.

Where it is loose: a ``list`` parameter is taken as a ``Sequence`` (and a
``dict`` as a ``Mapping``), so a tuple passes where a list is declared. It
keeps the untyped ``EndpointRef[..., Any]`` for a reference whose actor type
is ``Any`` or a type variable, and for generic or overloaded endpoints; it
knows ``endpoint`` by that name only (not under an alias). This module is for
mypy only: it imports mypy, and nothing in atoll imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from mypy.nodes import (
    CallExpr,
    Decorator,
    Expression,
    NameExpr,
    OverloadedFuncDef,
    RefExpr,
    TypeInfo,
)
from mypy.plugin import AttributeContext, ClassDefContext, Plugin
from mypy.subtypes import find_member
from mypy.types import (
    AnyType,
    CallableType,
    Instance,
    Parameters,
    TupleType,
    Type,
    UnionType,
    get_proper_type,
)

__all__ = ["plugin"]

_KERNEL = "atoll.kernel"
ACTOR = f"{_KERNEL}._actor.Actor"
ACTOR_REF = f"{_KERNEL}._actor.ActorRef"
ENDPOINT_REF = f"{_KERNEL}._actor.EndpointRef"
ENDPOINT = f"{_KERNEL}._actor.endpoint"
PROMISE = f"{_KERNEL}._promise.Promise"
_AWAITED = ("typing.Coroutine", "typing.Awaitable")  # what the runtime awaits
_LIFTED = {  # what holds values the runtime resolves in place, and what takes it
    "builtins.list": "typing.Sequence",
    "typing.Sequence": "typing.Sequence",
    "builtins.tuple": "builtins.tuple",
    "builtins.dict": "typing.Mapping",
    "typing.Mapping": "typing.Mapping",
}


class AtollPlugin(Plugin):
    """Types ``ActorRef[A].name`` by ``A``'s endpoint ``name``.

    Which methods are endpoints is recorded when an actor class is analysed
    (in its ``TypeInfo``'s metadata, which mypy's cache keeps; the cache does
    not keep decorators)."""

    def get_base_class_hook(self, fullname: str) -> Callable[[ClassDefContext], None] | None:
        # asked per direct base only: an actor's may be any subclass of Actor
        return _record_endpoints

    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        owner, _, name = fullname.rpartition(".")
        if owner == ACTOR_REF and not name.startswith("_"):
            return partial(_endpoint_type, name)
        return None


def plugin(version: str) -> type[Plugin]:
    """mypy's entry point."""
    return AtollPlugin


def _endpoint_type(name: str, ctx: AttributeContext) -> Type:
    ref = get_proper_type(ctx.type)
    if not isinstance(ref, Instance) or not ref.args:
        return ctx.default_attr_type
    actor = get_proper_type(ref.args[0])
    if not isinstance(actor, Instance) or ref.type.get(name) is not None:
        return ctx.default_attr_type  # Any or a type variable; or ActorRef's own (name, id)
    default = get_proper_type(ctx.default_attr_type)
    resolves = _endpoint(actor.type, name)
    if resolves is None:
        ctx.api.fail(f'Actor "{actor.type.name}" has no endpoint "{name}"', ctx.context)
        return default
    method = get_proper_type(find_member(name, actor, actor))
    if not isinstance(default, Instance) or not isinstance(method, CallableType):
        return default  # overloaded, or not a method after all
    if method.variables:  # generic: R would name the method's own type variables
        return default
    promise = get_proper_type(_call_type(default.type).ret_type)
    assert isinstance(promise, Instance)
    types = method.arg_types
    if resolves:  # for *args and **kwargs, these are the elements' types
        named = partial(_named, ctx.api.named_generic_type, promise.type)
        types = [_lift(named, t) for t in types]
    params = Parameters(types, method.arg_kinds, method.arg_names)
    return Instance(default.type, [params, _settled(method.ret_type)])


def _call_type(endpoint_ref: TypeInfo) -> CallableType:
    call = endpoint_ref.get_method("__call__")
    assert call is not None and isinstance(call.type, CallableType)
    return call.type


def _named(named: NamedType, promise: TypeInfo, fullname: str, args: list[Type]) -> Instance:
    """Instances of ``Promise`` (by its ``TypeInfo``: a module that does not
    import it cannot look it up) and of ``typing``'s classes."""
    return Instance(promise, args) if fullname == PROMISE else named(fullname, args)


def _record_endpoints(ctx: ClassDefContext) -> None:
    """Note in the class's metadata which of its methods are endpoints, and
    whether each resolves its arguments."""
    info = ctx.cls.info
    if not info.has_base(ACTOR):
        return
    endpoints: dict[str, bool] = {}  # made again on every pass: a later one knows more
    for statement in ctx.cls.defs.body:
        node = statement.impl if isinstance(statement, OverloadedFuncDef) else statement
        if isinstance(node, Decorator):
            resolves = _endpoint_resolves(node)
            if resolves is not None:
                endpoints[node.name] = resolves
    info.metadata["atoll"] = {"endpoints": endpoints}


def _endpoint(info: TypeInfo, name: str) -> bool | None:
    """Whether ``name`` is an endpoint of ``info``'s class that resolves its
    arguments (True) or not (False); None: it is no endpoint. The first
    class in the MRO that marks ``name`` decides, as at run time (where an
    override without the decorator keeps its base's endpoint)."""
    for base in info.mro:
        endpoints: dict[str, bool] = base.metadata.get("atoll", {}).get("endpoints", {})
        if name in endpoints:
            return endpoints[name]
    return None


def _endpoint_resolves(node: Decorator) -> bool | None:
    """Whether an ``@endpoint`` resolves its arguments; None: not an endpoint."""
    for decorator in node.decorators:
        if _is_endpoint(decorator):
            return True
        if isinstance(decorator, CallExpr) and _is_endpoint(decorator.callee):
            return not any(
                key == "resolve_args" and _is_false(value)
                for key, value in zip(decorator.arg_names, decorator.args, strict=True)
            )
    return None


def _is_endpoint(expr: Expression) -> bool:
    return isinstance(expr, RefExpr) and expr.fullname == ENDPOINT


def _is_false(expr: Expression) -> bool:
    return isinstance(expr, NameExpr) and expr.fullname == "builtins.False"


def _settled(ret: Type) -> Type:
    """What a call's promise gives: a coroutine's result, a promise's value
    (of each member of a union)."""
    proper = get_proper_type(ret)
    if isinstance(proper, Instance) and proper.type.fullname in _AWAITED:
        return _settled(proper.args[-1])
    if isinstance(proper, UnionType):
        return UnionType.make_union([_settled(item) for item in proper.items])
    if isinstance(proper, Instance) and proper.type.fullname == PROMISE:
        return proper.args[0]
    return ret


NamedType = Callable[[str, list[Type]], Instance]


def _lift(named: NamedType, arg: Type) -> Type:
    """``arg``, or a promise of it, or (for a list, dict or tuple) one with
    promises inside: what an endpoint that resolves its arguments takes.
    (A list is taken as a ``Sequence`` of lifted items, a dict as a
    ``Mapping``: one context, so that a list display infers against it.)"""
    proper = get_proper_type(arg)
    if isinstance(proper, AnyType):
        return proper
    if isinstance(proper, UnionType):
        return UnionType.make_union([_lift(named, item) for item in proper.items])
    same: Type = arg
    if isinstance(proper, Instance) and proper.type.fullname in _LIFTED:
        *keys, value = proper.args
        same = named(_LIFTED[proper.type.fullname], [*keys, _lift(named, value)])
    elif isinstance(proper, TupleType):
        same = proper.copy_modified(items=[_lift(named, item) for item in proper.items])
    return UnionType.make_union([same, named(PROMISE, [arg])])
