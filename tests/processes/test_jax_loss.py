"""A lost JAX host: its gangs fail with ``HostLost``, everything else goes on.

Host processes with ``JaxDevice`` s share one ``jax.distributed`` runtime. When
one of them dies:

* a gang over its devices fails (``HostLost``, boxed when a surviving shard
  raises it) instead of leaving the surviving shards at the gang's barrier,
  or in a collective with the dead peer, for ever;
* the survivors are not terminated by JAX when its coordination service
  notices the death (recoverability is on), so the other island's gangs,
  across processes, and single-device work on the survivors go on, before
  and after that moment (the heartbeat timeout, shortened here to 5 s).

The first tests check two parts in one process: the barrier, over a device
that answers as a lost host's does, and where a host collects garbage.
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import anyio
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import atoll
from atoll.devices import Aval, Computation, RunReport
from atoll.devices._plan import DeviceProgram
from atoll.devices.jax import JaxDevice
from atoll.kernel import Actor, HostLost, Promise, endpoint, failed
from atoll.runtime import (
    Allocation,
    ClusterSpec,
    GraphBuilder,
    IslandScheduler,
    SliceSpec,
    Topology,
    process_cluster,
)
from atoll.runtime.control.planner import CompiledPlan, compile_gangs, plan
from atoll.runtime.deploy.process import _collect_garbage_on_loop
from atoll.transports.testing import eventually, pid_alive

pytestmark = pytest.mark.anyio

HEARTBEAT_S = 5  # JAX's: a dead process is noticed (and, before, fatal) after this
COLLECTIVE_S = 5  # a collective with a dead peer fails after this


class LostDevice(Actor):
    """Answers every run as the link to a dead host process does: HostLost
    itself (raised here, it would come boxed, as a device's own error)."""

    @endpoint
    def install_plan(self, program: DeviceProgram) -> None:
        pass

    @endpoint(resolve_args=False)
    def run_plan(
        self, plan_id: int, epoch: int, inputs: list[Any], owner: str = ""
    ) -> Promise[RunReport]:
        return failed(HostLost(f"the host of a device of run {epoch} is lost"))


def _collective_over(devices: tuple[int, ...], plan_id: int) -> CompiledPlan:
    """A program of one collective gang over ``devices`` (one island, one host)."""
    work = Computation("allreduce", lambda: np.zeros(1), collective=True)
    builder = GraphBuilder()
    (out,) = builder.add(work, SliceSpec(0, (len(devices),), ("x",)), [], [Aval((1,), "float64")])
    graph = builder.build([out])
    topology = Topology.even(islands=1, hosts_per_island=1, devices_per_host=len(devices))
    made = plan(graph, {0: Allocation(0, devices, 0, "")}, topology, [""], push=True)
    [step] = compile_gangs(made, graph, iter([plan_id]), lambda _: 0)
    return step


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # trio: through the bridge
async def test_a_gang_over_a_lost_device_frees_its_partners_at_the_barrier() -> None:
    """Device 0 waits at the gang's barrier for device 1, whose host is lost:
    the island abandons the run, so device 0's gang fails and it is free again."""
    async with atoll.local_cluster(1, 1, 1) as cluster:
        devices = {0: cluster.device_ref(0), 1: cluster.system.spawn(LostDevice)}
        island = cluster.system.spawn(IslandScheduler, 0, "fifo", devices)
        with anyio.fail_after(10):  # without the abandon, device 0 waits for ever
            for epoch in (1, 2):  # a later gang over the lost device fails as fast
                step = _collective_over((0, 1), epoch)
                reports = await island.run_plan(step, epoch, {0: [], 1: []})
                with pytest.raises(Exception) as caught:
                    await reports[1]
                assert _host_lost(caught.value)
                assert _host_lost((await reports[0]).errors[0])
            handle = await cluster.put(np.ones(2, np.float32), 0)  # device 0 is free
            np.testing.assert_array_equal(await cluster.fetch(handle), np.ones(2))


class Cycle:
    """Garbage only the cyclic collector frees; records the thread it ran on."""

    freed_on: ClassVar[list[int]] = []

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        Cycle.freed_on.append(threading.get_ident())


def test_a_host_collects_garbage_on_its_event_loop_only() -> None:
    """Where a collection runs, the garbage's finalizers run: on a JAX worker
    thread, capnp objects there abort the process. So a host's loop collects."""

    def make_garbage() -> list[list[int]]:  # on a worker thread, past the threshold
        for _ in range(10):
            Cycle()
        return [[] for _ in range(20_000)]

    async def host() -> int:
        _collect_garbage_on_loop(asyncio.get_running_loop(), every=0.01)
        kept = await asyncio.to_thread(make_garbage)  # still counted, as allocated
        await eventually(lambda: len(Cycle.freed_on) >= 10, "the cycles collected", timeout=10)
        del kept
        return threading.get_ident()

    try:
        loop_thread = asyncio.run(host())
    finally:
        gc.enable()
    assert set(Cycle.freed_on) == {loop_thread}


def total(x: Any) -> Any:
    """An all-reduce over the slice."""
    return jnp.sum(x)


def spinner(marks: Path) -> Callable[[Any], Any]:
    """A long collective program; each shard first touches ``marks/<pid>``,
    so a test can tell its process is in the program (in its collectives)."""

    def mark(v: np.ndarray) -> np.ndarray:
        (marks / str(os.getpid())).touch()
        return np.zeros_like(v)

    def spin(x: Any) -> Any:
        def shard(v: Any) -> Any:
            v = v + io_callback(mark, jax.ShapeDtypeStruct(v.shape, v.dtype), v)
            step = lambda _, w: w + jax.lax.psum(jnp.sum(w), "d") * 1e-9  # noqa: E731
            return jax.lax.fori_loop(0, 1_000_000, step, v)

        mesh = AbstractMesh((4,), ("d",))
        return jax.shard_map(shard, mesh=mesh, in_specs=P("d"), out_specs=P("d"))(x)

    return spin


def counted_dead(victim: int) -> Callable[[Any], Any]:
    """A program for a survivor that returns (how many of it and ``victim``
    are alive) once JAX's coordination service has counted ``victim`` dead:
    the service answers ``get_live_nodes`` when every process it names that
    is alive asks, so a dead one is waited for until its heartbeat lapses."""

    def alive(_: np.ndarray) -> np.ndarray:
        from jax._src import distributed

        state = distributed.global_state
        assert state.client is not None  # a host process of a JAX cluster
        return np.array(len(state.client.get_live_nodes([state.process_id, victim])), np.int32)

    def program(x: Any) -> Any:
        return io_callback(alive, jax.ShapeDtypeStruct((), jnp.int32), x)

    return program


def double(a: np.ndarray) -> np.ndarray:
    return a * 2


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_lost_jax_host_fails_its_gangs_and_spares_the_rest(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    jax.devices()  # this process's JAX keeps its own devices (flags are read once)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # per host
    monkeypatch.setenv("ATOLL_JAX_HEARTBEAT_S", str(HEARTBEAT_S))
    monkeypatch.setenv("ATOLL_JAX_COLLECTIVE_TIMEOUT_S", str(COLLECTIVE_S))
    x = np.arange(8, dtype=np.float32)
    async with process_cluster(ClusterSpec(2, 2, 2, device_cls=JaxDevice)) as cluster:
        pids = [usage["pid"] for usage in await cluster.store_usage()]
        # lose JAX process 0: the launcher, not it, serves the coordination
        # service, so its loss ends no other process
        victim = next(h for h in range(4) if _jax_process_id(pids[h]) == 0)
        island, survivor = victim // 2, victim ^ 1
        lost = await cluster.devices(4, island=island, mesh_shape=(4,), axis_names=("d",))
        kept = await cluster.devices(4, island=1 - island, mesh_shape=(4,), axis_names=("d",))
        on_lost, on_kept = (s.jit(total, in_specs=(P("d"),), out_specs=P()) for s in (lost, kept))
        spin = lost.jit(spinner(tmp_path), in_specs=(P("d"),), out_specs=P("d"))
        assert await cluster.run(on_lost, x) == 28.0
        assert await cluster.run(on_kept, x) == 28.0

        running = cluster.run(spin, x)
        in_collectives = (tmp_path / str(pids[survivor])).exists
        await eventually(in_collectives, "the survivor in its collectives", timeout=60)
        os.kill(pids[victim], signal.SIGKILL)
        await _fails_with_host_lost(running, COLLECTIVE_S + 15)  # its collective gave up
        await _fails_with_host_lost(cluster.run(on_lost, x), 10)  # no collective: at once
        assert [pid_alive(pid) for pid in pids] == [i != victim for i in range(4)], pids

        async def goes_on() -> None:
            assert await cluster.run(on_kept, x) == 28.0  # across processes
            for device in (2 * survivor, 2 * survivor + 1):  # the survivor's devices
                out = cluster.run(Computation("double", double), device, [x])
                np.testing.assert_array_equal(await cluster.fetch(out), x * 2)

        await goes_on()
        # past the moment JAX's coordination service counts the victim dead,
        # which used to terminate every other process: a survivor asks the
        # service, which answers once it has (its own heartbeat timeout)
        counted = Computation("live", counted_dead(0))  # the victim is JAX process 0
        live = cluster.run(counted, 2 * survivor, [x])
        with anyio.fail_after(4 * HEARTBEAT_S + 30):
            assert int((await cluster.fetch(live))[()]) == 1  # the survivor alone
        assert [pid_alive(pid) for pid in pids] == [i != victim for i in range(4)]
        await goes_on()
        await _fails_with_host_lost(cluster.run(on_lost, x), 10)


async def _fails_with_host_lost(outputs: Any, within: float) -> None:
    with anyio.fail_after(within), pytest.raises(Exception) as failed:
        await outputs
    assert _host_lost(failed.value), failed.value


def _host_lost(error: BaseException) -> bool:
    """``HostLost``, or a ``HostLost`` a surviving shard raised (boxed)."""
    boxed = isinstance(error, atoll.RemoteActorError) and error.exc_type.endswith("HostLost")
    return isinstance(error, HostLost) or boxed


def _jax_process_id(pid: int) -> int:
    """The JAX process id the launcher gave host process ``pid`` (Linux)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    value = next(e for e in environ if e.startswith(b"ATOLL_JAX_PROCESS_ID="))
    return int(value.partition(b"=")[2])
