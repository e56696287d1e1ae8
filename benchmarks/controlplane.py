"""``atoll bench controlplane``: what one computation costs the control plane, by process.

The figures come from the processes' own CPU clocks (``time.process_time``
in each process, user and system time of all its threads), so they hold on
a noisy machine where wall-clock rates do not. For each case the table
gives, per computation that a device ran in the measured window:

* CPU µs in the controller's process, in the host processes, in the client
  processes, and in all of them (``total``), beside the issue's target;
* computations per second and the devices' utilization (simulated device
  time over wall time);
* actor messages (calls enqueued on a local mailbox), Cap'n Proto calls
  (made, served) and socket writes (each a gathered burst of Cap'n Proto
  messages, and a wake-up of the far side) per computation, for each role.

Cases (simulated devices, each computation ``--program-ms`` of device time):

* ``awaited``: a client awaits each call before it makes the next;
* ``single``: single-computation runs, 16 in flight per client, round-robin
  over the devices; with 1, 4, 8 and 16 client processes;
* ``chain``: two-step chains whose second step runs on another host and
  reads the first's output, 16 chains in flight per client; 1, 4 and 8;
* ``host-chain``: the same with the second step on another device of the
  same host (a pipeline over one machine's accelerators); 1 client.

Each case runs over processes (``atoll up`` with ``--hosts`` host
processes and the controller in its own, each client a process of its own
connected over Cap'n Proto) and in one process (``local_cluster``, every
client a task: only the total is known there).

Run as ``python -m atoll.benchmarks.controlplane --client ...`` it is one of
the client processes (the benchmark starts them so): it says ``ready``,
starts on ``go``, and answers each ``snap`` line with its counters.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass

import numpy as np

from atoll.benchmarks._common import Column, Row, emit, system_column, table, wait_for_line
from atoll.devices import BufferHandle, Computation, CostModel
from atoll.kernel import AtollError, Promise, process_counters
from atoll.runtime import Cluster, local_cluster
from atoll.runtime.client.connect import connect
from atoll.transports.capnp import ClusterFile
from atoll.transports.processes import stop_processes

__all__ = ["CASES", "Case", "main", "run"]

BENCH = "controlplane"
FLOPS_PER_S = 1e12  # the simulated devices' CostModel default
IN_FLIGHT = 16  # runs (or chains) each client keeps in flight
ROLES = ("controller", "hosts", "clients")
MESSAGES = (
    "actor_messages",
    "capnp_calls_out",
    "capnp_calls_in",
    "lane_messages_out",
    "lane_messages_in",
    "socket_writes",
    "answers_from_hosts",
    "runs_leased",
)  # counted per computation, per role
# the targets, µs of CPU per computation over processes: (case, role)
TARGETS = {
    ("single x1", "total"): 250.0,
    ("single x16", "total"): 150.0,
    ("single x16", "controller"): 60.0,
    ("awaited x1", "total"): 400.0,
}


@dataclass(frozen=True)
class Case:
    """One workload: ``mode`` (awaited, single, chain or host-chain) from ``clients`` clients."""

    mode: str
    clients: int

    @property
    def name(self) -> str:
        return f"{self.mode} x{self.clients}"


CASES = (
    Case("awaited", 1),
    Case("single", 1),
    Case("single", 4),
    Case("single", 8),  # the shape TARGETS.md was measured at
    Case("single", 16),
    Case("chain", 1),
    Case("chain", 4),
    Case("chain", 8),
    Case("host-chain", 1),
)


# -- the workload, in a client process or as a task ------------------------------
def _computations(program_s: float) -> tuple[Computation, Computation]:
    """A source and a step: functions named by module, so that they travel
    by reference (a client runs this file as ``__main__``)."""
    this = importlib.import_module("atoll.benchmarks.controlplane")
    flops = program_s * FLOPS_PER_S
    return Computation("source", this._zero, flops), Computation("step", this._step, flops)


def _zero() -> np.ndarray:
    return np.zeros(1, np.float32)


def _step(x: np.ndarray) -> np.ndarray:
    return np.asarray(x) + 1


async def workload(
    cluster: Cluster, mode: str, devices: int, per_host: int, program_s: float
) -> None:
    """Run ``mode`` until cancelled (what finished, the devices count)."""
    source, step = _computations(program_s)
    sent = 0
    if mode == "awaited":
        while True:
            await cluster.run(source, sent % devices, [])
            sent += 1
    pending: deque[Promise[BufferHandle]] = deque()
    while True:
        while len(pending) < IN_FLIGHT:
            device = sent % devices
            first = cluster.run(source, device, [])
            if mode == "chain":  # the second step on the next host (or device)
                other = (device + per_host) % devices if devices > per_host else device
                first = cluster.run(step, other, [first])
            elif mode == "host-chain":  # ... on the next device of the same host
                other = device - device % per_host + (device + 1) % per_host
                first = cluster.run(step, other, [first])
            pending.append(first)
            sent += 1
        await pending.popleft()


async def client_main(
    cluster_file: str, mode: str, devices: int, per_host: int, program_s: float
) -> None:
    """One client process: connect, say ``ready``, run the workload from ``go``
    on, and answer each ``snap`` with this process's counters, until stdin ends."""
    async with connect(cluster_file) as client:
        cluster = await client.cluster("bench")
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        task = asyncio.create_task(workload(cluster, mode, devices, per_host, program_s))
        while (await asyncio.to_thread(sys.stdin.readline)).strip() == "snap":
            print(json.dumps(process_counters()), flush=True)
        task.cancel()
        with suppress(asyncio.CancelledError, AtollError):
            await task


