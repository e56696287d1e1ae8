"""Promise combinators: derive promises from promises without waiting.

The controller uses :func:`then` and :func:`flatten` to hand out one promise
per output of a node whose result is not there yet; :func:`forward` settles
one promise like another. The others convert between values and promises, and
join several promises, for code that may be handed either;
:func:`log_failure` logs the failure of a notice nobody awaits. None of them
blocks: each returns at once and settles from promise callbacks, on the event
loop's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ._errors import ActorStopped, HostLost
from ._promise import Promise

__all__ = [
    "all_settled",
    "as_promise",
    "failed",
    "first_settled",
    "flatten",
    "forward",
    "log_failure",
    "then",
    "value_of",
    "when_settled",
]

T = TypeVar("T")
U = TypeVar("U")

# _BASE: each settle here fails its promise with whatever it raised, not only
# an Exception: a cancellation or an exit raised inside a callback would
# otherwise escape past the promise machinery (which only logs Exception) and
# leave the promise pending. Those that are not an Exception are raised
# again once the promise holds them.


def then(promise: Promise[T], fn: Callable[[T], U], label: str = "") -> Promise[U]:
    """A promise of ``fn(value)``; returns at once, settles when ``promise`` does."""
    out: Promise[U] = Promise(label or "then")  # (a repr of the source per call cost a
    # formatted string, nested ever deeper along a chain)

    def settle(done: Promise[T]) -> None:
        error = done._error
        if error is not None:
            out._reject(error)
            return
        try:
            out._resolve(fn(done._value))
        except Exception as exc:
            out._reject(exc)
        except BaseException as exc:  # see _BASE
            out._reject(exc)
            raise

    promise.add_done_callback(settle)
    return out


def flatten(promise: Promise[Promise[T] | T], label: str = "") -> Promise[T]:
    """A promise of the value of the promise that ``promise`` will hold.

    The inner value may also arrive as a plain value: a network transport
    delivers a promise that settled before it was sent as its value.
    """
    out: Promise[T] = Promise(label or "flat")

    def outer(done: Promise[Promise[T] | T]) -> None:
        error = done._error
        if error is not None:
            out._reject(error)
            return
        inner = done._value
        try:  # see _BASE
            if isinstance(inner, Promise):
                out._follow(inner)
            else:
                out._resolve(inner)
        except Exception as exc:
            out._reject(exc)
        except BaseException as exc:
            out._reject(exc)
            raise

    promise.add_done_callback(outer)
    return out


def forward(source: Promise[T], target: Promise[T]) -> None:
    """Settle ``target`` the way ``source`` settles (now or later)."""
    target._follow(source)


def as_promise(value: Promise[T] | T, label: str = "value") -> Promise[T]:
    """``value`` if it is a promise, else a promise already settled with it."""
    if isinstance(value, Promise):
        return value
    promise: Promise[T] = Promise(label)
    promise.set_result(value)
    return promise


def failed(error: BaseException, label: str = "failed") -> Promise[Any]:
    """A promise that already failed with ``error``."""
    promise: Promise[Any] = Promise(label)
    promise.set_exception(error)
    return promise


async def value_of(value: Promise[T] | T) -> T:
    """The value: awaited if it is a promise (raising its error), else itself."""
    return await value if isinstance(value, Promise) else value


def all_settled(
    promises: Sequence[Promise[Any]], label: str = "all settled", into: Promise[None] | None = None
) -> Promise[None]:
    """A promise that settles (with None) once every one of ``promises`` has,
    whichever way; callers look at the promises themselves for the outcome.
    ``into``: settle that promise (and return it) rather than a new one."""
    return when_settled(promises, _nothing, label, into)


def _nothing() -> None:
    return None


def when_settled(
    promises: Sequence[Promise[Any]],
    fn: Callable[[], U],
    label: str = "when settled",
    into: Promise[U] | None = None,
) -> Promise[U]:
    """A promise of ``fn()``, called once every one of ``promises`` has
    settled, whichever way (``then(all_settled(...), ...)`` in one promise:
    a run's answer is one of these, on every hop); ``into``: settle that
    promise rather than a new one."""
    out: Promise[U] = Promise(label) if into is None else into
    left = [len(promises)]

    def settle() -> None:
        try:
            out._resolve(fn())
        except Exception as exc:
            out._reject(exc)
        except BaseException as exc:  # see _BASE
            out._reject(exc)
            raise

    def one(_: Promise[Any]) -> None:
        left[0] -= 1
        if left[0] == 0:
            settle()

    if not promises:
        settle()
    elif len(promises) == 1:  # (most runs: one device) no count to keep
        promises[0].add_done_callback(lambda _: settle())
    else:
        for promise in promises:
            promise.add_done_callback(one)
    return out


async def first_settled(*promises: Promise[Any]) -> None:
    """Return when the first of ``promises`` settles (whichever way)."""
    either: Promise[None] = Promise("first settled")
    for promise in promises:
        promise.add_done_callback(lambda _: either.set_result(None))
    await either


def log_failure(
    logger: logging.Logger, what: str, level: int = logging.WARNING
) -> Callable[[Promise[Any]], None]:
    """A done-callback for ``what`` (a notice, a free: a call whose answer
    nobody awaits) that logs its failure: at DEBUG when its actor stopped or
    its host was lost (expected while a cluster or a host goes down), else at
    ``level``."""

    def logged(answer: Promise[Any]) -> None:
        error = answer.exception()
        if error is not None:
            quiet = isinstance(error, (HostLost, ActorStopped))
            logger.log(logging.DEBUG if quiet else level, "%s failed: %s", what, error)

    return logged
