"""Endpoints that run inline (``@endpoint(inline=True)``): a call that finds
its actor idle runs in the caller's step, one per endpoint per pass of the
event loop; every other call queues, and the actor's one-at-a-time order
holds."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from atoll.kernel import (
    Actor,
    ActorSystem,
    CallCancelled,
    Promise,
    RemoteActorError,
    UsageError,
    endpoint,
    wait_idle,
)

pytestmark = pytest.mark.anyio


class Relay(Actor):
    """Records what it is given, in the order it handles it."""

    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.release: Promise[None] | None = None

    @endpoint(inline=True)
    def take(self, value: Any) -> int:
        self.seen.append(value)
        return len(self.seen)

    @endpoint(inline=True, resolve_args=False)
    def forward(self, value: Any) -> Any:
        self.seen.append("forward")
        return value

    @endpoint(inline=True)
    def broken(self) -> None:
        raise ValueError("no")

    @endpoint(inline=True)
    def awaitable(self) -> Any:
        return anyio.sleep(0)

    @endpoint
    def note(self, value: Any) -> None:
        self.seen.append(value)

    @endpoint
    async def hold(self) -> None:
        self.seen.append("hold")
        self.release = Promise("release")
        await self.release


class Failing(Relay):
    fail_on_error = True


async def test_an_idle_actor_takes_a_call_at_once_and_the_rest_of_the_pass_queue() -> None:
    async with ActorSystem() as system:
        relay = system.spawn(Relay, name="relay")
        await wait_idle()
        first, second, third = relay.take("a"), relay.take("b"), relay.take("c")
        assert first.done() and first.result() == 1  # ran in this step
        assert not second.done() and not third.done()  # the same pass: queued, in order
        assert [await second, await third] == [2, 3]
        await wait_idle()
        fourth = relay.take("d")  # a later pass: at once again
        assert fourth.done() and fourth.result() == 4


async def test_another_endpoint_runs_inline_in_the_same_pass_unless_calls_queue() -> None:
    async with ActorSystem() as system:
        relay = system.spawn(Relay, name="relay")
        await wait_idle()
        first, other = relay.take("a"), relay.forward("x")
        assert first.done() and other.done()  # one call per endpoint per pass goes at once
        second, third = relay.take("b"), relay.forward("y")
        assert not second.done() and not third.done()  # `take` queued: `forward` behind it
        assert [await second, await third] == [3, "y"]
        instance = system._cells[relay.id].instance
        assert isinstance(instance, Relay) and instance.seen == ["a", "forward", "b", "forward"]


async def test_a_busy_actor_queues_an_inline_call_behind_the_one_it_runs() -> None:
    async with ActorSystem() as system:
        relay = system.spawn(Relay, name="relay")
        held = relay.hold()
        await wait_idle()
        taken = relay.take("after")
        await wait_idle()
        assert not taken.done()  # the actor waits in `hold`: nothing runs beside it
        instance = system._cells[relay.id].instance
        assert isinstance(instance, Relay) and instance.release is not None
        instance.release.set_result(None)
        await held
        assert await taken == 2
        assert instance.seen == ["hold", "after"]


async def test_a_call_with_a_promise_to_resolve_first_queues() -> None:
    async with ActorSystem() as system:
        relay = system.spawn(Relay, name="relay")
        await wait_idle()
        value: Promise[int] = Promise("value")
        taken = relay.take(value)
        assert not taken.done()
        value.set_result(7)
        assert await taken == 1
        await wait_idle()
        passed = relay.forward(value)  # not resolved by the actor: runs at once
        assert passed.done() and passed.result() == 7  # (a promise it returns is followed)


async def test_an_inline_call_that_raises_fails_its_caller_not_the_actor() -> None:
    async with ActorSystem() as system:
        relay = system.spawn(Relay, name="relay")
        await wait_idle()
        broken = relay.broken()
        assert broken.done()
        with pytest.raises(RemoteActorError, match="no"):
            await broken
        await wait_idle()
        assert await relay.take("still") == 1
        await wait_idle()
        odd = relay.awaitable()  # an inline handler may not hand back an awaitable
        with pytest.raises(UsageError, match="inline and returned an awaitable"):
            await odd


async def test_an_actor_that_fails_on_error_never_runs_calls_inline() -> None:
    async with ActorSystem() as system:
        failing = system.spawn(Failing, name="failing")
        await wait_idle()
        taken = failing.take("x")
        assert not taken.done()  # supervision runs in the actor's own task
        assert await taken == 1


def test_an_async_handler_cannot_be_inline() -> None:
    with pytest.raises(TypeError, match="cannot run inline"):

        class Wrong(Actor):
            @endpoint(inline=True)
            async def run(self) -> None:
                pass


async def test_an_inline_call_never_overtakes_one_queued_before_it() -> None:
    async with ActorSystem() as system:
        relay = system.spawn(Relay, name="relay")
        await wait_idle()
        noted = relay.note("queued")  # not inline: it waits for the actor's task
        taken = relay.take("inline")
        assert not taken.done()  # the mailbox holds a call: this one queues behind it
        await noted
        assert await taken == 2
        instance = system._cells[relay.id].instance
        assert isinstance(instance, Relay) and instance.seen == ["queued", "inline"]


async def test_a_call_that_ran_inline_and_forwarded_a_promise_can_be_cancelled() -> None:
    async with ActorSystem() as system:
        relay = system.spawn(Relay, name="relay")
        await wait_idle()
        later: Promise[int] = Promise("later")
        forwarded = relay.forward(later)  # ran at once; its answer follows `later`
        assert not forwarded.done()
        assert forwarded.cancel("no longer wanted")
        with pytest.raises(CallCancelled):
            await forwarded
