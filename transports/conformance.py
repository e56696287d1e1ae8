"""The transport conformance suite: one set of checks for every transport.

A transport passes when every function in :data:`CHECKS` completes against a
:class:`Harness` built on it. The checks only talk to the far side through
actor calls on the harness's node reference, so the same checks run
in-process, over a socket, or between machines. The actors they use live in
this module and are spawned by class path.

``Harness.settle`` must return once every message already sent has been
delivered and handled as far as it can go (in-process: the event loop is idle).
It replaces sleeps: checks observe states, never wait for wall time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from ..kernel import (
    Actor,
    ActorRef,
    ActorStopped,
    AtollError,
    CallCancelled,
    MailboxFull,
    NodeActor,
    NoSuchEndpoint,
    Promise,
    RemoteActorError,
    count_waits,
    endpoint,
)

__all__ = ["CHECKS", "Harness"]

HERE = __name__


@dataclass
class Harness:
    """What a check needs: the far node, and a way to let messages settle."""

    node: ActorRef[NodeActor]
    settle: Callable[[], Awaitable[None]]

    async def spawn(self, cls: str, *args: Any) -> ActorRef[Any]:
        ref: ActorRef[Any] = await self.node.spawn(f"{HERE}:{cls}", *args)
        return ref


# -- actors used by the checks ---------------------------------------------
class Counter(Actor):
    def __init__(self) -> None:
        self.items: list[Any] = []
        self.total = 0

    @endpoint
    def append(self, item: Any) -> None:
        self.items.append(item)

    @endpoint
    def add(self, n: int) -> int:
        self.total += n
        return self.total

    @endpoint
    def get_items(self) -> list[Any]:
        return list(self.items)


class Echo(Actor):
    @endpoint
    def echo(self, value: Any) -> Any:
        return value

    @endpoint
    def describe(self, array: np.ndarray) -> tuple[tuple[int, ...], str, float]:
        return array.shape, str(array.dtype), float(array.sum(dtype=np.float64))


class Latch(Actor):
    """Answers ``wait`` only when ``release`` is called; never blocks itself."""

    def __init__(self) -> None:
        self.waiting: list[Promise[Any]] = []
        self.value: Any = None
        self.released = False

    @endpoint
    def wait(self) -> Promise[Any]:
        promise: Promise[Any] = Promise("latch")
        if self.released:
            promise.set_result(self.value)
        else:
            self.waiting.append(promise)
        return promise

    @endpoint
    def release(self, value: Any = None) -> None:
        self.released, self.value = True, value
        for promise in self.waiting:
            promise.set_result(value)
        self.waiting.clear()


class Worker(Actor):
    """Blocks on a latch when asked, and logs what it handled."""

    def __init__(self) -> None:
        self.log: list[Any] = []
        self.cancelled = 0

    @endpoint
    async def block(self, latch: ActorRef[Latch]) -> Any:
        try:
            return await latch.wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise

    @endpoint
    def record(self, item: Any) -> None:
        self.log.append(item)

    @endpoint
    def get_log(self) -> list[Any]:
        return list(self.log)

    @endpoint
    def get_cancelled(self) -> int:
        return self.cancelled


class TinyWorker(Worker):
    mailbox_capacity = 2
    mailbox_slack = 1


class Failer(Actor):
    @endpoint
    def boom(self, message: str) -> None:
        raise ValueError(message)


@dataclass
class Task:
    """A user object that holds capabilities: travels pickled, with its
    actor reference and promise set aside as capabilities."""

    name: str
    target: ActorRef[Any]
    value: Any  # a promise, while it is sent


class Runner(Actor):
    """Keeps the tasks it is given, and runs them on request."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []

    @endpoint
    def keep(self, task: Task) -> str:
        self.tasks.append(task)
        return task.name

    @endpoint
    async def run_all(self) -> list[Any]:
        results = []
        for task in self.tasks:
            value = await task.value if isinstance(task.value, Promise) else task.value
            results.append(await task.target.add(value))
        return results

    @endpoint
    def drop_all(self) -> int:
        dropped, self.tasks = len(self.tasks), []
        return dropped


