"""Elastic slices over real host processes (Cap'n Proto, asyncio).

A training loop whose slice moves between host processes twice and is
suspended and resumed once gives the losses of an uninterrupted run, while
a second client trains beside it unaffected; a drained host (by call, or
by SIGTERM, as a preempted one) leaves with no buffer lost; a host killed
with ``kill -9`` while a spare is configured has its slices re-placed on the
spare: what lived only on it fails with ``HostLost``, the rest is right.
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import atoll
from atoll.devices import Aval, Computation
from atoll.devices.jax import JaxDevice
from atoll.kernel import HostLost
from atoll.runtime import Cluster
from atoll.runtime.graph import GraphBuilder, SliceSpec
from atoll.transports.testing import eventually

from ..runtime.test_elastic import Hook, train

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


def _add_one(v: np.ndarray) -> np.ndarray:
    return v + 1


def _sub_one(v: np.ndarray) -> np.ndarray:
    return v - 1


N = 70_000  # float32: 280 KiB, whose bytes move (a small value rides in its handle)
VECTOR = Aval((N,), "float32")


def on(slice_: SliceSpec, fn: Any) -> Callable[..., Any]:
    """``fn`` over a float32 vector of ``N``, as a one-node graph on
    ``slice_`` for simulated devices; called with a value, its ``ArrayRef``."""
    builder = GraphBuilder()
    x = builder.input(VECTOR)
    [y] = builder.add(Computation(fn.__name__, fn, 1e6), slice_, [x], [VECTOR])
    graph = builder.build([y])

    def call(cluster: Cluster, value: Any) -> Any:
        return cluster.run_graph(graph, [value])[0]

    return call


def on_big(slice_: SliceSpec, cluster: Cluster, value: np.ndarray) -> Any:
    """``value`` placed on ``slice_``'s device (a one-node copy)."""
    builder = GraphBuilder()
    aval = Aval(value.shape, "float32")
    x = builder.input(aval)
    [y] = builder.add(Computation("copy", np.copy, 1e6), slice_, [x], [aval])
    return cluster.run_graph(builder.build([y]), [value])[0]


async def _pids(cluster: Cluster) -> list[int]:
    return [usage["pid"] for usage in await cluster.store_usage()]


@pytest.mark.slow
async def test_training_over_host_processes_moves_and_suspends_and_loses_nothing() -> None:
    async with atoll.local_cluster(1, 3, 2, device_cls=JaxDevice, transport="capnp") as cluster:
        reference = cluster.client("reference")
        ref_slice = await reference.devices(2, axis_names=("data",))
        expected = await train(reference, ref_slice)
        await reference.close()

        other = cluster.client("other")
        mine = await cluster.devices(2, axis_names=("data",))  # host 0
        theirs = await other.devices(2, axis_names=("data",))  # host 1
        reports: list[dict[str, Any]] = []

        async def elastic(step: int, c: Cluster, s: Any) -> None:
            if step == 3:
                reports.append(await c.move(s, host=2))
            elif step == 6:
                reports.append(await c.move(s, devices=[0, 1]))
            elif step == 8:
                reports.append(await c.suspend(s))
                reports.append(await c.resume(s))

        results: dict[str, list[float]] = {}

        async def run(name: str, c: Cluster, s: Any, hook: Hook | None) -> None:
            results[name] = await train(c, s, hook)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "mine", cluster, mine, elastic)
            tg.start_soon(run, "theirs", other, theirs, None)
        assert results["mine"] == expected
        assert results["theirs"] == expected
        assert [r["op"] for r in reports] == ["move", "move", "suspend", "resume"]
        assert all(r["bytes"] > 250_000 for r in reports[:2])  # the bytes crossed processes


@pytest.mark.slow
async def test_a_drained_host_process_leaves_with_no_buffer_lost(tmp_path: Path) -> None:
    async with atoll.local_cluster(1, 3, 1, transport="capnp") as cluster:
        slice_ = await cluster.devices(1)  # on host 0
        inc = on(slice_, _add_one)
        values = [np.full(N, float(i), np.float32) for i in range(3)]
        made = [inc(cluster, v) for v in values]
        put = cluster.put(values[0], 0)  # a buffer on a device no slice holds
        await cluster.ready(made[-1])
        pids = await _pids(cluster)
        report = await cluster.drain(0)
        assert report["buffers"] >= 4
        await eventually(lambda: _gone(pids[0]), "the drained host process exited")
        for ref, value in zip(made, values, strict=True):  # their old host is gone
            np.testing.assert_array_equal(await cluster.fetch(ref), value + 1)
        np.testing.assert_array_equal(await cluster.fetch(put), values[0])
        again = inc(cluster, made[0])
        np.testing.assert_array_equal(await cluster.fetch(again), values[0] + 2)
        await cluster.free(made[1])  # a free finds where it went
        if importlib.util.find_spec("orbax") is not None:  # the [train] extra
            await cluster.save({"x": made[2]}, tmp_path / "ck")  # written where it is now
            restored = await cluster.restore(tmp_path / "ck", device=1)
            np.testing.assert_array_equal(await cluster.fetch(restored["x"]), values[2] + 1)
        builder = cluster.controller.name.rsplit("/", 1)[0]  # its parent: ClusterBuilder
        rows = await cluster.system.lookup(builder).status()
        hosts = {r["host"]: r for r in rows if r["kind"] == "host"}
        assert hosts[0]["elastic"] == "drained" and hosts[1]["elastic"] is None
        changes = [r for r in rows if r["kind"] == "change"]
        assert changes[-1]["op"] == "drain" and changes[-1]["host"] == 0


