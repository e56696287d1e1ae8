"""Run lanes and call lanes: the control plane's hot path, one way.

``transports/oneway.py`` (the link), ``devices/_runlane.py`` (the codec and
the receiving ends) and ``runtime/runlanes.py`` (the calling ends): what a
loop turn sends leaves in one write, handles travel as their fields, what
needs Cap'n Proto goes beside the call without breaking its order, and a
lost link fails what was sent on it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atoll.benchmarks._testbed import up_cluster
from atoll.devices import Aval, BufferHandle, Computation
from atoll.devices import _runlane as wire
from atoll.kernel import HostLost, Promise, failed, process_counters
from atoll.runtime import GraphBuilder
from atoll.runtime.client.connect import connect
from atoll.runtime.runlanes import Caller
from atoll.transports import oneway
from atoll.transports.capnp import capnp_runtime

pytestmark = pytest.mark.anyio
TOKEN = b"t" * 16


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # lanes live beside Cap'n Proto, on its asyncio loop


def _handle(host_id: int, host: Any = None) -> BufferHandle:
    return BufferHandle.of("b1", np.arange(3.0), host, host_id, 0, 0, "x:1")


# -- the link --------------------------------------------------------------------
async def test_sends_made_together_leave_as_the_block_ends_in_one_write() -> None:
    """``writes_together``: a batch sent at the end of a loop turn leaves
    at once, in one write per link, not a pass of the loop later."""
    got: list[bytes] = []
    address = await oneway.serve("test", "127.0.0.1", TOKEN, lambda _, m: got.extend(m), print)
    try:
        link = await oneway.connect(address, TOKEN, lambda *_: None, lambda _: None)
        writes = process_counters()["socket_writes"]
        with oneway.writes_together():
            for i in range(5):
                link.send(b"m%d" % i)
            with oneway.writes_together():  # (nested: the outer end writes)
                link.send(b"m5")
            assert process_counters()["socket_writes"] == writes
        assert process_counters()["socket_writes"] - writes == 1  # before any pass of the loop
        link.send(b"m6")  # outside: at the end of the turn, as before
        assert process_counters()["socket_writes"] - writes == 1
        await asyncio.sleep(0.05)
        assert process_counters()["socket_writes"] - writes == 2
        assert got == [b"m%d" % i for i in range(7)]
        link.close()
    finally:
        await oneway.aclose()


async def test_a_turn_of_sends_leaves_in_one_write_and_arrives_in_order() -> None:
    got: list[list[bytes]] = []
    address = await oneway.serve("test", "127.0.0.1", TOKEN, lambda _, m: got.append(m), print)
    try:
        link = await oneway.connect(address, TOKEN, lambda *_: None, lambda _: None)
        writes = process_counters()["socket_writes"]
        for i in range(50):
            link.send(b"m%d" % i)
        await asyncio.sleep(0.05)
        assert process_counters()["socket_writes"] - writes == 1
        assert [m for batch in got for m in batch] == [b"m%d" % i for i in range(50)]
        link.close()
    finally:
        await oneway.aclose()


async def test_a_wrong_token_is_refused_before_any_message() -> None:
    got: list[bytes] = []
    lost: list[oneway.Link] = []
    address = await oneway.serve("test", "127.0.0.1", TOKEN, lambda _, m: got.extend(m), print)
    try:
        link = await oneway.connect(address, b"wrong" * 4, lambda *_: None, lost.append)
        link.send(b"hello")
        for _ in range(100):
            if lost:
                break
            await asyncio.sleep(0.01)
        assert lost == [link] and got == []
    finally:
        await oneway.aclose()


# -- the codec ---------------------------------------------------------------------
def test_a_handle_of_the_far_host_goes_as_its_fields_and_comes_back_with_its_host() -> None:
    data = wire.dumps(([_handle(2)], None), 2, 7, wire.RUN, 5)
    request, kind, target, body = wire.parse(data)
    assert (request, kind, target) == (7, wire.RUN, 5)
    args, ticket = wire.loads(body, {2: "host two"})  # type: ignore[dict-item]
    assert ticket is None and args[0].host == "host two" and args[0].id == "b1"
    np.testing.assert_array_equal(args[0].value, np.arange(3.0))


def test_what_needs_capnp_is_set_aside() -> None:
    pending: Promise[int] = Promise("pending")
    for value in (_handle(1), pending, np.zeros(1 << 15)):
        with pytest.raises(wire.Aside):
            wire.dumps((value,), 2)
    assert wire.dumps((_handle(1),), None)  # to or from the controller: any host's
    settled: Promise[int] = Promise("settled")
    settled.set_result(4)
    assert wire.loads(wire.parse(wire.dumps((settled,), 2))[3], {}) == (4,)
    (back,) = wire.loads(wire.parse(wire.dumps((failed(KeyError("k")),), 2))[3], {})
    assert isinstance(back, Promise) and isinstance(back.exception(), KeyError)


def test_a_closure_goes_by_value() -> None:
    k = 3

    def times(x: int) -> int:
        return k * x

    (back,) = wire.loads(wire.parse(wire.dumps((times,), 0))[3], {})
    assert back(2) == 6


# -- the calling end ---------------------------------------------------------------
class _Far:
    """A far end that answers each call with its args, and records them."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, Any]] = []

    def received(self, link: oneway.Link, messages: list[bytes]) -> None:
        for data in messages:
            request, kind, target, body = wire.parse(data)
            args, _ = wire.loads(body, {})
            self.calls.append((target, kind, args))
            link.send(wire.dumps((None, args), None, request))


