"""Leases: a session sends its calls of one device straight to the device's host.

The host's table (``devices/_lease.py``) on its own, on both backends, with
the stride order of several leases on one device; the controller's side of
the quota (``Tenants.reserve``); and, over host processes, the whole round:
a lease granted after a few calls, calls under it answered by the host
with the controller off the path, a chain across loop turns, a failing
call, two sessions' leases side by side on one device (the share policy),
another session taking the device back (any run under gang FIFO, a gang
over several devices under the share policy: the refused calls go through
the controller, nothing is lost or run twice), an elastic change and the
session's end taking it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from atoll.benchmarks._testbed import up_cluster
from atoll.devices import Aval, Computation, RunReport
from atoll.devices import _lease as host_leases
from atoll.kernel import AtollError, HostLost, Promise, process_counters
from atoll.runtime import GraphBuilder, local_cluster
from atoll.runtime.client.connect import connect
from atoll.runtime.control.leases import GRACE_RUNS, GRACE_S
from atoll.runtime.control.tenancy import Tenants
from atoll.transports.capnp import capnp_runtime

pytestmark = pytest.mark.anyio


# -- the host's table --------------------------------------------------------------
class _Device:
    """A device's ``run_plan`` whose reports the test settles."""

    def __init__(self) -> None:
        self.runs: list[tuple[Any, ...]] = []
        self.reports: list[Promise[RunReport]] = []

    def run_plan(self, *args: Any) -> Promise[RunReport]:
        self.runs.append(args)
        self.reports.append(Promise("report"))
        return self.reports[-1]


@pytest.fixture
def table() -> Any:
    yield host_leases
    host_leases._leases.clear()
    host_leases._queues.clear()
    host_leases._ending.clear()
    host_leases._ended_ids.clear()


async def test_a_run_under_a_lease_reaches_its_device_as_the_sessions(table: Any) -> None:
    device = _Device()
    table.grant(7, 3, "alice.x", [11], None)
    report = table.run(device, 3, (7, 11, 5, ["in"]))
    assert device.runs == [(11, 5, ["in"], "alice.x")]
    device.reports[0].set_result(RunReport())
    assert report.done() and table.held() == {7: (3, "alice.x", 0)}


async def test_a_revoked_lease_refuses_later_runs_and_answers_once_its_runs_ended(
    table: Any,
) -> None:
    device = _Device()
    table.grant(7, 3, "alice.x", [11], None)
    table.run(device, 3, (7, 11, 1, []))
    ended = table.revoke(7)
    assert not ended.done()  # its run is still going
    with pytest.raises(host_leases.LeaseEnded):
        table.run(device, 3, (7, 11, 2, []))
    assert len(device.runs) == 1
    device.reports[0].set_result(RunReport(errors={0: ValueError("no")}))
    assert ended.result() == (1, 1)  # one run, failed
    assert table.revoke(7).result() == (0, 0)  # twice: nothing held


async def test_a_lease_covers_its_own_plans_and_device_only(table: Any) -> None:
    device = _Device()
    table.grant(7, 3, "alice.x", [11], None)
    with pytest.raises(AtollError, match="does not cover plan 12"):
        table.run(device, 3, (7, 12, 1, []))
    with pytest.raises(AtollError, match="on device 4"):
        table.run(device, 4, (7, 11, 1, []))
    with pytest.raises(host_leases.LeaseEnded):
        table.run(device, 3, (8, 11, 1, []))
    with pytest.raises(AtollError, match="another session"):
        table.grant(7, 3, "bob.y", [11], None)
    assert device.runs == []


async def test_a_dropped_plan_ends_the_lease_that_covers_it(table: Any) -> None:
    """Every later run under it is refused, so none reads the output of
    one that was (it goes through the controller)."""
    device = _Device()
    table.grant(7, 3, "alice.x", [11, 12], None)
    table.run(device, 3, (7, 12, 1, []))
    table.dropped(3, [11])
    with pytest.raises(host_leases.LeaseEnded):
        table.run(device, 3, (7, 12, 2, []))
    with pytest.raises(host_leases.LeaseEnded):  # a grant that crossed the drop
        table.grant(7, 3, "alice.x", [13], None)
    ended = table.revoke(7)  # the controller's, later: waits for the run as ever
    assert not ended.done()
    device.reports[0].set_result(RunReport())
    assert ended.result() == (1, 0)