# -- measuring ---------------------------------------------------------------------
Snapshot = dict[str, list[dict[str, float]]]  # role -> each process's counters
DEVICES = "devices"


async def _snapshot(cluster: Cluster, clients: Sequence[subprocess.Popen[str]]) -> Snapshot:
    """Every process's counters, by role, and the devices' counters."""
    controller = await cluster.controller.process_counters()
    hosts = {}
    for host in cluster.host_refs:
        counters = await host.process_counters()
        hosts[counters["pid"]] = counters
    answers = await asyncio.gather(*(asyncio.to_thread(_ask, client) for client in clients))
    stats = await cluster.device_stats()
    devices = [{"busy_s": s.busy_s, "computations": s.computations} for s in stats]
    return {
        "controller": [controller],
        "hosts": list(hosts.values()),
        "clients": list(answers),
        DEVICES: devices,
    }


def _ask(client: subprocess.Popen[str]) -> dict[str, float]:
    assert client.stdin is not None and client.stdout is not None
    client.stdin.write("snap\n")
    client.stdin.flush()
    line = client.stdout.readline()
    if not line:
        raise AtollError(f"client process {client.pid} ended")
    answer: dict[str, float] = json.loads(line)
    return answer


def _delta(before: Snapshot, after: Snapshot, role: str, key: str) -> float:
    return sum(a[key] for a in after[role]) - sum(b[key] for b in before[role])


def _rows(
    case: Case, where: str, before: Snapshot, after: Snapshot, wall: float, roles: Sequence[str]
) -> list[Row]:
    """The case's rows: CPU µs, messages and calls per computation, rate, busy."""
    label = f"{case.name} {where}"
    computations = _delta(before, after, DEVICES, "computations")
    if computations <= 0:
        raise AtollError(f"{label}: no computation finished in {wall:.1f} s")
    rows = []
    cpu = {role: _delta(before, after, role, "cpu_s") for role in roles}
    for role in roles:
        per = 1e6 * cpu[role] / computations
        rows.append(Row(BENCH, label, f"cpu_{role}", per, "µs"))
        for key in MESSAGES:
            count = _delta(before, after, role, key) / computations
            rows.append(Row(BENCH, label, f"{key}_{role}", count, "/comp"))
    total = 1e6 * sum(cpu.values()) / computations
    rows.append(Row(BENCH, label, "cpu_total", total, "µs"))
    devices = len(after[DEVICES])
    busy = _delta(before, after, DEVICES, "busy_s") / (devices * wall)
    rows.append(Row(BENCH, label, "rate", computations / wall, "comp/s", devices))
    rows.append(Row(BENCH, label, "busy", 100 * busy, "%", devices))
    for role in ("total", *ROLES):
        target = TARGETS.get((case.name, role)) if where == "processes" else None
        if target is not None:
            rows.append(Row(BENCH, label, f"target_{role}", target, "µs"))
    return rows


