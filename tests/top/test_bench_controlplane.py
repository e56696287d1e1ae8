"""``atoll bench controlplane --tiny``: the benchmark runs and measures something.

It starts ``atoll up`` with a host process and a client process, and the
same case in this process; each case must finish computations and report
CPU per computation from every role, and the process case Cap'n Proto calls
and socket writes.
"""

from __future__ import annotations

import json

import pytest

from atoll.benchmarks.controlplane import main


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_tiny_benchmark_reports_every_role(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tiny", "--json", "--seconds", "0.5"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    by = {(row["case"], row["system"]): row["value"] for row in rows}
    for role in ("controller", "hosts", "clients", "total"):
        assert by["single x1 processes", f"cpu_{role}"] > 0
    assert by["single x1 in-process", "cpu_all"] > 0
    assert by["single x1 processes", "rate"] > 0 and by["single x1 processes", "busy"] > 0
    reached = by["single x1 processes", "lane_messages_in_controller"]
    reached += by["single x1 processes", "capnp_calls_in_controller"]
    reached += by["single x1 processes", "runs_leased_clients"]
    assert reached >= 0.5  # a run reaches it, by lane or by call, or its host under a lease
    assert by["single x1 processes", "socket_writes_clients"] > 0  # it is sent
    assert by["single x1 in-process", "socket_writes_all"] == 0  # no socket in one process
    assert by["single x1 processes", "target_total"] == 250.0
