"""Colocated functions (issue 37, part two): Python on each host of a slice, over its shards.

``cluster.colocated(fn, slice_, *args)`` runs ``fn`` on every host that holds
a device of the slice, with that host's block of each array argument, and
keeps its block of each output as shards on its devices: a ``ShardedRef``.
Checked in one process (asyncio and trio; JAX devices, and simulated devices
over two hosts) and over two host processes, where a JAX program over the
same slice reads each shard where it is (no byte crosses hosts, none goes
through the client).
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import gc
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import atoll
from atoll.devices import Computation, NotYours, QuotaExceeded, Shard
from atoll.devices.jax import JaxDevice
from atoll.kernel import UsageError

pytestmark = pytest.mark.anyio

ROWS, COLS = 8, 3


@atoll.colocated(out=jax.ShapeDtypeStruct((ROWS, COLS), np.float32), out_specs=P("data"))
def numbered(base: float, shard: Shard) -> np.ndarray:
    """Each host's rows of a table whose row i holds ``base + i``."""
    rows = shard.blocks[0][0]
    column = np.arange(rows.start, rows.stop, dtype=np.float32)[:, None] + base
    return np.repeat(column, COLS, axis=1)


@atoll.colocated(out=lambda x: x, in_specs=[P("data")])
def doubled(x: np.ndarray) -> np.ndarray:
    return x * 2


def table(base: float) -> np.ndarray:
    return np.repeat(np.arange(ROWS, dtype=np.float32)[:, None] + base, COLS, axis=1)


async def test_a_jax_program_reads_colocated_outputs_and_feeds_them() -> None:
    async with atoll.local_cluster(1, 1, 4, device_cls=JaxDevice) as cluster:
        mesh = await cluster.devices(4, mesh_shape=(4,), axis_names=("data",))
        x = await cluster.colocated(numbered, mesh, 10.0)
        assert isinstance(x, atoll.ShardedRef) and x.shape == (ROWS, COLS)
        np.testing.assert_array_equal(await cluster.fetch(x), table(10.0))
        f = mesh.jit(
            lambda a: (jnp.sum(a, axis=1), a * 3),
            in_specs=(P("data"),),
            out_specs=(P("data"), P("data")),
        )
        sums, tripled = cluster.run(f, x).refs
        np.testing.assert_array_equal(await cluster.fetch(sums), table(10.0).sum(axis=1))
        again = await cluster.colocated(doubled, mesh, tripled)  # a run's output, read on the host
        np.testing.assert_array_equal(await cluster.fetch(again), table(10.0) * 6)
        twice = await cluster.colocated(doubled, mesh, again)  # its own kind, as it is split
        np.testing.assert_array_equal(
            await cluster.fetch(cluster.run(f, twice).refs[1]), table(10.0) * 36
        )


async def test_over_two_hosts_each_runs_its_block_and_a_computation_reads_the_whole() -> None:
    seen: list[tuple[int, int, tuple[int, ...]]] = []

    @atoll.colocated(out=jax.ShapeDtypeStruct((ROWS, COLS), np.float32))
    def noted(base: float, shard: Shard) -> np.ndarray:
        rows = shard.blocks[0][0]
        seen.append((shard.host_id, shard.position, shard.devices))
        return table(base)[rows]

    async with atoll.local_cluster(1, 2, 2) as cluster:  # simulated devices, two hosts
        mesh = await cluster.devices(4, mesh_shape=(4,), axis_names=("data",))
        x = await cluster.colocated(noted, mesh, 1.0)  # returns before it ran
        await cluster.ready(x)
        assert sorted(seen) == [(0, 0, (0, 1)), (1, 1, (2, 3))]
        total = Computation("total", lambda a: np.asarray(a.sum(), np.float32))
        assert await cluster.fetch(cluster.run(total, 0, [x])) == table(1.0).sum()
        np.testing.assert_array_equal(await cluster.fetch(x), table(1.0))