async def over_processes(
    case: Case,
    hosts: int,
    per_host: int,
    seconds: float,
    program_s: float,
    scrape_s: float | None = None,
) -> list[Row]:
    """``case`` on ``atoll up`` with client processes; rows per role. With
    ``scrape_s``, ``/metrics`` is scraped that often meanwhile (its cost
    shows in the controller's CPU)."""
    devices = hosts * per_host
    with tempfile.TemporaryDirectory() as directory:
        cluster_file = os.path.join(directory, "cluster.json")
        up = _start_up(cluster_file, hosts, per_host, scrape_s is not None)
        scraper: asyncio.Task[int] | None = None
        clients: list[subprocess.Popen[str]] = []
        try:
            for _ in range(case.clients):
                clients.append(_start_client(cluster_file, case.mode, devices, per_host, program_s))
            for client in clients:
                wait_for_line(client, "ready")
            for client in clients:
                _say(client, "go")
            if scrape_s is not None:
                scraper = asyncio.ensure_future(_scrape(up, cluster_file, scrape_s))
            async with connect(cluster_file) as admin:
                cluster = await admin.cluster("admin")
                await asyncio.sleep(_warmup(seconds))
                before, start = await _snapshot(cluster, clients), time.monotonic()
                await asyncio.sleep(seconds)
                after, wall = await _snapshot(cluster, clients), time.monotonic() - start
        finally:
            if scraper is not None:
                scraper.cancel()
                with suppress(asyncio.CancelledError):
                    await scraper
            for client in clients:
                with suppress(OSError):
                    assert client.stdin is not None
                    client.stdin.close()
            stop_processes([*clients], 30)
            stop_processes([up], 30)
    where = "processes" if scrape_s is None else f"scraped {scrape_s:g}s"
    return _rows(case, where, before, after, wall, ROLES)


async def _scrape(up: subprocess.Popen[str], cluster_file: str, every: float) -> int:
    """Scrape ``atoll up``'s ``/metrics`` every ``every`` seconds, as
    Prometheus would; how many scrapes were made (until cancelled)."""
    address = (await asyncio.to_thread(wait_for_line, up, "atoll web at")).split()[3]
    token = ClusterFile.read(cluster_file).token.hex()
    request = urllib.request.Request(
        address + "metrics", headers={"Authorization": f"Bearer {token}"}
    )

    def get() -> None:
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()

    done = 0
    while True:
        await asyncio.to_thread(get)
        done += 1
        await asyncio.sleep(every)


async def in_process(
    case: Case, hosts: int, per_host: int, seconds: float, program_s: float
) -> list[Row]:
    """``case`` on ``local_cluster``, every client a task of this process."""
    devices = hosts * per_host
    cost = CostModel(flops_per_s=FLOPS_PER_S)
    async with local_cluster(1, hosts, per_host, cost=cost) as cluster:
        tasks = [
            asyncio.create_task(
                workload(cluster.client(f"c{i}"), case.mode, devices, per_host, program_s)
            )
            for i in range(case.clients)
        ]
        try:
            await asyncio.sleep(_warmup(seconds))
            before, start = await _local_snapshot(cluster), time.monotonic()
            await asyncio.sleep(seconds)
            after, wall = await _local_snapshot(cluster), time.monotonic() - start
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with suppress(asyncio.CancelledError, AtollError):
                    await task
    return _rows(case, "in-process", before, after, wall, ("all",))


async def _local_snapshot(cluster: Cluster) -> Snapshot:
    stats = await cluster.device_stats()
    devices = [{"busy_s": s.busy_s, "computations": s.computations} for s in stats]
    return {"all": [process_counters()], DEVICES: devices}


def _warmup(seconds: float) -> float:
    return min(1.5, max(0.3, seconds / 3))


def _start_up(
    cluster_file: str, hosts: int, per_host: int, http: bool = False
) -> subprocess.Popen[str]:
    command = [
        *(sys.executable, "-m", "atoll.cli", "up", "--hosts", str(hosts)),
        *("--devices-per-host", str(per_host), "--cluster-file", cluster_file),
        *(("--http", "127.0.0.1:0") if http else ()),
    ]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, close_fds=False)
    wait_for_line(up, "atoll cluster up")
    return up


def _start_client(
    cluster_file: str, mode: str, devices: int, per_host: int, program_s: float
) -> subprocess.Popen[str]:
    command = [
        *(sys.executable, "-m", "atoll.benchmarks.controlplane", "--client", cluster_file),
        *("--mode", mode, "--devices", str(devices), "--per-host", str(per_host)),
        *("--program-ms", str(program_s * 1e3)),
    ]
    return subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, close_fds=False
    )


def _say(process: subprocess.Popen[str], line: str) -> None:
    assert process.stdin is not None
    process.stdin.write(line + "\n")
    process.stdin.flush()


