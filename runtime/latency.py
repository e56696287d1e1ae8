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

from ..kernel import Actor, ActorRef, Clock, Promise, endpoint, forward

__all__ = ["DelayLine", "Wire"]


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
    """One sender's outgoing link: its delay line and latency.

    Senders hold ``None`` instead of a wire when there is no modelled latency;
    :meth:`through` takes either.
    """

    def __init__(self, clock: Clock, latency_s: float, line: ActorRef[DelayLine]) -> None:
        self.clock = clock
        self.latency_s = latency_s
        self.line = line

    def call(self, target: Any, name: str, *args: Any) -> Promise[Any]:
        """``target.name(*args)``, made ``latency_s`` from now (returns at once)."""
        result: Promise[Any] = Promise(f"{name} (delayed)")
        self.line.push(self.clock.now() + self.latency_s, target, name, args, result)
        return result

    @staticmethod
    def through(wire: Wire | None, target: Any, name: str, *args: Any) -> Promise[Any]:
        """``target.name(*args)`` over ``wire``, or directly when there is none."""
        if wire is None:
            direct: Promise[Any] = getattr(target, name)(*args)
            return direct
        return wire.call(target, name, *args)

    def reply(self, promise: Promise[Any]) -> Promise[Any]:
        """A promise that settles like ``promise``, ``latency_s`` later (a reply's hop)."""
        late: Promise[Any] = Promise("reply (delayed)")

        def answer(_: Promise[Any]) -> None:
            self.line.push(self.clock.now() + self.latency_s, None, "", (promise,), late)

        promise.add_done_callback(answer)
        return late