async def _caller(far: _Far, waits: bool) -> Caller:
    address = await oneway.serve("test", "127.0.0.1", TOKEN, far.received, lambda _: None)

    def stash(ticket: str, args: tuple[Any, ...]) -> Promise[None]:
        raise AssertionError("nothing here needs Cap'n Proto")

    caller = Caller("far", None, dict, stash, waits=waits)
    answer: Promise[str] = Promise("where")
    answer.set_result(address)
    caller.start(answer, TOKEN)
    return caller


async def test_a_call_waiting_for_its_input_holds_back_its_target_only() -> None:
    far = _Far()
    caller = await _caller(far, waits=True)
    try:
        by_call = lambda: failed(AssertionError("not by call"))  # noqa: E731
        later: Promise[int] = Promise("input")
        first = caller.call(wire.RUN, 1, (later,), by_call)
        second = caller.call(wire.RUN, 1, ("after",), by_call)
        other = caller.call(wire.RUN, 2, ("other device",), by_call)
        assert await other == ("other device",)
        assert not first.done() and not second.done()
        later.set_result(5)
        assert await first == (5,) and await second == ("after",)
        assert [args for target, _, args in far.calls if target == 1] == [(5,), ("after",)]
    finally:
        caller.close()
        await oneway.aclose()


async def test_a_lost_link_fails_what_was_sent_and_sends_the_rest_by_call() -> None:
    class Silent(_Far):
        def received(self, link: oneway.Link, messages: list[bytes]) -> None:
            link.close()  # takes the calls, answers none

    caller = await _caller(Silent(), waits=True)
    try:
        by_call = lambda: failed(KeyError("by call"))  # noqa: E731
        sent = caller.call(wire.RUN, 1, ("x",), by_call)
        with pytest.raises(HostLost):
            await sent
        later = caller.call(wire.RUN, 1, ("y",), by_call)
        with pytest.raises(KeyError):
            await later
    finally:
        caller.close()
        await oneway.aclose()


# -- over host processes -----------------------------------------------------------
def _plus_one(x: np.ndarray) -> np.ndarray:
    return np.asarray(x) + 1


@contextlib.asynccontextmanager
async def _session(tmp_path: Path, token: str, name: str) -> AsyncIterator[Any]:
    """A session of a client in this process on ``atoll up`` with two hosts."""
    async with (
        capnp_runtime(),
        up_cluster(2, tmp_path, token * 16) as cluster,
        connect(cluster.cluster_file) as client,
    ):
        yield await client.cluster(name)


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_runs_go_by_lane_and_a_pipelined_promise_still_reaches_its_run(
    tmp_path: Path,
) -> None:
    """A client in another process: its runs and the hosts' parts go by lane
    (no Cap'n Proto call from the client or the controller per run); a
    promise passed on before it settled goes beside its run (stash), in
    order, and the chain's value is right."""
    step = Computation("plus1", _plus_one, flops=1e3)
    async with _session(tmp_path, "3c", "lanes") as handle:
        x = await handle.fetch(handle.run(step, 0, [np.zeros(2, np.float32)]))
        calls = process_counters()["capnp_calls_out"]
        for _ in range(20):
            x = await handle.fetch(handle.run(step, 1, [x]))
        calls = process_counters()["capnp_calls_out"] - calls  # by call (20 runs and the
        assert calls < 10  # frees without lanes): only frees, merged every 10 ms
        first = handle.run(step, 0, [x])
        await asyncio.sleep(0)  # its batch leaves: the next call gets its promise
        second = handle.run(step, 1, [first])  # on the other host, before first settled
        np.testing.assert_array_equal(await handle.fetch(second), np.full(2, 23.0))


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_release_made_after_a_run_reaches_the_controller_after_it(
    tmp_path: Path,
) -> None:
    """The run goes by call lane and the release by Cap'n Proto, two
    connections: the release waits until the runs sent before it are in
    the controller's mailbox, so the run is planned on a slice still held."""
    step = Computation("plus1", _plus_one, flops=1e3)
    scalar = Aval((), "float32")
    async with _session(tmp_path, "3d", "order") as handle:
        for attempt in range(20):
            slice_ = await handle.devices(1)
            builder = GraphBuilder()
            (out,) = builder.add(step, slice_, [builder.input(scalar)], [scalar])
            [result] = handle.run_graph(builder.build([out]), [np.float32(attempt)])
            await handle.release(slice_)  # right after: the run is not back yet
            assert float(await handle.fetch(result)) == attempt + 1.0


