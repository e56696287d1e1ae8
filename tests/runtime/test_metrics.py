"""``/metrics`` and the web server of a real ``atoll up --http`` (issue 38).

Known work moves the metrics by as much: a run of known device time moves
the devices' busy seconds by that time, and every run is counted once. The
server asks for the cluster token (a bearer token, as Prometheus sends it),
keeps connections alive and answers ``HEAD``. The rendering itself is
checked on a made-up snapshot: histogram buckets add up, and the session
labels stay bounded however many sessions came and went.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from atoll.benchmarks.controlplane import _computations
from atoll.kernel import Promise
from atoll.runtime.client.connect import connect
from atoll.runtime.control.metrics import (
    MAX_SESSIONS,
    RunCounters,
    Snapshot,
    metric_names,
    render,
)
from atoll.transports.capnp import ClusterFile
from atoll.transports.testing import atoll_up

PROGRAM_S = 0.01  # the device time of each run below


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the client reaches the cluster over Cap'n Proto


pytestmark = pytest.mark.anyio


class Up:
    """A running ``atoll up --http``: its cluster file, token and web address."""

    def __init__(self, cluster_file: Path, url: str) -> None:
        self.cluster_file = cluster_file
        self.token = ClusterFile.read(cluster_file).token.hex()
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "", parts.port or 0

    def get(self, path: str, method: str = "GET", **headers: str) -> tuple[int, Any, bytes]:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            connection.request(method, path, headers=headers)
            answer = connection.getresponse()
            return answer.status, answer.headers, answer.read()
        finally:
            connection.close()

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of ``/metrics``, by name and labels."""
        status, _, body = self.get("/metrics", Authorization=f"Bearer {self.token}")
        assert status == 200, body
        samples = {}
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
        return samples


def _sum(samples: dict[tuple[str, Any], float], name: str) -> float:
    return sum(value for (found, _), value in samples.items() if found == name)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    cluster_file = tmp_path / "cluster.json"
    args = ("--hosts", "1", "--devices-per-host", "2", "--http", "127.0.0.1:0")
    with atoll_up(cluster_file, *args, until="atoll web at ") as line:
        yield Up(cluster_file, line.split()[3])


@pytest.mark.timeout(120)
async def test_known_work_moves_the_metrics_by_as_much(up: Up) -> None:
    before = up.scrape()
    source, _ = _computations(PROGRAM_S)
    runs = 12
    async with connect(up.cluster_file) as client:
        cluster = await client.cluster("metrics-test")
        outputs = [cluster.run(source, i % 2, []) for i in range(runs)]
        for output in outputs:
            await cluster.ready(output)
    after = up.scrape()

    def moved(name: str) -> float:
        return _sum(after, name) - _sum(before, name)

    assert moved("atoll_device_busy_seconds_total") == pytest.approx(runs * PROGRAM_S, rel=0.05)
    assert moved("atoll_device_gangs_total") == runs
    assert moved("atoll_runs_submitted_total") == runs
    assert moved("atoll_runs_completed_total") == runs
    assert moved("atoll_run_dispatch_seconds_count") == runs
    assert _sum(after, "atoll_run_errors_total") == 0
    sessions = {dict(labels).get("session") for (name, labels) in after}
    assert any("metrics-test" in str(session) for session in sessions)
    assert after["atoll_hosts", (("state", "alive"),)] == 1
    assert after["atoll_hosts", (("state", "lost"),)] == 0
    assert moved("atoll_controller_messages_total") > 0
    assert after["atoll_controller_loop_lag_seconds", ()] >= 0
    assert metric_names() >= {name for name, _ in after}  # every name is documented there


