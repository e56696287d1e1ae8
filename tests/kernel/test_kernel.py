"""The kernel on its own: lifecycle, supervision, promises, back-pressure."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

from atoll.kernel import (
    Actor,
    ActorCancelled,
    ActorFailed,
    ActorRef,
    ActorStopped,
    ActorSystem,
    AtollError,
    BadCall,
    CallCancelled,
    Directive,
    MailboxFull,
    Promise,
    RemoteActorError,
    VirtualClock,
    WallClock,
    count_waits,
    current_clock,
    endpoint,
    fail_after,
    move_on_after,
    use_clock,
    wait_idle,
)
from atoll.transports.conformance import expect

pytestmark = pytest.mark.anyio


class Store(Actor):
    def __init__(self) -> None:
        self.value: Any = None

    @endpoint
    def put(self, value: Any) -> None:
        self.value = value

    @endpoint
    def get(self) -> Any:
        return self.value

    @endpoint
    def plus(self, a: int, b: int = 0) -> int:
        return a + b


class Gate(Actor):
    """Holds calls open until ``open`` is called, without blocking itself."""

    def __init__(self) -> None:
        self.waiters: list[Promise[None]] = []

    @endpoint
    def wait(self) -> Promise[None]:
        promise: Promise[None] = Promise("gate")
        self.waiters.append(promise)
        return promise

    @endpoint
    def open(self) -> None:
        for promise in self.waiters:
            promise.set_result(None)


class Blocker(Actor):
    mailbox_capacity = 2
    mailbox_slack = 0

    def __init__(self) -> None:
        self.seen: list[int] = []

    @endpoint
    async def hold(self, gate: ActorRef[Gate]) -> str:
        await gate.wait()
        return "released"

    @endpoint
    def note(self, i: int) -> None:
        self.seen.append(i)

    @endpoint
    def get_seen(self) -> list[int]:
        return self.seen


# -- lifecycle, stop and cancel ------------------------------------------------
class Hanging(Actor):
    @endpoint
    async def forever(self) -> None:
        await anyio.sleep_forever()


class SlowStart(Actor):
    async def on_start(self) -> None:
        await anyio.sleep_forever()

    @endpoint
    def hello(self) -> str:
        return "hi"


async def test_stop_never_hangs_on_a_stuck_handler() -> None:
    async with ActorSystem() as system:
        ref = system.spawn(Hanging)
        stuck = ref.forever()
        queued = ref.forever()
        await wait_idle()
        with anyio.fail_after(5):
            await ref.stop(grace=0.01)
        with pytest.raises(ActorCancelled):
            await stuck
        with pytest.raises(ActorStopped):
            await queued


async def test_cancel_during_on_start() -> None:
    async with ActorSystem() as system:
        ref = system.spawn(SlowStart)
        pending = ref.hello()
        await wait_idle()
        with anyio.fail_after(5):
            await ref.cancel("enough")
        error = await expect(ActorStopped, pending)
        assert "enough" in str(error)


async def test_leaving_the_system_fails_pending_calls() -> None:
    async with ActorSystem() as system:
        ref = system.spawn(Hanging)
        pending = ref.forever()
        await wait_idle()
    assert isinstance(pending.exception(), ActorStopped)


async def test_actor_can_stop_itself() -> None:
    class Quitter(Actor):
        @endpoint
        async def quit(self) -> str:
            await self.ctx.ref.stop()
            return "bye"

    async with ActorSystem() as system:
        ref = system.spawn(Quitter)
        assert await ref.quit() == "bye"
        await expect(ActorStopped, ref.quit())


async def test_lifecycle_hooks_run_in_order() -> None:
    events: list[str] = []

    class Hooks(Actor):
        async def on_start(self) -> None:
            events.append("start")

        async def on_stop(self) -> None:
            events.append("stop")

        @endpoint
        def work(self) -> None:
            events.append("work")

    async with ActorSystem() as system:
        ref = system.spawn(Hooks)
        await ref.work()
        await ref.stop()
    assert events == ["start", "work", "stop"]


# -- calls ---------------------------------------------------------------------
async def test_bad_calls_fail_before_sending() -> None:
    async with ActorSystem() as system:
        ref = system.spawn(Store)
        with pytest.raises(BadCall):
            ref.plus(1, 2, 3)  # type: ignore[call-arg]  # what mypy's plugin catches too
        with pytest.raises(AttributeError):
            ref.nothing_here()  # type: ignore[misc]
        assert await ref.plus(1, b=2) == 3
        with pytest.raises(TypeError):
            system.spawn(int)  # type: ignore[type-var]


async def test_numpy_arrays_are_shared_not_copied() -> None:
    big = np.ones((1024, 1024), dtype=np.float32)  # 4 MiB
    async with ActorSystem() as system:
        ref = system.spawn(Store)
        await ref.put(big)
        held = await ref.get()
    assert np.shares_memory(held, big)
    assert not held.flags.writeable  # a receiver cannot scribble on the sender
    assert big.flags.writeable


async def test_an_endpoint_that_only_passes_its_arguments_on_takes_them_as_they_are() -> None:
    """``@endpoint(share_args=False)``: no read-only view is made (a relay
    never writes into what it is given); the default still makes one."""

    class Relay(Actor):
        @endpoint(share_args=False)
        def keep(self, values: list[np.ndarray]) -> list[np.ndarray]:
            return values

        @endpoint
        def shared(self, values: list[np.ndarray]) -> list[np.ndarray]:
            return values

    array = np.zeros(4, np.float32)
    async with ActorSystem() as system:
        ref = system.spawn(Relay)
        [kept] = await ref.keep([array])
        [shared] = await ref.shared([array])
    assert kept is array
    assert shared is not array and np.shares_memory(shared, array)
    assert not shared.flags.writeable


async def test_a_running_call_of_an_endpoint_that_is_not_cancellable_runs_to_its_end() -> None:
    """``@endpoint(cancellable=False)``: no cancel scope per call, so a
    running call cannot be cancelled (``cancel`` says so), while a queued
    one can, and stopping the actor still stops a running one."""
    go = anyio.Event()

    class Worker(Actor):
        @endpoint(cancellable=False)
        async def work(self, x: int) -> int:
            await go.wait()
            return x

    async with ActorSystem() as system:
        ref = system.spawn(Worker)
        running, queued = ref.work(1), ref.work(2)
        await wait_idle()
        assert not running.cancel("too late")
        assert queued.cancel("not wanted")
        go.set()
        assert await running == 1
        await expect(CallCancelled, queued)
        go = anyio.Event()
        stuck = ref.work(3)
        await wait_idle()
        with anyio.fail_after(5):
            await ref.cancel("enough")
        await expect(ActorCancelled, stuck)


async def test_promise_argument_is_resolved_by_the_receiver() -> None:
    async with ActorSystem() as system:
        gate, blocker, store = system.spawn(Gate), system.spawn(Blocker), system.spawn(Store)
        with count_waits() as waits:
            held = blocker.hold(gate)
            stored = store.put(held)  # the caller does not wait for `held`
            await wait_idle()
            assert not stored.done() and not held.done()
            gate.open()
            await stored
            assert await store.get() == "released"
        assert waits.waits == 2  # one for `stored`, one for the final get


async def test_pipelined_chain_costs_one_wait_and_three_messages() -> None:
    class Link(Actor):
        def __init__(self, depth: int) -> None:
            self.depth = depth

        @endpoint
        def child(self) -> ActorRef[Link]:
            return self.ctx.spawn(Link, self.depth + 1)

        @endpoint
        def get_depth(self) -> int:
            return self.depth

    async with ActorSystem() as system:
        root = system.spawn(Link, 0)
        with count_waits() as waits:
            result = root.child().child().get_depth()
            assert system.stats(root)["queued"] == 1  # only the first hop sent
            assert await result == 2
        assert waits.waits == 1


async def test_an_endpoint_can_answer_with_a_promise() -> None:
    async with ActorSystem() as system:
        gate = system.spawn(Gate)
        waiting = gate.wait()
        await wait_idle()
        assert not waiting.done()
        await gate.open()  # the gate was not blocked by its pending answer
        assert waiting.done() and waiting.exception() is None  # answered, with None


# -- back-pressure -------------------------------------------------------------
async def test_bounded_mailbox_blocks_sender_then_resumes() -> None:
    async with ActorSystem() as system:
        gate, blocker = system.spawn(Gate), system.spawn(Blocker)
        held = blocker.hold(gate)
        await wait_idle()
        progress: list[int] = []

        async def flood() -> None:
            for i in range(10):
                await blocker.note.send(i)
                progress.append(i)

        async with anyio.create_task_group() as tg:
            tg.start_soon(flood)
            await wait_idle()
            assert progress == [0, 1]  # capacity 2: the third send waits
            assert system.stats(blocker)["blocked_puts"] == 1
            with pytest.raises(MailboxFull):
                blocker.note(99)  # no slack: a sync call is refused at once
            gate.open()
        assert await held == "released"
        assert progress == list(range(10))
        assert await (await blocker.get_seen.send()) == list(range(10))


# -- supervision ---------------------------------------------------------------
class Flaky(Actor):
    fail_on_error = True
    max_restarts = 2
    starts = 0

    def __init__(self) -> None:
        type(self).starts += 1
        self.count = 0

    @endpoint
    def bump(self) -> int:
        self.count += 1
        return self.count

    @endpoint
    def crash(self) -> None:
        raise RuntimeError("crashed on purpose")


class Parent(Actor):
    def __init__(self, directive: Directive) -> None:
        self.directive = directive
        self.failures: list[BaseException] = []

    @endpoint
    def make_child(self) -> ActorRef[Flaky]:
        return self.ctx.spawn(Flaky, name="child")

    @endpoint
    def failures_seen(self) -> list[str]:
        return [str(f) for f in self.failures]

    def on_child_failed(self, child: ActorRef[Any], error: BaseException) -> Directive:
        self.failures.append(error)
        return self.directive


async def test_restart_keeps_ref_and_mailbox_but_resets_state() -> None:
    Flaky.starts = 0
    async with ActorSystem() as system:
        parent = system.spawn(Parent, Directive.RESTART)
        child = await parent.make_child()
        assert await child.bump() == 1
        await expect(RemoteActorError, child.crash())
        assert await child.bump() == 1  # a fresh instance, same reference
        assert Flaky.starts == 2
        assert len(await parent.failures_seen()) == 1
        assert system.stats(child)["restarts"] == 1


async def test_stop_directive_fails_later_calls() -> None:
    async with ActorSystem() as system:
        parent = system.spawn(Parent, Directive.STOP)
        child = await parent.make_child()
        await expect(RemoteActorError, child.crash())
        await expect(ActorStopped, child.bump())
        assert await parent.failures_seen()  # the parent lives on


async def test_escalation_fails_the_parent_up_to_the_top() -> None:
    async with ActorSystem() as system:
        parent = system.spawn(Parent, Directive.ESCALATE)
        child = await parent.make_child()
        await expect(RemoteActorError, child.crash())
        await wait_idle()
        await expect(ActorStopped, parent.failures_seen())
        await expect(ActorStopped, child.bump())
        assert len(system.failures) == 1
        failed = system.failures[0]
        assert isinstance(failed, ActorFailed) and "Parent" in failed.actor
        assert isinstance(failed.error, ActorFailed) and "child" in failed.error.actor


async def test_too_many_restarts_escalate() -> None:
    async with ActorSystem() as system:
        parent = system.spawn(Parent, Directive.RESTART)
        child = await parent.make_child()
        for _ in range(Flaky.max_restarts + 1):
            await expect(RemoteActorError, child.crash())
        await wait_idle()
        assert len(system.failures) == 1
        await expect(ActorStopped, child.bump())


async def test_failing_on_start_is_supervised() -> None:
    class BadStart(Actor):
        async def on_start(self) -> None:
            raise OSError("no device")

        @endpoint
        def hello(self) -> str:
            return "hi"

    seen: list[ActorFailed] = []

    def supervise(ref: ActorRef[Any], failed: ActorFailed) -> Directive:
        seen.append(failed)
        return Directive.STOP

    async with ActorSystem(supervise=supervise) as system:
        ref = system.spawn(BadStart)
        error = await expect(ActorStopped, ref.hello())
        assert "no device" in str(error)
    assert len(seen) == 1 and isinstance(seen[0].error, OSError)


async def test_children_stop_with_their_parent() -> None:
    async with ActorSystem() as system:
        parent = system.spawn(Parent, Directive.STOP)
        child = await parent.make_child()
        await parent.stop()
        await expect(ActorStopped, child.bump())


# -- clocks --------------------------------------------------------------------
async def test_virtual_clock_jumps_deterministically() -> None:
    clock = VirtualClock()
    order: list[tuple[str, float]] = []

    async def sleeper(name: str, delay: float) -> None:
        await clock.sleep(delay)
        order.append((name, clock.now()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(clock.run)
        with anyio.fail_after(5):
            async with anyio.create_task_group() as sleepers:
                for name, delay in [("c", 3.0), ("a", 1.0), ("b", 2.0), ("a2", 1.0)]:
                    sleepers.start_soon(sleeper, name, delay)
        tg.cancel_scope.cancel()
    # trio shuffles tasks that become ready together, so ties have no order
    assert sorted(order, key=lambda o: (o[1], o[0])) == [
        ("a", 1.0),
        ("a2", 1.0),
        ("b", 2.0),
        ("c", 3.0),
    ]
    assert [t for _, t in order] == [1.0, 1.0, 2.0, 3.0]
    assert clock.jumps == 3


async def test_timers_fire_in_deadline_order_on_a_virtual_clock_only_when_advanced() -> None:
    clock = VirtualClock(autojump=False)
    fired: list[tuple[str, float]] = []

    def fire(name: str) -> Callable[[], None]:
        return lambda: fired.append((name, clock.now()))

    for name, delay in [("c", 3.0), ("a", 1.0), ("b", 2.0)]:
        clock.call_later(delay, fire(name))
    dropped = clock.call_later(1.5, lambda: fired.append(("dropped", clock.now())))
    dropped.cancel()
    await anyio.lowlevel.checkpoint()
    assert fired == []  # no autojump: nothing moves by itself
    clock.advance(2.0)
    assert fired == [("a", 1.0), ("b", 2.0)] and clock.now() == 2.0
    clock.advance(5.0)
    assert fired[-1] == ("c", 3.0) and clock.now() == 7.0
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance(-1)


async def test_cancelled_timers_do_not_pile_up_and_a_timer_for_ever_is_not_queued() -> None:
    clock = VirtualClock(autojump=False)
    for _ in range(1000):
        clock.call_later(1.0, lambda: None).cancel()  # a connection's hold timers, say
    assert len(clock._sleepers) <= 130
    never = clock.call_later(math.inf, lambda: None)
    assert len(clock._sleepers) <= 130
    never.cancel()


async def test_a_timeout_on_a_clock_takes_that_clocks_time() -> None:
    clock = VirtualClock(autojump=False)
    reached: list[str] = []

    async def waits() -> None:
        with move_on_after(clock, 10.0) as scope:
            await anyio.sleep_forever()
        reached.append("moved on" if scope.cancelled_caught else "?")
        with pytest.raises(TimeoutError), fail_after(clock, 1.0):
            await anyio.sleep_forever()
        reached.append("failed")

    async with anyio.create_task_group() as tg:
        tg.start_soon(waits)
        await wait_idle()
        clock.advance(9.9)
        await wait_idle()
        assert reached == []
        clock.advance(0.1)
        await wait_idle()
        assert reached == ["moved on"]
        clock.advance(1.0)
    assert reached == ["moved on", "failed"]


async def test_a_wall_clock_timer_fires_and_a_cancelled_one_does_not() -> None:
    clock = WallClock()
    last = anyio.Event()
    called: list[str] = []

    def raises() -> None:
        called.append("raised")
        raise RuntimeError("a timer's own failure")

    clock.call_later(0.0, raises)  # logged, not fatal
    clock.call_later(0.001, lambda: called.append("cancelled")).cancel()
    clock.call_later(0.002, last.set)
    with anyio.fail_after(10):
        await last.wait()
    assert called == ["raised"]


async def test_use_clock_sets_the_clock_of_this_context_and_its_systems() -> None:
    assert isinstance(current_clock(), WallClock)
    clock = VirtualClock(autojump=False)
    with use_clock(clock):
        assert current_clock() is clock
        async with ActorSystem("clocked") as system:
            assert system.clock is clock
    assert isinstance(current_clock(), WallClock)


async def test_system_is_required_for_spawning() -> None:
    system = ActorSystem()
    with pytest.raises(AtollError):
        system.spawn(Store)


async def test_signature_checks_fast_and_slow_paths_agree() -> None:
    class Shapes(Actor):
        @endpoint
        def fixed(self, a: int, b: int = 0) -> int:
            return a + b

        @endpoint
        def star(self, a: int, *rest: int) -> int:
            return a + sum(rest)

        @endpoint
        def keyword(self, a: int, *, k: int) -> int:
            return a + k

    async with ActorSystem() as system:
        ref = system.spawn(Shapes)
        assert await ref.fixed(1) == 1 and await ref.fixed(1, 2) == 3
        assert await ref.star(1, 2, 3) == 6
        assert await ref.keyword(1, k=2) == 3
        calls: list[tuple[str, tuple[int, ...], dict[str, int]]] = [
            ("fixed", (), {}),
            ("fixed", (1, 2, 3), {}),
            ("star", (), {}),
            ("keyword", (1,), {}),
            ("fixed", (1,), {"c": 2}),
        ]
        for name, args, kwargs in calls:
            with pytest.raises(BadCall):
                getattr(ref, name)(*args, **kwargs)


async def test_parent_restarted_after_a_child_escalated_keeps_serving() -> None:
    class Grandparent(Actor):
        @endpoint
        def make_parent(self) -> ActorRef[Parent]:
            return self.ctx.spawn(Parent, Directive.ESCALATE, name="parent")

        def on_child_failed(self, child: ActorRef[Any], error: BaseException) -> Directive:
            return Directive.RESTART

    async with ActorSystem() as system:
        top = system.spawn(Grandparent)
        parent = await top.make_parent()
        child = await parent.make_child()
        await expect(RemoteActorError, child.crash())
        await wait_idle()
        assert await parent.failures_seen() == []  # a fresh instance, same reference
        assert system.stats(parent)["restarts"] == 1
        await expect(ActorStopped, child.bump())  # the old children went with it
        assert system.failures == []


async def test_a_hanging_on_stop_does_not_hang_stop() -> None:
    class Stubborn(Actor):
        async def on_stop(self) -> None:
            await anyio.sleep_forever()

        @endpoint
        def hello(self) -> str:
            return "hi"

    async with ActorSystem(on_stop_timeout=0.05) as system:
        ref = system.spawn(Stubborn)
        assert await ref.hello() == "hi"
        with anyio.fail_after(5):
            await ref.stop()


class Watcher(Actor):
    """Counts in a task of its own, beside its messages (``ctx.start_soon``)."""

    def __init__(self) -> None:
        self.ticks = 0
        self.stopped = anyio.Event()

    async def on_start(self) -> None:
        self.ctx.start_soon(self._tick)

    async def _tick(self) -> None:
        try:
            while True:
                self.ticks += 1
                await anyio.sleep(0.001)
        finally:
            self.stopped.set()

    @endpoint
    def count(self) -> int:
        return self.ticks


async def test_a_task_started_by_an_actor_ends_with_it() -> None:
    async with ActorSystem() as system:
        ref = system.spawn(Watcher)
        with anyio.fail_after(5):
            while await ref.count() < 3:
                await anyio.sleep(0.005)
        cell = system._cells[ref.id]
        instance = cell.instance
        assert isinstance(instance, Watcher)
        await ref.stop()
        with anyio.fail_after(5):
            await instance.stopped.wait()  # cancelled when its actor stopped


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # (trio runs callbacks in tasks)
async def test_an_actor_starts_a_task_from_a_plain_callback_of_the_loop(
    anyio_backend: str,
) -> None:
    """A promise settled outside any task (an asyncio timer, a socket's
    read: a callback in the loop's own context) may start an actor's task
    from its callback, and the task runs in the actor's context, not the
    loop's (the runtime keeps its clock and its Cap'n Proto mark there)."""
    import asyncio
    import contextvars

    mark: contextvars.ContextVar[str] = contextvars.ContextVar("mark", default="the loop's")
    mark.set("the actor's")
    async with ActorSystem() as system:
        ref = system.spawn(Watcher)
        await wait_idle()
        instance = system._cells[ref.id].instance
        assert isinstance(instance, Watcher)
        ran = anyio.Event()
        seen: list[str] = []

        async def task() -> None:
            seen.append(mark.get())
            ran.set()

        loop = asyncio.get_running_loop()
        loop.call_soon(instance.ctx.start_soon, task, context=contextvars.Context())
        with anyio.fail_after(5):
            await ran.wait()
        assert seen == ["the actor's"]


async def test_a_stopping_actor_starts_no_task() -> None:
    """From ``on_stop`` on, ``ctx.stopping`` says so and ``start_soon``
    refuses: the task would outlive the actor."""
    seen: list[Any] = []

    class Closing(Actor):
        async def on_stop(self) -> None:
            seen.append(self.ctx.stopping)
            try:
                self.ctx.start_soon(anyio.sleep, 0)
            except ActorStopped as exc:
                seen.append(exc)

        @endpoint
        def stopping(self) -> bool:
            return self.ctx.stopping

    async with ActorSystem() as system:
        ref = system.spawn(Closing)
        assert await ref.stopping() is False
        await ref.stop()
    assert seen[0] is True and isinstance(seen[1], ActorStopped)


async def test_call_soon_and_threadsafe_callers_reach_this_loop() -> None:
    import threading

    from atoll.kernel.lowlevel import call_soon, threadsafe_caller

    seen: list[str] = []
    done = anyio.Event()
    call_soon(lambda: seen.append("soon"))
    assert seen == []  # not before this turn is over
    post = threadsafe_caller()

    def arrived() -> None:
        seen.append(threading.current_thread().name)
        done.set()

    def elsewhere() -> None:
        post(arrived)

    thread = threading.Thread(target=elsewhere, name="other")
    thread.start()
    with anyio.fail_after(5):
        await done.wait()
    thread.join()
    assert seen == ["soon", threading.current_thread().name]


async def test_a_call_that_needs_no_waiting_settles_at_once() -> None:
    """A plain endpoint runs to its end in the cell's turn (no cancel scope),
    and one that raises still answers with its error."""

    class Plain(Actor):
        @endpoint
        def double(self, x: int) -> int:
            return 2 * x

        @endpoint
        def fail(self) -> None:
            raise KeyError("nope")

    async with ActorSystem() as system:
        ref = system.spawn(Plain)
        assert await ref.double(21) == 42
        await expect(RemoteActorError, ref.fail())
        waiting: Promise[int] = Promise("later")
        answer = ref.double(waiting)  # a promise argument: resolved first
        waiting.set_result(4)
        assert await answer == 8


def test_a_notice_nobody_awaits_logs_its_failure_quietly_when_its_host_went(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from atoll.kernel import HostLost, log_failure

    logger = logging.getLogger("atoll.test.notices")
    logged = log_failure(logger, "a notice")
    with caplog.at_level(logging.DEBUG, logger.name):
        for error in (HostLost("gone"), ValueError("wrong")):
            notice: Promise[None] = Promise("notice")
            notice.set_exception(error)
            logged(notice)
        done: Promise[None] = Promise("notice")
        done.set_result(None)
        logged(done)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, "a notice failed: gone"),
        (logging.WARNING, "a notice failed: wrong"),
    ]
