"""JAX gangs whose devices span hosts: one SPMD program, real cross-host collectives.

Two host processes with 4 fake CPU devices each join one ``jax.distributed``
runtime (gloo collectives); a node on a slice over all 8 devices runs on both
hosts at once and must give what plain single-process JAX gives.
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import atoll
from atoll.devices.jax import JaxDevice, JaxHost
from atoll.kernel import ActorRef
from atoll.runtime import ClusterSpec, process_cluster

pytestmark = pytest.mark.anyio


def layer(x: Any, w: Any) -> Any:
    """A matmul contracting over a sharded axis: XLA reduces across devices."""
    return jnp.tanh(x @ w)


def summary(h: Any) -> tuple[Any, Any]:
    """A full reduction and a normalisation: all-reduces over the whole mesh."""
    return jnp.sum(h), h / jnp.max(jnp.abs(h))


def psum_rows(x: Any) -> Any:
    """An explicit collective: the row blocks of the two hosts summed (psum over "a")."""
    mesh = AbstractMesh((2, 4), ("a", "b"))
    block_sum = jax.shard_map(
        lambda v: jax.lax.psum(v, "a"), mesh=mesh, in_specs=P("a"), out_specs=P()
    )
    return block_sum(x)


def _inputs() -> tuple[np.ndarray, np.ndarray]:
    x = np.linspace(-1.0, 1.0, 8 * 16, dtype=np.float32).reshape(8, 16)
    w = np.linspace(0.5, -0.5, 16 * 8, dtype=np.float32).reshape(16, 8)
    return x, w


def _expected(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same two nodes in plain JAX, in this process, on one device."""
    total, normed = jax.jit(summary)(jax.jit(layer)(x, w))
    return np.asarray(total), np.asarray(normed)


@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_a_gang_over_two_host_processes_is_one_spmd_program(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jax.devices()  # this process's JAX keeps its own devices (flags are read once)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")  # per host
    async with process_cluster(ClusterSpec(1, 2, 4, device_cls=JaxDevice)) as cluster:
        both = await cluster.devices(8, mesh_shape=(2, 4), axis_names=("a", "b"))
        f = both.jit(layer, in_specs=(P("a", "b"), P("b")), out_specs=P("a"))
        g = both.jit(summary, out_specs=(P(), P("a", "b")))
        s = both.jit(psum_rows, in_specs=(P("a"),), out_specs=P())

        @atoll.program
        def model(x: Any, w: Any) -> Any:
            return g(f(x, w))  # the second node reads the first's output in place

        x, w = _inputs()
        out = cluster.run(model, x, w)
        total, normed = await out
        want_total, want_normed = _expected(x, w)
        np.testing.assert_allclose(total, want_total, rtol=1e-5)
        np.testing.assert_allclose(normed, want_normed, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(await cluster.run(s, x), x.reshape(2, 4, 16).sum(0))

        handle = await out.flat[1].promise
        host: ActorRef[JaxHost] = handle.host  # type: ignore[assignment]
        assert handle.shape == (8, 8)
        assert len(await host.placement(handle.id)) == 1  # whole, on the gang leader's device
        stats = await cluster.device_stats()
        assert [s.computations for s in stats] == [3] * 8  # every shard took part

        await cluster.release(both)
        part = await cluster.devices(6, mesh_shape=(6,), axis_names=("d",))  # 4 + 2 devices
        spread = part.jit(summary, in_specs=(P("d"),), out_specs=(P(), P("d")))
        y = np.arange(1, 13, dtype=np.float32).reshape(6, 2)
        y_total, y_normed = await cluster.run(spread, y)
        assert y_total == pytest.approx(78.0)
        np.testing.assert_allclose(y_normed, y / 12.0, rtol=1e-6)
        stats = await cluster.device_stats()
        assert sorted(s.computations for s in stats) == [3, 3, 4, 4, 4, 4, 4, 4]
