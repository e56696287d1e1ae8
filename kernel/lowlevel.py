"""The kernel's low-level interface, for transports and tools (like ``trio.lowlevel``).

Application code never needs these. A transport that carries actor calls
between processes does: it settles promises from answers that arrive on the
wire, lets a promise pipeline calls to an actor the peer has not returned yet,
resolves the promises nested in decoded arguments, and reaches the channel
behind an :class:`~atoll.kernel.ActorRef`. Everything here is synchronous and
runs on the event loop's thread, except :func:`resolve_arguments`, which waits
for the promises it finds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ._actor import ActorRef, Channel
from ._alarm import running_asyncio_loop
from ._clock import call_later_precisely
from ._counts import COUNTS as counts
from ._promise import Promise, WaitCounter, count_waits, detach_wait_counter
from ._soon import call_soon
from ._soon import on_trio as _on_trio
from ._system import _Cell, share_arguments_with
from ._system import _has_promise as holds_promises
from ._system import _resolve as _resolve_nested

__all__ = [
    "MessageHandler",
    "WaitCounter",
    "attach_pipeline",
    "call_later_precisely",
    "call_soon",
    "channel_of",
    "count_waits",
    "counts",
    "detach_wait_counter",
    "holds_promises",
    "message_handler",
    "pipeline_answer",
    "resolve_arguments",
    "running_asyncio_loop",
    "set_canceller",
    "set_message_handler",
    "share_arguments_with",
    "threadsafe_caller",
]

T = TypeVar("T")
# how an actor's cell handles one message: (cell, actor instance, call) -> done
MessageHandler = Callable[[Any, Any, Any], Awaitable[None]]


def message_handler() -> MessageHandler:
    """How every actor cell handles one message now, for tools that meter
    actors' work one message at a time (``benchmarks/scale.py``): a wrapper
    given to :func:`set_message_handler` calls it, and may await it in steps."""
    handler: MessageHandler = _Cell._handle
    return handler


def set_message_handler(handler: MessageHandler) -> None:
    """Make every actor cell handle messages with ``handler`` (a wrapper of
    :func:`message_handler`'s); put the one you replaced back when done."""
    _Cell._handle = handler  # type: ignore[method-assign,assignment]


def channel_of(ref: ActorRef[Any]) -> Channel:
    """The channel a reference sends its calls through (local mailbox or a peer)."""
    return ref._channel


def attach_pipeline(
    promise: Promise[Any], pipe: Callable[[], Channel | None], answer: object | None
) -> None:
    """Let ``promise`` pipeline before it settles.

    ``pipe()`` gives a channel to the actor the promise will resolve to, so
    that ``promise.method(...)`` goes straight to the peer (or None when it
    no longer can: the call then waits for the promise); ``answer`` is the
    transport's own handle on the pending result, which it can pass on to a
    third party without waiting (see :func:`pipeline_answer`). Both are
    dropped when the promise settles.
    """
    if not promise.done():
        promise._pipe, promise._answer = pipe, answer


def pipeline_answer(promise: Promise[Any]) -> object | None:
    """The transport handle :func:`attach_pipeline` gave ``promise``, while pending."""
    return promise._answer


def set_canceller(promise: Promise[Any], cancel: Callable[[str], bool]) -> None:
    """What ``promise.cancel(reason)`` does until it settles (True: cancelled)."""
    if not promise.done():
        promise._canceller = cancel


async def resolve_arguments(value: T) -> T:
    """``value`` with every promise in it (nested in lists, tuples, dicts) awaited."""
    resolved: T = await _resolve_nested(value)
    return resolved


def threadsafe_caller() -> Callable[[Callable[[], object]], object]:
    """How another thread runs ``fn()`` soon on the event loop running here.

    The returned function may be called from any thread; ``fn`` then runs
    on this loop's thread in a turn of its own (asyncio's
    ``call_soon_threadsafe``, trio's ``TrioToken.run_sync_soon``). It
    raises ``RuntimeError`` once the loop is closed.
    """
    if _on_trio():
        import trio

        token = trio.lowlevel.current_trio_token()
        return token.run_sync_soon
    return asyncio.get_running_loop().call_soon_threadsafe