# -- the benchmark -----------------------------------------------------------------
async def run(
    cases: Sequence[Case],
    where: Sequence[str] = ("processes", "in-process"),
    hosts: int = 2,
    per_host: int = 2,
    seconds: float = 4.0,
    program_s: float = 0.5e-3,
    scrape_s: float | None = None,
) -> list[Row]:
    """Every case, over processes and in one process as asked (with
    ``scrape_s``, over processes twice: unscraped, then scraped)."""
    rows: list[Row] = []
    for case in cases:
        if "processes" in where:
            rows += await over_processes(case, hosts, per_host, seconds, program_s)
            if scrape_s is not None:
                rows += await over_processes(case, hosts, per_host, seconds, program_s, scrape_s)
        if "in-process" in where:
            rows += await in_process(case, hosts, per_host, seconds, program_s)
    return rows


def _render(rows: Sequence[Row]) -> str:
    cpu: list[Column] = [
        system_column(f"cpu_{role}", 10, ",.0f", title=role) for role in (*ROLES, "all")
    ]
    cpu += [
        system_column("cpu_total", 8, ",.0f", title="total"),
        system_column("target_total", 7, ",.0f", title="target"),
        system_column("target_controller", 9, ",.0f", title="ctl tgt"),
        system_column("rate", 9, ",.0f", title="comp/s"),
        system_column("busy", 6, ".0f", title="busy%"),
    ]
    messages: list[Column] = []
    for role in (*ROLES, "all"):
        short = role[:4]
        messages.append(system_column(f"actor_messages_{role}", 8, ".1f", title=f"msg {short}"))
        messages.append(system_column(f"capnp_calls_out_{role}", 8, ".1f", title=f"out {short}"))
        messages.append(system_column(f"capnp_calls_in_{role}", 8, ".1f", title=f"in {short}"))
        messages.append(system_column(f"lane_messages_out_{role}", 8, ".1f", title=f"lo {short}"))
        messages.append(system_column(f"lane_messages_in_{role}", 8, ".1f", title=f"li {short}"))
        messages.append(system_column(f"socket_writes_{role}", 8, ".1f", title=f"wr {short}"))
    messages.insert(3 * 6, system_column("answers_from_hosts_clients", 8, ".1f", title="ah clie"))
    messages.insert(3 * 6 + 1, system_column("runs_leased_clients", 8, ".1f", title="ls clie"))
    return "\n".join(
        [
            "CPU µs per computation, by process role",
            table(rows, cpu, case_width=24),
            "",
            "per computation: actor messages (msg), Cap'n Proto calls made (out) and served"
            " (in), lane messages sent (lo) and received (li), socket writes (wr); clients'"
            " calls answered by a device's host, not the controller (ah), and sent to it"
            " under a lease (ls)",
            table(rows, messages, case_width=24),
        ]
    )


def _cases(names: str | None, quick: bool) -> list[Case]:
    if names is None:
        return [c for c in CASES if not quick or c.clients <= 4]
    chosen = [c for c in CASES if c.name.replace(" ", "") in names.replace(" ", "").split(",")]
    if not chosen:
        raise SystemExit(f"no case named {names!r}; cases: {[c.name for c in CASES]}")
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atoll bench controlplane", description=__doc__)
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--quick", action="store_true", help="shorter windows, 4 clients at most")
    parser.add_argument("--tiny", action="store_true", help="a smoke test: one case, one device")
    parser.add_argument("--only", help="cases, e.g. 'single x1,chain x1'")
    parser.add_argument("--where", choices=["both", "processes", "in-process"], default="both")
    parser.add_argument("--hosts", type=int, default=2, help="host processes")
    parser.add_argument("--per-host", type=int, default=2, help="devices per host")
    parser.add_argument("--seconds", type=float, default=None, help="measured window")
    parser.add_argument("--program-ms", type=float, default=0.5, help="device time per step")
    parser.add_argument(
        "--scrape",
        type=float,
        metavar="SECONDS",
        help="also run each case over processes with /metrics scraped this often",
    )
    parser.add_argument("--client", metavar="CLUSTER_FILE", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="single", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    program_s = args.program_ms * 1e-3
    if args.client:
        with suppress(KeyboardInterrupt):
            asyncio.run(client_main(args.client, args.mode, args.devices, args.per_host, program_s))
        return 0
    where = ("processes", "in-process") if args.where == "both" else (args.where,)
    if args.tiny:
        cases, hosts, per_host, seconds = [Case("single", 1)], 1, 1, args.seconds or 0.5
    else:
        cases, hosts, per_host = _cases(args.only, args.quick), args.hosts, args.per_host
        seconds = args.seconds or (2.0 if args.quick else 5.0)
    rows = asyncio.run(run(cases, where, hosts, per_host, seconds, program_s, args.scrape))
    emit(rows, args.json, _render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
