"""Timelines: ``cluster.recording``, ``run(..., record=True)`` and
``atoll demo --timeline`` write Chrome trace event files with the right events
on the right devices."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import atoll
from atoll.cli import main
from atoll.devices import Computation
from atoll.devices.timeline import chrome_trace
from atoll.examples.demo import affine

pytestmark = pytest.mark.anyio
STEP = Computation("affine", affine, flops=1e6)
REQUIRED = {  # what the trace event format needs of each phase
    "X": {"name", "ph", "pid", "tid", "ts", "dur"},
    "i": {"name", "ph", "pid", "tid", "ts", "s"},
    "s": {"name", "ph", "pid", "tid", "ts", "id", "cat"},
    "f": {"name", "ph", "pid", "tid", "ts", "id", "cat", "bp"},
    "M": {"name", "ph", "pid", "tid", "args"},
}


def check_format(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Every event has its phase's fields, every arrow has both ends; the events."""
    events: list[dict[str, Any]] = document["traceEvents"]
    for event in events:
        assert REQUIRED[event["ph"]] <= set(event), event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if "dur" in event:
            assert event["dur"] > 0 and event["ts"] >= 0
    ends = Counter((e["id"], e["ph"]) for e in events if e["ph"] in "sf")
    assert all(ends[flow, "s"] == 1 and ends[flow, "f"] == 1 for flow, _ in ends), ends
    return events


def names(events: list[dict[str, Any]], what: str) -> dict[tuple[int, int], str]:
    return {
        (e["pid"], e["tid"] if what == "thread_name" else 0): e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == what
    }


def gangs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((e for e in events if e.get("cat") == "gang"), key=lambda e: e["ts"])


async def test_a_chain_across_hosts_is_on_the_right_devices_in_order(tmp_path: Path) -> None:
    path = tmp_path / "chain.json"
    async with atoll.local_cluster(1, 2, 2) as cluster, cluster.recording(path) as log:
        handle = cluster.put(np.arange(1 << 16, dtype=np.float32), 0)  # 256 KiB
        for device in [0, 2, 1, 3]:  # hosts 0, 1, 0, 1
            handle = cluster.run(STEP, device, [handle])
        await cluster.fetch(handle)
    events = check_format(json.loads(path.read_text()))
    assert events == log.events
    ran = gangs(events)
    assert [(e["pid"], e["tid"]) for e in ran] == [(2, 1), (3, 3), (2, 2), (3, 4)]
    assert [e["args"]["device"] for e in ran] == [0, 2, 1, 3]
    assert [e["args"]["position"] for e in ran] == [0, 1, 2, 3]  # the island's order
    assert {e["args"]["client"] for e in ran} == {cluster.owner}
    assert all(e["name"] == "affine" for e in ran)
    moved = [e for e in events if e.get("cat") == "transfer" and e["ph"] == "X"]
    pushed = [e for e in moved if e["name"] == "push"]  # each hop: a push and its receipt
    assert len(moved) == 6 and all(e["args"]["bytes"] == 1 << 18 for e in moved)
    assert [(e["args"]["src_host"], e["args"]["dst_host"]) for e in pushed] == [
        (0, 1),
        (1, 0),
        (0, 1),
    ]
    dispatches = [e for e in events if e["ph"] == "i" and e["name"] == "dispatch"]
    assert len(dispatches) == 4 and all(e["pid"] == 1 for e in dispatches)
    processes = names(events, "process_name")
    assert processes[2, 0] == "host 0" and processes[3, 0] == "host 1"
    assert processes[1, 0] == "controller"
    assert names(events, "thread_name")[3, 4] == "device 3"


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(180)
async def test_a_pipeline_program_recorded_with_run_record_true(tmp_path: Path) -> None:
    """GPipe: 4 stages on 4 hosts, 4 micro-batches, 16 nodes. Each stage's
    device runs its 4 micro-batches, and micro-batch m passes the stages in
    order; every gang names the program and its node."""
    from atoll.devices.jax import JaxDevice
    from atoll.examples import pipeline

    stages_n = pipeline.STAGES
    async with atoll.local_cluster(1, stages_n, 1, device_cls=JaxDevice) as cluster:
        stages = [
            (await cluster.devices(1)).jit(pipeline.block, name=f"stage{s}")
            for s in range(stages_n)
        ]
        micro = np.split(pipeline.inputs(8), 4)
        run = cluster.run(pipeline.gpipe(stages), pipeline.init(), micro, record=True)
        document = await run.timeline(tmp_path / "gpipe.json")
        outs = await run
    np.testing.assert_allclose(np.concatenate(outs), pipeline.reference(8), atol=1e-4)
    events = check_format(json.loads((tmp_path / "gpipe.json").read_text()))
    assert events == document["traceEvents"]
    ran = gangs(events)
    assert len(ran) == 16 and {e["args"]["program"] for e in ran} == {"gpipe"}
    for s in range(stages_n):
        mine = [e for e in ran if e["name"] == f"stage{s}"]
        assert len({(e["pid"], e["tid"]) for e in mine}) == 1  # one device per stage
        assert len(mine) == 4
        # each its own place in the dispatch order (a device may run a later
        # micro-batch first when its input came first: docs/performance.md,
        # the eleventh session)
        assert len({e["args"]["position"] for e in mine}) == 4
    moved = [e for e in events if e.get("cat") == "transfer" and e["ph"] == "X"]
    moved = [e for e in moved if e["name"] == "push"]
    hops = sorted((e["args"]["src_host"], e["args"]["dst_host"]) for e in moved)
    assert hops == sorted([(s, s + 1) for s in range(stages_n - 1)] * 4)  # stage to stage
    for m in range(4):  # micro-batch m: stage 0, 1, 2, 3, in time order
        chain = [
            next(e for e in ran if e["name"] == f"stage{s}" and _nth(ran, e) == m)
            for s in range(stages_n)
        ]
        starts = [e["ts"] for e in chain]
        assert starts == sorted(starts)


