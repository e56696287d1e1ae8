"""A model of control-plane latency for in-process clusters.

In one process an actor call costs microseconds; across hosts each RPC hop
costs a few hundred (Cap'n Proto measured 150-260 us here). A
:class:`DelayLine` stands for one sender's outgoing link: it delivers each
call ``latency_s`` after it was made, in the order calls were made, without
blocking the sender, and can delay the reply the same way. Clusters built
with ``rpc_latency_s=0`` (the default) use no delay line at all.

This is what makes dispatch modes comparable in-process: parallel dispatch
pays a hop's latency once per program, sequential dispatch once per node.

Senders call through :func:`over`: ``over(wire, ref).method(...)`` is a
plain (typed) actor call that the wire, if there is one, makes
``latency_s`` later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any, TypeVar

from ..kernel import Actor, ActorRef, Call, Clock, EndpointSpec, Promise, endpoint, forward
from ..kernel.lowlevel import channel_of

__all__ = ["DelayLine", "Wire", "over"]

A = TypeVar("A", bound=Actor)
_Queued = tuple[float, Any, str, tuple[Any, ...], dict[str, Any], Promise[Any]]


class DelayLine(Actor):
    """Delivers calls after a fixed latency, in order (one modelled RPC link)."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self._queue: deque[_Queued] = deque()

    @endpoint(resolve_args=False)
    def push(
        self,
        due: float,
        target: Any,
        name: str,
        args: tuple[Any, ...],
        result: Promise[Any],
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Queue one call; ``result`` settles like the call once it is made."""
        self._queue.append((due, target, name, args, kwargs or {}, result))
        if len(self._queue) == 1:
            self.ctx.ref.pump()

    @endpoint
    async def pump(self) -> None:
        """Deliver queued calls as they fall due (runs until the queue is empty)."""
        clock = self.ctx.clock
        while self._queue:
            due, target, name, args, kwargs, result = self._queue[0]
            if due > clock.now():
                await clock.sleep(due - clock.now())
            self._queue.popleft()
            if target is None:  # a delayed reply: args[0] has settled already
                forward(args[0], result)
            else:
                forward(getattr(target, name)(*args, **kwargs), result)


class Wire:
    """One sender's outgoing link: its delay line and latency.

    Senders hold ``None`` instead of a wire when there is no modelled latency;
    :func:`over` takes either.
    """

    def __init__(self, clock: Clock, latency_s: float, line: ActorRef[DelayLine]) -> None:
        self.clock = clock
        self.latency_s = latency_s
        self.line = line

    def push(self, target: ActorRef[Any], call: Call) -> None:
        """Make ``call`` to ``target`` ``latency_s`` from now; its promise
        settles like that call (returns at once)."""
        due = self.clock.now() + self.latency_s
        self.line.push(due, target, call.endpoint, call.args, call.promise, call.kwargs)

    def reply(self, promise: Promise[Any]) -> Promise[Any]:
        """A promise that settles like ``promise``, ``latency_s`` later (a reply's hop)."""
        late: Promise[Any] = Promise("reply (delayed)")

        def answer(_: Promise[Any]) -> None:
            self.line.push(self.clock.now() + self.latency_s, None, "", (promise,), late)

        promise.add_done_callback(answer)
        return late


def over(wire: Wire | None, ref: ActorRef[A]) -> ActorRef[A]:
    """``ref`` as seen over ``wire``: a reference whose calls the wire makes
    ``latency_s`` later, in order (``ref`` itself when there is no wire).
    Calls through it are checked and typed as calls to ``ref``."""
    if wire is None:
        return ref
    return ActorRef(_Delayed(wire, ref))


class _Delayed:
    """A channel that hands each call to a wire's delay line (see :func:`over`)."""

    __slots__ = ("_ref", "_wire")

    def __init__(self, wire: Wire, ref: ActorRef[Any]) -> None:
        self._wire = wire
        self._ref = ref

    @property
    def actor_id(self) -> str:
        return self._ref.id

    @property
    def actor_name(self) -> str:
        return self._ref.name

    @property
    def endpoints(self) -> Mapping[str, EndpointSpec | None] | None:
        return channel_of(self._ref).endpoints

    def submit(self, call: Call) -> None:
        self._wire.push(self._ref, call)

    async def submit_wait(self, call: Call) -> None:
        self._wire.push(self._ref, call)  # a delay line takes every call

    async def stop(self, grace: float | None) -> None:
        await self._ref.stop(grace)

    async def cancel(self, reason: str) -> None:
        await self._ref.cancel(reason)