async def test_giving_a_lane_up_fails_what_was_sent_on_it_at_once() -> None:
    """As for a frozen host: its socket may never drain, so a close that
    waited for it would leave the calls sent on it waiting."""

    class Mute(_Far):
        def received(self, link: oneway.Link, messages: list[bytes]) -> None:
            pass  # takes the calls, answers none, stays open

    caller = await _caller(Mute(), waits=True)
    try:
        sent = caller.call(wire.RUN, 1, ("x",), lambda: failed(KeyError("by call")))
        for _ in range(100):
            if caller.pending:
                break
            await asyncio.sleep(0.01)
        caller.close()
        with pytest.raises(HostLost):
            await sent
    finally:
        await oneway.aclose()


async def test_arguments_whose_call_never_came_are_dropped_in_time() -> None:
    """A ticket's arguments that came by Cap'n Proto after their lane died
    (the call with the ticket never arrives) do not stay for ever."""
    wire.stash("lanes-test/old", (1,))
    wire._arrived["lanes-test/old"] -= wire.KEPT_S + 1  # as if it came long ago
    wire.stash("lanes-test/new", (2,))
    try:
        assert "lanes-test/old" not in wire._stashed
        assert wire._stashed["lanes-test/new"] == (2,)
    finally:
        wire._stashed.pop("lanes-test/new", None)
        wire._arrived.pop("lanes-test/new", None)


# -- answers straight from the device's host ---------------------------------------------
def _unused_stash(ticket: str, args: tuple[Any, ...]) -> Promise[None]:
    raise AssertionError("nothing here goes beside its call")


def test_a_host_answers_a_call_to_the_controller_down_its_own_lane() -> None:
    """A ``DONE`` on the lane to a host answers the call lane's call of that
    number; an answer from the controller that comes after it is dropped."""
    calls = Caller("the controller", None, dict, _unused_stash, waits=False)
    host = Caller("host 0", 0, dict, _unused_stash, waits=False)
    host.done_to = calls
    answer: Promise[Any] = Promise("run")
    calls.pending[7], calls.direct[7] = answer, host
    host._answers(None, [wire.dumps((None, ["made"]), 0, 7, wire.DONE)])  # type: ignore[arg-type]
    assert answer.result() == ["made"] and not calls.direct
    calls._answers(None, [wire.dumps((None, ["again"]), None, 7)])  # type: ignore[arg-type]
    assert answer.result() == ["made"]


def test_a_host_lane_that_closes_fails_the_calls_it_was_to_answer() -> None:
    """Only those: a call another host answers, or the controller, waits on."""
    calls = Caller("the controller", None, dict, _unused_stash, waits=False)
    hosts = [Caller(f"host {i}", i, dict, _unused_stash, waits=False) for i in range(2)]
    for host in hosts:
        host.done_to = calls
    answers: list[Promise[Any]] = [Promise(f"run {i}") for i in range(3)]
    calls.pending.update(enumerate(answers))
    calls.direct.update({0: hosts[0], 1: hosts[1]})  # call 2: the controller's to answer
    hosts[0].close()
    assert isinstance(answers[0].exception(), HostLost)
    assert not answers[1].done() and not answers[2].done()
    assert list(calls.direct) == [1]


def _fails(x: np.ndarray) -> np.ndarray:
    raise ValueError("no")


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_call_on_one_device_is_answered_by_its_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over host processes: once the client has a lane to a host's process,
    that host answers the client's calls on its devices itself (the
    controller's answer is not sent); a call whose computation fails is
    answered by the controller, with its error. (Without a lease, which
    would take the controller off the path: ``test_leases.py``.)"""
    monkeypatch.setenv("ATOLL_LEASES", "0")  # (read by this client process)
    step = Computation("plus1", _plus_one, flops=1e3)
    async with _session(tmp_path, "3e", "direct") as handle:
        x = await handle.fetch(handle.run(step, 0, [np.zeros(2, np.float32)]))
        host = handle.topology.device(0).host
        for _ in range(500):  # the fetch dialled the host's process: its lane comes up
            if handle._direct is not None and handle._direct.answering(host) is not None:
                break
            await asyncio.sleep(0.01)
        before = process_counters()["answers_from_hosts"]
        for _ in range(10):
            x = await handle.fetch(handle.run(step, 0, [x]))
        assert process_counters()["answers_from_hosts"] - before == 10
        np.testing.assert_array_equal(x, np.full(2, 11.0))
        with pytest.raises(Exception, match="no"):
            await handle.run(Computation("fails", _fails, flops=1e3), 0, [x])
        assert process_counters()["answers_from_hosts"] - before == 10