def _owners(device: _Device, start: int = 0) -> list[str]:
    """The sessions of the device's runs from ``start`` on, in the order handed over."""
    return [args[3] for args in device.runs[start:]]


def _end_runs(device: _Device, count: int) -> None:
    """The device finishes its oldest ``count`` runs not finished yet (or all it has)."""
    for _ in range(count):
        report = next((r for r in device.reports if not r.done()), None)
        if report is not None:
            report.set_result(RunReport())


async def test_a_device_two_leases_share_hands_their_runs_over_by_weight(table: Any) -> None:
    """While both leases are busy, at most ``DEPTH`` of their runs are on
    the device; the rest wait, and go lowest pass first: bob, of weight 3,
    has three runs handed over for each of alice's, each lease's in the
    order sent."""
    device = _Device()
    table.grant(1, 0, "alice.x", [11], None, 1.0, {11: 1.0})
    table.grant(2, 0, "bob.y", [12], None, 3.0, {12: 1.0})
    alice = [table.run(device, 0, (1, 11, e, [])) for e in range(1)]
    bob = [table.run(device, 0, (2, 12, e, [])) for e in range(1)]
    alice += [table.run(device, 0, (1, 11, e, [])) for e in range(1, 40)]
    bob += [table.run(device, 0, (2, 12, e, [])) for e in range(1, 40)]
    assert len(device.runs) == table.DEPTH
    _end_runs(device, 40)
    handed = _owners(device)
    assert len(handed) == 48 and abs(handed.count("bob.y") - 3 * handed.count("alice.x")) <= 4
    bobs = [args[1] for args in device.runs if args[3] == "bob.y"]
    assert bobs == list(range(len(bobs)))  # in the order he sent them
    _end_runs(device, 80)  # (each run ended hands the next over)
    assert all(run.done() for run in alice + bob)


async def test_a_lease_back_from_idle_banks_nothing_and_alone_it_waits_for_none(
    table: Any,
) -> None:
    device = _Device()
    table.grant(1, 0, "alice.x", [11], None)
    [table.run(device, 0, (1, 11, e, [])) for e in range(30)]  # alone: all at once
    assert len(device.runs) == 30
    table.grant(2, 0, "bob.y", [12], None)
    [table.run(device, 0, (2, 12, e, [])) for e in range(30)]
    [table.run(device, 0, (1, 11, e, [])) for e in range(30, 60)]
    _end_runs(device, 30)  # alice's first 30: now they take turns from her pass on
    handed = _owners(device, 30)
    assert handed.count("bob.y") - handed.count("alice.x") in (0, 1, 2)


async def test_a_revoked_shared_lease_refuses_the_runs_that_waited_and_lets_the_rest_go(
    table: Any,
) -> None:
    device = _Device()
    table.grant(1, 0, "alice.x", [11], None)
    table.grant(2, 0, "bob.y", [12], None)
    alice = [table.run(device, 0, (1, 11, 0, []))]
    bob = [table.run(device, 0, (2, 12, 0, []))]
    alice += [table.run(device, 0, (1, 11, e, [])) for e in range(1, 12)]
    bob += [table.run(device, 0, (2, 12, e, [])) for e in range(1, 12)]
    assert _owners(device).count("alice.x") == 7  # 8 on the device, the rest wait
    ended = table.revoke(1)
    assert [type(run.exception()) for run in alice[7:]] == [table.LeaseEnded] * 5
    assert len(device.runs) == 8 + 11  # bob is alone now: his all go
    _end_runs(device, 8)  # (alice's 7 and bob's first)
    assert ended.result() == (7, 0)
    _end_runs(device, 11)
    assert all(run.done() and run.exception() is None for run in bob)
    assert table._queues[0].waiting == table._queues[0].busy == 0


