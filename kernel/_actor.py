"""Actors, typed endpoints and references to them.

An :class:`Actor` is a plain class whose methods marked with :func:`endpoint`
can be called from other tasks, actors or processes. Each actor handles one
message at a time, in the order its mailbox received them, so its state needs no
locks. Nothing calls an actor's methods directly: callers hold an
:class:`ActorRef`, and ``ref.method(*args)`` returns a :class:`Promise` at once.

The reference does not know how messages travel; it talks to a
:class:`Channel`, which a transport provides (in-process: the actor's own
mailbox; Cap'n Proto: a capability on a TCP connection).
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, ParamSpec, Protocol, TypeVar, overload

from ._errors import BadCall, NoSuchEndpoint, NotRunning
from ._promise import Promise

if TYPE_CHECKING:
    from ._system import ActorContext

__all__ = [
    "Actor",
    "ActorRef",
    "Call",
    "Channel",
    "Directive",
    "EndpointRef",
    "EndpointSpec",
    "endpoint",
]

A = TypeVar("A", bound="Actor")
A_co = TypeVar("A_co", bound="Actor", covariant=True)
F = TypeVar("F", bound=Callable[..., Any])
P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class EndpointSpec:
    """What the runtime knows about one endpoint.

    ``resolve_args``: when True (the default) the runtime awaits every promise
    among the arguments before the handler starts, so the handler sees plain
    values. Set it False for endpoints that forward promises onwards without
    waiting (a controller dispatching ahead of the data).

    ``share_args``: when True (the default) a caller in the same process hands
    its arguments over as the transport shares them (the in-process one: numpy
    arrays as read-only views, so the handler cannot write into the caller's
    memory). Set it False for an endpoint that never writes into an array it
    is given and only passes its arguments on (a controller, a scheduler):
    walking every argument on every call is then a cost for nothing.

    ``cancellable``: when True (the default) an ``async`` handler runs in a
    cancel scope of its own, so that cancelling its call's promise stops it
    where it waits. Set it False for a hot endpoint whose calls nobody
    cancels once they run: a scope costs microseconds on every call. Its
    queued calls still cancel, and stopping or cancelling the actor still
    stops it.

    ``inline``: when True, a call that finds the actor idle (waiting for
    a message, its mailbox empty) runs at once, in the caller's own step,
    instead of waking the actor's task in a later pass of the event loop:
    the same one-at-a-time order, with no mailbox round and no task switch.
    For hot plain (not ``async``) handlers of actors without
    ``fail_on_error`` that only pass work on (a controller, a scheduler);
    the caller's promise is then settled when the call returns. A busy
    actor, a call with promises to resolve first, or a full mailbox queues
    as usual.
    """

    name: str
    resolve_args: bool
    signature: inspect.Signature
    positional: tuple[int, int | None] = (0, None)  # (required, most; None = *args)
    share_args: bool = True
    cancellable: bool = True
    inline: bool = False

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise TypeError if the call does not fit the signature.

        Positional-only calls are checked by counting (the hot path: a full
        ``Signature.bind`` costs several microseconds per call); calls with
        keywords get the full check.
        """
        required, most = self.positional
        if not kwargs and required <= len(args) and (most is None or len(args) <= most):
            return
        self.signature.bind(None, *args, **kwargs)


@overload
def endpoint(fn: F, /) -> F: ...
@overload
def endpoint(
    *,
    resolve_args: bool = True,
    share_args: bool = True,
    cancellable: bool = True,
    inline: bool = False,
) -> Callable[[F], F]: ...
def endpoint(
    fn: Any = None,
    /,
    *,
    resolve_args: bool = True,
    share_args: bool = True,
    cancellable: bool = True,
    inline: bool = False,
) -> Any:
    """Mark an actor method as callable through an :class:`ActorRef`.

    Usable bare (``@endpoint``) or with options
    (``@endpoint(resolve_args=False)``; see :class:`EndpointSpec`). The
    method may be ``async def`` or plain; either way callers get a promise.
    """

    def mark(method: F) -> F:
        if inline and inspect.iscoroutinefunction(method):
            raise TypeError(f"endpoint {method.__name__}: an async handler cannot run inline")
        sig = inspect.signature(method)
        method.__atoll_endpoint__ = EndpointSpec(  # type: ignore[attr-defined]
            method.__name__, resolve_args, sig, _positional(sig), share_args, cancellable, inline
        )
        return method

    return mark(fn) if fn is not None else mark


