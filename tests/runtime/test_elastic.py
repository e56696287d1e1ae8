"""Elastic slices in one process: moves, suspend and resume, drains, spares.

A training loop chains its parameters through ``.refs`` while its slice
moves and is suspended; its losses must equal an uninterrupted run's, and a
second client's work beside it must not change. The parameters are large
enough (about 260 KiB) that their bytes really move: small values would
ride along in their handles.
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import functools
import gc
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import atoll
from atoll.devices.jax import JaxDevice
from atoll.examples import spmd
from atoll.kernel import AtollError
from atoll.runtime import Cluster, VirtualSlice
from atoll.transports.testing import eventually

pytestmark = pytest.mark.anyio

SIZES = (16, 256, 256, 4)  # 2 x 256 KiB weights: no value rides in a handle
STEPS = 10

Hook = Callable[[int, Cluster, VirtualSlice], Awaitable[None]]


async def train(cluster: Cluster, slice_: VirtualSlice, hook: Hook | None = None) -> list[float]:
    """``STEPS`` SGD steps on ``slice_``, the parameters chained on the
    devices; ``hook(step, ...)`` runs before each step's run is made."""
    step_fn = slice_.jit(spmd.train_step, in_specs=(None, P("data"), P("data")), out_specs=P())
    params: Any = spmd.init(sizes=SIZES)
    losses = []
    for i in range(STEPS):
        if hook is not None:
            await hook(i, cluster, slice_)
        params, loss = cluster.run(step_fn, params, *spmd.data(i)).refs
        losses.append(loss)
    return [float(await cluster.fetch(loss)) for loss in losses]


def cluster_of(**options: Any) -> Any:
    return atoll.local_cluster(1, 2, 4, device_cls=JaxDevice, **options)


async def uninterrupted() -> list[float]:
    async with cluster_of() as cluster:
        return await train(cluster, await cluster.devices(2, axis_names=("data",)))


@pytest.mark.slow
async def test_a_slice_moved_twice_and_suspended_trains_as_if_it_never_moved() -> None:
    expected = await uninterrupted()
    async with cluster_of() as cluster:
        slice_ = await cluster.devices(2, axis_names=("data",))
        reports: list[dict[str, Any]] = []

        async def elastic(step: int, c: Cluster, s: VirtualSlice) -> None:
            if step == 3:
                reports.append(await c.move(s, host=1))  # to another host
            elif step == 6:
                reports.append(await c.move(s, devices=[2, 3]))  # back, other devices
            elif step == 8:
                reports.append(await c.suspend(s))
                reports.append(await c.resume(s))

        losses = await train(cluster, slice_, elastic)
        assert losses == expected  # the same devices' kind, the same program: bit for bit
        gc.collect()  # the chain's references are gone: every buffer is freed, old copies too
        await eventually(lambda: _stored(cluster, 0), "every buffer freed after the moves")
        assert [r["op"] for r in reports] == ["move", "move", "suspend", "resume"]
        assert reports[0]["buffers"] >= 6 and reports[0]["bytes"] > 250_000
        status = await cluster.elastic_status()
        assert status["suspended"] == [] and status["moving"] == []


async def _stored(cluster: Cluster, count: int) -> bool:
    return sum(u["buffers"] for u in await cluster.store_usage()) == count


async def test_runs_made_during_a_move_keep_their_order() -> None:
    async with cluster_of() as cluster:
        slice_ = await cluster.devices(1)
        add = slice_.jit(lambda x, k: x + k)
        x: Any = cluster.run(add, np.zeros(70_000, np.float32), 0.0).refs  # 280 KiB
        outs = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(cluster.move, slice_, devices=[5]))
            for k in range(1, 6):  # made before, during or after the move
                x = cluster.run(add, x, float(k)).refs
                outs.append(x)
                await anyio.sleep(0)
        values = [float((await cluster.fetch(o))[0]) for o in outs]
        assert values == [1, 3, 6, 10, 15]