async def test_an_idle_lease_holds_no_one_back_and_a_lanes_sync_waits_for_its_waiting_runs(
    table: Any,
) -> None:
    """A lease with nothing on the device does not make the others wait;
    a lane's sync settles once the runs it sent that waited were handed
    over (what the client sends after it, a slice's release, comes after
    them), and at once for a lane with none waiting."""
    device = _Device()
    table.grant(1, 0, "alice.x", [11], None)
    table.grant(2, 0, "bob.y", [12], None)  # bob: idle
    [table.run(device, 0, (1, 11, e, []), "lane-a") for e in range(20)]
    assert len(device.runs) == 20
    table.run(device, 0, (2, 12, 0, []), "lane-b")  # now both are busy: bob waits his turn
    table.run(device, 0, (1, 11, 20, []), "lane-a")
    assert len(device.runs) == 20
    assert table.handed_over("lane-c") is None
    synced = table.handed_over("lane-b")
    _end_runs(device, 12)  # 8 on the device now: not yet
    assert not synced.done() and _owners(device, 20) == []
    _end_runs(device, 1)  # (level passes: the older lease first)
    assert not synced.done() and _owners(device, 20) == ["alice.x"]
    _end_runs(device, 1)
    assert synced.done() and _owners(device, 20) == ["alice.x", "bob.y"]


# -- the quota a lease holds -------------------------------------------------------
def test_a_lease_holds_half_the_room_left_of_its_sessions_gang_quota() -> None:
    tenants = Tenants()
    tenants.set_quotas("alice.x", 10, None)
    assert tenants.reserve("alice.x", 64) == 5
    assert tenants.rows()["alice.x"]["outstanding"] == 5
    assert tenants.reserve("alice.x", 64) == 2
    tenants.unreserve("alice.x", 7)
    assert tenants.rows()["alice.x"]["outstanding"] == 0
    assert tenants.reserve("nobody", 64) == 64  # not a session: not counted


def test_stalled_gangs_go_when_a_lease_gives_its_quota_back() -> None:
    tenants = Tenants()
    tenants.set_quotas("alice.x", 2, None)
    held = tenants.reserve("alice.x", 64)
    sent: list[int] = []
    tenants.admit("alice.x", lambda: sent.append(1), print)
    tenants.admit("alice.x", lambda: sent.append(2), print)  # stalls behind the lease
    assert (held, sent) == (1, [1])
    assert tenants.reserve("alice.x", 64) == 0  # none while a gang stalls
    tenants.unreserve("alice.x", held)
    assert sent == [1, 2]


# -- over host processes -------------------------------------------------------------
def _over_processes(test: Any) -> Any:
    """A test over host processes: slow, bounded, on asyncio (where Cap'n Proto runs)."""
    marks = (
        pytest.mark.parametrize("anyio_backend", ["asyncio"]),
        pytest.mark.timeout(120),
        pytest.mark.slow,
    )
    for mark in marks:
        test = mark(test)
    return test


def _plus_one(x: np.ndarray) -> np.ndarray:
    return np.asarray(x) + 1


def _fails(x: np.ndarray) -> np.ndarray:
    raise ValueError("no")


STEP = Computation("plus1", _plus_one, flops=1e3)
FAILS = Computation("fails", _fails, flops=1e3)


async def _within(awaitable: Any, what: str, seconds: float = 30.0) -> Any:
    """``await awaitable``, or an AssertionError that says what hung."""
    try:
        with anyio.fail_after(seconds):
            return await awaitable
    except TimeoutError:
        raise AssertionError(f"hung: {what}") from None


async def _until(check: Callable[[], Any], what: str, seconds: float = 30.0) -> None:
    """Wait until ``check()`` (or what it returns, awaited) is true; each
    check may take up to ``seconds`` too."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with anyio.fail_after(seconds, shield=False):
            done = check()
            if await done if asyncio.iscoroutine(done) else done:
                return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


@contextlib.asynccontextmanager
async def _two_sessions(
    tmp_path: Path, scheduler: str = "share"
) -> AsyncIterator[tuple[Any, Any, Any]]:
    """Two clients of ``atoll up`` with two hosts (one device each): their
    sessions, and the first's connection."""
    async with (
        capnp_runtime(),
        up_cluster(2, tmp_path, "4a" * 16, scheduler=scheduler) as cluster,
        connect(cluster.cluster_file) as first,
        connect(cluster.cluster_file) as second,
    ):
        yield await first.cluster("alice"), await second.cluster("bob"), first


