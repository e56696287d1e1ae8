"""Multi-tenancy: many client processes share one island, by weight.

``atoll bench multitenant [--json] [--quick]`` starts a cluster with ``atoll
up`` (one host process of simulated devices, the default ``"share"`` island
policy) and client processes that each ``atoll.connect`` to it over Cap'n
Proto, with a weight, and keep the island busy with programs of 0.33 ms of
device time (``cluster.run`` of one computation, a few in flight per client).
Shares and utilization are read from ``client.status()``: the device seconds
each session used, between two snapshots taken while every client runs.

Cases (Pathways' multi-tenancy figures, ``shared/docs/PAPERS.md``, beside):

* ``shares``: 4 clients of weights 1, 2, 4 and 8. Each one's share of the
  device time, against its due share (1/15, 2/15, 4/15, 8/15); the largest
  relative error; the island's utilization (busy time / wall time). The
  same again under gang FIFO (column ``fifo``), which knows no weights, and
  with 5 ms programs, long enough for this control plane to keep a device
  busy.
* ``utilization``: 1, 4 and 16 clients of weight 1.
* ``isolation``: the shares run again, with two more clients: a *flooder*
  (thousands of programs in flight, gang quota 64: it stalls, then is
  refused) and a *doomed* client holding buffers, killed (SIGKILL) in the
  middle of the run. The weighted clients' shares among themselves, the
  flooder's refusals, and the buffers left in the store by clients that are
  gone (0: only the survivors' remain).

Run as ``python -m atoll.benchmarks.multitenant --client ...`` it is one of
those client processes (the benchmark starts them so).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from atoll.benchmarks._common import Row, system_column, table, unit_column, wait_for_line
from atoll.devices import BufferHandle, Computation
from atoll.kernel import AtollError, Promise
from atoll.runtime.client.connect import Client, connect
from atoll.transports.processes import stop_processes

__all__ = ["PROGRAM_S", "WEIGHTS", "main", "run"]

BENCH = "multitenant"
PROGRAM_S = 0.33e-3  # device time of one program, as in the paper
FLOPS_PER_S = 1e12  # the simulated devices' CostModel default
WEIGHTS = (1, 2, 4, 8)
DEPTH = 32  # programs each client keeps in flight: enough to claim an 8/15 share
HELD = np.zeros(1 << 16, np.float32)  # 256 KiB a client keeps in the store
FLOOD_QUOTA = 64
SATURATING_S = 5e-3  # programs long enough for this control plane to keep a device busy


# -- one client process ----------------------------------------------------------
def _program(seconds: float) -> Computation:
    """One program: its function named by module, so that it travels by
    reference (a client runs this file as ``__main__``, whose functions would
    be pickled by value on every call)."""
    this = importlib.import_module("atoll.benchmarks.multitenant")
    return Computation("tenant", this._zero, seconds * FLOPS_PER_S)


def _zero() -> np.ndarray:
    return np.zeros(1, np.float32)


async def client_main(
    cluster_file: str, name: str, weight: float, depth: int, devices: int, program_s: float
) -> None:
    """Connect with ``weight``, hold a buffer, say ``ready``; once told ``go``
    (a line on stdin), keep ``depth`` programs in flight, round-robin over
    ``devices`` devices, until killed."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)  # stop cleanly
    async with connect(cluster_file, weight=weight) as client:
        cluster = await client.cluster(name)
        held = await cluster.put(HELD, 0)  # noqa: F841  (it holds a buffer while it runs)
        program = _program(program_s)
        pending: deque[Promise[BufferHandle]] = deque()
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        sent = 0
        while True:
            while len(pending) < depth:
                pending.append(cluster.run(program, sent % devices, []))
                sent += 1
            with suppress(AtollError):  # a flooder is refused some
                await pending.popleft()


# -- the benchmark -----------------------------------------------------------------
@dataclass
class Running:
    """A cluster started by ``atoll up`` and the client processes on it."""

    cluster_file: str
    up: subprocess.Popen[str]
    clients: dict[str, subprocess.Popen[str]]


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


def _start_up(directory: str, devices: int, scheduler: str = "share") -> Running:
    cluster_file = os.path.join(directory, "cluster.json")
    command = _python(
        *("-m", "atoll.cli", "up", "--hosts", "1", "--devices-per-host", str(devices)),
        *("--cluster-file", cluster_file, "--scheduler", scheduler),
    )
    up = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, close_fds=False)
    wait_for_line(up, "atoll cluster up")
    return Running(cluster_file, up, {})