async def test_runs_made_while_suspended_wait_and_go_in_order_to_the_new_devices() -> None:
    async with cluster_of() as cluster:
        slice_ = await cluster.devices(1)
        add = slice_.jit(lambda x, k: x + k)
        x: Any = cluster.run(add, np.zeros(70_000, np.float32), 0.0).refs
        await cluster.suspend(slice_)
        other = cluster.client("other")
        await other.devices(4)  # takes host 0, where the slice was
        outs = []
        for k in range(1, 6):
            x = cluster.run(add, x, float(k)).refs
            outs.append(x)
        cluster.flush()  # the runs reach the controller before the resume
        report = await cluster.resume(slice_)
        assert report["buffers"] == 1
        values = [float((await cluster.fetch(o))[0]) for o in outs]
        assert values == [1, 3, 6, 10, 15]
        stats = await cluster.device_stats()
        assert sum(s.computations for s in stats[4:]) == 5  # on host 1


async def test_a_move_drops_the_slices_plans_and_the_next_run_compiles_for_the_new_devices() -> (
    None
):
    async with cluster_of() as cluster:
        slice_ = await cluster.devices(1)
        add = slice_.jit(lambda x: x + 1)
        x: Any = cluster.run(add, np.zeros(70_000, np.float32)).refs
        for _ in range(3):
            x = cluster.run(add, x).refs
        await cluster.ready(x)
        before = await cluster.controller.plan_stats()
        await cluster.move(slice_, devices=[6])
        assert (await cluster.controller.plan_stats())["plans"] < before["plans"]
        for _ in range(3):
            x = cluster.run(add, x).refs
        np.testing.assert_array_equal(await cluster.fetch(x), np.full(70_000, 7, np.float32))
        after = await cluster.controller.plan_stats()
        assert after["misses"] == before["misses"] + 1  # planned once for device 6
        stats = await cluster.device_stats()
        assert stats[6].computations == 3


async def test_a_second_client_is_not_affected_by_moves() -> None:
    expected = await uninterrupted()
    async with cluster_of() as cluster:
        other = cluster.client("other")
        mine = await cluster.devices(2, axis_names=("data",))
        theirs = await other.devices(2, axis_names=("data",))

        async def move(step: int, c: Cluster, s: VirtualSlice) -> None:
            if step in (2, 5):
                await c.move(s)

        async with anyio.create_task_group() as tg:
            results: dict[str, list[float]] = {}

            async def run(name: str, c: Cluster, s: VirtualSlice, hook: Hook | None) -> None:
                results[name] = await train(c, s, hook)

            tg.start_soon(run, "mine", cluster, mine, move)
            tg.start_soon(run, "theirs", other, theirs, None)
        assert results["mine"] == expected
        assert results["theirs"] == expected


async def test_a_drained_host_keeps_every_buffer() -> None:
    async with cluster_of() as cluster:
        slice_ = await cluster.devices(2)
        values = [np.full(50_000, i, np.float32) for i in range(3)]
        refs = [cluster.put(v, d) for v, d in zip(values, [0, 1, 3], strict=True)]
        double = slice_.jit(lambda x: x * 2)
        doubled = cluster.run(double, values[0]).refs
        await cluster.ready(doubled)
        report = await cluster.drain(0)
        assert report["buffers"] >= 4
        usage = await cluster.store_usage()
        assert usage[0]["buffers"] == 0  # nothing left on host 0
        for ref, value in zip(refs, values, strict=True):
            np.testing.assert_array_equal(await cluster.fetch(ref), value)
        np.testing.assert_array_equal(await cluster.fetch(doubled), values[0] * 2)
        again = cluster.run(double, doubled).refs  # the slice lives on host 1 now
        np.testing.assert_array_equal(await cluster.fetch(again), values[0] * 4)
        with pytest.raises(AtollError, match="not free"):
            await cluster.devices(5)  # host 0's devices are gone
        status = await cluster.elastic_status()
        assert status["drained"] == [0]


async def test_spares_are_kept_out_of_allocation() -> None:
    async with cluster_of(spares=1) as cluster:
        first = await cluster.devices(4)
        with pytest.raises(AtollError):
            await cluster.devices(1)  # host 1 is the spare
        assert (await cluster.elastic_status())["spares"] == [4, 5, 6, 7]
        await cluster.drain(0)  # the slice must leave: it takes the spare
        double = first.jit(lambda x: x * 2)
        out = cluster.run(double, np.ones(4, np.float32)).refs
        np.testing.assert_array_equal(await cluster.fetch(out), 2 * np.ones(4))