@pytest.mark.slow
async def test_moves_on_one_machine_take_the_segment_over_and_free_it() -> None:
    async with atoll.local_cluster(1, 2, 1, transport="capnp") as cluster:
        slice_ = await cluster.devices(1)  # on host 0
        inc = on(slice_, _add_one)
        big = np.arange(N * 8, dtype=np.float32)  # 2.2 MiB: in shared memory
        x = on_big(slice_, cluster, big)
        await cluster.ready(x)
        for host in (1, 0, 1):
            before = _segments()
            await cluster.move(slice_, host=host)
            after = _segments()
            renamed = {n for i, n in after.items() if i in before and before[i] != n}
            assert len(renamed) == 1, renamed  # the same file, under the new holder's name
            np.testing.assert_array_equal(await cluster.fetch(x), big)
        taken = sum(u["taken_over"] for u in await cluster.store_usage())
        assert taken == 3  # no byte copied
        y = inc(cluster, np.zeros(N, np.float32))  # the slice computes where it is
        np.testing.assert_array_equal(await cluster.fetch(y), np.ones(N))
        await cluster.free(x)
        [name] = renamed
        await eventually(lambda: name not in os.listdir("/dev/shm"), "its segment removed")


@pytest.mark.slow
async def test_sigterm_drains_a_host_before_it_stops() -> None:
    async with atoll.local_cluster(1, 2, 1, transport="capnp") as cluster:
        slice_ = await cluster.devices(1)  # on host 0
        inc = on(slice_, _add_one)
        x = inc(cluster, np.zeros(N, np.float32))
        await cluster.ready(x)
        pids = await _pids(cluster)
        os.kill(pids[0], signal.SIGTERM)  # as SLURM or Kubernetes preempt it
        await eventually(lambda: _gone(pids[0]), "the host stopped once drained")
        status = await cluster.elastic_status()
        assert status["drained"] == [0]
        np.testing.assert_array_equal(await cluster.fetch(x), np.ones(N))
        np.testing.assert_array_equal(await cluster.fetch(inc(cluster, x)), 2 * np.ones(N))


@pytest.mark.slow
async def test_a_killed_host_with_a_spare_has_its_slices_re_placed() -> None:
    async with atoll.local_cluster(1, 3, 1, transport="capnp", spares=1) as cluster:
        other = cluster.client("other")
        mine = await cluster.devices(1)  # host 0 (host 2 is the spare)
        theirs = await other.devices(1)  # host 1
        inc, dec = on(mine, _add_one), on(theirs, _sub_one)
        lost = inc(cluster, np.zeros(N, np.float32))  # only on host 0
        kept = dec(other, np.zeros(N, np.float32))  # on host 1
        await cluster.ready(lost)
        await other.ready(kept)
        pids = await _pids(cluster)
        os.kill(pids[0], signal.SIGKILL)
        await eventually(
            lambda: _has(cluster, "lost", [0]), "the controller re-placed host 0's slices"
        )
        with pytest.raises(HostLost):
            await cluster.fetch(lost)
        fresh = inc(cluster, np.zeros(N, np.float32))  # on the spare now
        np.testing.assert_array_equal(await cluster.fetch(fresh), np.ones(N))
        np.testing.assert_array_equal(await other.fetch(kept), -np.ones(N))
        again = dec(other, kept)
        np.testing.assert_array_equal(await other.fetch(again), -2 * np.ones(N))
        spare = await cluster.device_ref(2).stats()
        assert spare.computations >= 1  # the spare ran it


async def _has(cluster: Cluster, key: str, value: Any) -> bool:
    return bool((await cluster.elastic_status())[key] == value)


def _segments() -> dict[int, str]:
    """The shared-memory files of this machine, by inode (a spare made
    meanwhile is a new file; a segment taken over keeps its inode)."""
    found = {}
    for name in os.listdir("/dev/shm"):
        with contextlib.suppress(FileNotFoundError):
            found[os.stat(f"/dev/shm/{name}").st_ino] = name
    return found


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie until its parent reaps it
        return stat.read().split()[2] == "Z"
