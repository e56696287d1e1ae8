"""Devices that run ahead, buffers freed when dropped, and errors that reach their readers.

A ``JaxDevice`` enqueues a gang and moves on: its outputs are futures in the
store, and the next gang reading them is enqueued behind it with no host
wait (``devices/jax/device.py``). A client's buffers are freed when its last
reference to them goes (``runtime/client/ownership.py``). These tests hold both to
what a training loop needs: thousands of steps that drop their references
end with a handful of buffers, on both transports, and never stall in a
store bounded to a few outputs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import anyio
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import atoll
from atoll.devices import Computation, NotYours
from atoll.devices._inflight import InFlight
from atoll.devices.jax import JaxDevice
from atoll.kernel import config

pytestmark = pytest.mark.anyio

W = np.full((8, 8), 0.5, np.float32)
X = np.eye(8, dtype=np.float32)


def step(x: Any, w: Any) -> Any:
    """One link of a chain (host processes import it by name)."""
    return jnp.tanh(x @ w)


def expected(steps: int) -> np.ndarray:
    x = X
    for _ in range(steps):
        x = np.tanh(x @ W)
    return x


async def buffers(cluster: atoll.Cluster) -> int:
    """Buffers in every store, once the frees sent so far have arrived."""
    last = -1
    for _ in range(100):
        held = sum(u["buffers"] for u in await cluster.store_usage())
        if held == last:
            return held
        last = held
        await anyio.sleep(0.05)
    return last


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["inproc", "capnp"])
@pytest.mark.timeout(180)
async def test_a_long_chain_that_drops_its_references_keeps_a_handful(
    anyio_backend: str, transport: str
) -> None:
    """10,000 steps of ``x = cluster.run(step, x, w).refs``, awaited every
    1,000: every link but the last is freed (x, w and the put of x stay)."""
    if transport == "capnp" and anyio_backend != "asyncio":
        pytest.skip("host processes: pycapnp is asyncio-only")
    async with atoll.local_cluster(1, 1, 1, device_cls=JaxDevice, transport=transport) as cluster:
        devices = await cluster.devices(1)
        f = devices.jit(step, name="step")
        w = cluster.run(devices.jit(lambda a: a, name="w"), W).refs
        x = cluster.run(devices.jit(lambda a: a, name="x"), X).refs
        for _ in range(10):
            for _ in range(1000):
                x = cluster.run(f, x, w).refs
            await cluster.ready(x)
        np.testing.assert_allclose(await cluster.fetch(x), expected(10_000), rtol=1e-5)
        assert await buffers(cluster) <= 4


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["inproc", "capnp"])
@pytest.mark.timeout(180)
async def test_a_low_level_chain_frees_its_links_too(anyio_backend: str, transport: str) -> None:
    """``h = cluster.run(Computation, 0, [h, w])``, one turn per 500 steps."""
    if transport == "capnp" and anyio_backend != "asyncio":
        pytest.skip("host processes: pycapnp is asyncio-only")
    link = Computation("step", step)
    async with atoll.local_cluster(1, 1, 1, device_cls=JaxDevice, transport=transport) as cluster:
        w = await cluster.put(W, 0)
        h = cluster.put(X, 0)
        for _ in range(4):
            for _ in range(500):
                h = cluster.run(link, 0, [h, w])
            await cluster.ready(h)
        np.testing.assert_allclose(await cluster.fetch(h), expected(2000), rtol=1e-5)
        assert await buffers(cluster) <= 3


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["inproc", "capnp"])
@pytest.mark.timeout(180)
async def test_a_store_bounded_to_a_few_outputs_never_stalls(
    anyio_backend: str, transport: str
) -> None:
    """A store that holds four outputs: a 2,000-step chain, all of it sent
    at once, still runs to its end (frees make room as it goes)."""
    if transport == "capnp" and anyio_backend != "asyncio":
        pytest.skip("host processes: pycapnp is asyncio-only")
    bound = 4 * X.nbytes
    async with atoll.local_cluster(
        1, 1, 1, device_cls=JaxDevice, transport=transport, store_bytes=bound
    ) as cluster:
        devices = await cluster.devices(1)
        f = devices.jit(step, name="step")
        w = cluster.run(devices.jit(lambda a: a, name="w"), W).refs
        x = cluster.run(devices.jit(lambda a: a, name="x"), X).refs
        began = time.monotonic()
        for _ in range(2000):
            x = cluster.run(f, x, w).refs
        with anyio.fail_after(120):
            np.testing.assert_allclose(await cluster.fetch(x), expected(2000), rtol=1e-5)
        assert time.monotonic() - began < 120
        usage = await cluster.store_usage()
        assert max(u["peak_bytes"] for u in usage) <= bound


def slow(x: Any) -> Any:
    """About 50 ms of work on a CPU: a loop of matrix products."""

    def body(_: Any, y: Any) -> Any:
        return jnp.tanh(y @ y) * 0.5

    return jax.lax.fori_loop(0, 60, body, x)


@pytest.mark.timeout(120)
async def test_the_device_runs_ahead_of_a_slow_kernel(anyio_backend: str) -> None:
    """Eight gangs of a slow kernel: all are enqueued before the first is
    done, and its outputs' handles arrive before they exist."""
    async with atoll.local_cluster(1, 1, 1, device_cls=JaxDevice) as cluster:
        devices = await cluster.devices(1)
        f = devices.jit(slow, name="slow")
        big = np.full((384, 384), 0.01, np.float32)
        x = cluster.run(f, big).refs
        await cluster.ready(x)  # compiled
        began = time.monotonic()
        outs = [cluster.run(f, x).refs for _ in range(8)]
        handles = [await out.promise for out in outs]  # enqueued: handles come at once
        enqueued = time.monotonic() - began
        stats = (await cluster.device_stats())[0]
        assert stats.in_flight >= 4, stats  # still running, several at once
        for out in outs:
            await cluster.ready(out)
        finished = time.monotonic() - began
        assert enqueued < finished / 2, (enqueued, finished)
        stats = (await cluster.device_stats())[0]
        assert stats.peak_in_flight >= 4 and stats.in_flight == 0
        assert stats.busy_s > 0
        assert len({h.id for h in handles}) == 8