def _start_clients(
    running: Running,
    clients: Sequence[tuple[str, float, int]],
    devices: int,
    program_s: float = PROGRAM_S,
) -> None:
    """Start client processes (name, weight, depth); return once all are ready."""
    for name, weight, depth in clients:
        command = _python(
            "-m",
            "atoll.benchmarks.multitenant",
            "--client",
            running.cluster_file,
            "--name",
            name,
            "--weight",
            str(weight),
            "--depth",
            str(depth),
            "--devices",
            str(devices),
            "--program-ms",
            str(program_s * 1e3),
        )
        running.clients[name] = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, close_fds=False
        )
    for name, _, _ in clients:
        wait_for_line(running.clients[name], "ready")


def _go(running: Running, names: Sequence[str]) -> None:
    """Let these (ready) clients start sending work."""
    for name in names:
        stdin = running.clients[name].stdin
        assert stdin is not None
        stdin.write("go\n")
        stdin.flush()


def _stop(running: Running) -> None:
    """Stop the clients, then the cluster (so that their sessions end first).
    A client still waiting for ``go`` reads end-of-file and stops too."""
    for client in running.clients.values():
        if client.stdin is not None:
            with suppress(OSError):
                client.stdin.close()
    for group in (list(running.clients.values()), [running.up]):
        stop_processes(group, 30)


async def _sessions(client: Client) -> dict[str, dict[str, Any]]:
    """Session rows of ``client.status()`` by client name (``"w4#3"`` -> ``"w4"``)."""
    rows = await client.status()
    return {str(row["name"]).split("#")[0]: row for row in rows if row.get("kind") == "session"}


def _warmup(seconds: float) -> float:
    """How long to let every client get under way (and the first gangs, sent
    before the island knew it was shared, run) before measuring."""
    return min(2.0, seconds / 3)


async def _window(client: Client, seconds: float) -> tuple[dict[str, float], float]:
    """Device seconds each session used over ``seconds`` of wall time."""
    before, start = await _sessions(client), time.monotonic()
    await asyncio.sleep(seconds)
    after, wall = await _sessions(client), time.monotonic() - start
    used = {
        name: float(row["device_s"]) - float(before.get(name, {}).get("device_s", 0.0))
        for name, row in after.items()
    }
    return used, wall


def _share_rows(case: str, used: dict[str, float], wall: float, devices: int) -> list[Row]:
    """Each weighted client's share against its due share, the largest error,
    and utilization."""
    weighted = {f"w{w}": w for w in WEIGHTS}
    total = sum(used.get(name, 0.0) for name in weighted)
    rows = []
    errors = []
    for name, weight in weighted.items():
        due = weight / sum(WEIGHTS)
        share = used.get(name, 0.0) / total if total else 0.0
        errors.append(abs(share / due - 1))
        rows.append(Row(BENCH, f"{case}_share_w{weight}", "atoll", 100 * share, "%", devices))
        rows.append(Row(BENCH, f"{case}_share_w{weight}", "due", 100 * due, "%", devices))
    rows.append(Row(BENCH, f"{case}_max_share_error", "atoll", 100 * max(errors), "%", devices))
    rows.append(Row(BENCH, f"{case}_max_share_error", "target", 5.0, "%", devices))
    busy = sum(used.values())
    busy_percent = 100 * busy / (devices * wall)
    rows.append(Row(BENCH, f"{case}_utilization", "atoll", busy_percent, "%", devices))
    rows.append(Row(BENCH, f"{case}_utilization", "pathways", 100.0, "%", devices))
    return rows


async def shares(
    devices: int, seconds: float, program_s: float = PROGRAM_S, scheduler: str = "share"
) -> list[Row]:
    """4 clients of weights 1:2:4:8, programs of ``program_s``."""
    with tempfile.TemporaryDirectory() as directory:
        running = _start_up(directory, devices, scheduler)
        try:
            weighted = [(f"w{w}", w, DEPTH) for w in WEIGHTS]
            _start_clients(running, weighted, devices, program_s)
            _go(running, list(running.clients))
            async with connect(running.cluster_file) as admin:
                await asyncio.sleep(_warmup(seconds))  # every client under way
                used, wall = await _window(admin, seconds)
        finally:
            _stop(running)
    case = "shares" if program_s == PROGRAM_S else f"shares_{program_s * 1e3:g}ms"
    rows = _share_rows(case, used, wall, devices)
    if scheduler == "share":
        return rows
    return [replace(row, system=scheduler) for row in rows if row.system == "atoll"]


