"""A real Prometheus scrapes a real ``atoll up --http`` (issue 38).

Prometheus is started with a scrape configuration that names the cluster's
web address and carries the cluster token as a bearer token, as
``docs/observability.md`` tells an operator to write it; a second job
scrapes without the token and must be refused. After a program of known
device time runs, Prometheus' own HTTP API must answer with the devices'
busy seconds and the run counters, and they must agree with what the
cluster itself says (``atoll status`` and ``Cluster.device_stats``).

It needs the ``prometheus`` binary (Debian's package; ``./dev test``
installs it in CI) and skips, saying so, without one.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from atoll.benchmarks.controlplane import _computations
from atoll.runtime.client.connect import connect
from atoll.runtime.tools.admin import status_rows
from atoll.transports.capnp import ClusterFile
from atoll.transports.testing import atoll_up, eventually

PROGRAM_S = 0.01
RUNS = 20

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="Prometheus test skipped: no `prometheus` on PATH (Debian's package: "
        "apt-get install prometheus; ./dev test installs it in CI)",
    ),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """``atoll up --http``: its cluster file and its web server's host:port."""
    cluster_file = tmp_path / "cluster.json"
    args = ("--hosts", "1", "--devices-per-host", "2", "--http", "127.0.0.1:0")
    with atoll_up(cluster_file, *args, until="atoll web at ") as line:
        yield cluster_file, urllib.parse.urlsplit(line.split()[3]).netloc


@pytest.fixture
def prometheus(tmp_path: Path, up: tuple[Path, str]) -> Iterator[str]:
    """Prometheus scraping the cluster every second, with and without the
    token; its HTTP API's base URL."""
    cluster_file, target = up
    token = ClusterFile.read(cluster_file).token.hex()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n"
        f"  - job_name: atoll\n    authorization:\n      type: Bearer\n"
        f"      credentials: {token}\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
        f"  - job_name: atoll-without-token\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    port = _free_port()
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=False,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(30)


def _api(base: str, path: str, **query: str) -> Any:
    url = f"{base}{path}?{urllib.parse.urlencode(query)}"
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.load(answer)["data"]


def _value(base: str, query: str) -> float | None:
    """The single value of ``query`` now, or None while Prometheus has none."""
    try:
        result = _api(base, "/api/v1/query", query=query)["result"]
    except OSError:  # not listening yet
        return None
    return float(result[0]["value"][1]) if result else None


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_prometheus_scrapes_the_cluster_with_the_token_and_agrees_with_it(
    prometheus: str, up: tuple[Path, str]
) -> None:
    cluster_file, _ = up
    source, _ = _computations(PROGRAM_S)
    async with connect(cluster_file) as client:
        cluster = await client.cluster("scraped")
        outputs = [cluster.run(source, i % 2, []) for i in range(RUNS)]
        for output in outputs:
            await cluster.ready(output)
        busy = sum(stats.busy_s for stats in await cluster.device_stats())
    assert busy == pytest.approx(RUNS * PROGRAM_S, rel=0.05)

    def scraped() -> bool:  # a scrape after the work: the counters have it all
        runs = _value(prometheus, 'sum(atoll_runs_submitted_total{job="atoll"})')
        seen = _value(prometheus, 'sum(atoll_device_busy_seconds_total{job="atoll"})')
        return runs is not None and runs >= RUNS and seen is not None and seen >= busy - 1e-9

    await eventually(scraped, "Prometheus scraped the work", timeout=60)
    seen = _value(prometheus, 'sum(atoll_device_busy_seconds_total{job="atoll"})')
    assert seen == pytest.approx(busy, abs=1e-6)
    assert _value(prometheus, 'sum(atoll_device_gangs_total{job="atoll"})') == RUNS
    assert _value(prometheus, 'sum(atoll_runs_completed_total{job="atoll"})') == RUNS
    rows = await status_rows(cluster_file)
    hosts = [row for row in rows if row["kind"] == "host"]
    alive = _value(prometheus, 'atoll_hosts{job="atoll",state="alive"}')
    assert alive == sum(1 for row in hosts if row["alive"]) == 1
    stored = _value(prometheus, 'sum(atoll_host_store_bytes{job="atoll"})')
    assert stored == sum(row["bytes"] for row in hosts)

    def refused() -> bool:
        targets = _api(prometheus, "/api/v1/targets")["activeTargets"]
        tried = [t for t in targets if t["labels"]["job"] == "atoll-without-token"]
        return bool(tried) and tried[0]["health"] == "down" and "401" in tried[0]["lastError"]

    await eventually(refused, "the scrape without the token refused (401)", timeout=30)
    assert _value(prometheus, 'up{job="atoll"}') == 1
    grafana = json.loads(
        (Path(__file__).resolve().parents[2] / "docs/grafana/atoll.json").read_text()
    )
    for panel in grafana["panels"]:  # the dashboard's queries are valid PromQL, and answer
        for target in panel["targets"]:
            _api(prometheus, "/api/v1/query", query=target["expr"])  # raises on a bad query