def _explode(x: Any) -> Any:
    raise FloatingPointError("this kernel diverged")


def broken(x: Any) -> Any:
    """Fails when it runs on the device (tracing it does not call the callback)."""
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)  # type: ignore[no-untyped-call]
    return jax.pure_callback(_explode, shape, x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fuse", ["1", "0"])
async def test_a_failing_computation_fails_its_readers_not_independent_work(
    anyio_backend: str, fuse: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ATOLL_FUSE", fuse)  # unfused: the lean path, with and without a wait
    config.reset()
    async with atoll.local_cluster(1, 1, 2, device_cls=JaxDevice) as cluster:
        devices = await cluster.devices(1)
        bad = devices.jit(broken, name="broken")
        f = devices.jit(step, name="step")
        x = cluster.run(devices.jit(lambda a: a), X).refs
        w = cluster.run(devices.jit(lambda a: a), W).refs
        failed = cluster.run(bad, x).refs
        reader = cluster.run(f, failed, w).refs
        independent = cluster.run(f, x, w).refs
        for value in (failed, reader):
            with pytest.raises(atoll.AtollError, match="this kernel diverged"):
                await cluster.fetch(value)
        np.testing.assert_allclose(await cluster.fetch(independent), expected(1), rtol=1e-5)
        low = cluster.run(Computation("broken", broken), 1, [X])
        after = cluster.run(Computation("step", step), 1, [low, W])
        with pytest.raises(atoll.AtollError, match="this kernel diverged"):
            await cluster.fetch(after)


class _Future:
    """An accelerator's output as the watcher sees it: done when told, or failed."""

    def __init__(self) -> None:
        self.done = False
        self.error: BaseException | None = None

    def is_ready(self) -> bool:
        return self.done


def _wait(outputs: Sequence[Any]) -> None:
    for output in outputs:
        while not output.done:
            time.sleep(0.001)
        if output.error is not None:
            raise output.error


async def test_the_watcher_reports_in_order_with_errors_and_holds_the_window(
    anyio_backend: str,
) -> None:
    """Gangs finish out of order; each report comes once, with its error;
    ``room`` waits while the window is full."""
    inflight = InFlight(_wait, lambda output: output.done, window=2)
    reports: list[tuple[int, str | None]] = []
    futures = [_Future() for _ in range(3)]

    def done(index: int) -> Any:
        return lambda error, _: reports.append((index, None if error is None else str(error)))

    for index, future in enumerate(futures[:2]):
        inflight.add([future], done(index))
    assert inflight.count == 2
    with anyio.move_on_after(0.05) as waited:
        await inflight.room()
    assert waited.cancelled_caught  # the window is full
    futures[1].done = True  # the newer one first: nothing is reported yet
    await anyio.sleep(0.05)
    futures[0].error = ValueError("out of memory")
    futures[0].done = True
    with anyio.fail_after(5):
        await inflight.room()
        while len(reports) < 2:
            await anyio.sleep(0.01)
    inflight.add([futures[2]], done(2))
    futures[2].done = True
    with anyio.fail_after(5):
        while len(reports) < 3:
            await anyio.sleep(0.01)
    assert reports == [(0, "out of memory"), (1, None), (2, None)]
    assert inflight.count == 0 and inflight.peak == 2
    await inflight.close()


async def _program_then_chain(cluster: atoll.Cluster, links: int) -> Any:
    """A 16-node program of ``step``, then a chain of ``links`` runs of it,
    on one device: the chain's last output."""
    devices = await cluster.devices(1)
    f = devices.jit(step, name="step")

    @atoll.program
    def program(x: Any, w: Any, f: Any = f) -> Any:
        for _ in range(16):
            x = f(x, w)
        return x

    w = cluster.run(devices.jit(lambda a: a), W).refs
    x = cluster.run(program, X, w).refs
    for _ in range(links):
        x = cluster.run(f, x, w).refs
    return x


@pytest.mark.timeout(120)
async def test_consecutive_gangs_fuse_and_give_what_they_give_one_by_one(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 16-node program and a 200-link chain on one device: fused (blocks of
    the chain share one executable) and not, the same values."""
    results = []
    for fuse in ("1", "0"):
        monkeypatch.setenv("ATOLL_FUSE", fuse)
        config.reset()  # a process reads its settings once
        async with atoll.local_cluster(1, 1, 1, device_cls=JaxDevice) as cluster:
            x = await _program_then_chain(cluster, 200)
            results.append(await cluster.fetch(x))
            device = cluster.system._cells[cluster.device_ref(0).id].instance
            assert isinstance(device, JaxDevice)
            fused = [s for segments in device._fused.values() for s in segments.values()]
            if fuse == "1":
                compiled = device.executables.compilations
                assert fused and compiled <= 6, compiled
            else:
                assert not fused
    np.testing.assert_allclose(results[0], expected(216), rtol=1e-5)
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)


@pytest.mark.timeout(120)
async def test_unfused_gangs_whose_inputs_are_here_go_without_a_wait(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a kernel ran on a device, its next gangs there whose inputs are
    all in the store go on the device with no wait in between
    (``JaxDevice.alone_now``), and give what the awaited path gives; a gang
    that reads another session's buffer still fails with why."""
    monkeypatch.setenv("ATOLL_FUSE", "0")
    config.reset()
    taken: list[bool] = []
    alone_now = JaxDevice.alone_now

    def counted(self: JaxDevice, *args: Any) -> Any:
        out = alone_now(self, *args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(JaxDevice, "alone_now", counted)
    async with atoll.local_cluster(1, 1, 2, device_cls=JaxDevice) as cluster:
        x = await _program_then_chain(cluster, 100)
        np.testing.assert_allclose(await cluster.fetch(x), expected(116), rtol=1e-5)
        assert taken.count(True) >= 90, "".join("+" if t else "." for t in taken)
        other = cluster.client("other")
        theirs = await other.devices(1)
        g = theirs.jit(step, name="step")
        mine = other.run(theirs.jit(lambda a: a), W).refs
        np.testing.assert_allclose(await other.fetch(other.run(g, mine, mine).refs), np.tanh(W @ W))
        with pytest.raises(NotYours):  # (g ran: alone_now knows its kernel)
            await other.fetch(other.run(g, x, mine).refs)


class _Kernel:
    """A kernel as a fused segment sees one: a function (not a JaxKernel)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn


def _chain_program(nodes: Sequence[int], keep: int, kernel: _Kernel) -> Any:
    """A device's program: a chain of ``kernel`` over graph ``nodes`` (the
    gaps are gangs on other devices), keeping the output of ``nodes[keep]``."""
    from atoll.devices._aval import Aval
    from atoll.devices._plan import MADE_HERE, DeviceProgram, PlannedGang

    aval = Aval((2,), "float32")
    gangs = []
    for k, node in enumerate(nodes):
        made = k > 0
        gangs.append(
            PlannedGang(
                node, kernel, (0,), (1,), ("x",), (aval,),
                inputs=(MADE_HERE if made else 0,),
                resident=(made,),
                push=(),
                keep=(k == keep,),
                local=((nodes[k - 1], 0) if made else None,),
            )
        )  # fmt: skip
    return DeviceProgram(0, 0, tuple(gangs), (0,))


def test_fused_segments_that_keep_different_gangs_never_share_an_executable() -> None:
    """Two chains of the same kernel, one with gaps in its node numbers: the
    one keeping its middle gang's output is not the one keeping its last's."""
    from atoll.devices.jax.compiled import Meshes
    from atoll.devices.jax.fused import FusedSegment

    kernel = _Kernel(lambda x: x + 1)
    device, meshes = jax.devices()[0], Meshes()
    middle = FusedSegment(_chain_program((0, 2, 3), 1, kernel), 0, 3, device, meshes)
    last = FusedSegment(_chain_program((0, 1, 2), 2, kernel), 0, 3, device, meshes)
    assert middle.exported == [(2, 0)] and last.exported == [(2, 0)]
    assert middle.shape != last.shape
    ones = jnp.ones(2, jnp.float32)
    assert float(middle(ones)[0][0]) == 3.0 and float(last(ones)[0][0]) == 4.0
