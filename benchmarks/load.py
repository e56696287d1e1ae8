"""Load on one node process: ``atoll bench load [--json]``.

Three figures against a real node process (``atoll node``), each beside the
latency of one well-behaved client that echoes small values meanwhile:

- ``idle``: that client alone;
- ``flood``: another client puts 10,000 calls in flight against one actor at
  once (synchronous calls: the node admits or refuses each, ``MailboxFull``,
  see ``ATOLL_CONNECTION_CALLS`` in docs/transport.md);
- ``clients``: 64 clients connect at once and each makes 100 calls.

The load runs in a process of its own (``--drive CASE ADDRESS``), as other
clients would: the well-behaved client's latency then measures the node, not
its own event loop queueing behind the load's work. It is sampled for as long
as the load runs. Each row reports the calls answered and refused, wall time,
the node's resident memory before, at its peak (sampled every 10 ms) and after
the case, and the well-behaved client's median and p99 latency with their
ratio to the idle figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import anyio

from ..kernel import ActorRef, ActorSystem, MailboxFull
from ..transports.capnp import CapnpTransport, capnp_runtime
from ..transports.testing import NodeProcess

__all__ = ["main", "run_load"]

TOKEN = b"atoll-bench-load"
CONF = "atoll.transports.conformance"
READY = "LOAD-READY"


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


class _PeakRss:
    """The highest RSS of ``pid`` seen while the block runs (a thread samples
    /proc every 10 ms: nothing on the event loop)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = _rss_mib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss_mib(self.pid))

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mib(self.pid))


def _figures(took: list[float]) -> dict[str, float]:
    took = sorted(took)
    return {"median_us": statistics.median(took), "p99_us": took[int(0.99 * len(took))]}


async def _latency(echo: ActorRef[Any], calls: int = 200) -> dict[str, float]:
    """Median and p99 of ``calls`` awaited echoes, in microseconds."""
    took = []
    for i in range(calls):
        began = time.perf_counter()
        await echo.echo(i)
        took.append((time.perf_counter() - began) * 1e6)
    return {**_figures(took), "probes": calls}


async def _latency_while(echo: ActorRef[Any], load: asyncio.Future[Any]) -> dict[str, float]:
    """Echo after echo until ``load`` is done (at least 20), timing each."""
    took: list[float] = []
    while not load.done() or len(took) < 20:
        began = time.perf_counter()
        await echo.echo(len(took))
        took.append((time.perf_counter() - began) * 1e6)
    return {**_figures(took), "probes": len(took)}


# -- the load, run in its own process ----------------------------------------------
async def _flood(transport: CapnpTransport, address: str, system: ActorSystem) -> dict[str, Any]:
    """10,000 calls in flight against one actor; counts those answered with the
    right running total's share, and those refused."""
    connection = await transport.connect(address, system)
    try:
        counter = await connection.node.spawn(f"{CONF}:Counter")
        print(READY, flush=True)
        began, calls, refused = time.perf_counter(), [], 0
        for _ in range(10_000):
            try:
                calls.append(counter.add(1))
            except MailboxFull:
                refused += 1
        answered = 0
        for call in calls:
            try:
                await call
                answered += 1
            except MailboxFull:
                refused += 1
        total = await counter.add(0)  # every admitted call ran once, refused ones never
        return {
            "answered": answered,
            "refused": refused,
            "ran": total,
            "s": time.perf_counter() - began,
        }
    finally:
        await connection.aclose()


async def _clients(transport: CapnpTransport, address: str, system: ActorSystem) -> dict[str, Any]:
    """64 clients at once, 100 calls each; counts the calls answered with
    the value sent, and those refused (a full mailbox)."""
    counts = {"answered": 0, "refused": 0}
    print(READY, flush=True)

    async def one(k: int) -> None:
        connection = await transport.connect(address, system)
        try:
            echo = await connection.node.spawn(f"{CONF}:Echo")
            for i in range(100):
                try:
                    right = await echo.echo((k, i)) == (k, i)
                except MailboxFull:
                    counts["refused"] += 1
                    continue
                counts["answered"] += right
        finally:
            await connection.aclose()

    began = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for k in range(64):
            tg.start_soon(one, k)
    return {**counts, "s": time.perf_counter() - began}


LOADS = {"flood": _flood, "clients": _clients}


async def drive(case: str, address: str) -> dict[str, Any]:
    """Run one load against ``address`` (prints ``READY`` once it is about to start)."""
    async with capnp_runtime(), ActorSystem("load-driver") as system:
        return await LOADS[case](CapnpTransport(TOKEN), address, system)


def _start_driver(case: str, address: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "atoll.benchmarks.load", "--drive", case, address]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, close_fds=False)


async def _run_case(case: str, address: str, pid: int, echo: ActorRef[Any]) -> dict[str, Any]:
    """One load in its own process, the well-behaved client timed meanwhile."""
    driver = _start_driver(case, address)
    assert driver.stdout is not None
    try:
        line = await asyncio.to_thread(driver.stdout.readline)
        if line.strip() != READY:
            raise RuntimeError(f"load driver for {case!r} did not start: {line!r}")
        before = _rss_mib(pid)
        with _PeakRss(pid) as peak:
            done = asyncio.ensure_future(asyncio.to_thread(driver.communicate))
            latency = await _latency_while(echo, done)
            out, _ = await done
        if driver.returncode != 0:
            raise RuntimeError(f"load driver for {case!r} failed ({driver.returncode})")
        figures = json.loads(out.strip().splitlines()[-1])
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    rss = {"rss_before_mib": before, "rss_peak_mib": peak.peak, "rss_after_mib": _rss_mib(pid)}
    return {"case": case, **figures, **latency, **rss}


async def run_load() -> list[dict[str, Any]]:
    """The three rows (see the module docstring)."""
    node = NodeProcess(TOKEN)
    rows: list[dict[str, Any]] = []
    try:
        async with capnp_runtime(), ActorSystem("load") as system:
            probe = await CapnpTransport(TOKEN).connect(node.address, system)
            try:
                echo = await probe.node.spawn(f"{CONF}:Echo")
                await _latency(echo, 50)  # warm up
                rss = _rss_mib(node.pid)
                idle = {"case": "idle", **await _latency(echo, 1000), "rss_before_mib": rss}
                rows.append(idle)
                for case in LOADS:
                    row = await _run_case(case, node.address, node.pid, echo)
                    row["median_x_idle"] = row["median_us"] / idle["median_us"]
                    row["p99_x_idle"] = row["p99_us"] / idle["p99_us"]
                    rows.append(row)
            finally:
                await probe.aclose()
    finally:
        node.stop()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atoll bench load", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--drive", nargs=2, metavar=("CASE", "ADDRESS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.drive:
        print(json.dumps(asyncio.run(drive(*args.drive))), flush=True)
        return 0
    rows = asyncio.run(run_load())
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            print(
                "  ".join(
                    f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
