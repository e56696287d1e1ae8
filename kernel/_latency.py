"""A model of control-plane latency for in-process clusters.

In one process an actor call costs microseconds; across hosts each RPC hop
costs a few hundred (Cap'n Proto measured 150-260 us here). A
:class:`DelayLine` stands for one sender's outgoing link: it delivers each
call ``latency_s`` after it was made, in the order calls were made, without
blocking the sender, and can delay the reply the same way. Clusters built
with ``rpc_latency_s=0`` (the default) use no delay line at all.

This is what makes dispatch modes comparable in-process: parallel dispatch
pays a hop's latency once per program, sequential dispatch once per node.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ._actor import Actor, ActorRef, endpoint
from ._clock import Clock
from ._graph import forward
from ._promise import Promise

__all__ = ["DelayLine", "Wire", "delayed", "send"]


class DelayLine(Actor):
    """Delivers calls after a fixed latency, in order (one modelled RPC link)."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self._queue: deque[tuple[float, Any, str, tuple[Any, ...], Promise[Any]]] = deque()

    @endpoint(resolve_args=False)
    def push(
        self, due: float, target: Any, name: str, args: tuple[Any, ...], result: Promise[Any]
    ) -> None:
        """Queue one call; ``result`` settles like the call once it is made."""
        self._queue.append((due, target, name, args, result))
        if len(self._queue) == 1:
            self.ctx.ref.pump()

    @endpoint
    async def pump(self) -> None:
        """Deliver queued calls as they fall due (runs until the queue is empty)."""
        clock = self.ctx.clock
        while self._queue:
            due, target, name, args, result = self._queue[0]
            if due > clock.now():
                await clock.sleep(due - clock.now())
            self._queue.popleft()
            if target is None:  # a delayed reply: args[0] has settled already
                forward(args[0], result)
            else:
                forward(getattr(target, name)(*args), result)


class Wire:
    """One sender's outgoing link: a delay line (or none) and its latency."""

    def __init__(self, clock: Clock, latency_s: float, line: ActorRef[DelayLine] | None) -> None:
        self.clock = clock
        self.latency_s = latency_s
        self.line = line

    def call(self, target: Any, name: str, *args: Any, reply: bool = False) -> Promise[Any]:
        return send(self.line, self.clock, self.latency_s, target, name, *args, reply=reply)

    @staticmethod
    def through(wire: Wire | None, target: Any, name: str, *args: Any) -> Promise[Any]:
        """``target.name(*args)`` over ``wire``, or directly when there is none."""
        if wire is None:
            direct: Promise[Any] = getattr(target, name)(*args)
            return direct
        return wire.call(target, name, *args)

    def reply(self, promise: Promise[Any]) -> Promise[Any]:
        return delayed(self.line, self.clock, self.latency_s, promise)


def send(
    line: ActorRef[DelayLine] | None,
    clock: Clock,
    latency_s: float,
    target: Any,
    name: str,
    *args: Any,
    reply: bool = False,
) -> Promise[Any]:
    """``target.name(*args)``, through ``line`` when there is one (else directly).

    With ``reply=True`` the result also reaches the caller ``latency_s`` after
    the call settled, as an RPC's answer would.
    """
    if line is None:
        direct: Promise[Any] = getattr(target, name)(*args)
        return direct
    result: Promise[Any] = Promise(f"{name} (delayed)")
    line.push(clock.now() + latency_s, target, name, args, result)
    return delayed(line, clock, latency_s, result) if reply else result


def delayed(
    line: ActorRef[DelayLine] | None, clock: Clock, latency_s: float, promise: Promise[Any]
) -> Promise[Any]:
    """A promise that settles like ``promise``, ``latency_s`` later (a reply's hop)."""
    if line is None:
        return promise
    late: Promise[Any] = Promise("reply (delayed)")

    def answer(_: Promise[Any]) -> None:
        line.push(clock.now() + latency_s, None, "", (promise,), late)

    promise.add_done_callback(answer)
    return late
