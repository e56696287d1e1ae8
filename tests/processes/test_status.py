"""``atoll status``, ``atoll down`` and ``atoll.connect()`` without an argument,
against a real ``atoll up`` (a controller and host processes)."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import atoll
from atoll.devices import Computation
from atoll.kernel import AtollError, Promise
from atoll.runtime import Topology
from atoll.runtime.tools.status import host_rows, kind_of, render
from atoll.transports.testing import line_with, pid_alive

pytestmark = pytest.mark.anyio


async def _atoll(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -m atoll.cli ARGS`` to completion, off the event loop (posix_spawn)."""
    run = functools.partial(
        subprocess.run,
        [sys.executable, "-m", "atoll.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        close_fds=False,
    )
    return await anyio.to_thread.run_sync(run)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # trio: through the bridge
@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_status_connect_and_down_find_the_last_cluster_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # atoll up's default goes here
    env = dict(os.environ)
    cluster_file = tmp_path / "atoll" / "cluster.json"
    up = subprocess.Popen(
        [sys.executable, "-m", "atoll.cli", "up", "--hosts", "2", "--devices-per-host", "2"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        close_fds=False,
    )
    try:
        assert f"cluster file {cluster_file}" in line_with(up, "listening at")
        line_with(up, "cluster up")
        async with atoll.connect() as client:  # no argument: the cluster just started
            cluster = await client.cluster(owner="tester")
            step = Computation("negate", np.negative, flops=1e6)
            done = cluster.run(step, 2, [cluster.put(np.arange(4.0), 0)])
            np.testing.assert_array_equal(await cluster.fetch(done), -np.arange(4.0))
            kept = cluster.put(np.ones(1024), 1)  # 8 KiB held by host 0
            await kept

            shown = await _atoll("status", "--json", env=env)
            assert shown.returncode == 0, shown.stderr
            rows: list[dict[str, Any]] = json.loads(shown.stdout)
            hosts = [r for r in rows if kind_of(r) == "host"]
            assert [h["devices"] for h in hosts] == [[0, 1], [2, 3]]
            assert all(h["alive"] and h["error"] is None for h in hosts)
            assert all(h["address"].startswith("capnp://") for h in hosts)
            assert hosts[0]["bytes"] >= 8192 and hosts[0]["buffers"] >= 1
            islands = [r for r in rows if kind_of(r) == "island"]
            assert [(i["island"], i["queued"], i["running"]) for i in islands] == [(0, 0, 0)]
            assert isinstance(islands[0]["scheduler"], str)
            sessions = [r for r in rows if kind_of(r) == "session"]
            labels = [str(s.get("owner", s.get("name"))) for s in sessions]
            assert any(label.startswith("tester#") for label in labels), sessions

            # atoll timeline records what the cluster does meanwhile, from outside
            out = tmp_path / "timeline.json"
            recording = subprocess.Popen(
                [sys.executable, "-m", "atoll.cli", "timeline", "--seconds", "4", "-o", str(out)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
                close_fds=False,
            )
            assert recording.stdout is not None
            assert "recording" in await anyio.to_thread.run_sync(recording.stdout.readline)
            await cluster.fetch(cluster.run(step, 3, [cluster.run(step, 0, [np.ones(4)])]))
            assert await anyio.to_thread.run_sync(recording.wait, 30) == 0
            assert "written to" in recording.stdout.read()
            recording.stdout.close()
            ran = [e for e in json.loads(out.read_text())["traceEvents"] if e.get("cat") == "gang"]
            assert [e["args"]["device"] for e in ran] == [0, 3]

            table = await _atoll("status", env=env)
            assert table.returncode == 0, table.stderr
            assert "hosts (2)" in table.stdout and "alive" in table.stdout
            assert "islands (1)" in table.stdout

        host_pids = [h["pid"] for h in hosts]
        assert all(pid_alive(pid) for pid in host_pids)
        stopped = await _atoll("down", env=env)
        assert stopped.returncode == 0, stopped.stderr
        assert "stopped" in stopped.stdout
        assert up.wait(30) == 0  # it stopped as after SIGTERM: cleanly
        assert not any(pid_alive(pid) for pid in host_pids)  # no orphans
        assert not cluster_file.exists()  # the next connect() finds no stale cluster

        gone = await _atoll("status", env=env)
        assert gone.returncode != 0 and "atoll up" in gone.stderr  # says how to start one
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            up.wait(30)
        assert up.stdout is not None
        up.stdout.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # trio: through the bridge
async def test_connect_without_a_cluster_says_how_to_start_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(AtollError, match="atoll up"):
        async with atoll.connect():
            pass


def test_status_tables_show_rows_of_any_kind() -> None:
    """Rows another part of the runtime adds (here a session with a weight)
    get a table and columns without a change to the renderer."""
    from rich.console import Console

    rows = [
        {"kind": "host", "host": 0, "alive": False, "bytes": 3 << 20, "error": "[gone]"},
        {"session": 1, "owner": "a#1", "weight": 2.0},
    ]
    console = Console(record=True, width=120)
    for table in render(rows):
        console.print(table)
    text = console.export_text()
    assert "hosts (1)" in text and "lost" in text and "3.0 MiB" in text and "[gone]" in text
    assert "sessions (1)" in text and "weight" in text


class _Silent:
    """A host that is asked (the time noted) and answers never, or at once."""

    def __init__(self, answers: bool, asked: list[float]) -> None:
        self.answers, self.asked = answers, asked

    def _answer(self, value: Any) -> Promise[Any]:
        self.asked.append(anyio.current_time())
        promise: Promise[Any] = Promise("silent")
        if self.answers:
            promise.set_result(value)
        return promise

    def store_usage(self) -> Promise[Any]:
        return self._answer({"buffers": 2, "bytes": 8})

    def address(self) -> Promise[Any]:
        return self._answer("capnp://127.0.0.1:9")


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_frozen_hosts_are_asked_at_once_and_share_one_deadline() -> None:
    asked: list[float] = []
    hosts: Any = [_Silent(i == 1, asked) for i in range(4)]
    topology = Topology.even(1, 4, 1)
    lost: dict[int, str] = {3: "gone before"}
    rows = await host_rows(hosts, ["pid 1"] * 4, topology, lost, timeout=1.0)
    assert [row["alive"] for row in rows] == [False, True, False, False]
    assert rows[1]["buffers"] == 2 and rows[1]["address"] == "capnp://127.0.0.1:9"
    assert lost[0] == lost[2] == "no answer within 1.0 s" and lost[3] == "gone before"
    assert len(asked) == 6 and max(asked) - min(asked) < 0.5  # not one after the other
