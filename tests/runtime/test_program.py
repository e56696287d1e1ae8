"""Programs: tracing into sharded dataflow graphs, the resource manager, dispatch."""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import atoll
from atoll.devices import Aval, Computation, CostModel, JaxKernel
from atoll.devices.jax import JaxDevice
from atoll.kernel import AtollError, Promise, VirtualClock, wait_idle
from atoll.runtime import GraphBuilder, ResourceManager, SliceSpec, ValueRef, VirtualSlice

pytestmark = pytest.mark.anyio


def test_tracing_makes_one_node_per_call_and_runs_nothing() -> None:
    calls: list[str] = []

    def layer(x: Any, w: Any) -> Any:
        calls.append("traced")  # jax traces the function; it never runs on data
        return jnp.tanh(x @ w)

    a = VirtualSlice(0, (4,), ("d",), 0)
    b = VirtualSlice(1, (2,), ("x",), 0)
    f = a.jit(layer, in_specs=(P("d"), None), out_specs=P("d"))
    g = b.jit(lambda h: (h.sum(), h.mean(axis=0)))

    @atoll.program
    def prog(x: Any, w: Any) -> Any:
        return g(f(x, w))

    trace = prog.trace([Aval((8, 3), "float32"), Aval((3, 5), "float32")], _tree(2))
    graph = trace.graph
    assert [n.name for n in graph.nodes] == ["layer", "<lambda>"]
    assert graph.nodes[0].outputs == (Aval((8, 5), "float32"),)
    assert graph.nodes[1].inputs == (ValueRef(0, 0),)  # the edge: a transfer a -> b
    assert graph.nodes[1].outputs == (Aval((), "float32"), Aval((5,), "float32"))
    assert graph.outputs == (ValueRef(1, 0), ValueRef(1, 1))
    kernel = graph.nodes[0].kernel
    assert isinstance(kernel, JaxKernel) and kernel.in_specs == (P("d"), P())
    assert calls == ["traced"]
    prog.trace([Aval((8, 3), "float32"), Aval((3, 5), "float32")], _tree(2))
    assert calls == ["traced"]  # cached per signature


def _tree(n: int) -> Any:
    import jax

    return jax.tree_util.tree_structure(tuple(range(n)))


def test_placed_functions_only_run_through_a_client() -> None:
    f = VirtualSlice(0, (1,), ("x",), 0).jit(jnp.sin)
    with pytest.raises(AtollError, match=r"client\.run"):
        f(np.ones(3))

    @atoll.program
    def bad(x: Any) -> Any:
        return f(np.ones(3))  # not a program value

    with pytest.raises(AtollError, match="program values"):
        bad.trace([Aval((3,), "float32")], _tree(1))