async def _leased(handle: Any, device: int) -> None:
    """Calls on ``device`` until a lease holds it (its host's lane is up), for
    both shapes of call the tests make: an array by value, and a handle."""

    async def held() -> bool:
        x = handle.run(STEP, device, [np.zeros(2, np.float32)])
        await asyncio.sleep(0)  # (its batch leaves: the next call is one of its own)
        await handle.fetch(handle.run(STEP, device, [x]))
        status = await handle.controller.lease_status()
        return device in status["held"] and handle._leases.granted() == 2

    await _until(held, f"a lease on device {device}")


@_over_processes
async def test_a_lease_takes_the_controller_off_the_path_until_another_session_comes(
    tmp_path: Path,
) -> None:
    """Under gang FIFO, whose devices are leased to one session at a time."""
    async with _two_sessions(tmp_path, "fifo") as (alice, bob, _):
        await _leased(alice, 0)
        leases = alice._leases
        sent, hosts_answered = leases.sent, process_counters()["answers_from_hosts"]
        x = await _within(alice.fetch(alice.run(STEP, 0, [np.zeros(2, np.float32)])), "a run")
        refs = []
        for _ in range(10):  # a chain across loop turns: each reads one not back yet
            x = alice.run(STEP, 0, [x])
            refs.append(x)
            await asyncio.sleep(0)
        np.testing.assert_array_equal(await _within(alice.fetch(x), "a chain"), np.full(2, 11.0))
        assert leases.sent - sent == 11
        assert process_counters()["answers_from_hosts"] == hosts_answered  # none by DONE
        for _ in range(100):  # a failing call: through the controller, then under the lease
            before = leases.sent
            with pytest.raises(Exception, match="no"):
                await _within(alice.run(FAILS, 0, [x]), "a failing run")
            if leases.sent > before:
                break
            await asyncio.sleep(0.01)
        assert leases.sent - sent == 12

        # bob runs on device 0: alice's lease ends; her calls still come right
        await _within(bob.fetch(bob.run(STEP, 0, [np.zeros(2, np.float32)])), "bob's run")
        await _until(
            lambda: _held_by(alice, 0), "the lease taken back once another session ran there"
        )
        y = x
        for _ in range(5):  # each is refused by the host (its lease ended), and goes again
            y = alice.run(STEP, 0, [y])
            await asyncio.sleep(0)
        np.testing.assert_array_equal(await _within(alice.fetch(y), "refused"), np.full(2, 16.0))
        assert 1 <= leases.refused == leases.sent - sent - 12
        status = await alice.controller.lease_status()
        assert 0 not in status["held"]
        assert status["taken_back"] >= 1
        del refs

        async def quota_back() -> bool:  # the lease's share of alice's gang quota
            rows = await alice.controller.tenant_usage()
            return bool(rows[alice.owner]["outstanding"] == 0)

        await _until(quota_back, "the lease's quota given back")


@_over_processes
async def test_sessions_share_a_device_under_leases_until_a_gang_over_several_comes(
    tmp_path: Path,
) -> None:
    """Under the share policy bob's calls on alice's leased device get a
    lease of their own beside hers; his gang over both devices takes hers
    back (the island orders it), and her later calls, refused, come right
    through the controller."""
    async with _two_sessions(tmp_path) as (alice, bob, _):
        await _leased(alice, 0)
        await _leased(bob, 0)

        await _until(lambda: _held_by(alice, 0, alice.owner, bob.owner), "two leases on 0")
        sent = (alice._leases.sent, bob._leases.sent)
        x, y = np.zeros(2, np.float32), np.full(2, 10, np.float32)
        for _ in range(8):  # both under their leases, side by side
            x, y = alice.run(STEP, 0, [x]), bob.run(STEP, 0, [y])
            await asyncio.sleep(0)
        np.testing.assert_array_equal(await _within(alice.fetch(x), "alice"), np.full(2, 8.0))
        np.testing.assert_array_equal(await _within(bob.fetch(y), "bob"), np.full(2, 18.0))
        assert (alice._leases.sent - sent[0], bob._leases.sent - sent[1]) == (8, 8)

        held = (await alice.controller.lease_status())["held"][0]
        [ended] = [lease_id for owner, lease_id, _ in held if owner == alice.owner]
        wide = await bob.devices(2)  # a gang over both devices: alice's lease ends
        scalar = Aval((), "float32")
        builder = GraphBuilder()
        (out,) = builder.add(STEP, wide, [builder.input(scalar)], [scalar])
        [gang] = bob.run_graph(builder.build([out]), [np.float32(1)])
        assert float(await _within(bob.fetch(gang), "the gang")) == 2.0
        await _until(lambda: _held_by(alice, 0, bob.owner), "alice's lease taken back")
        for _ in range(5):  # refused by the host, and sent again
            x = alice.run(STEP, 0, [x])
            await asyncio.sleep(0)
        np.testing.assert_array_equal(await _within(alice.fetch(x), "refused"), np.full(2, 13.0))
        assert alice._leases.refused >= 1
        assert ended not in alice._leases._in_flight  # (nothing kept of an ended lease)


