"""Parallel against sequential dispatch, and the dispatch benchmark's machinery."""

from __future__ import annotations

import json

import numpy as np
import pytest

import atoll
from atoll.benchmarks import dispatch as bench
from atoll.devices import CostModel
from atoll.kernel import VirtualClock

pytestmark = pytest.mark.anyio

COST = CostModel(flops_per_s=1e12, link_bytes_per_s=1e9, link_latency_s=50e-6)
HOP = 50e-6 + 4 / 1e9  # one float32 between hosts


@pytest.mark.parametrize(
    ("sequential", "latency", "hops"),
    [(False, 0.0, 0), (True, 0.0, 0), (False, 1e-3, 4), (True, 1e-3, 16 * 4)],
)
async def test_a_chain_costs_device_transfer_and_control_hops_exactly(
    sequential: bool, latency: float, hops: int
) -> None:
    """Device and transfer time are the same in both modes. With a modelled RPC
    latency L per control hop (client->controller->scheduler->device, and the
    reply), a 16-node chain costs 4 L in parallel mode and 4 L per node in
    sequential mode on top; with none, both cost exactly the same."""
    clock = VirtualClock()
    async with atoll.local_cluster(
        1, 16, 1, clock=clock, cost=COST, rpc_latency_s=latency
    ) as cluster:
        slices = [await cluster.devices(1) for _ in range(16)]
        graph = bench.chain_graph(slices, bench.step(0.002))
        x = await cluster.put(np.zeros(1, np.float32), 0)
        start = clock.now()
        if sequential:
            [out] = await cluster.run_graph_sequential(graph, [x])
        else:
            [out] = cluster.run_graph(graph, [x])
        await out.promise
        elapsed = clock.now() - start
        assert (await cluster.fetch(out))[0] == 16
        stats = await cluster.device_stats()
        assert [s.computations for s in stats] == [1] * 16
    assert elapsed == pytest.approx(16 * 0.002 + 15 * HOP + hops * latency)


async def test_pipeline_overhead_is_measured_in_both_modes() -> None:
    rows = [await bench.pipeline_overhead(s, reps=2, stages=4) for s in (False, True)]
    assert [r.case for r in rows] == [
        "pipeline4_parallel_overhead",
        "pipeline4_sequential_overhead",
    ]
    for row in rows:
        assert row.value is not None and row.unit == "ms"
        assert 0 <= row.value < 1000  # time beyond 8 ms of device time


async def test_modes_and_baseline_are_measured_side_by_side() -> None:
    rows = await bench.measure_modes(hosts=2, calls=4, nodes=8, reps=2)
    got = {(r.case, r.system) for r in rows}
    assert got == {
        (case, system)
        for case in ("opbyop", "chained128", "fused128")
        for system in ("atoll", "multicontroller")
    }
    for row in rows:
        assert row.value is not None and row.value > 0
        assert row.devices == 8 and row.hosts == 2
        record = json.loads(row.json())
        assert set(record) == {"bench", "case", "system", "value", "unit", "devices", "hosts"}
    text = bench.format_table(rows)
    assert "chained128" in text and "multi-ctl" in text


async def test_parity_point_comes_from_the_grid() -> None:
    rows = await bench.parity_point(hosts=1, nodes=4)
    assert [r.system for r in rows] == [
        "atoll_vs_multicontroller",
        "atoll_vs_multicontroller_parallel_hosts",
    ]
    for row in rows:
        assert row.case == "parity_point" and row.unit == "ms"
        assert row.value in bench.PARITY_GRID_MS
    assert "parity_point" in bench.format_table(rows)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(120)
async def test_pipeline_over_processes_is_measured_three_ways() -> None:
    rows = await bench.pipeline_processes(runs=1, stages=3)
    assert [r.case for r in rows] == [
        "pipeline3_parallel_overhead_processes",
        "pipeline3_parallel_no_push_overhead_processes",
        "pipeline3_sequential_overhead_processes",
    ]
    for row in rows:
        assert row.value is not None and -1 < row.value < 10_000
        assert row.hosts == 3
