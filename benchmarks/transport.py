"""The transport benchmark: atoll over Cap'n Proto between two processes.

Measured on loopback, against baselines run in the same invocation:

* ``pycapnp-raw``: a bare pycapnp server in its own process (one trivial
  method, and a byte buffer read in 1 MiB chunks, 4 in flight): the floor
  under atoll's own layers;
* ``atoll-lane``: the one-way links that runs take between processes
  (``transports/oneway.py``, with the run lanes' codec): a call and its
  answer as two messages, echoed by an actor in the node's process;
* ``ray``: the peer script ``shared/peers/bench_ray.py`` (W1 op-by-op and W5
  64 MiB hand-off), when a Python with Ray is available (``--ray-python``).

Cases (``--json`` prints one object per line: bench, case, system, value,
unit): ``latency_small`` (us, median), ``latency_small_p99`` (us),
``calls_per_s_inflight``, ``chain10_pipelined`` and ``chain10_awaited`` (ms),
``bulk_1MiB``, ``bulk_16MiB``, ``bulk_64MiB`` (MB/s, client to node).

Run it as ``atoll bench transport [--json] [--quick]``,
``python benchmarks/transport.py`` or ``python -m atoll.benchmarks.transport``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from atoll.benchmarks._common import (
    Column,
    Row,
    emit,
    median_time,
    p99,
    system_column,
    table,
    timings,
    unit_column,
)
from atoll.benchmarks.peers_ray import PeerFigure, ray_figures
from atoll.devices import _runlane as lanes
from atoll.kernel import Actor, ActorSystem, endpoint
from atoll.transports import oneway
from atoll.transports.capnp import CapnpTransport, capnp_runtime, default_token
from atoll.transports.capnp._schema import schema
from atoll.transports.testing import READY_PREFIX, NodeProcess

__all__ = ["format_table", "main", "run"]

CONF = "atoll.transports.conformance"
MB = 1e6
BULK_MIB = (1, 16, 64)

Job = Callable[[], Awaitable[Any]]


def _row(case: str, system: str, value: float, unit: str) -> Row:
    return Row("transport", case, system, round(value, 3), unit)


def _progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def _latency_rows(system: str, samples: list[float]) -> list[Row]:
    return [
        _row("latency_small", system, statistics.median(samples) * 1e6, "us"),
        _row("latency_small_p99", system, p99(samples) * 1e6, "us"),
    ]


async def _call_rows(system: str, call: Job, calls: int) -> list[Row]:
    """Small calls: latency one at a time, then the rate with ``2 * calls`` in flight."""
    rows = _latency_rows(system, await timings(call, calls))
    took = await median_time(lambda: asyncio.gather(*(call() for _ in range(calls * 2))))
    rows.append(_row("calls_per_s_inflight", system, calls * 2 / took, "1/s"))
    return rows


async def _bulk_rows(system: str, transfer: Callable[[int], Job], reps: int) -> list[Row]:
    """MB/s of ``transfer(mib)``, which moves ``mib`` MiB, for each size."""
    rows = []
    for mib in BULK_MIB:
        _progress(f"{system}: bulk {mib} MiB")
        took = await median_time(transfer(mib), reps)
        rows.append(_row(f"bulk_{mib}MiB", system, (mib << 20) / MB / took, "MB/s"))
    return rows


# -- atoll, from asyncio and from trio ------------------------------------------------
async def _atoll_rows(address: str, token: bytes, quick: bool) -> list[Row]:
    calls, reps = (300, 5) if quick else (2000, 20)
    transport = CapnpTransport(token)
    async with capnp_runtime(), ActorSystem("bench") as system:
        connection = await transport.connect(address, system)
        try:
            node = connection.node
            echo = await node.spawn(f"{CONF}:Echo")
            _progress("atoll: small-call latency, calls in flight")
            for _ in range(100):
                await echo.echo(1.0)
            rows = await _call_rows("atoll", lambda: echo.echo(1.0), calls)
            rows += await _chain_rows(node, reps)
            rows += await _bulk_rows("atoll", functools.partial(_send, echo), 3 if quick else 7)
            rows += await _lane_rows(node, token, calls)
        finally:
            await connection.aclose()
    return rows


class LaneEcho(Actor):
    """Answers every message on its lane with its arguments (in the node's process)."""

    def __init__(self, token: bytes) -> None:
        self.token = token
        self.where = ""

    async def on_start(self) -> None:
        self.where = await oneway.serve("echo", "127.0.0.1", self.token, _echo, lambda _: None)

    @endpoint
    def address(self) -> str:
        return self.where


def _echo(link: oneway.Link, messages: list[bytes]) -> None:
    for data in messages:
        request, _, _, body = lanes.parse(data)
        args, _ = lanes.loads(body, {})
        link.send(lanes.dumps((None, args), None, request))


async def _lane_rows(node: Any, token: bytes, calls: int) -> list[Row]:
    """A small call and its answer over a lane, as the call lanes send them."""
    echo = await node.spawn(f"{__name__}:LaneEcho", token)
    waiting: dict[int, asyncio.Future[Any]] = {}

    def answers(link: oneway.Link, messages: list[bytes]) -> None:
        for data in messages:
            request, _, _, body = lanes.parse(data)
            waiting.pop(request).set_result(lanes.loads(body, {})[1])

    link = await oneway.connect(await echo.address(), token, answers, lambda _: None)
    numbers = iter(range(1, 1 << 62))

    async def call() -> Any:
        request = next(numbers)
        waiting[request] = asyncio.get_running_loop().create_future()
        link.send(lanes.dumps(((1.0,), None), None, request, lanes.RUN_CALL, 0))
        return await waiting[request]

    try:
        _progress("atoll-lane: small-call latency, calls in flight")
        for _ in range(100):
            await call()
        return await _call_rows("atoll-lane", call, calls)
    finally:
        link.close()


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
        _row("chain10_pipelined", "atoll", await median_time(pipelined, reps) * 1e3, "ms"),
        _row("chain10_awaited", "atoll", await median_time(awaited, reps) * 1e3, "ms"),
    ]


