"""Load on one node process: ``atoll bench load [--json]``.

Three figures against a real node process (``atoll node``), each beside the
latency of one well-behaved client that echoes small values meanwhile:

- ``idle``: that client alone;
- ``flood``: another client puts 10,000 calls in flight against one actor at
  once (synchronous calls: the mailbox admits or refuses each, ``MailboxFull``);
- ``clients``: 64 clients connect at once and each makes 100 calls.

It reports answered and refused calls, wall time, the node's resident memory
before and after, and the well-behaved client's median and p99 latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
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


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


async def _latency(echo: ActorRef[Any], calls: int = 200) -> dict[str, float]:
    """Median and p99 of ``calls`` awaited echoes, in microseconds."""
    took = []
    for i in range(calls):
        began = time.perf_counter()
        await echo.echo(i)
        took.append((time.perf_counter() - began) * 1e6)
    took.sort()
    return {"median_us": statistics.median(took), "p99_us": took[int(0.99 * len(took))]}


async def _flood(transport: CapnpTransport, address: str, system: ActorSystem) -> dict[str, Any]:
    """10,000 calls in flight against one actor."""
    connection = await transport.connect(address, system)
    try:
        counter = await connection.node.spawn(f"{CONF}:Counter")
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
        return {"answered": answered, "refused": refused, "s": time.perf_counter() - began}
    finally:
        await connection.aclose()


async def _clients(transport: CapnpTransport, address: str, system: ActorSystem) -> dict[str, Any]:
    """64 clients at once, 100 calls each; counts the calls answered with
    the value sent, and those refused (a full mailbox)."""
    counts = {"answered": 0, "refused": 0}

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


async def run_load() -> list[dict[str, Any]]:
    """The three rows (see the module docstring)."""
    node = NodeProcess(TOKEN)
    rows: list[dict[str, Any]] = []
    try:
        async with capnp_runtime(), ActorSystem("load") as system:
            transport = CapnpTransport(TOKEN)
            probe = await transport.connect(node.address, system)
            try:
                echo = await probe.node.spawn(f"{CONF}:Echo")
                rss = _rss_mib(node.pid)
                rows.append({"case": "idle", **await _latency(echo), "rss_mib": rss})
                for name, load in (("flood", _flood), ("clients", _clients)):
                    busy = asyncio.ensure_future(_latency(echo))
                    figures = await load(transport, node.address, system)
                    row = {"case": name, **figures, **await busy, "rss_mib": _rss_mib(node.pid)}
                    rows.append(row)
            finally:
                await probe.aclose()
    finally:
        node.stop()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atoll bench load", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
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