async def test_errors_reach_the_caller_and_the_hosts_go_on() -> None:
    @atoll.colocated(out=jax.ShapeDtypeStruct((ROWS,), np.float32))
    def fails(n: int) -> np.ndarray:
        raise ValueError(f"bad row count {n}")

    @atoll.colocated(out=jax.ShapeDtypeStruct((ROWS,), np.float32))
    def wrong_shape() -> np.ndarray:
        return np.zeros(ROWS + 1, np.float32)

    @atoll.colocated(out=jax.ShapeDtypeStruct((ROWS + 1,), np.float32))
    def uneven() -> np.ndarray:
        return np.zeros(ROWS + 1, np.float32)

    async with atoll.local_cluster(1, 2, 2) as cluster:
        mesh = await cluster.devices(4, mesh_shape=(4,), axis_names=("data",))
        with pytest.raises(ValueError, match="bad row count 3") as caught:
            await cluster.fetch(await cluster.colocated(fails, mesh, 3))
        assert "fails" in caught.value.remote_traceback  # type: ignore[attr-defined]
        with pytest.raises(UsageError, match=r"must be \(4,\) float32"):
            await cluster.fetch(await cluster.colocated(wrong_shape, mesh))
        with pytest.raises(UsageError, match="does not split 4 ways"):
            await cluster.colocated(uneven, mesh)
        with pytest.raises(UsageError, match=r"@atoll\.colocated"):
            await cluster.colocated(lambda: 0, mesh)
        x = await cluster.colocated(numbered, mesh, 0.0)  # the hosts went on
        np.testing.assert_array_equal(await cluster.fetch(x), table(0.0))


@atoll.colocated(out=jax.ShapeDtypeStruct((4, 8192), np.float32))
def ones(shard: Shard) -> np.ndarray:
    """A shard too large to ride inside its handle."""
    return np.ones((len(shard.devices), 8192), np.float32)


async def test_shards_are_the_sessions_own_and_freed_when_dropped() -> None:
    async with atoll.local_cluster(1, 2, 2) as cluster:
        mesh = await cluster.devices(4, mesh_shape=(4,), axis_names=("data",))
        before = sum(u["buffers"] for u in await cluster.store_usage())
        x = await cluster.colocated(ones, mesh)
        await cluster.ready(x)
        assert sum(u["buffers"] for u in await cluster.store_usage()) == before + 4
        other = cluster.client("other")
        with pytest.raises(NotYours):
            await other.fetch(x)
        del x
        gc.collect()
        for _ in range(100):  # frees leave at the end of a loop turn
            if sum(u["buffers"] for u in await cluster.store_usage()) == before:
                break
        assert sum(u["buffers"] for u in await cluster.store_usage()) == before


def _bytes_in(usage: list[dict[str, Any]]) -> int:
    keys = ("shm_in_bytes", "stream_in_bytes", "chunks_in_bytes", "inline_in_bytes")
    return sum(u[k] for u in usage for k in keys)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # Cap'n Proto's own loop
@pytest.mark.timeout(150)
async def test_over_host_processes_a_program_reads_each_shard_where_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from atoll.kernel.lowlevel import counts
    from atoll.runtime import ClusterSpec, process_cluster

    rows, cols = 64, 256  # 64 KiB a host: past what rides inside a handle

    @atoll.colocated(out=jax.ShapeDtypeStruct((rows, cols), np.float32))
    def block(shard: Shard) -> np.ndarray:  # defined here: it travels by value
        r = shard.blocks[0][0]
        return np.arange(r.start * cols, r.stop * cols, dtype=np.float32).reshape(-1, cols)

    @atoll.colocated(out=lambda x: x, in_specs=[P("data")])
    def halved(x: np.ndarray) -> np.ndarray:
        return x / 2

    jax.devices()
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # per host
    async with process_cluster(ClusterSpec(1, 2, 2, device_cls=JaxDevice)) as cluster:
        mesh = await cluster.devices(4, mesh_shape=(4,), axis_names=("data",))
        total = mesh.jit(lambda a: jnp.sum(a, axis=1), in_specs=(P("data"),), out_specs=P())
        want = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
        x = await cluster.colocated(block, mesh)
        await cluster.ready(x)
        await cluster.ready(cluster.run(total, x).refs)  # compiled, and its plan installed
        hosts_in, sent = _bytes_in(await cluster.store_usage()), counts["bytes_out"]
        sums = await cluster.fetch(cluster.run(total, x).refs)
        np.testing.assert_allclose(sums, want.sum(axis=1), rtol=1e-6)
        assert _bytes_in(await cluster.store_usage()) == hosts_in  # no shard crossed hosts
        sharded, sent = counts["bytes_out"] - sent, counts["bytes_out"]
        await cluster.fetch(cluster.run(total, want).refs)  # the same array, from here
        whole = counts["bytes_out"] - sent  # what leaves this process (client and controller)
        assert whole > want.nbytes > 4 * sharded
        again = await cluster.colocated(halved, mesh, cluster.run(total, x).refs)
        np.testing.assert_allclose(await cluster.fetch(again), want.sum(axis=1) / 2, rtol=1e-6)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # Cap'n Proto's own loop