def test_resource_manager_packs_slices_onto_few_hosts() -> None:
    # 2 islands x 2 hosts x 4 devices: (id, host, island)
    rm = ResourceManager([(d, d // 4, d // 8) for d in range(16)])
    small = rm.allocate(2, owner="a")
    assert small.devices == (0, 1) and small.island in (0, 1)
    again = rm.allocate(2, island=small.island, owner="a")
    assert rm.hosts_of(again.slice_id) == rm.hosts_of(small.slice_id)  # best fit
    big = rm.allocate(6, owner="b")
    assert big.island != small.island and len(rm.hosts_of(big.slice_id)) == 2
    with pytest.raises(AtollError, match="not free"):
        rm.allocate(5, island=big.island)
    rm.release(big.slice_id)
    assert rm.free_count(big.island) == 8
    assert len(rm.release_owner("a")) == 2 and rm.free_count() == 16
    with pytest.raises(AtollError, match="no slice"):
        rm.get(small.slice_id)


COST = CostModel(flops_per_s=1e12, link_bytes_per_s=1e9, link_latency_s=50e-6)


def inc(x: np.ndarray) -> np.ndarray:
    return x + np.float32(1)


def chain(slices: Sequence[SliceSpec], flops: float = 2e9) -> Any:
    builder = GraphBuilder()
    value = builder.input(Aval((1,), "float32"))
    for s in slices:
        [value] = builder.add(Computation("inc", inc, flops), s, [value], [Aval((1,), "float32")])
    return builder.build([value])


async def test_parallel_dispatch_puts_every_node_on_its_devices_before_any_data() -> None:
    async with atoll.local_cluster(1, 5, 1, clock=VirtualClock(), cost=COST) as cluster:
        slices = [await cluster.devices(1) for _ in range(4)]  # devices 0-3; 4 stays free
        gate: Promise[atoll.devices.BufferHandle] = Promise("input not there yet")
        [out] = cluster.run_graph(chain(slices), [gate])
        await wait_idle()
        for device in range(4):  # its part of the plan (installed once) and the run
            assert cluster.system.stats(cluster.device_ref(device))["received"] == 2
        assert cluster.clock.now() == 0.0
        gate.set_result(await cluster.put(np.zeros(1, np.float32), 4))
        assert (await cluster.fetch(out))[0] == 4
        assert cluster.clock.now() == pytest.approx(4 * 0.002 + 4 * (50e-6 + 4 / 1e9))
        # every intermediate was freed; the input (the caller's own) and the output stay
        assert sum(u["buffers"] for u in await cluster.store_usage()) == 2


async def test_sequential_dispatch_sends_nothing_ahead_of_the_data() -> None:
    async with atoll.local_cluster(1, 5, 1, clock=VirtualClock(), cost=COST) as cluster:
        slices = [await cluster.devices(1) for _ in range(4)]
        gate: Promise[atoll.devices.BufferHandle] = Promise("input not there yet")
        outs: list[list[atoll.ArrayRef]] = []

        async def run() -> None:
            outs.append(await cluster.run_graph_sequential(chain(slices), [gate]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await wait_idle()
            for device in range(4):
                assert cluster.system.stats(cluster.device_ref(device))["received"] == 0
            gate.set_result(await cluster.put(np.zeros(1, np.float32), 4))
        assert (await cluster.fetch(outs[0][0]))[0] == 4
        assert cluster.clock.now() == pytest.approx(4 * 0.002 + 4 * (50e-6 + 4 / 1e9))
        assert sum(u["buffers"] for u in await cluster.store_usage()) == 2


async def test_program_across_slices_matches_plain_jax() -> None:
    async with atoll.local_cluster(1, 2, 4, device_cls=JaxDevice) as cluster:
        a = await cluster.devices(4, mesh_shape=(4,), axis_names=("d",))
        b = await cluster.devices(2)
        f = a.jit(lambda x, w: jnp.tanh(x @ w), in_specs=(P("d"), None), out_specs=P("d"))
        g = b.jit(lambda h: (h.sum(), h * 2))

        @atoll.program
        def prog(x: Any, w: Any) -> Any:
            return g(f(x, w))

        x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3)
        w = np.linspace(0, 1, 15, dtype=np.float32).reshape(3, 5)
        total, doubled = await cluster.run(prog, x, w)
        again_total, _ = await (await cluster.run_sequential(prog, x, w))
        h = np.tanh(x @ w)
        np.testing.assert_allclose(total, h.sum(), rtol=1e-5)
        np.testing.assert_allclose(doubled, 2 * h, rtol=1e-5)
        np.testing.assert_allclose(again_total, total, rtol=1e-6)


def _scaled(x: Any, *, by: Any) -> Any:
    return x * by


def test_a_partial_sent_again_finds_the_compiled_code_of_the_first() -> None:
    """Over the wire a ``functools.partial`` arrives as a new object each
    time; its kernel still compares equal (a device's compile cache keeps
    hitting) while its function and arguments are the same."""
    import functools
    import pickle

    import jax

    from atoll.devices._jax_kernel import fn_key
    from atoll.runtime.tracing import _FlatCall

    tree = jax.tree_util.tree_structure((1, 2))
    sent = _FlatCall(functools.partial(_scaled, by=2.0), tree)
    again = pickle.loads(pickle.dumps(sent))
    assert again.fn is not sent.fn and again == sent and hash(again) == hash(sent)
    assert _FlatCall(functools.partial(_scaled, by=3.0), tree) != sent
    unhashable = functools.partial(_scaled, by=[2.0])
    assert fn_key(unhashable) is unhashable  # compared as the object itself
