"""The transport benchmark: atoll over Cap'n Proto between two processes.

Measured on loopback, against baselines run in the same invocation:

* ``pycapnp-raw``: a bare pycapnp server in its own process (one trivial
  method, and a byte buffer read in 1 MiB chunks, 4 in flight): the floor
  under atoll's own layers;
* ``ray``: the peer script ``shared/peers/bench_ray.py`` (W1 op-by-op and W5
  64 MiB hand-off), when a Python with Ray is available (``--ray-python``).

Cases (``--json`` prints one object per line: bench, case, system, value,
unit): ``latency_small`` (us, median), ``latency_small_p99`` (us),
``calls_per_s_inflight``, ``chain10_pipelined`` and ``chain10_awaited`` (ms),
``bulk_1MiB``, ``bulk_16MiB``, ``bulk_64MiB`` (MB/s, client to node).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...kernel import ActorSystem
from ._process import READY_PREFIX, NodeProcess
from ._schema import schema
from ._transport import CapnpTransport, capnp_runtime, default_token

__all__ = ["Row", "main", "run"]

CONF = "atoll.transports.conformance"
MB = 1e6


@dataclass
class Row:
    case: str
    system: str
    value: float
    unit: str

    def as_json(self) -> str:
        return json.dumps(
            {
                "bench": "transport",
                "case": self.case,
                "system": self.system,
                "value": round(self.value, 3),
                "unit": self.unit,
            }
        )


def _progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


async def _timed(fn: Callable[[], Awaitable[Any]], reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - start)
    return samples


async def _atoll_rows(address: str, token: bytes, quick: bool) -> list[Row]:
    calls, reps = (300, 5) if quick else (2000, 20)
    rows: list[Row] = []
    transport = CapnpTransport(token)
    async with capnp_runtime(), ActorSystem("bench") as system:
        connection = await transport.connect(address, system)
        try:
            node = connection.node
            echo = await node.spawn(f"{CONF}:Echo")
            _progress("atoll: small-call latency")
            for _ in range(100):
                await echo.echo(1.0)
            lat = await _timed(lambda: echo.echo(1.0), calls)
            rows += _latency_rows("atoll", lat)
            _progress("atoll: calls in flight")
            start = time.perf_counter()
            await asyncio.gather(*(echo.echo(i) for i in range(calls * 2)))
            rows.append(
                Row(
                    "calls_per_s_inflight",
                    "atoll",
                    calls * 2 / (time.perf_counter() - start),
                    "1/s",
                )
            )
            rows += await _chain_rows(node, reps)
            rows += await _bulk_rows(echo, quick)
        finally:
            await connection.aclose()
    return rows


def _latency_rows(system: str, samples: list[float]) -> list[Row]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return [
        Row("latency_small", system, statistics.median(samples) * 1e6, "us"),
        Row("latency_small_p99", system, p99 * 1e6, "us"),
    ]


async def _chain_rows(node: Any, reps: int) -> list[Row]:
    _progress("atoll: 10-hop chains")

    async def pipelined() -> None:
        chain = node.spawn(f"{CONF}:Chain")
        for _ in range(10):
            chain = chain.next()
        assert await chain.get_depth() == 10

    async def awaited() -> None:
        ref = await node.spawn(f"{CONF}:Chain")
        for _ in range(10):
            ref = await ref.next()
        assert await ref.get_depth() == 10

    await pipelined()
    return [
        Row(
            "chain10_pipelined",
            "atoll",
            statistics.median(await _timed(pipelined, reps)) * 1e3,
            "ms",
        ),
        Row("chain10_awaited", "atoll", statistics.median(await _timed(awaited, reps)) * 1e3, "ms"),
    ]


async def _bulk_rows(echo: Any, quick: bool) -> list[Row]:
    rows = []
    for mib in (1, 16, 64):
        _progress(f"atoll: bulk {mib} MiB")
        array = np.random.default_rng(mib).standard_normal(mib << 18).astype(np.float32)

        async def send(array: np.ndarray = array) -> None:
            shape, _, _ = await echo.describe(array)
            assert tuple(shape) == array.shape

        samples = await _timed(send, 3 if quick else 7)
        rows.append(
            Row(f"bulk_{mib}MiB", "atoll", array.nbytes / MB / statistics.median(samples), "MB/s")
        )
    return rows


def _bridge_rows(address: str, token: bytes, quick: bool) -> list[Row]:
    """Small-call latency from a trio app, through the asyncio bridge thread."""
    import trio

    from .bridge import CapnpBridge

    calls = 300 if quick else 2000

    async def measure() -> list[float]:
        async with CapnpBridge.connect(address, token) as node:
            echo = await node.spawn(f"{CONF}:Echo")
            for _ in range(50):
                await echo.echo(1.0)
            return await _timed(lambda: echo.echo(1.0), calls)  # no loop-specific waits

    _progress("atoll from trio, through the bridge: small-call latency")
    return _latency_rows("atoll-trio-bridge", trio.run(measure))


# -- the raw pycapnp floor --------------------------------------------------------
class _RawBuffer(schema.Buffer.Server):  # type: ignore[misc]
    def __init__(self, nbytes: int) -> None:
        self._data = memoryview(bytes(nbytes))

    async def read(self, offset: int, length: int, _context: Any, **_: Any) -> None:
        _context.results.data = self._data[offset : offset + length]


async def _raw_server() -> None:
    import capnp

    async def handler(stream: Any) -> None:
        await capnp.TwoPartyServer(stream, bootstrap=_RawBuffer(64 << 20)).on_disconnect()

    async with capnp_runtime():
        server = await capnp.AsyncIoStream.create_server(handler, "127.0.0.1", 0)
        print(f"{READY_PREFIX}127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
        async with server:
            await server.serve_forever()


async def _raw_rows(port: int, quick: bool) -> list[Row]:
    import capnp

    async with capnp_runtime():
        stream = await capnp.AsyncIoStream.create_connection(host="127.0.0.1", port=port)
        client = capnp.TwoPartyClient(stream)
        buffer = client.bootstrap().cast_as(schema.Buffer)
        try:
            rows = await _raw_measure(buffer, quick)
        finally:
            del buffer  # capnp objects must go before the loop does
            client.close()
    return rows


async def _raw_measure(buffer: Any, quick: bool) -> list[Row]:
    calls = 300 if quick else 2000
    _progress("pycapnp-raw: latency, calls in flight, bulk")
    lat = await _timed(lambda: buffer.read(offset=0, length=8), calls)
    rows = _latency_rows("pycapnp-raw", lat)
    start = time.perf_counter()
    await asyncio.gather(*(buffer.read(offset=0, length=8) for _ in range(calls * 2)))
    rate = calls * 2 / (time.perf_counter() - start)
    rows.append(Row("calls_per_s_inflight", "pycapnp-raw", rate, "1/s"))
    for mib in (1, 16, 64):
        nbytes = mib << 20

        async def pull(nbytes: int = nbytes) -> None:
            window = asyncio.Semaphore(4)

            async def one(offset: int) -> None:
                async with window:
                    await buffer.read(offset=offset, length=1 << 20)

            await asyncio.gather(*(one(o) for o in range(0, nbytes, 1 << 20)))

        samples = await _timed(pull, 3 if quick else 7)
        mbps = nbytes / MB / statistics.median(samples)
        rows.append(Row(f"bulk_{mib}MiB", "pycapnp-raw", mbps, "MB/s"))
    return rows


def _start_raw_server() -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [sys.executable, "-m", "atoll.transports.capnp.bench", "--raw-server"],
        stdout=subprocess.PIPE,
        text=True,
        close_fds=False,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith(READY_PREFIX):
        process.kill()
        raise RuntimeError("raw pycapnp server did not start")
    return process, int(line.rsplit(":", 1)[1])


# -- Ray, from the shared peer scripts --------------------------------------------
def _ray_rows(quick: bool, ray_python: str | None) -> list[Row]:
    from ..._peers import pick, ray_rows

    rows = ray_rows("W1,W5", quick, ray_python)
    found: list[Row] = []
    latency = pick(rows, "W1", "actor op-by-op scalar", "latency")
    if latency is not None:
        found.append(Row("latency_small", "ray", latency * 1e3, "us"))
    handoff = pick(rows, "W5", "64MiB A->B by ref", "hand-off MiB/s")
    if handoff is not None:
        found.append(Row("bulk_64MiB", "ray", handoff * 2**20 / MB, "MB/s"))
    return found


# -- table and entry point ---------------------------------------------------------
def _table(rows: list[Row]) -> str:
    systems = ["atoll", "atoll-trio-bridge", "pycapnp-raw", "ray"]
    cases = list(dict.fromkeys(r.case for r in rows))
    value = {(r.case, r.system): r for r in rows}
    lines = [
        f"{'case':<22}"
        + "".join(f"{s:>18}" for s in systems)
        + f"{'unit':>8}"
        + f"{'atoll/raw':>11}{'atoll/ray':>11}"
    ]
    for case in cases:
        cells, unit = [], ""
        for system in systems:
            row = value.get((case, system))
            cells.append(f"{row.value:>18,.1f}" if row else f"{'-':>18}")
            unit = unit or (row.unit if row else "")
        ratios = [_ratio(value, case, other) for other in ("pycapnp-raw", "ray")]
        lines.append(f"{case:<22}" + "".join(cells) + f"{unit:>8}" + "".join(ratios))
    return "\n".join(lines)


def _ratio(value: dict[tuple[str, str], Row], case: str, other: str) -> str:
    mine, theirs = value.get((case, "atoll")), value.get((case, other))
    if mine is None or theirs is None or theirs.value == 0:
        return f"{'-':>11}"
    return f"{mine.value / theirs.value:>10.2f}x"


def run(quick: bool = False, ray_python: str | None = None) -> list[Row]:
    """Run every measurement; returns the rows (progress goes to stderr)."""
    token = default_token()
    node = NodeProcess(token)
    try:
        raw, port = _start_raw_server()
    except BaseException:
        node.stop()
        raise
    try:
        rows = asyncio.run(_atoll_rows(node.address, token, quick))
        rows += _bridge_rows(node.address, token, quick)
        rows += asyncio.run(_raw_rows(port, quick))
    finally:
        node.stop()
        raw.terminate()
        raw.wait(10)
        if raw.stdout is not None:
            raw.stdout.close()
    rows += _ray_rows(quick, ray_python)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atoll bench transport", description=__doc__)
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke test)")
    parser.add_argument("--ray-python", help="a Python that can `import ray`")
    parser.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.raw_server:
        asyncio.run(_raw_server())
        return 0
    os.environ.setdefault("ATOLL_TOKEN", default_token().hex())
    rows = run(args.quick, args.ray_python)
    print("\n".join(r.as_json() for r in rows) if args.json else _table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
