"""The in-process cluster, simulated devices and the demo chain."""

from __future__ import annotations

import itertools

import anyio
import numpy as np
import pytest

import atoll
from atoll.devices import Computation, CostModel
from atoll.examples.demo import affine, chain_devices, run_demo
from atoll.kernel import ActorStopped, AtollError, Promise, VirtualClock, wait_idle

pytestmark = pytest.mark.anyio

COST = CostModel(flops_per_s=1e12, link_bytes_per_s=1e9, link_latency_s=50e-6)
TWO_MS = Computation("affine", affine, flops=2e9)


async def test_demo_chain_is_exact_under_a_virtual_clock() -> None:
    result = await run_demo(2, 2, 2, steps=16, step_ms=2.0, virtual=True)
    np.testing.assert_allclose(result.result, result.expected, rtol=1e-6)
    # 16 steps of 2 ms; 15 hops between hosts of 20 us + 32 bytes at 10 GB/s
    hops = 15 * (20e-6 + 32 / 10e9)
    assert result.device_elapsed_s == pytest.approx(0.032 + hops, rel=1e-9)
    assert [s.computations for s in result.stats] == [2] * 8
    assert all(s.busy_s == pytest.approx(0.004) for s in result.stats)
    assert all(0 < s.busy_fraction <= 1 for s in result.stats)


def test_chain_devices_hop_hosts_and_cover_devices() -> None:
    plan = chain_devices(8, hosts=4, devices_per_host=2)
    hosts = [d // 2 for d in plan]
    assert all(a != b for a, b in itertools.pairwise(hosts))
    assert sorted(plan) == list(range(8))


async def test_whole_chain_is_dispatched_before_its_data_exists() -> None:
    async with atoll.local_cluster(1, 5, 1, clock=VirtualClock(), cost=COST) as cluster:
        gate: Promise[atoll.devices.BufferHandle] = Promise("never yet")
        handle = gate
        for device in [0, 1, 2, 3]:
            handle = cluster.run(TWO_MS, device, [handle])
        await wait_idle()
        for device in range(4):
            stats = cluster.system.stats(cluster.device_ref(device))
            assert stats["received"] == 2  # its part of the plan, and the run, sit there
        assert cluster.clock.now() == 0.0  # and nothing has run
        # (device 0 is busy waiting for the gate: put the input on a free one)
        gate.set_result(await cluster.put(np.ones(4, np.float32), 4))
        out = await cluster.fetch(handle)
    np.testing.assert_allclose(out, affine(affine(affine(affine(np.ones(4, np.float32))))))


async def test_chain_time_counts_transfers_between_hosts_only() -> None:
    clock = VirtualClock()
    async with atoll.local_cluster(1, 2, 2, clock=clock, cost=COST) as cluster:
        x = cluster.put(np.zeros(250_000, np.float32), 0)  # 1 MB
        same_host = cluster.run(TWO_MS, 1, [x])
        await same_host
        t_same = clock.now()
        other_host = cluster.run(TWO_MS, 2, [same_host])
        await other_host
        t_other = clock.now() - t_same
    assert t_same == pytest.approx(0.002)
    assert t_other == pytest.approx(0.002 + 50e-6 + 1e6 / 1e9)


async def test_failed_step_fails_the_rest_of_the_chain() -> None:
    def broken(x: np.ndarray) -> np.ndarray:
        raise FloatingPointError("bad kernel")

    async with atoll.local_cluster(1, 2, 1, clock=VirtualClock(), cost=COST) as cluster:
        x = cluster.put(np.ones(3), 0)
        bad = cluster.run(Computation("broken", broken, 1e6), 0, [x])
        after = cluster.run(TWO_MS, 1, [bad])
        with pytest.raises(atoll.RemoteActorError) as info:
            await cluster.fetch(after)
        assert info.value.exc_type == "builtins.FloatingPointError"
        # the devices survive a failed computation
        assert (await cluster.fetch(cluster.run(TWO_MS, 0, [x]))).shape == (3,)


async def test_bad_requests_get_clear_errors() -> None:
    with pytest.raises(ValueError, match="islands"):
        async with atoll.local_cluster(0):
            pass
    with pytest.raises(KeyError, match="no scheduler named"):
        async with atoll.local_cluster(scheduler="nope"):
            pass
    async with atoll.local_cluster(1, 1, 2, clock=VirtualClock()) as cluster:
        with pytest.raises(AtollError, match="no device 7"):
            cluster.run(TWO_MS, 7, [])
        with pytest.raises(TypeError, match="Computation"):
            cluster.run(affine, 0, [])  # type: ignore[call-overload]


async def test_calls_pending_at_exit_fail_instead_of_hanging() -> None:
    never: Promise[atoll.devices.BufferHandle] = Promise("never")
    with anyio.fail_after(10):
        async with atoll.local_cluster(1, 1, 1, clock=VirtualClock()) as cluster:
            pending = cluster.run(TWO_MS, 0, [never])
            await wait_idle()
    assert isinstance(pending.exception(), ActorStopped)


async def test_arrays_can_be_passed_by_value_small_inline_large_put() -> None:
    total = Computation("total", np.sum, flops=1e9)
    async with atoll.local_cluster(1, 1, 2, clock=VirtualClock(), cost=COST) as cluster:
        small = np.ones(4, dtype=np.float32)
        handle = cluster.run(TWO_MS, 1, [small])
        small[:] = 7  # the call took a copy of the small array when it was made
        assert np.allclose(await cluster.fetch(handle), affine(np.ones(4, np.float32)))
        large = np.ones(1 << 13, dtype=np.float32)  # 32 KiB: put on the device first
        assert float(await cluster.fetch(cluster.run(total, 0, [large]))) == 1 << 13
        assert float(await cluster.fetch(cluster.run(total, 0, [small]))) == 28.0


async def test_large_arrays_put_for_one_call_are_freed_after_it() -> None:
    async with atoll.local_cluster(
        1, 1, 1, clock=VirtualClock(), cost=COST, store_bytes=100 * 1024
    ) as cluster:
        large = np.ones(1 << 13, dtype=np.float32)  # 32 KiB, put on the device each time
        for _ in range(6):  # would fill the store, and stall, if the puts stayed
            out = cluster.run(TWO_MS, 0, [large])
            result = await cluster.fetch(out)
            assert not result.flags.writeable  # a stored value is nobody's to change
            await cluster.free(out)
        await wait_idle()  # the frees are sent when the calls settle
        assert (await cluster.store_usage())[0]["buffers"] == 0
