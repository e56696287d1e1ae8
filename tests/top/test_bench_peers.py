"""``atoll bench peers``: every atoll workload, tiny, over real host processes,
and the code that sets Ray's figures beside them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

import atoll
from atoll.benchmarks import peers
from atoll.benchmarks._common import Row

TINY = peers.Params(
    w1_calls=5,
    w1_reps=2,
    w1_warmup=1,
    w2_chain=8,
    w2_reps=2,
    w3_fused=8,
    w3_reps=2,
    w4_stages=4,
    w4_stage_ms=1.0,
    w4_microbatches=2,
    w4_reps=2,
    w5_bytes=1 << 20,
    w5_reps=2,
    warmup_reps=1,
    startup_reps=1,
)
UNITS = {
    peers.W1_RUN: "calls/s",
    peers.W1_PROGRAM: "calls/s",
    peers.W2_RUN: "computations/s",
    peers.W2_PROGRAM: "computations/s",
    peers.W3_CALL: "computations/s",
    peers.W4_RUN: "ms",
    peers.W4_PROGRAM: "ms",
    peers.GPIPE_RUN: "wall/ideal",
    peers.GPIPE_PROGRAM: "wall/ideal",
    peers.MEM_W4: "MiB",
    peers.W5_E2E_RUN: "MiB/s",
    peers.W5_HAND_RUN: "MiB/s",
    peers.W5_E2E_PROGRAM: "MiB/s",
    peers.W5_HAND_PROGRAM: "MiB/s",
    peers.START: "s",
    peers.MEM_START: "MiB",
}
Workload = Callable[[atoll.Cluster, peers.Params], Awaitable[list[Row]]]


def check(rows: list[Row], cases: list[str]) -> None:
    assert [r.case for r in rows] == cases
    for r in rows:
        assert (r.bench, r.system, r.unit) == ("peers", "atoll", UNITS[r.case])
        assert r.value is not None and r.value > 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(
    ("workload", "cases"),
    [
        (peers.w1, [peers.W1_RUN, peers.W1_PROGRAM]),
        (peers.w2, [peers.W2_RUN, peers.W2_PROGRAM]),
        (peers.w3, [peers.W3_CALL]),
        (peers.w4, [peers.W4_RUN, peers.W4_PROGRAM, peers.GPIPE_RUN, peers.GPIPE_PROGRAM]),
        (
            peers.w5,
            [peers.W5_E2E_RUN, peers.W5_HAND_RUN, peers.W5_E2E_PROGRAM, peers.W5_HAND_PROGRAM],
        ),
    ],
)
@pytest.mark.slow
@pytest.mark.anyio
async def test_each_workload_runs_on_host_processes(workload: Workload, cases: list[str]) -> None:
    """Each workload gives its rows, checks its results and leaves the stores empty."""
    async with atoll.local_cluster(1, TINY.w4_stages, 1, transport="capnp") as cluster:
        rows = await workload(cluster, TINY)
        usage = await cluster.store_usage()
    check(rows[: len(cases)], cases)
    check(rows[len(cases) :], [peers.MEM_W4] if workload is peers.w4 else [])
    assert [u["buffers"] for u in usage] == [0] * TINY.w4_stages


@pytest.mark.slow
def test_startup_is_measured_in_a_fresh_process() -> None:
    check(peers.startup(TINY), [peers.START, peers.MEM_START])


def fake(case: str, system: str, value: float) -> Row:
    return Row("peers", case, system, value, "x")


def test_ratios_say_above_one_when_atoll_is_better() -> None:
    """More calls/s is better, so atoll / peer; fewer ms is better, so peer / atoll."""
    rows = [
        fake(peers.W1_RUN, "atoll", 200.0),
        fake(peers.W1_RUN, "ray", 100.0),
        fake(peers.W1_RUN, "ray_cg", 400.0),
        fake(peers.W4_RUN, "atoll", 40.0),
        fake(peers.W4_RUN, "ray", 80.0),
        fake(peers.START, "ray", 6.0),  # atoll's figure is missing: no ratio
    ]
    got = {(r.case, r.system): r.value for r in peers.ratios(rows, peers.CASES)}
    assert got == {
        (peers.W1_RUN, "atoll_vs_ray"): 2.0,
        (peers.W1_RUN, "atoll_vs_ray_cg"): 0.5,
        (peers.W4_RUN, "atoll_vs_ray"): 2.0,
    }


def test_ray_rows_become_cases_in_atolls_units() -> None:
    """Ray's start-up is the sum of its three steps, in ms, given in s; Compiled
    Graphs' rows go to ``ray_cg``; a figure Ray did not measure is left out."""

    def raw(workload: str, variant: str, metric: str, median: float) -> dict[str, object]:
        return {"workload": workload, "variant": variant, "metric": metric, "median": median}

    ray = [
        raw("start", "import ray", "time", 1000.0),
        raw("start", "ray.init()", "time", 4000.0),
        raw("start", "create+ready 4 actors", "time", 1000.0),
        raw("W2", "chain128/4 actors scalar", "computations/s", 700.0),
        raw("W6", "CG chain128/4 scalar", "computations/s", 4400.0),
    ]
    units = {peers.START: "s", peers.W2_PROGRAM: "computations/s", peers.W3_CALL: "c/s"}
    got = peers.peer_rows(ray, peers.CASES, units)
    assert [(r.case, r.system, r.value, r.unit) for r in got] == [
        (peers.W2_PROGRAM, "ray", 700.0, "computations/s"),
        (peers.W2_PROGRAM, "ray_cg", 4400.0, "computations/s"),
        (peers.START, "ray", pytest.approx(6.0), "s"),
    ]
    table = peers.format_table(got + peers.ratios(got, peers.CASES))
    assert "> 1 means atoll is better" in table and ">= Ray CG" in table


def test_only_maps_to_the_ray_scripts_workloads() -> None:
    assert peers.ray_only(peers.WORKLOADS) == ""
    assert peers.ray_only(["W1", "W5"]) == "W1,W5,W6"
    assert peers.ray_only(["W3"]) == "W3"
    assert peers.ray_only(["START"]) == "START"


def test_parameters_are_the_peers_constants() -> None:
    """common.py's numbers (its ``apply_quick`` ones with ``quick``), or the same here."""
    full, quick = peers.Params.of(False), peers.Params.of(True)
    assert full == peers.Params()
    assert quick == peers.Params(**peers.QUICK)
