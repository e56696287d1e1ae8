"""How a Cap'n Proto peer awaits a remote call's answer (``_Awaiting``).

No task per answer: the answer's future is taken in the loop's next turn and
its callback settles the promise. These tests stand a fake answer in for
pycapnp's (an object whose ``__await__`` is an asyncio future's), so each
order of events can be made to happen: a cancel or a close before the turn,
a cancel between the answer and its callback, an answer that fails.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from atoll.kernel import CallCancelled, HostLost, Promise
from atoll.transports.capnp._peer import Peer

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]


class _Answer:
    """Stands in for pycapnp's answer: awaiting it awaits ``future``."""

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self.future = future

    def __await__(self) -> Any:
        return self.future.__await__()


def _asked() -> tuple[Peer, Promise[Any], asyncio.Future[Any], list[Any]]:
    """A peer asked one question: its promise, the answer's future, and what
    the peer read of answers (the decoding is not these tests' subject)."""
    peer = Peer("far")
    read: list[Any] = []

    def answered(promise: Promise[Any], response: Any) -> None:
        read.append(response)
        promise.set_result(1)

    peer._answered = answered  # type: ignore[method-assign]
    future = asyncio.get_running_loop().create_future()
    promise: Promise[Any] = Promise("remote")
    return peer, promise, future, read


async def _turns(count: int = 3) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def test_an_answer_settles_its_promise_with_no_task_and_the_count_goes_back() -> None:
    peer, promise, future, read = _asked()
    awaiting = peer.settle_later(_Answer(future), promise)
    await _turns()
    assert peer.asking == 1 and not awaiting.done()  # asked, and waiting
    future.set_result("response")
    await _turns()
    assert read == ["response"] and promise.result() == 1
    assert awaiting.done() and peer.asking == 0 and not peer._tasks


async def test_a_cancel_before_the_next_turn_asks_nothing() -> None:
    peer, promise, future, read = _asked()
    awaiting = peer.settle_later(_Answer(future), promise)
    assert awaiting.cancel()
    promise.set_exception(CallCancelled("far", "f", "at once"))  # (what the caller does)
    await _turns()
    assert read == [] and peer.asking == 0 and not peer._tasks
    assert not future.done()  # never taken: pycapnp's question is the caller's to drop


async def test_a_cancel_after_the_answer_came_reads_nothing_of_it() -> None:
    peer, promise, future, read = _asked()
    awaiting = peer.settle_later(_Answer(future), promise)
    await _turns()
    future.set_result("response")  # its callback waits for the next turn
    assert awaiting.cancel()  # as a task's would: it has not ended yet
    promise.set_exception(CallCancelled("far", "f", "late"))
    await _turns()
    assert read == [] and peer.asking == 0
    assert isinstance(promise.exception(), CallCancelled)


async def test_a_close_before_or_after_the_turn_fails_the_promise_with_host_lost() -> None:
    for turns in (0, 3):
        peer, promise, future, read = _asked()
        peer.settle_later(_Answer(future), promise)
        await _turns(turns)
        peer.close("the far end went")
        await _turns()
        assert isinstance(promise.exception(), HostLost)
        assert read == [] and peer.asking == 0 and not peer._tasks


async def test_an_answer_that_fails_fails_its_promise() -> None:
    peer, promise, future, read = _asked()
    peer.settle_later(_Answer(future), promise)
    await _turns()
    future.set_exception(ValueError("broken"))
    await _turns()
    assert isinstance(promise.exception(), ValueError) and read == [] and peer.asking == 0
