"""What the trio bridge adds: the client on asyncio and on trio, same cluster.

``atoll bench bridge [--json] [--reps N]`` starts ``atoll up`` (one host
process, one simulated device) and times, on each backend, with the same
client code (``atoll.connect``; under trio it runs on an asyncio loop thread
and hands out proxies, ``transports/capnp/bridge.py``):

* ``ping``: one actor call to the controller's node and its answer;
* ``run+fetch``: one ``cluster.run`` of a tiny computation and its fetch;
* ``chain16``: 16 chained ``cluster.run`` calls, then one fetch.

It prints the median of each, per backend (each backend runs twice,
alternating, and the second round counts), and what trio adds. The results
are kept in docs/transport.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
from rich.progress import Progress

import atoll
from atoll.devices import Computation

__all__ = ["main", "measure"]

STEP = Computation("negate", np.negative, flops=0.0)


async def _timed(reps: int, once: Callable[[], Awaitable[Any]], tick: Callable[[], None]) -> float:
    """The median seconds of ``once()`` over ``reps`` runs (after a warm-up)."""
    await once()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        await once()
        times.append(time.perf_counter() - started)
        tick()
    return statistics.median(times)


async def measure(cluster_file: Path, reps: int, tick: Callable[[], None]) -> dict[str, float]:
    """Median seconds of each case, on whichever backend this runs on."""
    async with atoll.connect(cluster_file) as client:
        cluster = await client.cluster()
        x = np.ones(4)

        async def ping() -> None:
            await client.node.ping()

        async def run_fetch() -> None:
            await cluster.fetch(cluster.run(STEP, 0, [x]))

        async def chain16() -> None:
            handle = cluster.run(STEP, 0, [x])
            for _ in range(15):
                handle = cluster.run(STEP, 0, [handle])
            await cluster.fetch(handle)

        return {
            "ping": await _timed(reps, ping, tick),
            "run+fetch": await _timed(reps, run_fetch, tick),
            "chain16": await _timed(max(reps // 4, 1), chain16, tick),
        }


def _start(runtime: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime))
    command = [sys.executable, "-m", "atoll.cli", "up", "--hosts", "1", "--devices-per-host", "1"]
    up = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, close_fds=False)
    assert up.stdout is not None
    for line in up.stdout:
        if "cluster up" in line:
            return up
    raise SystemExit("atoll bench bridge: atoll up did not start")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atoll bench bridge", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as runtime:
        up = _start(Path(runtime))
        try:
            cluster_file = Path(runtime) / "atoll" / "cluster.json"
            results = {}
            total = 4 * (2 * args.reps + max(args.reps // 4, 1))
            with Progress(transient=True) as progress:
                task = progress.add_task("bridge", total=total)
                # each backend twice, alternating; the second round counts
                for backend in ("asyncio", "trio", "asyncio", "trio"):
                    progress.update(task, description=backend)
                    tick = functools.partial(progress.advance, task)
                    results[backend] = anyio.run(
                        measure, cluster_file, args.reps, tick, backend=backend
                    )
        finally:
            up.send_signal(signal.SIGTERM)
            up.wait(60)
            assert up.stdout is not None
            up.stdout.close()
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"{'case':<10} {'asyncio µs':>11} {'trio µs':>9} {'trio adds µs':>13}")
    for case in results["asyncio"]:
        a, t = results["asyncio"][case] * 1e6, results["trio"][case] * 1e6
        print(f"{case:<10} {a:>11.0f} {t:>9.0f} {t - a:>13.0f}")
    return 0