async def test_a_suspended_slice_gives_its_devices_to_others() -> None:
    async with cluster_of() as cluster:
        slice_ = await cluster.devices(4)
        add = slice_.jit(lambda x: x + 1)
        x = cluster.run(add, np.zeros(70_000, np.float32)).refs
        await cluster.ready(x)
        await cluster.suspend(slice_)
        other = cluster.client("other")
        borrowed = await other.devices(8)  # every device: the suspended slice has none
        held = cluster.run(add, x).refs  # waits for the resume
        await other.release(borrowed)
        await cluster.resume(slice_)
        np.testing.assert_array_equal(await cluster.fetch(held), np.full(70_000, 2, np.float32))
        np.testing.assert_array_equal(await cluster.fetch(x), np.ones(70_000, np.float32))


async def test_a_slice_released_while_runs_wait_fails_them_and_frees_everything() -> None:
    async with cluster_of() as cluster:
        slice_ = await cluster.devices(2)
        add = slice_.jit(lambda x: x + 1)
        x = cluster.run(add, np.zeros(70_000, np.float32)).refs
        await cluster.suspend(slice_)
        held = [cluster.run(add, x).refs for _ in range(3)]
        cluster.flush()
        await cluster.release(slice_)
        for out in held:  # they fail (no such slice), none hangs
            with pytest.raises(AtollError):
                await cluster.fetch(out)
        np.testing.assert_array_equal(await cluster.fetch(x), np.ones(70_000))  # parked, kept
        assert await cluster.close() >= 1


async def test_a_suspended_slice_parked_on_a_drained_host_resumes_elsewhere() -> None:
    async with cluster_of() as cluster:
        slice_ = await cluster.devices(2)  # host 0
        add = slice_.jit(lambda x: x + 1)
        x = cluster.run(add, np.zeros(70_000, np.float32)).refs
        y = cluster.run(add, x).refs
        await cluster.suspend(slice_)  # parked in host 0's memory
        report = await cluster.drain(0)  # the parked buffers go to host 1
        assert report["buffers"] >= 2 and (await cluster.store_usage())[0]["buffers"] == 0
        await cluster.resume(slice_)  # on host 1, where they are now
        z = cluster.run(add, y).refs
        np.testing.assert_array_equal(await cluster.fetch(z), np.full(70_000, 3, np.float32))
        np.testing.assert_array_equal(await cluster.fetch(x), np.ones(70_000, np.float32))


async def test_a_spare_taken_and_given_back_stays_a_spare() -> None:
    async with cluster_of(spares=1) as cluster:
        slice_ = await cluster.devices(2)  # host 0
        await cluster.drain(0)  # forced off: to the spare
        assert (await cluster.elastic_status())["spares"] == [6, 7]
        await cluster.release(slice_)
        assert (await cluster.elastic_status())["spares"] == [4, 5, 6, 7]
        with pytest.raises(AtollError):
            await cluster.devices(1)  # host 0 drained, host 1 spare: nothing to allocate


async def test_bad_moves_are_refused_and_lose_nothing() -> None:
    async with cluster_of() as cluster:
        slice_ = await cluster.devices(2)
        inc = slice_.jit(lambda v: v + 1)
        x = cluster.run(inc, np.arange(70_000, dtype=np.float32)).refs
        other = cluster.client("other")
        with pytest.raises(AtollError):
            await other.move(slice_, host=1)  # not theirs
        with pytest.raises(AtollError, match="not free"):
            await cluster.move(slice_, devices=[2, 9])
        with pytest.raises(AtollError, match="free devices"):
            await cluster.move(slice_, host=3)
        with pytest.raises(AtollError, match="does not hold"):
            await cluster.move(slice_, devices=[1, 2])  # overlaps its own [0, 1]
        np.testing.assert_array_equal(await cluster.fetch(x), np.arange(70_000) + 1)
        again = cluster.run(inc, x).refs
        np.testing.assert_array_equal(await cluster.fetch(again), np.arange(70_000) + 2)