@pytest.mark.timeout(120)
async def test_the_server_asks_for_the_token_keeps_alive_and_answers_head(up: Up) -> None:
    assert up.get("/metrics")[0] == 401
    assert up.get("/metrics", Authorization="Bearer " + "00" * 32)[0] == 401
    assert up.get("/metrics", Authorization="Basic abc")[0] == 401
    status, headers, _ = up.get("/metrics", **{"X-Atoll-Token": up.token})
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    connection = http.client.HTTPConnection(up.host, up.port, timeout=30)
    try:
        bearer = {"Authorization": f"Bearer {up.token}"}
        connection.request("GET", "/api/status", headers=bearer)
        first = connection.getresponse()
        assert first.status == 200 and b"rows" in first.read()
        kept = connection.sock
        connection.request("HEAD", "/api/status", headers=bearer)
        head = connection.getresponse()
        assert head.status == 200 and head.read() == b""
        assert int(head.headers["content-length"]) > 0
        assert connection.sock is kept  # the same connection served both
    finally:
        connection.close()


def test_histogram_buckets_add_up_and_session_labels_stay_bounded() -> None:
    runs = RunCounters()
    for took in (0.0001, 0.003, 20.0):  # runs that took this long to be taken
        answer: Promise[list[Any]] = Promise("a run")
        answer.set_result([])
        runs._settled(time.monotonic() - took, answer)
    sessions = {
        f"s{i}": {"device_s": float(i), "queued": 1, "running": 0, "bytes": 10} for i in range(80)
    }
    text = render(Snapshot(controller=runs.snapshot(), sessions=sessions)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    buckets = {
        s.labels["le"]: s.value
        for s in families["atoll_run_dispatch_seconds"].samples
        if s.name.endswith("_bucket")
    }
    assert buckets["0.0005"] == 1 and buckets["0.005"] == 2 and buckets["+Inf"] == 3
    labels = {s.labels["session"] for s in families["atoll_session_store_bytes"].samples}
    assert len(labels) == MAX_SESSIONS + 1 and "other" in labels and "s79" in labels
    other = [
        s.value
        for s in families["atoll_session_gangs_queued"].samples
        if s.labels["session"] == "other"
    ]
    assert other == [80 - MAX_SESSIONS]  # summed, not lost


def test_without_the_extra_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from atoll.kernel import AtollError
    from atoll.runtime.tools import dashboard

    real_import = builtins.__import__

    def no_hypercorn(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("hypercorn"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_hypercorn)
    with pytest.raises(AtollError, match=r"pip install 'atoll\[dashboard\]'"):
        dashboard._config("127.0.0.1", 0)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # trio: through the bridge
async def test_atoll_top_draws_one_frame_of_devices_and_sessions(up: Up) -> None:
    import io

    import anyio
    from rich.console import Console

    from atoll.runtime.tools.top import top

    source, _ = _computations(PROGRAM_S)
    out = io.StringIO()
    async with connect(up.cluster_file) as client:
        cluster = await client.cluster("top-test")
        outputs = [cluster.run(source, i % 2, []) for i in range(400)]  # 2 s on each device
        async with anyio.create_task_group() as group:  # a 0.5 s window: a loaded machine
            group.start_soon(top, up.cluster_file, 0.5, True, Console(file=out, width=120))
            for output in outputs:
                await cluster.ready(output)
    drawn = out.getvalue()
    assert drawn.startswith("atoll top  hosts 1/1 alive")
    rows = [line.split() for line in drawn.splitlines()]
    devices = [row for row in rows if row[:1] in (["0"], ["1"]) and len(row) >= 6]
    assert len(devices) == 2
    assert any(float(row[4].rstrip("%")) > 10 for row in devices), drawn  # it was busy
    assert "top-test" in drawn


GRAFANA = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "atoll.json"


def grafana_queries() -> list[str]:
    """Every PromQL expression of the Grafana dashboard in ``docs/grafana``."""
    import json

    dashboard = json.loads(GRAFANA.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_grafana_query_names_metrics_atoll_exports() -> None:
    import re

    queries = grafana_queries()
    assert len(queries) >= 10
    exported = metric_names()
    for query in queries:
        named = set(re.findall(r"\batoll_[a-z_]+", query))
        assert named, f"{query!r} names no atoll metric"
        assert named <= exported, f"{query!r} names {sorted(named - exported)}, not exported"