def _positional(sig: inspect.Signature) -> tuple[int, int | None]:
    """(required, most) positional arguments after ``self``; None = *args."""
    kinds = inspect.Parameter
    params = list(sig.parameters.values())[1:]
    if any(p.kind is kinds.KEYWORD_ONLY and p.default is p.empty for p in params):
        return (len(params) + 1, 0)  # a required keyword: never the fast path
    positional = [
        p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    required = sum(1 for p in positional if p.default is p.empty)
    most = None if any(p.kind is kinds.VAR_POSITIONAL for p in params) else len(positional)
    return required, most


class Directive(enum.Enum):
    """What a parent decides when a child fails (see ``on_child_failed``)."""

    RESTART = "restart"  # build a fresh instance; the mailbox and refs survive
    STOP = "stop"  # stop the child for good; its pending calls fail
    ESCALATE = "escalate"  # the parent fails too, and its own parent decides


class Actor:
    """Base class of every actor.

    Subclasses define endpoints with :func:`endpoint` and may override the
    lifecycle hooks. ``self.ctx`` (available from ``on_start`` on) gives the
    actor its own reference, its parent, a clock, and ``spawn`` for children.

    Class options:
        mailbox_capacity: messages queued before ``send`` blocks.
        mailbox_slack: extra room for synchronous calls before ``MailboxFull``.
        fail_on_error: if True, an endpoint that raises also fails the actor
            (after the caller got its ``RemoteActorError``), so supervision runs.
        max_restarts: restarts allowed before a failure is escalated anyway.
    """

    __endpoints__: ClassVar[dict[str, EndpointSpec]] = {}
    mailbox_capacity: ClassVar[int] = 1024
    mailbox_slack: ClassVar[int] = 65536
    fail_on_error: ClassVar[bool] = False
    max_restarts: ClassVar[int] = 3
    _atoll_ctx: ActorContext | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        found: dict[str, EndpointSpec] = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                spec = getattr(value, "__atoll_endpoint__", None)
                if isinstance(spec, EndpointSpec):
                    found[name] = spec
        cls.__endpoints__ = found

    @property
    def ctx(self) -> ActorContext:
        """The runtime's handle for this actor; set before ``on_start``."""
        if self._atoll_ctx is None:
            raise NotRunning(f"{type(self).__name__} is not running under an ActorSystem")
        return self._atoll_ctx

    async def on_start(self) -> None:
        """Runs in the actor's task before the first message (and after restarts)."""

    async def on_stop(self) -> None:
        """Runs after the last message, when the actor stops for good or restarts."""

    def on_child_failed(self, child: ActorRef[Any], error: BaseException) -> Directive:
        """Decide a failed child's fate. Synchronous: no awaiting in here.

        The default escalates: the failure is not hidden, and the parent fails
        in turn. Override it to restart or stop instead.
        """
        return Directive.ESCALATE


@dataclass(eq=False, slots=True)
class Call:
    """One message: an endpoint call on its way to an actor."""

    endpoint: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    promise: Promise[Any]
    cancelled: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Channel(Protocol):
    """A transport's handle on one actor: how a reference delivers calls.

    ``submit`` is synchronous: it enqueues or raises ``MailboxFull`` at once.
    ``submit_wait`` waits for room instead. Both keep the order of calls made
    through the same channel. ``endpoints`` lets references check calls
    before sending: None when nothing is known on this side, and a None
    value for an endpoint known by name only (no signature check).
    """

    @property
    def actor_id(self) -> str: ...
    @property
    def actor_name(self) -> str: ...
    @property
    def endpoints(self) -> Mapping[str, EndpointSpec | None] | None: ...
    def submit(self, call: Call) -> None: ...
    async def submit_wait(self, call: Call) -> None: ...
    async def stop(self, grace: float | None) -> None: ...
    async def cancel(self, reason: str) -> None: ...


class ActorRef(Generic[A_co]):
    """A reference to an actor, wherever it runs.

    ``ref.method(*args, **kwargs)`` returns a :class:`Promise` at once;
    ``await ref.method.send(...)`` waits for mailbox room first (back-pressure).
    ``await ref.stop()`` stops the actor; ``await ref.cancel()`` also cancels
    the call it is running. References compare equal when they name the same
    actor.
    """

    __slots__ = ("_channel", "_id")

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._id = channel.actor_id  # (fixed for a channel: hashed and compared often)

    @property
    def name(self) -> str:
        return self._channel.actor_name

    @property
    def id(self) -> str:
        return self._id

    def __getattr__(self, name: str) -> EndpointRef[..., Any]:
        # typed per endpoint by atoll's mypy plugin (atoll.kernel.mypy_plugin)
        if name.startswith("_"):
            raise AttributeError(name)
        endpoints = self._channel.endpoints
        if endpoints is not None and name not in endpoints:
            raise NoSuchEndpoint(self.name, name)
        return EndpointRef(self, name)

    async def stop(self, grace: float | None = 10.0) -> None:
        """Stop after the running call (waiting ``grace`` s at most, None=forever).

        Queued calls fail with ``ActorStopped``. Returns once it stopped.
        """
        await self._channel.stop(grace)

    async def cancel(self, reason: str = "cancelled") -> None:
        """Stop at once, cancelling the running call too."""
        await self._channel.cancel(reason)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and other._id == self._id

    def __hash__(self) -> int:
        return hash(self._id)

    def __repr__(self) -> str:
        return f"<ActorRef {self.name}>"


class EndpointRef(Generic[P, R]):
    """``ref.method``: call it for a promise, or ``await .send(...)`` it.

    ``P`` are the method's parameters and ``R`` what its promise gives (a
    coroutine's or a returned promise's value). Under mypy with atoll's
    plugin (``plugins = ["atoll.kernel.mypy_plugin"]``) ``ref.method`` has
    them, so calls are checked; without it, ``ref.method`` is
    ``EndpointRef[..., Any]``.
    """

    __slots__ = ("_name", "_ref")

    def __init__(self, ref: ActorRef[Any], name: str) -> None:
        self._ref = ref
        self._name = name

    def _make(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        endpoints = self._ref._channel.endpoints
        spec = endpoints.get(self._name) if endpoints is not None else None
        if spec is not None:
            try:
                spec.check(args, kwargs)
            except TypeError as exc:
                raise BadCall(f"{self._ref.name}.{self._name}: {exc}") from None
        promise: Promise[Any] = Promise(f"{self._ref.name}.{self._name}")
        return Call(self._name, args, kwargs, promise)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Promise[R]:
        call = self._make(args, kwargs)
        self._ref._channel.submit(call)
        return call.promise

    async def send(self, *args: P.args, **kwargs: P.kwargs) -> Promise[R]:
        """Like calling it, but wait for mailbox room instead of failing."""
        call = self._make(args, kwargs)
        await self._ref._channel.submit_wait(call)
        return call.promise
