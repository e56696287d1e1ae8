"""A client's buffers are freed when its last reference to them goes.

References are the promises a client hands out (``put``, ``run``, an
``ArrayRef``'s) and the handles they settle with (``runtime/client/ownership.py``).
A buffer read by a run that has not taken it yet is kept until it has.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator, Iterator

import anyio
import numpy as np
import pytest

import atoll
import atoll.runtime.client.ownership as ownership_module
from atoll.devices import BufferHandle, Computation
from atoll.kernel import Actor, ActorRef, ActorSystem, Promise, as_promise, endpoint
from atoll.runtime.client.ownership import Ownership
from atoll.transports.testing import eventually

pytestmark = pytest.mark.anyio

ADD = Computation("add", np.add)


@pytest.fixture(autouse=True)
def _collect_only_this_tests_objects() -> Iterator[None]:
    """The collections these tests ask for walk only what the test made: what
    the suite made before (JAX's many objects among it) waits, frozen, until
    the test is over. A full collection of that heap costs seconds each."""
    gc.freeze()
    yield
    gc.unfreeze()


async def held(cluster: atoll.Cluster) -> int:
    """Buffers in the stores once the frees of the last turns arrived."""
    for _ in range(3):
        gc.collect()
        await anyio.sleep(0.01)
    return sum(u["buffers"] for u in await cluster.store_usage())


@pytest.mark.slow
async def test_what_the_client_drops_is_freed_and_what_it_holds_stays() -> None:
    async with atoll.local_cluster(1, 1, 2) as cluster:
        kept = await cluster.put(np.ones(4), 0)  # a handle held
        promise = cluster.put(np.ones(4), 1)  # a promise held
        cluster.put(np.ones(4), 0)  # dropped at once
        assert await held(cluster) == 2
        out = cluster.run(ADD, 0, [kept, promise])
        np.testing.assert_array_equal(await cluster.fetch(out), np.full(4, 2.0))
        assert await held(cluster) == 3
        del out
        assert await held(cluster) == 2
        del kept
        assert await held(cluster) == 1
        assert await cluster.free(promise)  # by hand: then dropping it frees nothing more
        del promise
        assert await held(cluster) == 0


@pytest.mark.slow
async def test_a_dropped_input_is_kept_until_its_run_has_read_it() -> None:
    async with atoll.local_cluster(1, 1, 2) as cluster:
        gate: Promise[atoll.devices.BufferHandle] = Promise("not yet")
        x = cluster.put(np.full(4, 3.0), 0)
        out = cluster.run(ADD, 0, [x, gate])  # waits for the gate on the device
        del x
        await anyio.sleep(0.05)
        assert await held(cluster) == 1  # x: its reader has not read it
        gate.set_result(await cluster.put(np.ones(4), 1))  # device 0 waits for it
        np.testing.assert_array_equal(await cluster.fetch(out), np.full(4, 4.0))
        assert await held(cluster) == 2  # out, and the gate's put (the gate holds its handle)
        del gate
        assert await held(cluster) == 1  # x went once read, the put with the gate


async def test_arrays_a_run_put_for_itself_are_the_clients_and_go_once_read() -> None:
    """An array given to a run (too big to ride in the call) is put first;
    the client owns that buffer as anything it put, so it goes once the run
    read it, with no free from the controller or the devices."""
    import atoll.runtime.graph as graphs

    big = np.full(1 << 14, 1.0)  # beyond what rides in a call
    async with atoll.local_cluster(1, 1, 2) as cluster:
        out = cluster.run(ADD, 1, [big, big])  # a low-level call: two puts
        np.testing.assert_array_equal(await cluster.fetch(out), 2 * big)
        assert await held(cluster) == 1  # the output alone
        devices = await cluster.devices(1)
        builder = graphs.GraphBuilder()
        x = builder.input(atoll.devices.Aval(big.shape, "float64"))
        [y] = builder.add(ADD, devices, [x, x], [atoll.devices.Aval(big.shape, "float64")])
        [doubled] = cluster.run_graph(builder.build([y]), [big])  # a program: one put
        np.testing.assert_array_equal(await cluster.fetch(doubled), 2 * big)
        assert await held(cluster) == 2
        del out, doubled
        assert await held(cluster) == 0


async def test_an_array_put_for_another_sessions_call_is_freed_once_the_call_ran() -> None:
    """A call made under another session's label (``owner=``) is not this
    client's to track: what it put is freed as that session once it ran,
    and its output is left to that session."""
    big = np.full(1 << 14, 1.0)
    async with atoll.local_cluster(1, 1, 1) as cluster:
        out = await cluster.run(ADD, 0, [big, big], owner="another")
        assert await held(cluster) == 1  # the output alone
        assert await cluster.host_of(out).free(out.id, "another")
        assert await held(cluster) == 0


@pytest.mark.slow
async def test_an_input_passed_through_to_an_output_stays_with_the_output() -> None:
    """A program that returns its input: dropping the input keeps the buffer,
    which the output now names; dropping that frees it."""
    import atoll.runtime.graph as graphs

    async with atoll.local_cluster(1, 1, 1) as cluster:
        devices = await cluster.devices(1)
        builder = graphs.GraphBuilder()
        x = builder.input(atoll.devices.Aval((4,), "float64"))
        [y] = builder.add(ADD, devices, [x, x], [atoll.devices.Aval((4,), "float64")])
        graph = builder.build([x, y])  # x passes through
        put = cluster.put(np.full(4, 1.0), 0)
        same, doubled = cluster.run_graph(graph, [put])
        del put
        np.testing.assert_array_equal(await cluster.fetch(doubled), np.full(4, 2.0))
        assert await held(cluster) == 2
        np.testing.assert_array_equal(await cluster.fetch(same), np.full(4, 1.0))
        del same
        assert await held(cluster) == 1


async def test_runs_reading_a_buffer_no_reference_here_holds_track_nothing() -> None:
    """A buffer no reference here holds (another session's, read by handle)
    is not this client's to free: however many runs read it, nothing is
    kept for it."""
    from atoll.devices import BufferHandle
    from atoll.runtime.client.ownership import Ownership

    ownership = Ownership("session")
    handle = BufferHandle("h0:1", None, 0, 0, (4,), "float64", 32)  # type: ignore[arg-type]
    for _ in range(100):
        ownership.reading([handle, as_promise(handle)], Promise("a run"))
    assert not ownership._readers


class _Freer(Actor):
    """A host as the frees see it: it records each ``free_many``."""

    def __init__(self) -> None:
        self.sent: list[list[str]] = []

    @endpoint
    def free_many(self, buffer_ids: list[str], owner: str = "") -> int:
        self.sent.append(list(buffer_ids))
        return len(buffer_ids)

    @endpoint
    def calls(self) -> list[list[str]]:
        return self.sent


class _Dropper:
    """References to buffers on ``host``, made and dropped a batch at a time."""

    def __init__(self, ownership: Ownership, host: ActorRef[_Freer]) -> None:
        self.ownership, self.host, self.made = ownership, host, 0

    async def drop(self, count: int) -> None:
        """``count`` references, dropped in one turn; then a few turns go by."""
        promises = [Promise[BufferHandle]("a run") for _ in range(count)]
        for promise in promises:
            self.ownership.track(promise)
            handle = BufferHandle(f"h0:{self.made}", self.host, 0, 0, (4,), "float64", 32)  # type: ignore[arg-type]
            promise.set_result(handle)
            self.made += 1
        del promises, promise, handle
        gc.collect()
        for _ in range(5):
            await anyio.sleep(0)


@contextlib.asynccontextmanager
async def _freeing() -> AsyncIterator[tuple[ActorRef[_Freer], Ownership, _Dropper]]:
    """A host that records its frees, an ownership that frees there, and a dropper."""
    async with ActorSystem() as system:
        host = system.spawn(_Freer)
        ownership = Ownership("session", host_of=lambda handle: host)
        yield host, ownership, _Dropper(ownership, host)


@pytest.fixture
def remote_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every host counts as one in another process, whose frees are put off."""
    monkeypatch.setattr(ownership_module, "_remote", lambda ref: True)


@pytest.fixture
def hourly(remote_hosts: None, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Remote hosts whose frees wait an hour between two (unless enough
    wait): what goes early goes for another reason. Returns the patcher."""
    monkeypatch.setattr(ownership_module, "FREE_EVERY_S", 3600.0)
    return monkeypatch


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # trio: every turn's frees go
async def test_frees_at_a_remote_host_wait_for_the_interval_or_a_full_batch(
    hourly: pytest.MonkeyPatch,
) -> None:
    hourly.setattr(ownership_module, "FREE_AT_ONCE", 3)
    async with _freeing() as (host, ownership, dropper):
        await dropper.drop(1)
        assert await host.calls() == [["h0:0"]]  # the first goes at once
        await dropper.drop(1)
        assert await host.calls() == [["h0:0"]]  # the next waits for the interval
        await dropper.drop(1)
        assert await host.calls() == [["h0:0"]]
        await dropper.drop(1)  # three wait: they go together
        assert await host.calls() == [["h0:0"], ["h0:1", "h0:2", "h0:3"]]
        await dropper.drop(1)
        ownership.close()  # the session's end frees the rest, not the timer
        assert ownership._timer is None and await host.calls() == [
            ["h0:0"],
            ["h0:1", "h0:2", "h0:3"],
        ]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_frees_at_a_remote_host_go_at_once_when_their_bytes_add_up(
    hourly: pytest.MonkeyPatch,
) -> None:
    hourly.setattr(ownership_module, "FREE_BYTES_AT_ONCE", 64)  # two buffers of 32 bytes
    async with _freeing() as (host, ownership, dropper):
        await dropper.drop(1)
        await dropper.drop(1)
        assert await host.calls() == [["h0:0"]]  # 32 bytes wait for the interval
        await dropper.drop(1)  # 64 bytes wait: they go
        assert await host.calls() == [["h0:0"], ["h0:1", "h0:2"]]
        assert ownership._sizes == {}  # nothing left to count
        ownership.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_frees_put_off_go_at_once_when_asked_for(
    hourly: pytest.MonkeyPatch,
) -> None:
    async with _freeing() as (host, ownership, dropper):
        await dropper.drop(1)
        await dropper.drop(2)
        assert await host.calls() == [["h0:0"]]  # put off
        [sent] = ownership.send_put_off()  # (before a count of what hosts hold)
        await sent
        assert await host.calls() == [["h0:0"], ["h0:1", "h0:2"]]
        assert ownership._timer is None and ownership.send_put_off() == []
        ownership.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_host_whose_interval_ends_sooner_sets_the_timer_sooner(
    hourly: pytest.MonkeyPatch,
) -> None:
    async with ActorSystem() as system:
        first, second = system.spawn(_Freer), system.spawn(_Freer)
        ownership = Ownership("session")  # (each handle's own host)
        here, there = _Dropper(ownership, first), _Dropper(ownership, second)
        there.made = 1000  # (other buffer ids)
        await here.drop(1)
        await here.drop(1)  # put off for an hour
        loop_time = ownership._timer.when() if ownership._timer is not None else 0.0
        ownership._sent_at[second] = loop_time - 3600.0 - 3599.0  # its hour ends in a second
        await there.drop(1)
        assert await second.calls() == []  # put off too, but not for an hour:
        assert ownership._timer is not None and ownership._timer.when() < loop_time - 3500.0
        assert set(ownership._held) == {first, second}
        ownership.close()


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_free_put_off_goes_when_the_interval_is_over(
    remote_hosts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ownership_module, "FREE_EVERY_S", 1.0)  # a busy machine's turns fit
    async with _freeing() as (host, ownership, dropper):
        await dropper.drop(2)
        await dropper.drop(1)
        assert ownership._timer is not None  # put off, the timer armed
        assert await host.calls() in ([["h0:0", "h0:1"]], [["h0:0", "h0:1"], ["h0:2"]])

        async def sent() -> bool:
            return await host.calls() == [["h0:0", "h0:1"], ["h0:2"]]

        await eventually(sent, "the put-off free was sent by its timer", timeout=5.0)