async def utilization(
    clients: int, devices: int, seconds: float, scheduler: str = "share"
) -> list[Row]:
    """``clients`` clients of weight 1; busy time over wall time."""
    with tempfile.TemporaryDirectory() as directory:
        running = _start_up(directory, devices, scheduler)
        try:
            _start_clients(running, [(f"c{i}", 1, DEPTH) for i in range(clients)], devices)
            _go(running, list(running.clients))
            async with connect(running.cluster_file) as admin:
                await asyncio.sleep(_warmup(seconds))
                used, wall = await _window(admin, seconds)
        finally:
            _stop(running)
    busy = 100 * sum(used.values()) / (devices * wall)
    case = f"utilization_{clients}_clients"
    return [
        Row(BENCH, case, "atoll", busy, "%", devices),
        Row(BENCH, case, "pathways", 100.0, "%", devices),
    ]


async def isolation(devices: int, seconds: float) -> list[Row]:
    """The shares run with a flooder and a client killed in the middle."""
    with tempfile.TemporaryDirectory() as directory:
        running = _start_up(directory, devices)
        try:
            weighted = [(f"w{w}", w, DEPTH) for w in WEIGHTS]
            flooder = ("flood", 1, 20 * FLOOD_QUOTA)
            _start_clients(running, [flooder, *weighted, ("doomed", 1, DEPTH)], devices)
            async with connect(running.cluster_file) as admin:
                flood_session = (await _sessions(admin))["flood"]["name"]
                await admin.set_quota(flood_session, max_gangs=FLOOD_QUOTA)
                _go(running, list(running.clients))
                await asyncio.sleep(_warmup(seconds))
                first, first_wall = await _window(admin, seconds / 2)
                running.clients["doomed"].send_signal(signal.SIGKILL)
                second, second_wall = await _window(admin, seconds / 2)
                used = {n: first.get(n, 0.0) + second.get(n, 0.0) for n in {*first, *second}}
                sessions = await _sessions(admin)
                left = await _leftover_buffers(admin, sessions)
        finally:
            _stop(running)
    rows = _share_rows("isolation", used, first_wall + second_wall, devices)
    flood = sessions.get("flood", {})
    gone = float("doomed" not in sessions)
    rows += [
        Row(BENCH, "isolation_flooder_stalled", "atoll", float(flood.get("stalled", 0)), "gangs"),
        Row(BENCH, "isolation_flooder_refused", "atoll", float(flood.get("refused", 0)), "gangs"),
        Row(BENCH, "isolation_killed_client_gone", "atoll", gone, "bool"),
        Row(BENCH, "isolation_buffers_left_by_the_gone", "atoll", float(left), "buffers"),
        Row(BENCH, "isolation_buffers_left_by_the_gone", "target", 0.0, "buffers"),
    ]
    return rows


async def _leftover_buffers(admin: Client, sessions: dict[str, dict[str, Any]]) -> int:
    """Buffers in the stores under no open session, once the killed client's
    session has ended (waits up to 20 s for it)."""
    deadline = time.monotonic() + 20
    while "doomed" in sessions and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        sessions.clear()
        sessions.update(await _sessions(admin))
    return int(sessions.get("(no open session)", {}).get("buffers", 0))


async def run(quick: bool = False, devices: int = 1) -> list[Row]:
    """Every case, in order (``quick``: shorter windows, 8 clients at most)."""
    seconds = 2.0 if quick else 6.0
    rows = await shares(devices, seconds)
    rows += await shares(devices, seconds, scheduler="fifo")  # the same, under gang FIFO
    rows += await shares(devices, seconds, SATURATING_S)
    for clients in (1, 4) if quick else (1, 4, 16):
        rows += await utilization(clients, devices, seconds)
    rows += await isolation(devices, seconds)
    return rows


def format_table(rows: Sequence[Row]) -> str:
    columns = [
        system_column("atoll", 9, ".1f"),
        system_column("fifo", 9, ".1f", title="fifo"),
        system_column("due", 9, ".1f", also=("pathways", "target"), title="paper/due"),
        unit_column(),
    ]
    return table(rows, columns, case_width=38)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--quick", action="store_true", help="shorter windows, fewer clients")
    parser.add_argument("--devices", type=int, default=1, help="devices of the island")
    parser.add_argument("--client", metavar="CLUSTER_FILE", help=argparse.SUPPRESS)
    parser.add_argument("--name", default="client", help=argparse.SUPPRESS)
    parser.add_argument("--weight", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, default=DEPTH, help=argparse.SUPPRESS)
    parser.add_argument("--program-ms", type=float, default=PROGRAM_S * 1e3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        with suppress(KeyboardInterrupt, asyncio.CancelledError):
            program_s = args.program_ms * 1e-3
            asyncio.run(
                client_main(
                    args.client, args.name, args.weight, args.depth, args.devices, program_s
                )
            )
        return 0
    rows = asyncio.run(run(args.quick, args.devices))
    if args.json:
        for row in rows:
            print(row.json())
    else:
        ms = PROGRAM_S * 1e3
        print(f"multi-tenancy: {ms:.2f} ms programs, client processes over Cap'n Proto")
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