@_over_processes
async def test_a_session_that_keeps_running_on_a_shared_device_without_a_lease_ends_its_leases(
    tmp_path: Path,
) -> None:
    """bob's client asks for no lease (a session refused one, say): once
    he has run on device 0 through the controller for ``GRACE_S`` and
    ``GRACE_RUNS`` runs, alice's lease there is taken back, and none is
    granted while he goes on; her calls, refused, come right through the
    controller."""
    async with _two_sessions(tmp_path) as (alice, bob, _):
        await _leased(alice, 0)
        bob._leases = None  # (every call of his through the controller)
        y = np.zeros(2, np.float32)
        deadline, runs = time.monotonic() + GRACE_S + 0.5, 0
        while time.monotonic() < deadline or runs < GRACE_RUNS + 8:
            y = await _within(bob.fetch(bob.run(STEP, 0, [y])), "bob's run")
            runs += 1
        await _until(lambda: _held_by(alice, 0), "alice's lease taken back")
        x = np.zeros(2, np.float32)
        for _ in range(5):
            x = alice.run(STEP, 0, [x])
            await asyncio.sleep(0)
        np.testing.assert_array_equal(await _within(alice.fetch(x), "alice"), np.full(2, 5.0))
        y = await _within(bob.fetch(bob.run(STEP, 0, [y])), "bob's run")
        assert await _held_by(alice, 0)  # (bob runs there still: none granted)


async def _held_by(handle: Any, device: int, *owners: str) -> bool:
    """Whether exactly ``owners`` hold leases on ``device`` (none: no lease there)."""
    status = await handle.controller.lease_status()
    return sorted(owner for owner, _, _ in status["held"].get(device, [])) == sorted(owners)


@_over_processes
async def test_an_elastic_change_and_the_sessions_end_take_leases_back(tmp_path: Path) -> None:
    async with (
        capnp_runtime(),
        up_cluster(2, tmp_path, "4b" * 16) as cluster,
        connect(cluster.cluster_file) as second,
    ):
        bob = await second.cluster("bob")
        async with connect(cluster.cluster_file) as first:
            alice = await first.cluster("alice")
            await _leased(alice, 1)
            slice_ = await bob.devices(1)
            await bob.move(slice_)  # an elastic change: every lease first
            assert 1 not in (await bob.controller.lease_status())["held"]
            await _leased(alice, 1)  # (granted again once it is over)
        await _until(lambda: _held_by(bob, 1), "the lease taken back when its session ended")


@_over_processes
async def test_a_program_on_one_device_runs_under_a_lease_until_its_slice_goes(
    tmp_path: Path,
) -> None:
    """A graph whose plan is one program on one device goes under a lease
    too; a release made right after a leased run comes after it."""
    scalar = Aval((), "float32")
    async with _two_sessions(tmp_path) as (alice, _, _):
        slice_ = await alice.devices(1)
        builder = GraphBuilder()
        (out,) = builder.add(STEP, slice_, [builder.input(scalar)], [scalar])
        graph = builder.build([out])
        x = 0.0
        for _ in range(500):
            [ref] = alice.run_graph(graph, [np.float32(x)])
            x = float(await alice.fetch(ref))
            if alice._leases.granted():
                break
            await asyncio.sleep(0.01)
        sent = alice._leases.sent
        [ref] = alice.run_graph(graph, [np.float32(x)])
        assert float(await alice.fetch(ref)) == x + 1 and alice._leases.sent == sent + 1
        [last] = alice.run_graph(graph, [np.float32(x)])
        await alice.release(slice_)  # right after: the leased run reached its device first
        assert float(await alice.fetch(last)) == x + 1

        async def none_held() -> bool:  # its plan was dropped with the slice
            return not (await alice.controller.lease_status())["held"]

        await _until(none_held, "the lease taken back when the slice went")