class Chain(Actor):
    """Each ``next`` spawns a child one level deeper and returns its ref."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth

    @endpoint
    def next(self) -> ActorRef[Chain]:
        return self.ctx.spawn(Chain, self.depth + 1)

    @endpoint
    async def next_after(self, latch: ActorRef[Latch]) -> ActorRef[Chain]:
        await latch.wait()
        return self.ctx.spawn(Chain, self.depth + 1)

    @endpoint
    def get_depth(self) -> int:
        return self.depth


# -- helpers -----------------------------------------------------------------
async def expect(
    kind: type[BaseException], awaitable: Awaitable[Any], timeout: float = 10.0
) -> BaseException:
    """Await ``awaitable`` and return the error of type ``kind`` it raised.

    Bounded: a promise that never settles fails the check with ``TimeoutError``
    (a clean failure, not a hung suite).
    """
    try:
        with anyio.fail_after(timeout):
            value = await awaitable
    except kind as exc:
        return exc
    raise AssertionError(f"expected {kind.__name__}, got a value: {value!r}")


# -- the checks ----------------------------------------------------------------
async def check_sender_order(h: Harness) -> None:
    counter = await h.spawn("Counter")
    for i in range(300):
        counter.append(i)
    assert await counter.get_items() == list(range(300))


async def check_order_per_sender_with_many_senders(h: Harness) -> None:
    counter = await h.spawn("Counter")

    async def sender(tag: str) -> None:
        for i in range(50):
            counter.append((tag, i))
            if i % 7 == 0:
                await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        for tag in "abc":
            tg.start_soon(sender, tag)
    items = await counter.get_items()
    for tag in "abc":
        assert [i for t, i in items if t == tag] == list(range(50))


async def check_promise_argument(h: Harness) -> None:
    latch, echo = await h.spawn("Latch"), await h.spawn("Echo")
    with count_waits() as waits:
        pending = latch.wait()
        echoed = echo.echo(pending)  # passed before it resolves
        await h.settle()
        assert not echoed.done()
        latch.release(42)
        assert await echoed == 42
    assert waits.waits == 1


async def check_pipelined_chain_one_wait(h: Harness) -> None:
    with count_waits() as waits:
        depth = await h.node.spawn(f"{HERE}:Chain").next().next().next().get_depth()
    assert depth == 3
    assert waits.waits == 1


async def check_pipelined_calls_wait_for_their_target(h: Harness) -> None:
    latch = await h.spawn("Latch")
    with count_waits() as waits:
        root = h.node.spawn(f"{HERE}:Chain")
        result = root.next_after(latch).next().get_depth()
        await h.settle()
        assert not result.done()  # sent, parked until its target exists
        latch.release()
        assert await result == 2
    assert waits.waits == 1


async def check_a_call_made_later_on_a_pending_promise_reaches_it(h: Harness) -> None:
    """A call made on a promise some turns after it was sent (the transport
    is awaiting its answer by then) still goes to the actor it settles with."""
    latch = await h.spawn("Latch")
    root = await h.node.spawn(f"{HERE}:Chain")
    child = root.next_after(latch)
    await h.settle()
    depth = child.get_depth()  # made now, while the answer is awaited
    latch.release()
    assert await depth == 1


async def check_remote_error_is_boxed(h: Harness) -> None:
    failer = await h.spawn("Failer")
    error = await expect(RemoteActorError, failer.boom("bad input 17"))
    assert isinstance(error, RemoteActorError)
    assert error.endpoint == "boom"
    assert "Failer" in error.actor
    assert error.exc_type == "builtins.ValueError"
    assert "bad input 17" in error.message
    assert "raise ValueError(message)" in error.remote_traceback
    assert "bad input 17" in str(error)


async def check_errors_flow_through_promises(h: Harness) -> None:
    failer, echo = await h.spawn("Failer"), await h.spawn("Echo")
    error = await expect(RemoteActorError, echo.echo(failer.boom("upstream")))
    assert isinstance(error, RemoteActorError) and error.endpoint == "boom"
    broken = failer.boom("no ref")
    await expect(RemoteActorError, broken.get_depth())
    await expect(NoSuchEndpoint, h.node.spawn(f"{HERE}:Echo").no_such_thing())
    await expect(RemoteActorError, h.node.spawn("atoll_missing.module:Nope"))


async def check_backpressure_blocks_and_resumes(h: Harness) -> None:
    latch, tiny = await h.spawn("Latch"), await h.spawn("TinyWorker")
    running = tiny.block(latch)
    await h.settle()
    sent = 0

    async def flood() -> None:
        nonlocal sent
        for i in range(6):
            await tiny.record.send(i)
            sent += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(flood)
        await h.settle()
        assert sent == TinyWorker.mailbox_capacity  # blocked, not failed
        latch.release("go")
        assert await running == "go"
    assert sent == 6
    assert await tiny.get_log() == list(range(6))


async def check_mailbox_full_is_reported(h: Harness) -> None:
    latch, tiny = await h.spawn("Latch"), await h.spawn("TinyWorker")
    running = tiny.block(latch)
    await h.settle()
    admitted = [tiny.record(i) for i in range(3)]  # capacity + slack
    try:
        refused = tiny.record(99)
    except MailboxFull:
        pass
    else:
        await expect(MailboxFull, refused)
    latch.release()
    await running
    for promise in admitted:
        await promise
    assert await tiny.get_log() == [0, 1, 2]


async def check_cancel_running_call(h: Harness) -> None:
    latch, worker = await h.spawn("Latch"), await h.spawn("Worker")
    running = worker.block(latch)
    await h.settle()
    assert running.cancel("test says so")
    error = await expect(CallCancelled, running)
    assert isinstance(error, CallCancelled) and "test says so" in str(error)
    assert await worker.get_cancelled() == 1
    worker.record("after")
    assert await worker.get_log() == ["after"]


async def check_cancel_queued_call(h: Harness) -> None:
    latch, worker = await h.spawn("Latch"), await h.spawn("Worker")
    running = worker.block(latch)
    queued = worker.record("never")
    kept = worker.record("kept")
    await h.settle()
    assert queued.cancel()
    await expect(CallCancelled, queued)
    latch.release()
    await running
    await kept
    assert await worker.get_log() == ["kept"]


async def check_cancel_in_the_same_turn(h: Harness) -> None:
    latch, worker = await h.spawn("Latch"), await h.spawn("Worker")
    running = worker.block(latch)
    queued = worker.record("never")
    assert queued.cancel()  # before its answer was even waited for
    await expect(CallCancelled, queued)
    kept = worker.record("kept")
    latch.release()
    await running
    await kept
    assert await worker.get_log() == ["kept"]


async def check_stop_fails_pending_calls(h: Harness) -> None:
    latch, worker = await h.spawn("Latch"), await h.spawn("Worker")
    running = worker.block(latch)
    queued = [worker.record(i) for i in range(3)]
    await h.settle()
    with anyio.fail_after(10):
        await worker.stop(grace=0)
    for promise in [running, *queued]:
        await expect(ActorStopped, promise)
    await expect(ActorStopped, worker.record("late"))


async def check_graceful_stop_finishes_running_call(h: Harness) -> None:
    latch, worker = await h.spawn("Latch"), await h.spawn("Worker")
    running = worker.block(latch)
    queued = worker.record("dropped")
    await h.settle()
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.stop, None)
        await h.settle()
        await expect(ActorStopped, queued)
        latch.release("finished")
    assert await running == "finished"


async def check_arrays_arrive_intact(h: Harness) -> None:
    echo = await h.spawn("Echo")
    rng = np.random.default_rng(0)
    for array in (
        rng.standard_normal((512, 1024), dtype=np.float32),
        np.arange(10, dtype=np.int64).reshape(2, 5),
        np.zeros((0, 3), dtype=np.float16),
    ):
        back = await echo.echo(array)
        assert back.dtype == array.dtype and back.shape == array.shape
        assert back.tobytes() == array.tobytes()
        shape, dtype, total = await echo.describe(array)
        assert (tuple(shape), dtype) == (array.shape, str(array.dtype))
        assert total == float(array.sum(dtype=np.float64))


async def check_capabilities_inside_pickled_objects(h: Harness) -> None:
    """Objects that hold actor references and promises travel (pickled, the
    capabilities beside them), are used later, are dropped, and the link
    keeps working afterwards: nothing hangs in the same process."""
    runner, counter, latch = (
        await h.spawn("Runner"),
        await h.spawn("Counter"),
        await h.spawn("Latch"),
    )
    names = [runner.keep(Task(f"t{i}", counter, latch.wait())) for i in range(5)]
    with anyio.fail_after(10):
        assert [await name for name in names] == [f"t{i}" for i in range(5)]
    results = runner.run_all()
    await h.settle()
    assert not results.done()  # the promises inside the tasks are still pending
    latch.release(3)
    with anyio.fail_after(10):
        assert await results == [3, 6, 9, 12, 15]
        assert await runner.drop_all() == 5
    await h.settle()
    with anyio.fail_after(10):  # later work on the same link and actors still runs
        assert await counter.add(1) == 16
        assert await runner.keep(Task("again", counter, 4)) == "again"
        assert await runner.run_all() == [20]
        echo = await h.spawn("Echo")
        assert await echo.echo(Task("back", counter, None)) == Task("back", counter, None)


async def check_unknown_actor_class_is_an_error(h: Harness) -> None:
    error = await expect(RemoteActorError, h.node.spawn(f"{HERE}:expect"))
    assert "not an Actor subclass" in str(error)
    assert isinstance(error, AtollError)


CHECKS: list[Callable[[Harness], Awaitable[None]]] = [
    check_sender_order,
    check_order_per_sender_with_many_senders,
    check_promise_argument,
    check_pipelined_chain_one_wait,
    check_pipelined_calls_wait_for_their_target,
    check_a_call_made_later_on_a_pending_promise_reaches_it,
    check_remote_error_is_boxed,
    check_errors_flow_through_promises,
    check_backpressure_blocks_and_resumes,
    check_mailbox_full_is_reported,
    check_cancel_running_call,
    check_cancel_queued_call,
    check_cancel_in_the_same_turn,
    check_stop_fails_pending_calls,
    check_graceful_stop_finishes_running_call,
    check_arrays_arrive_intact,
    check_capabilities_inside_pickled_objects,
    check_unknown_actor_class_is_an_error,
]