def _send(echo: Any, mib: int) -> Job:
    """A job that sends ``mib`` MiB of float32 to the echo actor, which describes it."""
    array = np.random.default_rng(mib).standard_normal(mib << 18).astype(np.float32)

    async def send() -> None:
        shape, _, _ = await echo.describe(array)
        assert tuple(shape) == array.shape

    return send


def _bridge_rows(address: str, token: bytes, quick: bool) -> list[Row]:
    """Small-call latency from a trio app, through the asyncio bridge thread."""
    import trio

    from atoll.transports.capnp.bridge import CapnpBridge

    calls = 300 if quick else 2000

    async def measure() -> list[float]:
        async with CapnpBridge.connect(address, token) as node:
            echo = await node.spawn(f"{CONF}:Echo")
            for _ in range(50):
                await echo.echo(1.0)
            return await timings(lambda: echo.echo(1.0), calls)  # no loop-specific waits

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
            _progress("pycapnp-raw: latency, calls in flight")
            call = functools.partial(buffer.read, offset=0, length=8)
            rows = await _call_rows("pycapnp-raw", call, 300 if quick else 2000)
            rows += await _bulk_rows(
                "pycapnp-raw", functools.partial(_pull, buffer), 3 if quick else 7
            )
        finally:
            del buffer  # capnp objects must go before the loop does
            client.close()
    return rows


def _pull(buffer: Any, mib: int) -> Job:
    """A job that reads ``mib`` MiB from the raw server, 1 MiB a call, 4 calls in flight."""

    async def pull() -> None:
        window = asyncio.Semaphore(4)

        async def one(offset: int) -> None:
            async with window:
                await buffer.read(offset=offset, length=1 << 20)

        await asyncio.gather(*(one(o) for o in range(0, mib << 20, 1 << 20)))

    return pull


def _start_raw_server() -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [sys.executable, "-m", "atoll.benchmarks.transport", "--raw-server"],
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
RAY = [
    PeerFigure("latency_small", "W1", "actor op-by-op scalar", "latency", "us", scale=1e3),
    PeerFigure("bulk_64MiB", "W5", "64MiB A->B by ref", "hand-off MiB/s", "MB/s", scale=2**20 / MB),
]


# -- table and entry point ---------------------------------------------------------
def _ratio(other: str, mine_: str = "atoll") -> Column:
    """``mine_``'s value over ``other``'s, for the cases both measured."""

    def cell(group: Mapping[str, Row]) -> str:
        mine, theirs = group.get(mine_), group.get(other)
        if mine is None or theirs is None or mine.value is None or not theirs.value:
            return "-"
        return f"{mine.value / theirs.value:.2f}x"

    short = mine_.removeprefix("atoll-")
    return Column(f"{short}/{other.removeprefix('pycapnp-')}", 10, cell)


SYSTEMS = ["atoll", "atoll-lane", "atoll-trio-bridge", "pycapnp-raw", "ray"]
COLUMNS = [
    *(system_column(system, 17) for system in SYSTEMS),
    unit_column(7),
    _ratio("pycapnp-raw"),
    _ratio("pycapnp-raw", "atoll-lane"),
    _ratio("ray"),
]


def format_table(rows: Sequence[Row]) -> str:
    """One line per case: each system's value, the unit, and atoll's ratios to the floors."""
    return table(rows, COLUMNS, case_width=22)


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
    return rows + ray_figures("transport", RAY, quick, ray_python)


def main(argv: Sequence[str] | None = None) -> int:
    """``atoll bench transport [--json] [--quick] [--ray-python PY]``: run and print."""
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
    emit(run(args.quick, args.ray_python), args.json, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