@_over_processes
async def test_a_client_in_the_controllers_own_process_has_leases_too() -> None:
    """``local_cluster(transport="capnp")``: the driver holds the controller;
    its calls under a lease go down its own lane to the host process."""
    async with local_cluster(1, 1, 1, transport="capnp") as cluster:
        x = np.zeros(2, np.float32)
        for _ in range(500):
            x = await cluster.fetch(cluster.run(STEP, 0, [x]))
            if cluster._leases is not None and cluster._leases.granted():
                break
            await asyncio.sleep(0.01)
        assert cluster._leases is not None
        sent = cluster._leases.sent
        x = await cluster.fetch(cluster.run(STEP, 0, [x]))
        assert cluster._leases.sent == sent + 1 and float(x[0]) >= 2.0


async def _leased_too(handle: Any, device: int, computation: Computation) -> np.ndarray:
    """A lease on ``device`` for the tests' two shapes of call and for
    ``computation`` on an array; the array it last made."""
    await _leased(handle, device)
    x = np.zeros(2, np.float32)
    for _ in range(100):
        x = np.asarray(await _within(handle.fetch(handle.run(computation, device, [x])), "a call"))
        if handle._leases.granted() == 3:
            return x
    raise AssertionError(f"no lease for {computation.name}")


async def _sent_leased(handle: Any, calls: list[tuple[Computation, int, Any]]) -> list[Any]:
    """Make ``calls`` in one loop turn, each under its lease; their outputs."""
    sent = handle._leases.sent
    outputs = [handle.run(computation, device, [x]) for computation, device, x in calls]
    await asyncio.sleep(0)
    await _until(lambda: handle._leases.sent == sent + len(calls), "the calls under a lease")
    return outputs


def _plus_one_after(seconds: float, x: np.ndarray) -> np.ndarray:
    time.sleep(seconds)
    return np.asarray(x) + 1


@_over_processes
async def test_a_host_killed_under_a_lease_fails_its_runs_and_leaves_the_rest(
    tmp_path: Path,
) -> None:
    """``kill -9`` of a leased device's host: the runs sent under the lease
    fail with ``HostLost`` (none hangs), the lease is gone, and the other
    host's device goes on."""
    slow = Computation("slow", functools.partial(_plus_one_after, 0.05), flops=1e3)
    async with (
        capnp_runtime(),
        up_cluster(2, tmp_path, "4c" * 16) as cluster,
        connect(cluster.cluster_file) as first,
    ):
        alice = await first.cluster("alice")
        x = await _leased_too(alice, 1, slow)
        running = await _sent_leased(alice, [(slow, 1, x)] * 3)
        os.kill(cluster.host_pids[1], signal.SIGKILL)
        for run in running:
            with pytest.raises(HostLost):
                await _within(run, "a leased run on a killed host")
        await _until(lambda: _held_by(alice, 1), "the lease gone with its host")
        y = await _within(alice.fetch(alice.run(STEP, 0, [x])), "a run on the other host")
        np.testing.assert_array_equal(y, x + 1)


@_over_processes
async def test_a_lease_taken_back_holds_back_only_the_runs_on_its_device(
    tmp_path: Path,
) -> None:
    """bob's run on alice's leased device waits until her leased runs there
    ended; his run on the other host's device does not (gang FIFO: a
    device is leased to one session at a time)."""
    slower = Computation("slower", functools.partial(_plus_one_after, 0.2), flops=1e3)
    async with _two_sessions(tmp_path, "fifo") as (alice, bob, _):
        x = await _leased_too(alice, 0, slower)
        running = await _sent_leased(alice, [(slower, 0, x)] * 10)  # 2 s of device 0
        there = bob.run(STEP, 0, [np.zeros(2, np.float32)])
        await asyncio.sleep(0)
        elsewhere = await _within(bob.fetch(bob.run(STEP, 1, [np.zeros(2, np.float32)])), "bob")
        np.testing.assert_array_equal(elsewhere, np.ones(2))
        assert not running[-1].done()  # (device 0 is still busy with alice's runs)
        np.testing.assert_array_equal(await _within(bob.fetch(there), "bob's held run"), 1.0)
        for run in running:
            np.testing.assert_array_equal(await _within(alice.fetch(run), "alice"), x + 1)