@pytest.mark.timeout(120)
async def test_a_lost_host_fails_the_call_with_host_lost(tmp_path: Any) -> None:
    import os
    import signal

    from atoll.kernel import HostLost
    from atoll.runtime.client.connect import connect
    from atoll.transports.testing import atoll_up

    @atoll.colocated(out=jax.ShapeDtypeStruct((2, 2), np.int32))
    def pids(shard: Shard) -> np.ndarray:  # defined here: it travels by value
        return np.full((1, 2), os.getpid(), np.int32)

    cluster_file = tmp_path / "cluster.json"
    with atoll_up(cluster_file, "--hosts", "2", "--devices-per-host", "1"):
        async with connect(cluster_file) as client:
            cluster = await client.cluster("colocated")
            both = await cluster.devices(2, axis_names=("data",))
            made = await cluster.fetch(await cluster.colocated(pids, both))
            assert len({int(p) for p in made[:, 0]} | {os.getpid()}) == 3  # in each host
            os.kill(int(made[1, 0]), signal.SIGKILL)
            with pytest.raises(HostLost):
                for _ in range(100):
                    await cluster.fetch(await cluster.colocated(pids, both))


def test_a_layout_places_shards_as_jax_does() -> None:
    """Row-major mesh positions, several axes on one dimension (the first
    major), replicas, a host's block, and the copy a host reads of each part."""
    from jax.sharding import Mesh, NamedSharding

    from atoll.devices._shards import Layout, ShardedHandle

    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    shape = (8, 6)
    for spec in (P("a"), P("b"), P(("a", "b")), P(("b", "a")), P("a", "b"), P(None, "a"), P()):
        layout = Layout.of(range(4), (2, 2), ("a", "b"), spec, 2)
        want = NamedSharding(Mesh(devices, ("a", "b")), spec).devices_indices_map(shape)
        for position, device in enumerate(devices.flat):
            got = layout.index(shape, position)
            assert [(s.start, s.stop) for s in got] == [
                (s.start or 0, shape[d] if s.stop is None else s.stop)
                for d, s in enumerate(want[device])
            ], (spec, position)
    rows = Layout.of(range(4), (2, 2), ("a", "b"), P("a"), 2)
    assert rows.block(shape, [2, 3]) == (slice(4, 8), slice(0, 6))
    with pytest.raises(ValueError, match="do not form one block"):
        Layout.of(range(4), (4,), ("a",), P("a"), 2).block(shape, [0, 2])
    assert rows.holders(shape) == [0, 0, 2, 2] and rows.holders(shape, [1, 2, 3]) == [1, 2, 2]
    from atoll.devices import BufferHandle

    parts = tuple(
        BufferHandle(f"b{p}", None, p // 2, p, (4, 6), "float32", 96)  # type: ignore[arg-type]
        for p in range(4)
    )
    replicated = ShardedHandle(parts, Layout.of(range(4), (4,), ("a",), P(), 2), shape, "float32")
    assert [h.id for _, h in replicated.distinct()] == ["b0"]
    assert [h.id for _, h in replicated.distinct(near=1)] == ["b2"]  # this host's own copy


async def test_a_call_that_fails_part_way_leaves_nothing_and_shards_are_copies() -> None:
    """A quota that takes the first output's shards but not the second's:
    the call fails and the shards it stored are freed (no reference will
    ever reach them). A function that fills the same array for every call
    (a loader's buffer) does not change what earlier calls stored."""
    buffer = np.zeros((ROWS, COLS), np.float32)

    @atoll.colocated(out=[jax.ShapeDtypeStruct((4, 1024), np.float32)] * 2)
    def two(shard: Shard) -> tuple[np.ndarray, np.ndarray]:
        n = len(shard.devices)
        return np.ones((n, 1024), np.float32), np.ones((n, 1024), np.float32)

    @atoll.colocated(out=jax.ShapeDtypeStruct((ROWS, COLS), np.float32))
    def fill(step: float, shard: Shard) -> np.ndarray:
        rows = shard.blocks[0][0]
        buffer[rows] = step
        return buffer[rows]

    async with atoll.local_cluster(1, 2, 2) as cluster:
        session = cluster.client("tight")
        await session.controller.set_tenant("tight", None, None, 3 * 4096 + 100)
        mesh = await session.devices(4, mesh_shape=(4,), axis_names=("data",))
        first, second = await session.colocated(two, mesh)
        with pytest.raises(QuotaExceeded):
            await session.ready(second)
        assert sum(u["buffers"] for u in await session.store_usage()) == 0
        del first, second
        one = await session.colocated(fill, mesh, 1.0)
        await session.ready(one)  # (two calls at once would fill it at once)
        two_ = await session.colocated(fill, mesh, 2.0)
        np.testing.assert_array_equal(await session.fetch(one), np.ones((ROWS, COLS)))
        np.testing.assert_array_equal(await session.fetch(two_), np.full((ROWS, COLS), 2.0))


async def test_a_plain_function_refuses_references_an_async_one_may_use_them() -> None:
    class Count(atoll.Actor):
        def __init__(self) -> None:
            self.n = 0

        @atoll.endpoint
        def add(self, n: int) -> int:
            self.n += n
            return self.n

    @atoll.colocated(out=jax.ShapeDtypeStruct((4,), np.int32))
    def plain(counters: dict[int, Any]) -> np.ndarray:
        return np.zeros(2, np.int32)

    @atoll.colocated(out=jax.ShapeDtypeStruct((4,), np.int32))
    async def counted(counters: dict[int, Any], shard: Shard) -> np.ndarray:
        total: int = await counters[shard.host_id].add(len(shard.devices))
        return np.full(len(shard.devices), total, np.int32)

    async with atoll.local_cluster(1, 2, 2) as cluster:
        mesh = await cluster.devices(4, mesh_shape=(4,), axis_names=("data",))
        counters = {h: await cluster.spawn(Count, host=h) for h in (0, 1)}
        with pytest.raises(UsageError, match="make it an async function"):
            await cluster.fetch(await cluster.colocated(plain, mesh, counters))
        await cluster.fetch(await cluster.colocated(counted, mesh, counters))
        twice = await cluster.fetch(await cluster.colocated(counted, mesh, counters))
        np.testing.assert_array_equal(twice, [4, 4, 4, 4])  # each host's actor kept count


async def test_a_moved_slice_takes_its_shards_and_runs_read_them_there() -> None:
    @atoll.colocated(out=jax.ShapeDtypeStruct((2, 8192), np.float32))
    def rows(shard: Shard) -> np.ndarray:
        r = shard.blocks[0][0]
        return np.repeat(np.arange(r.start, r.stop, dtype=np.float32)[:, None], 8192, axis=1)

    async with atoll.local_cluster(1, 2, 2) as cluster:
        mesh = await cluster.devices(2, axis_names=("data",))
        x = await cluster.colocated(rows, mesh)  # on host 0's devices
        await cluster.ready(x)
        await cluster.move(mesh, host=1)
        total = Computation("total", lambda a: np.asarray(a[:, 0].sum(), np.float32))
        assert await cluster.fetch(cluster.run(total, 2, [x])) == 1.0
        np.testing.assert_array_equal((await cluster.fetch(x))[:, 0], [0.0, 1.0])
