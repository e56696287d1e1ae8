"""JAX device actors on 8 fake CPU devices: placement, caching, sharding, memory."""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

from typing import Any

import anyio
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import atoll
from atoll.devices import Computation
from atoll.devices.jax import JaxDevice, JaxHost
from atoll.kernel import ActorRef, wait_idle

pytestmark = pytest.mark.anyio


def scale(x: Any) -> Any:
    return x * 3.0 + 1.0


def placement(handle: atoll.devices.BufferHandle) -> Any:
    host: ActorRef[JaxHost] = handle.host  # type: ignore[assignment]
    return host.placement(handle.id)


async def test_eight_fake_devices_are_there() -> None:
    assert len(jax.devices()) == 8


async def test_computation_runs_on_its_own_device_and_compiles_once() -> None:
    async with atoll.local_cluster(1, 2, 2, device_cls=JaxDevice) as cluster:
        step = Computation("scale", scale)
        x = cluster.put(np.arange(4, dtype=np.float32), 3)
        y = cluster.run(step, 3, [x])
        z = cluster.run(step, 3, [y])
        w = cluster.run(step, 3, [cluster.put(np.ones(6, np.float32), 3)])  # new signature
        np.testing.assert_allclose(await cluster.fetch(z), scale(scale(np.arange(4.0))))
        np.testing.assert_allclose(await cluster.fetch(w), scale(np.ones(6)))
        stats = await cluster.device_stats()
        assert [s.computations for s in stats] == [0, 0, 0, 3]
        assert stats[3].busy_s > 0


async def test_sharded_node_is_one_jax_computation_over_the_slice() -> None:
    async with atoll.local_cluster(1, 2, 4, device_cls=JaxDevice) as cluster:
        part = await cluster.devices(4, mesh_shape=(2, 2), axis_names=("a", "b"))
        # the reduction over a sharded input makes XLA emit a real all-reduce
        norm = part.jit(
            lambda x: (x / jnp.sum(x), x * 2), in_specs=(P("a", "b"),), out_specs=(P(), P("a"))
        )
        x = np.arange(1, 17, dtype=np.float32).reshape(4, 4)
        out = cluster.run(norm, x)
        normed, doubled = await out
        np.testing.assert_allclose(normed, x / x.sum(), rtol=1e-6)
        np.testing.assert_allclose(doubled, 2 * x)
        flat = out.flat
        handles = [await ref.promise for ref in flat]
        assert await placement(handles[0]) == await placement(handles[1])
        devices = await placement(handles[0])
        assert len(devices) == 4 and len({d // 4 for d in devices}) == 1  # one host
        stats = await cluster.device_stats()
        assert sorted(s.computations for s in stats) == [0, 0, 0, 0, 1, 1, 1, 1]


async def test_outputs_are_freed_by_reference_and_by_owner() -> None:
    async with atoll.local_cluster(1, 1, 2, device_cls=JaxDevice) as cluster:
        one = await cluster.devices(1)
        f = one.jit(scale)
        a = cluster.run(f, np.ones(3, np.float32))
        b = cluster.run(f, a.refs)  # chained without fetching
        np.testing.assert_allclose(await b, scale(scale(np.ones(3))))
        assert (await cluster.store_usage())[0]["buffers"] == 2
        assert await cluster.free(a.refs) is True
        assert (await cluster.store_usage())[0]["buffers"] == 1
        other = cluster.client("other")  # a session of its own: its own slice
        c = other.run((await other.devices(1)).jit(scale), np.ones(3, np.float32))
        await c
        assert (await cluster.store_usage())[0]["buffers"] == 2
        assert await other.close() == 1  # only the other client's buffer goes
        assert (await cluster.store_usage())[0]["buffers"] == 1
        assert await cluster.close() == 1
        with pytest.raises(atoll.kernel.UsageError, match="no slice"):  # the caller's mistake
            await cluster.run(f, np.ones(3, np.float32))  # its slice went with close()


async def test_full_store_stalls_the_device_instead_of_crashing() -> None:
    async with atoll.local_cluster(1, 1, 1, device_cls=JaxDevice, store_bytes=1000) as cluster:
        one = await cluster.devices(1)
        make = one.jit(lambda x: jnp.tile(x, 100))  # 400 bytes out of 4 in
        x = np.ones(1, np.float32)
        first, second = cluster.run(make, x), cluster.run(make, x)
        await first
        await second
        third = cluster.run(make, x)
        for _ in range(3):
            await wait_idle()
        assert not third.flat[0].promise.done()  # waiting for room, not failed
        await cluster.free(first.flat[0])
        with anyio.fail_after(10):
            np.testing.assert_allclose(await third, np.ones(100))


async def test_a_jax_node_must_sit_on_one_host() -> None:
    async with atoll.local_cluster(1, 2, 2, device_cls=JaxDevice) as cluster:
        wide = await cluster.devices(4)
        f = wide.jit(scale)
        with pytest.raises(atoll.RemoteActorError, match="one host"):
            await cluster.run(f, np.ones(4, np.float32))


async def test_more_atoll_devices_than_jax_devices_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="12 devices asked for, 8 exist"):
        async with atoll.local_cluster(1, 3, 4, device_cls=JaxDevice):
            pass
