"""Many clients, one cluster: isolation, weights, quotas and what status shows.

The controller (a ``ClusterBuilder`` with one host of simulated devices) is
served from this test process and its host joins in-process, so its store is
inspected directly. Every client connects over Cap'n Proto with a connection
and an actor system of its own, as separate processes do; the killed client
is a real process (this file run as a script) that the test SIGKILLs.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from atoll.benchmarks import dispatch as bench
from atoll.devices import BufferHandle, Computation
from atoll.kernel import AtollError, Promise
from atoll.runtime import Cluster
from atoll.runtime.client.connect import Client, connect
from atoll.runtime.control.tenancy import STALL_FACTOR
from atoll.transports.capnp import ClusterFile
from atoll.transports.testing import eventually

from .clusters import REPOSITORY, served_cluster

pytestmark = pytest.mark.anyio
TOKEN = b"tenancy-test-token"
DEVICES = 2
BIG = np.arange(8192, dtype=np.float32)  # 32 KiB: too large to ride in its handle


@asynccontextmanager
async def clients(
    address: str, *names_weights: tuple[str, float]
) -> AsyncIterator[list[tuple[Client, Cluster]]]:
    """One connection (and session) per ``(name, weight)``."""
    async with AsyncExitStack() as stack:
        out = []
        for name, weight in names_weights:
            client = await stack.enter_async_context(connect(address, token=TOKEN, weight=weight))
            out.append((client, await client.cluster(name)))
        yield out


@asynccontextmanager
async def cluster_and_clients(
    *names_weights: tuple[str, float], store_bytes: int | None = None
) -> AsyncIterator[list[tuple[Client, Cluster]]]:
    """A served cluster and one connected session per ``(name, weight)``."""
    async with (
        served_cluster(TOKEN, DEVICES, store_bytes) as (address, _, _),
        clients(address, *names_weights) as pairs,
    ):
        yield pairs


def work(ms: float) -> Computation:
    """A computation of ``ms`` milliseconds of simulated device time."""
    return Computation("work", lambda: np.zeros(1, np.float32), ms * 1e-3 * 1e12)


async def sessions(client: Client) -> dict[str, dict[str, Any]]:
    """The session rows of ``client.status()``, by public name."""
    rows = await client.status()
    return {row["name"]: row for row in rows if row.get("kind") == "session"}


async def test_a_session_cannot_read_or_free_another_sessions_buffer() -> None:
    async with cluster_and_clients(("alice", 1), ("bob", 1)) as [(_, alice), (_, bob)]:
        handle: BufferHandle = await alice.put(BIG, 0)
        guessed = BufferHandle(
            handle.id, handle.host, handle.host_id, 0, handle.shape, handle.dtype, 0
        )
        with pytest.raises(AtollError, match=r"no buffer .* held by session bob#2"):
            await bob.fetch(guessed)
        with pytest.raises(AtollError, match=r"no buffer .* held by session bob#2"):
            await bob.free(guessed)
        total = Computation("sum", lambda x: np.asarray(x.sum()), 1e6)
        with pytest.raises(AtollError, match=r"no buffer .* held by session bob#2"):
            await bob.run(total, 0, [guessed])  # nor read it in a computation
        assert (await alice.fetch(alice.run(total, 1, [handle])))[()] == BIG.sum()
        np.testing.assert_array_equal(await alice.fetch(handle), BIG)  # still there
        assert alice.owner.startswith("alice#1.") and len(alice.owner) > len("alice#1.") + 8
        assert await alice.free(guessed)  # its owner may


async def test_a_session_cannot_use_or_release_another_sessions_slice() -> None:
    async with cluster_and_clients(("alice", 1), ("bob", 1)) as [(_, alice), (_, bob)]:
        theirs = await alice.devices(1)
        with pytest.raises(AtollError, match=f"no slice {theirs.slice_id} allocated by"):
            await bob.release(theirs)
        with pytest.raises(AtollError, match=f"no slice {theirs.slice_id} allocated by"):
            await bob.controller.put(BIG, theirs.slice_id, bob.owner)
        graph = bench.chain_graph([theirs], bench.step(0.0))
        x = np.zeros(1, np.float32)
        [stolen] = bob.run_graph(graph, [x])
        with pytest.raises(AtollError, match=f"no slice {theirs.slice_id} allocated by"):
            await bob.fetch(stolen)
        [out] = alice.run_graph(graph, [x])
        assert (await alice.fetch(out))[0] == 1
        await alice.release(theirs)


async def test_weights_are_set_at_connect_changed_by_an_admin_and_shown_in_status() -> None:
    async with cluster_and_clients(("light", 1), ("heavy", 4)) as pairs:
        (light_client, light), (heavy_client, heavy) = pairs
        for _ in range(3):
            await light.run(work(1), 0, [])
        held = await heavy.put(BIG, 1)  # noqa: F841  (held: its buffer stays)
        rows = await sessions(light_client)
        assert set(rows) == {"light#1", "heavy#2"}
        assert rows["light#1"]["weight"] == 1 and rows["heavy#2"]["weight"] == 4
        assert rows["light#1"]["device_s"] == pytest.approx(3e-3)
        assert rows["heavy#2"]["bytes"] == BIG.nbytes and rows["heavy#2"]["buffers"] == 1
        assert {"queued", "running", "max_gangs", "max_bytes"} <= set(rows["light#1"])
        assert not any(light.owner in str(row) for row in await light_client.status())
        assert await heavy_client.set_weight("light#1", 2.5) == 2.5
        assert (await sessions(heavy_client))["light#1"]["weight"] == 2.5
        with pytest.raises(AtollError, match="weight must be positive"):
            await heavy_client.set_weight(1, 0)
        with pytest.raises(AtollError, match="weight must be positive"):
            async with connect(light_client.address, token=TOKEN, weight=-1) as bad:
                await bad.cluster("nobody")


@pytest.mark.slow
async def test_shares_follow_the_weights_over_connections() -> None:
    """Two sessions keep one device busy; its time splits about 1:3 (read
    from ``client.status()`` over a window of 120 computations, once both
    are past the ones they sent before sharing began)."""
    async with cluster_and_clients(("one", 1), ("three", 3)) as pairs:
        admin = pairs[0][0]
        done = {name: 0 for name in ("one#1", "three#2")}
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            for (_, cluster), name in zip(pairs, done, strict=True):
                tg.start_soon(_keep_busy, cluster, stop, done, name)
            await eventually(lambda: min(done.values()) >= 16, "both past their first gangs")
            before, mark = await sessions(admin), sum(done.values())
            await eventually(lambda: sum(done.values()) >= mark + 120, "120 more computations")
            after = await sessions(admin)
            stop.set()
    one, three = (after[n]["device_s"] - before[n]["device_s"] for n in done)
    assert three / (one + three) == pytest.approx(0.75, abs=0.06), (one, three)


async def _keep_busy(
    cluster: Cluster, stop: anyio.Event, done: dict[str, int], name: str, depth: int = 8
) -> None:
    """Keep ``depth`` computations of 10 ms on device 0 in flight until
    ``stop``, counting those done in ``done[name]``."""
    pending: list[Promise[BufferHandle]] = []
    while not stop.is_set():
        while len(pending) < depth:
            pending.append(cluster.run(work(10), 0, []))
        await pending.pop(0)
        done[name] += 1
    for each in pending:
        await each


async def test_a_flooder_stalls_then_is_refused_and_the_others_do_not_fail() -> None:
    async with cluster_and_clients(("flood", 1), ("calm", 1)) as pairs:
        (admin, flood), (_, calm) = pairs
        await admin.set_quota("flood#1", max_gangs=2)  # stalls beyond 2, refuses beyond 2+32
        floods = [flood.run(work(1), 0, []) for _ in range(60)]
        calms = [calm.run(work(1), 0, []) for _ in range(20)]
        stalled = (await sessions(admin))["flood#1"]
        assert stalled["outstanding"] <= 2 and stalled["stalled_now"] > 0
        outcomes = [await _outcome(p) for p in floods]
        refused = [o for o in outcomes if o is not None]
        assert refused and all("its quota is 2" in o for o in refused), outcomes[-1]
        admitted = 2 + 2 * STALL_FACTOR  # sent at once, then the stall's room (quota 2)
        assert all(o is None for o in outcomes[:admitted]), outcomes  # they all ran, in order
        for promise in calms:
            await promise  # none of the calm client's gangs failed
        rows = await sessions(admin)
        assert rows["flood#1"]["refused"] == len(refused) and rows["flood#1"]["stalled"] > 0
        assert rows["flood#1"]["outstanding"] == rows["flood#1"]["stalled_now"] == 0
        assert rows["calm#2"]["refused"] == 0


async def _outcome(promise: Promise[Any]) -> str | None:
    try:
        await promise
    except AtollError as exc:
        return str(exc)
    return None


async def test_a_session_over_its_byte_quota_fails_alone() -> None:
    async with cluster_and_clients(("big", 1), ("small", 1)) as pairs:
        (admin, big), (_, small) = pairs
        await admin.set_quota("big#1", max_bytes=3 * BIG.nbytes)
        kept = [await big.put(BIG, 0) for _ in range(3)]
        with pytest.raises(AtollError, match="its quota is 98304 bytes"):
            await big.put(BIG, 1)
        theirs = [await small.put(BIG, 0) for _ in range(5)]  # another session is not held to it
        assert len(theirs) == 5
        await big.free(kept[0])
        kept.append(await big.put(BIG, 1))  # room again, under its quota


async def test_an_admin_sets_the_quotas_of_sessions_opened_later() -> None:
    async with cluster_and_clients(("admin", 1)) as [(admin, _)]:
        await admin.set_default_quota(max_gangs=16, max_bytes=BIG.nbytes)
        later = await admin.cluster("later")
        rows = await sessions(admin)
        assert (rows["later#2"]["max_gangs"], rows["later#2"]["max_bytes"]) == (16, BIG.nbytes)
        assert rows["admin#1"]["max_bytes"] is None  # already open: kept its own
        held = await later.put(BIG, 0)
        with pytest.raises(AtollError, match="quota"):
            await later.put(BIG, 0)
        assert held.nbytes == BIG.nbytes
        with pytest.raises(AtollError, match="must be positive"):
            await admin.set_default_quota(max_gangs=0)


async def test_a_full_store_stalls_only_until_room_is_made() -> None:
    """Memory back-pressure: with the store full, a put waits (it does not
    fail), and goes on once the owner frees something."""
    async with cluster_and_clients(("a", 1), store_bytes=2 * BIG.nbytes) as [(_, a)]:
        first = await a.put(BIG, 0)
        second = await a.put(BIG, 0)
        third = a.put(BIG, 0)
        await eventually(_waiting_for_room(a), "the third put waiting for room")
        assert not third.done()  # stalled: no room
        await a.free(first)
        with anyio.fail_after(10):
            await third
        assert second.nbytes == BIG.nbytes


def _waiting_for_room(cluster: Cluster) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return any(usage["waiting_for_room"] for usage in await cluster.store_usage())

    return check


async def test_a_killed_client_releases_only_what_it_owned(tmp_path: Path) -> None:
    cluster_file = tmp_path / "cluster.json"
    async with served_cluster(TOKEN, DEVICES) as (address, info, _):
        ClusterFile(address, TOKEN).write(cluster_file)
        async with clients(address, ("stays", 1)) as [(client, stays)]:
            kept = await stays.put(BIG, 0)
            mine = await stays.devices(1)
            process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(cluster_file)],
                stdout=subprocess.PIPE,
                text=True,
                close_fds=False,
                cwd=REPOSITORY,
            )
            try:
                assert process.stdout is not None
                with anyio.fail_after(30):
                    line = await anyio.to_thread.run_sync(
                        process.stdout.readline, abandon_on_cancel=True
                    )
                assert line.startswith("ready"), line
                assert set(await sessions(client)) == {"stays#1", "doomed#2"}
                process.send_signal(signal.SIGKILL)
                assert process.wait(30) == -signal.SIGKILL
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait(30)
                if process.stdout is not None:
                    process.stdout.close()

            async def only_stays() -> bool:
                usage: dict[str, int] = await info.hosts[0].store_usage()
                return usage["buffers"] == 1 and set(await sessions(client)) == {"stays#1"}

            await eventually(only_stays, "the killed client's buffers and session are gone")

            async def idle() -> bool:
                rows = await info.controller.tenant_usage()
                return not any(row["queued"] or row["running"] for row in rows.values())

            await eventually(idle, "the killed client's gangs ran (or failed)")
            assert await only_stays()  # they stored nothing for the gone session
            np.testing.assert_array_equal(await stays.fetch(kept), BIG)
            await stays.release(mine)  # its slice is still its own


async def _doomed_client(cluster_file: str) -> None:
    """The killed client: it holds buffers and a slice, queues gangs, waits."""
    async with connect(cluster_file, weight=2) as client:
        cluster = await client.cluster("doomed")
        await cluster.devices(1)
        held = [await cluster.put(BIG, 1) for _ in range(3)]
        for _ in range(50):
            cluster.run(work(20), 1, [])  # still queued or running when it dies
        print("ready", flush=True)
        await asyncio.Event().wait()
        assert held  # kept until it is killed


if __name__ == "__main__":
    asyncio.run(_doomed_client(sys.argv[1]))


# -- the plain parts, without actors ----------------------------------------------
def test_admission_stalls_in_order_then_refuses_and_an_ended_session_fails_its_stalled() -> None:
    from atoll.runtime.control.tenancy import STALL_FACTOR, Tenants

    tenants = Tenants()
    tenants.set_quotas("t", max_gangs=1, max_bytes=None)
    sent: list[int] = []
    results = [Promise[Any](f"gang{i}") for i in range(STALL_FACTOR + 3)]
    for i, result in enumerate(results):
        tenants.admit("t", lambda i=i: sent.append(i), result.set_exception)  # type: ignore[misc]
    assert sent == [0]  # the quota: one at a time
    refused = [r for r in results if r.done()]
    assert len(refused) == 2 and "its quota is 1" in str(refused[0].exception())
    tenants.finished("t")
    tenants.finished("t")
    assert sent == [0, 1, 2]
    assert tenants.rows()["t"]["stalled_now"] == STALL_FACTOR - 2
    tenants.forget("t")
    assert all(r.done() for r in results[3:-2])
    assert "ended" in str(results[3].exception())
    untracked: list[int] = []
    tenants.admit("nobody", lambda: untracked.append(1), Promise("x").set_exception)
    assert untracked == [1]


def test_a_slice_is_its_owners_and_anyone_elses_use_is_refused() -> None:
    from atoll.runtime.control.resources import Allocation
    from atoll.runtime.control.tenancy import NotYourSlice, check_slice

    alloc = Allocation(7, (0,), 0, "alice#1.abc")
    assert check_slice(alloc, "alice#1.abc") is alloc
    assert check_slice(alloc, "") is alloc  # the runtime
    with pytest.raises(NotYourSlice, match=r"no slice 7 allocated by session bob#2$"):
        check_slice(alloc, "bob#2.def")


def test_the_ledger_counts_per_owner_and_holds_quotas() -> None:
    from atoll.devices import NotYours, ObjectStore, QuotaExceeded

    store = ObjectStore("h")
    store.ledger.set_quota("a#1.x", 100)
    kept = store.put(np.zeros(20, np.float32), "a#1.x")  # 80 bytes
    with pytest.raises(QuotaExceeded, match=r"session a#1 would hold 160 bytes"):
        store.ledger.check("a#1.x", 80)
    store.ledger.check("b#2.y", 10**9)  # no quota: anything
    store.ledger.charge("a#1.x", 0.5)
    assert store.ledger.usage() == {"a#1.x": {"bytes": 80, "buffers": 1, "device_s": 0.5}}
    with pytest.raises(NotYours, match=r"held by session b#2$"):
        store.check_owner(kept, "b#2.y")
    store.check_owner(kept, "a#1.x")
    store.decref(kept)
    assert store.ledger.usage() == {"a#1.x": {"bytes": 0, "buffers": 0, "device_s": 0.5}}
    store.ledger.forget("a#1.x")
    assert store.ledger.usage() == {}


async def test_isolation_and_quotas_hold_on_a_cluster_of_processes(tmp_path: Path) -> None:
    """The same checks against ``atoll up``: the host is a process of its own."""
    from atoll.benchmarks import multitenant

    running = multitenant._start_up(str(tmp_path), devices=2)
    try:
        async with (
            connect(running.cluster_file, weight=2) as one,
            connect(running.cluster_file) as other,
        ):
            alice, bob = await one.cluster("alice"), await other.cluster("bob")
            handle = await alice.put(BIG, 1)
            with pytest.raises(AtollError, match=r"no buffer .* held by session bob#2"):
                await bob.fetch(handle)
            theirs = await alice.devices(1)
            with pytest.raises(AtollError, match=f"no slice {theirs.slice_id} allocated by"):
                await bob.release(theirs)
            await other.set_quota("bob#2", max_bytes=BIG.nbytes)
            bobs = await bob.put(BIG, 0)
            with pytest.raises(AtollError, match="its quota is"):
                await bob.put(BIG, 1)
            rows = await sessions(one)
            assert rows["alice#1"]["weight"] == 2 and rows["alice#1"]["buffers"] == 1
            assert rows["bob#2"]["bytes"] == BIG.nbytes
            np.testing.assert_array_equal(await alice.fetch(handle), BIG)
            assert bobs.nbytes == BIG.nbytes
    finally:
        multitenant._stop(running)