def _nth(ran: list[dict[str, Any]], event: dict[str, Any]) -> int:
    """Which of its stage's runs ``event`` is, in dispatch order (0 for the
    first micro-batch)."""
    mine = [e for e in ran if e["name"] == event["name"]]
    return sorted(e["args"]["position"] for e in mine).index(event["args"]["position"])


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the capnp transport
@pytest.mark.timeout(120)
async def test_hosts_in_processes_send_their_timelines(tmp_path: Path) -> None:
    async with (
        atoll.local_cluster(1, 2, 1, transport="capnp") as cluster,
        cluster.recording() as log,
    ):
        handle = cluster.put(np.arange(1 << 16, dtype=np.float32), 0)
        for device in [0, 1, 0]:
            handle = cluster.run(STEP, device, [handle])
        await cluster.fetch(handle)
    events = check_format(log.document)
    ran = gangs(events)
    assert [(e["pid"], e["tid"]) for e in ran] == [(2, 1), (3, 2), (2, 1)]
    moved = [e for e in events if e.get("cat") == "transfer" and e["ph"] == "X"]
    assert moved and all(e["args"]["bytes"] == 1 << 18 for e in moved if "bytes" in e["args"])


def test_demo_writes_a_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "demo.json"
    assert main(["demo", "--virtual-clock", "--steps", "8", "--timeline", str(path)]) == 0
    assert f"timeline written to {path}" in capsys.readouterr().out
    events = check_format(json.loads(path.read_text()))
    assert len(gangs(events)) == 8


def _gang(ts: float, end: float, client: str, node: str = "a", device: int = 0) -> dict[str, Any]:
    return {
        "kind": "gang",
        "host": 0,
        "device": device,
        "gang": f"g{ts}",
        "node": node,
        "client": client,
        "leader": True,
        "ts": ts,
        "end": end,
    }


def _run(ts: float, client: str, program: str, nodes: list[str]) -> dict[str, Any]:
    return {"kind": "control", "name": "run", "lane": "client", "host": -2, "ts": ts} | {
        "client": client,
        "program": program,
        "nodes": nodes,
    }


def test_gangs_name_the_latest_run_of_their_client_and_fetches_the_gang_before() -> None:
    events = [
        _run(0, "alice", "first", ["a", "b"]),
        _gang(10, 20, "alice"),
        _run(30, "bob", "bobs", ["a"]),
        _run(40, "alice", "second", ["a"]),
        _gang(50, 60, "alice"),
        _gang(55, 58, "alice", node="b"),  # "second" has no node b: "first" does
        _gang(70, 80, "carol"),  # no run of carol's
        {"kind": "pull", "host": 1, "device": 4, "from_host": 0, "from_device": 0}
        | {"buffer": "x", "bytes": 4, "ts": 65, "end": 66},
    ]
    drawn = chrome_trace(events)["traceEvents"]
    programs = [e["args"].get("program") for e in drawn if e.get("cat") == "gang"]
    assert programs == ["first", "second", "first", None]
    [leaves] = [e for e in drawn if e.get("ph") == "s"]
    assert leaves["ts"] == 60 - 0 - 0.5  # the end of the last gang done before the fetch
