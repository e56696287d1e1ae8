"""Promises: values that will arrive, and that can be used before they do.

A :class:`Promise` is what every actor call returns, at once. It can be

* awaited, to get the value (or the boxed error);
* passed as an argument to another call: the *receiving* actor resolves it, so
  the caller never waits in between;
* used as an actor reference when it stands for an :class:`ActorRef`:
  ``promise.method(...)`` is queued on the promise and forwarded the moment the
  reference arrives, without a round trip through the caller. A chain
  ``a.f().g().h()`` therefore costs the caller one wait, not three.

Promises are loop-agnostic: they resolve from plain synchronous code on the
event loop's thread and wake waiters through :class:`anyio.Event`, so the same
object works on asyncio and on trio.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio

from ._alarm import running_asyncio_loop
from ._errors import AtollError

if TYPE_CHECKING:
    from ._actor import ActorRef, Channel

__all__ = ["Promise", "WaitCounter", "count_waits"]

T = TypeVar("T")
_log = logging.getLogger("atoll.kernel")
_PENDING = object()


@dataclass
class WaitCounter:
    """Counts how often the current task really suspended on a promise.

    Awaiting a promise that already holds its value does not count: only a
    wait that had to block does. Tests use it to prove that a pipelined chain
    costs the caller exactly one wait.
    """

    waits: int = 0


_counter: contextvars.ContextVar[WaitCounter | None] = contextvars.ContextVar(
    "atoll_wait_counter", default=None
)


@contextlib.contextmanager
def count_waits() -> Iterator[WaitCounter]:
    """Count the promise waits of the current task inside this block."""
    counter = WaitCounter()
    token = _counter.set(counter)
    try:
        yield counter
    finally:
        _counter.reset(token)


def detach_wait_counter() -> None:
    """Stop counting waits in this task (for tasks that inherited a counter).

    Transports call it in the tasks they start, so that their internal waits
    are not billed to the application task that happened to trigger them.
    """
    _counter.set(None)


class Promise(Generic[T]):
    """A value that will arrive; see the module docstring.

    Resolution is synchronous (:meth:`_resolve`, :meth:`_reject`) and happens
    on the loop thread; callbacks added with :meth:`add_done_callback` run
    right then, in the order they were added.
    """

    __slots__ = (
        "__weakref__",
        "_answer",
        "_callbacks",
        "_canceller",
        "_error",
        "_event",
        "_label",
        "_pipe",
        "_value",
    )

    def __init__(self, label: str = "") -> None:
        self._label = label
        self._value: Any = _PENDING
        self._error: BaseException | None = None
        self._event: list[Any] | None = None  # waiters: asyncio futures, anyio events
        self._callbacks: list[Callable[[Promise[T]], None]] | None = None
        self._canceller: Callable[[str], bool] | None = None
        # Set by network transports: a channel to the promised actor, usable
        # before resolution (native pipelining), and the transport's own handle
        # on the pending result (so it can be passed on without a round trip).
        self._pipe: Callable[[], Channel | None] | None = None
        self._answer: object | None = None

    # -- inspection -----------------------------------------------------
    def done(self) -> bool:
        """True once the promise holds a value or an error."""
        return self._value is not _PENDING or self._error is not None

    def result(self) -> T:
        """The value; raises the error, or :class:`AtollError` if still pending."""
        if self._error is not None:
            raise self._error
        if self._value is _PENDING:
            raise AtollError(f"promise {self._label!r} is not resolved yet")
        value: T = self._value
        return value

    def exception(self) -> BaseException | None:
        """The error it failed with, or None (also None while pending)."""
        return self._error

    def __repr__(self) -> str:
        state = "pending"
        if self._error is not None:
            state = f"failed: {type(self._error).__name__}"
        elif self._value is not _PENDING:
            state = "resolved"
        return f"<Promise {self._label} {state}>"

    # -- resolution -----------------------------------------------------
    def add_done_callback(self, callback: Callable[[Promise[T]], None]) -> None:
        """Run ``callback(self)`` when done (at once if already done)."""
        # (done() inlined here and below: these run several times per run)
        if self._value is not _PENDING or self._error is not None:
            _run_callback(callback, self)
        elif self._callbacks is None:
            self._callbacks = [callback]
        else:
            self._callbacks.append(callback)

    def set_result(self, value: T) -> None:
        """Resolve it (no-op if already done). For actors that answer later."""
        self._resolve(value)

    def set_exception(self, error: BaseException) -> None:
        """Fail it (no-op if already done)."""
        self._reject(error)

    def _resolve(self, value: T) -> None:
        if self._value is not _PENDING or self._error is not None:
            return
        self._value = value
        self._settle()

    def _reject(self, error: BaseException) -> None:
        if self._value is not _PENDING or self._error is not None:
            return
        self._error = error
        self._settle()

    def _settle(self) -> None:
        self._canceller = None
        self._pipe = None
        self._answer = None
        waiting = self._event
        if waiting is not None:
            self._event = None
            for waiter in waiting:
                if not isinstance(waiter, asyncio.Future):  # an anyio event (trio)
                    waiter.set()
                elif not waiter.done():  # a cancelled waiter cancelled its future
                    waiter.set_result(None)
        callbacks = self._callbacks
        if callbacks is not None:
            self._callbacks = None
            for callback in callbacks:
                try:  # (_run_callback, inlined)
                    callback(self)
                except Exception:  # a broken callback must not stop the others
                    _log.exception("promise callback %r failed", callback)

    def _follow(self, other: Promise[T]) -> None:
        """Settle like ``other`` does (used to forward pipelined calls)."""
        other.add_done_callback(self._copy_from)

    def _copy_from(self, other: Promise[T]) -> None:
        if other._error is not None:
            self._reject(other._error)
        else:
            self._resolve(other._value)

    def cancel(self, reason: str = "cancelled by caller") -> bool:
        """Ask the callee to drop this call.

        Returns at once. A queued call is dropped; a running one has its
        handler cancelled. The promise then fails with ``CallCancelled``.
        Returns False when there was nothing to cancel (already done, or not
        a cancellable call). Cancelling the *await* of a promise (a timeout
        around it) does not cancel the call: others may hold the promise.
        """
        if self.done() or self._canceller is None:
            return False
        return self._canceller(reason)

    # -- waiting --------------------------------------------------------
    def __await__(self) -> Generator[Any, None, T]:
        return self._wait().__await__()

    async def _wait(self) -> T:
        if not self.done():
            counter = _counter.get()
            if counter is not None:
                counter.waits += 1
            if self._event is None:
                self._event = []
            loop = running_asyncio_loop()
            if loop is not None:  # a future per waiter: cancelling one leaves the others
                future = loop.create_future()
                self._event.append(future)
                await future
            else:  # trio
                event = anyio.Event()
                self._event.append(event)
                await event.wait()
        return self.result()

    # -- pipelining -----------------------------------------------------
    def __getattr__(self, name: str) -> PipelinedEndpoint:
        if name.startswith("_"):
            raise AttributeError(name)
        return PipelinedEndpoint(self, name)


class PipelinedEndpoint:
    """``promise.name``: an endpoint of the actor the promise will resolve to.

    Calling it returns a new promise at once and forwards the call as soon as
    the reference arrives, in the order such calls were made.
    """

    __slots__ = ("_name", "_target")

    def __init__(self, target: Promise[Any], name: str) -> None:
        self._target = target
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Promise[Any]:
        result: Promise[Any] = Promise(f"{self._target._label}.{self._name}")
        pipe = self._target._pipe
        channel = pipe() if pipe is not None and not self._target.done() else None
        if channel is not None:  # the transport pipelines natively
            from ._actor import ActorRef

            inner: Promise[Any] = Promise(result._label)
            _forward_to(ActorRef(channel), self._name, args, kwargs, inner)
            result._canceller = inner.cancel
            result._pipe, result._answer = inner._pipe, inner._answer
            inner.add_done_callback(lambda done: _settle_pipelined(self._target, done, result))
            return result
        self._target.add_done_callback(
            lambda target: _forward(target, self._name, args, kwargs, result)
        )
        return result


def _forward(
    target: Promise[Any],
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    result: Promise[Any],
) -> None:
    from ._actor import ActorRef

    error = target._error
    if error is not None:
        result._reject(error)
        return
    ref = target._value
    if not isinstance(ref, ActorRef):
        result._reject(
            AtollError(f"cannot call {name!r} on {type(ref).__name__}: it is not an ActorRef")
        )
        return
    _forward_to(ref, name, args, kwargs, result)


def _forward_to(
    ref: ActorRef[Any],
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    result: Promise[Any],
) -> None:
    try:
        inner = getattr(ref, name)(*args, **kwargs)
    except AtollError as exc:
        result._reject(exc)
        return
    result._canceller = inner.cancel
    result._pipe, result._answer = inner._pipe, inner._answer  # keep pipelining natively
    result._follow(inner)


def _settle_pipelined(target: Promise[Any], inner: Promise[Any], result: Promise[Any]) -> None:
    """A natively pipelined call failed or not; if its target failed, that error wins."""
    if inner._error is None:
        result._resolve(inner._value)
        return
    error = inner._error
    target.add_done_callback(lambda t: result._reject(t._error if t._error is not None else error))


def _run_callback(callback: Callable[[Promise[Any]], None], promise: Promise[Any]) -> None:
    try:
        callback(promise)
    except Exception:  # a broken callback must not stop the others
        _log.exception("promise callback %r failed", callback)
