"""The data plane: large arrays by shared memory on one machine, by bulk stream across.

Host processes keep large buffers in ``/dev/shm`` segments named after their
pid (``atoll-<pid>-...``); a reader on the same machine maps them. A reader
on "another machine" (``ATOLL_MACHINE_ID=per-process`` makes every process
one) gets the bytes over a bulk TCP stream that a one-time ticket opens.
Which path a transfer took is read from the hosts' ``store_usage`` counters.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest

import atoll
from atoll.devices import Aval, Computation, CostModel
from atoll.kernel import ActorSystem, VirtualClock, use_clock
from atoll.runtime import Cluster, ClusterSpec, GraphBuilder
from atoll.runtime.client.connect import connect
from atoll.runtime.deploy.process import _controller
from atoll.transports.capnp import CapnpTransport, capnp_runtime
from atoll.transports.dataplane import bulk, shm
from atoll.transports.testing import eventually

pytestmark = pytest.mark.anyio
CONF = "atoll.transports.conformance"
N = 2 << 20  # float32: 8 MiB
BIG = Aval((N,), "float32")
TWO = Aval((2,), "float64")
FREE = CostModel(link_bytes_per_s=float("inf"), link_latency_s=0.0)


def make(seed: np.ndarray) -> np.ndarray:
    """8 MiB on a host (host processes import this module by name)."""
    out: np.ndarray = np.arange(N, dtype=np.float32) + seed[0]
    return out


def check(x: np.ndarray) -> np.ndarray:
    """What a reader makes of it: every element, and its size."""
    return np.asarray([x.sum(dtype=np.float64), x.nbytes])


MAKE = Computation("make", make, 1e6)
CHECK = Computation("check", check, 1e6)
EXPECTED = float(np.arange(N, dtype=np.float64).sum() + N)  # seed 1


def segments(pid: int) -> list[str]:
    """The shared-memory segments process ``pid`` made that are still there
    (spares made ahead included)."""
    return [name for name in os.listdir(shm.DIRECTORY) if name.startswith(f"atoll-{pid}-")]


def linked(name: str) -> bool:
    return name in os.listdir(shm.DIRECTORY)


def segment_of(array: np.ndarray) -> str:
    """The segment ``array`` is mapped from (it must be)."""
    where = shm.locate(array)
    assert where is not None, "not in shared memory"
    return where[0]


async def _made_and_read(cluster: Cluster) -> tuple[dict[str, list[int]], np.ndarray]:
    """Make 8 MiB on host 0, check it on host 1 and here; free it.

    Returns the usage before the free, and the array as this client read it.
    """
    seed = await cluster.put(np.ones(1, np.float32), 0)
    big = cluster.run(MAKE, 0, [seed])
    checked = cluster.run(CHECK, 1, [big])
    summed = await cluster.fetch(checked)
    assert summed.tolist() == [EXPECTED, N * 4]
    fetched = await cluster.fetch(big)
    np.testing.assert_array_equal(fetched, make(np.ones(1, np.float32)))
    assert not fetched.flags.writeable
    usage = await cluster.store_usage()
    for value in (big, seed, checked):
        await cluster.free(value)
    return {key: [u[key] for u in usage] for key in usage[0]}, fetched


async def test_on_one_machine_a_big_array_is_mapped_not_copied() -> None:
    mapped_here = bulk.counts["shm_in"]
    async with atoll.local_cluster(1, 2, 1, transport="capnp", cost=FREE) as cluster:
        usage, fetched = await _made_and_read(cluster)
        assert usage["shm_buffers"] == [1, 0] and usage["shm_bytes"] == [N * 4, 0]
        assert usage["shm_in"] == [0, 1]  # host 1 mapped host 0's segment
        assert usage["stream_in"] == [0, 0] and usage["chunks_in"] == [0, 0]
        assert bulk.counts["shm_in"] == mapped_here + 1  # so did this client
        name = segment_of(fetched)
        assert name.startswith(f"atoll-{usage['pid'][0]}-")
        after = await cluster.store_usage()
        assert [u["buffers"] for u in after] == [0, 0]
        assert [u["shm_buffers"] for u in after] == [0, 0]
        assert not linked(name)  # freed: unlinked, though still mapped here
        np.testing.assert_array_equal(fetched[:3], [1, 2, 3])


async def test_across_machines_a_big_array_comes_by_bulk_stream(other_machines: None) -> None:
    streamed_here = bulk.counts["stream_in"]
    async with atoll.local_cluster(1, 2, 1, transport="capnp", cost=FREE) as cluster:
        usage, fetched = await _made_and_read(cluster)
        assert shm.locate(fetched) is None  # received into private memory
        assert usage["shm_in"] == [0, 0] and usage["chunks_in"] == [0, 0]
        assert usage["stream_in"] == [0, 1]
        assert usage["stream_out"] == [2, 0]  # to host 1, and to this client
        assert bulk.counts["stream_in"] == streamed_here + 1


async def test_a_pushed_big_input_lands_mapped_and_leaves_nothing() -> None:
    async with atoll.local_cluster(1, 2, 1, transport="capnp", cost=FREE) as cluster:
        first, second = await cluster.devices(1), await cluster.devices(1)
        builder = GraphBuilder()
        x = builder.input(Aval((1,), "float32"))
        [y] = builder.add(MAKE, first, [x], [BIG])
        [z] = builder.add(CHECK, second, [y], [TWO])
        seed = await cluster.put(np.ones(1, np.float32), 0)
        [out] = cluster.run_graph(builder.build([z]), [seed])
        assert (await cluster.fetch(out)).tolist() == [EXPECTED, N * 4]
        usage = await cluster.store_usage()
        assert usage[1]["pushes_in"] == 1 and usage[1]["shm_in"] == 1
        assert usage[1]["shm_buffers"] == 0  # the pushed copy maps host 0's segment
        for value in (out, seed):
            await cluster.free(value)
        usage = await cluster.store_usage()
        assert [u["buffers"] for u in usage] == [0, 0]
        assert [u["shm_buffers"] for u in usage] == [0, 0]


async def test_a_killed_host_leaves_nothing_in_shared_memory() -> None:
    async with atoll.local_cluster(1, 2, 1, transport="capnp", cost=FREE) as cluster:
        seed = await cluster.put(np.ones(1, np.float32), 0)
        await cluster.run(MAKE, 0, [seed])
        pid = (await cluster.store_usage())[0]["pid"]
        assert segments(pid)
        os.kill(pid, signal.SIGKILL)
        await eventually(lambda: not segments(pid), "the controller sweeps the dead host's segment")
    assert segments(pid) == []


@asynccontextmanager
async def _served(token: bytes) -> AsyncIterator[str]:
    """A controller here with one host process; its address."""
    spec = ClusterSpec(1, 1, 1, cost=FREE)
    async with _controller(spec, "capnp://127.0.0.1:0", token, 60) as (_, listener, _info):
        yield listener.address


async def test_a_session_that_ends_frees_its_shared_memory() -> None:
    token = b"data-plane-test-token"
    async with _served(token) as address:
        async with connect(address, token=token) as client:
            cluster = await client.cluster("leaving")
            seed = await cluster.put(np.ones(1, np.float32), 0)
            name = segment_of(await cluster.fetch(cluster.run(MAKE, 0, [seed])))
            assert linked(name)
        async with connect(address, token=token) as other:
            watcher = await other.cluster("watching")

            async def freed() -> bool:
                return (await watcher.store_usage())[0]["buffers"] == 0

            await eventually(freed, "the ended session's buffers are freed")
            assert not linked(name)


async def test_a_freed_segment_is_reused_and_its_reader_keeps_its_mapping() -> None:
    """The second hand-off of a size goes into the first one's segment (under
    a new name), and host 1 reads it through the mapping it kept: new bytes."""
    async with atoll.local_cluster(1, 2, 1, transport="capnp", cost=FREE) as cluster:
        before = await cluster.store_usage()
        for seed in (1.0, 2.0):
            given = await cluster.put(np.full(1, seed, np.float32), 0)
            big = cluster.run(MAKE, 0, [given])
            checked = cluster.run(CHECK, 1, [big])
            expected = float(np.arange(N, dtype=np.float64).sum() + N * seed)
            assert (await cluster.fetch(checked)).tolist() == [expected, N * 4]
            for value in (big, given, checked):
                await cluster.free(value)
        after = await cluster.store_usage()
    assert after[0]["recycled"] - before[0]["recycled"] == 1
    assert after[1]["maps_reused"] - before[1]["maps_reused"] == 1
    assert after[1]["shm_in"] - before[1]["shm_in"] == 2


async def test_a_segment_a_reader_holds_is_not_reused_and_a_stale_name_fails() -> None:
    """(In this process: the creator and, with a file lock of its own, a reader.)"""
    recycled = shm.counts["recycled"]
    view, first = _shared(1.0)
    read = shm.attach(first.name, 0, ODD * 4, "<f4", (ODD,))
    shm.release(first)  # the buffer is freed: its name goes...
    del view  # ...and so does the creator's view: the segment is kept for reuse
    view, second = _shared(2.0)  # but the reader holds it: another segment
    assert shm.counts["recycled"] == recycled and read[0] == 1.0
    with pytest.raises(FileNotFoundError):
        shm.attach(first.name, 0, ODD * 4, "<f4", (ODD,))
    del read, view
    shm.release(second)
    _, third = _shared(3.0)  # the first segment again, under a new name
    assert shm.counts["recycled"] == recycled + 1
    reused = shm.counts["maps_reused"]
    again = shm.attach(third.name, 0, ODD * 4, "<f4", (ODD,))
    assert shm.counts["maps_reused"] == reused + 1 and again[0] == 3.0
    shm.release(third)


async def test_a_mapping_without_views_is_kept_for_its_time_on_its_clock() -> None:
    clock = VirtualClock(autojump=False)
    _held, segment = _shared(4.0)  # the creator keeps its view
    reused = shm.counts["maps_reused"]
    try:
        with use_clock(clock):
            read = shm.attach(segment.name, 0, ODD * 4, "<f4", (ODD,))
        del read
        gc.collect()  # its last view went: the mapping is kept KEEP_S
        clock.advance(shm.KEEP_S * 0.9)
        again = shm.attach(segment.name, 0, ODD * 4, "<f4", (ODD,))
        assert shm.counts["maps_reused"] == reused + 1 and again[0] == 4.0
        del again
        gc.collect()
        clock.advance(shm.KEEP_S)  # now it is let go of
        fresh = shm.attach(segment.name, 0, ODD * 4, "<f4", (ODD,))
        assert shm.counts["maps_reused"] == reused + 1 and fresh[0] == 4.0
        del fresh
    finally:
        shm.release(segment)


ODD = N + 1024  # a size of its own: no segment of it was freed before


def _shared(value: float) -> tuple[np.ndarray, shm.Segment]:
    gc.collect()  # the views dropped before are gone
    made = shm.share(np.full(ODD, value, np.float32))
    assert made is not None
    return made


# -- the bulk stream itself, in this process ---------------------------------------
async def test_a_wrong_or_reused_ticket_is_refused_and_closes_only_its_connection() -> None:
    data = np.arange(N, dtype=np.float32)
    view = data.data.cast("B")
    refused = bulk.counts["tickets_refused"]
    try:
        address, ticket = bulk.offer(view)
        good = asyncio.ensure_future(bulk.receive(address, ticket, view.nbytes))
        with pytest.raises(bulk.StreamRefused):
            await bulk.receive(address, b"\0" * bulk.TICKET_BYTES, view.nbytes)
        assert (await good).view(np.float32).tolist() == data.tolist()  # unharmed
        with pytest.raises(bulk.StreamRefused):
            await bulk.receive(address, ticket, view.nbytes)  # used once already
        assert bulk.counts["tickets_refused"] == refused + 2
        again, fresh = bulk.offer(view)  # the listener still serves
        assert again == address
        assert (await bulk.receive(address, fresh, view.nbytes)).nbytes == view.nbytes
    finally:
        await bulk.aclose()


async def test_a_ticket_expires_on_the_clock_it_was_offered_on() -> None:
    view = memoryview(bytes(16))
    clock = VirtualClock(autojump=False)
    try:
        with use_clock(clock):
            address, ticket = bulk.offer(view)
            _, kept = bulk.offer(view)
        clock.advance(bulk.TICKET_TTL_S - 0.001)
        assert (await bulk.receive(address, kept, 16)).nbytes == 16  # not yet expired
        clock.advance(0.001)
        with pytest.raises(bulk.StreamRefused):
            await bulk.receive(address, ticket, 16)
    finally:
        await bulk.aclose()


async def test_without_a_stream_the_bytes_come_in_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A holder that cannot open a stream still serves the array over capnp."""

    def no_listener(data: memoryview) -> tuple[str, bytes]:
        raise OSError("no bulk listener here")

    monkeypatch.setattr(bulk, "offer", no_listener)
    before = dict(bulk.counts)
    array = np.arange(N, dtype=np.float32)
    token = b"chunk-fallback-token"
    async with capnp_runtime(), ActorSystem("both") as system:
        listener = await CapnpTransport(token).serve(system)
        connection = await CapnpTransport(token).connect(listener.address, system)
        try:
            echo = await connection.node.spawn(f"{CONF}:Echo")
            shape, _, total = await echo.describe(array)
        finally:
            await connection.aclose()
            await listener.aclose()
    assert tuple(shape) == (N,) and total == float(array.sum(dtype=np.float64))
    assert bulk.counts["chunks_in"] == before.get("chunks_in", 0) + 1
    assert bulk.counts["stream_in"] == before.get("stream_in", 0)


def test_sweep_spares_the_living_and_takes_the_dead(tmp_path: Path) -> None:
    mine = shm.share(np.ones(N, np.float32))
    assert mine is not None
    _, segment = mine
    dead = f"atoll-{_dead_pid()}-feed-0"
    Path(shm.DIRECTORY, dead).write_bytes(b"x")
    swept = shm.sweep()
    assert dead in swept and segment.name not in swept
    assert segment.name in os.listdir(shm.DIRECTORY)
    shm.release(segment)
    assert segment.name not in os.listdir(shm.DIRECTORY)


def _dead_pid() -> int:
    """A pid that no process has (one past the largest in use, wrapped)."""
    pid = os.getpid()
    while True:
        pid = pid + 1 if pid < 4_000_000 else 2
        if not Path(f"/proc/{pid}").exists():
            return pid
