"""Fault injection over real processes: ``atoll bench faults [--json] [--seconds N]``.

A controller (``atoll up``), ``--hosts`` host processes (one simulated
device each) and ``--clients`` client processes that run programs
continuously, each with a known expected result (a chain of ``affine`` steps
over devices on randomly chosen hosts, now and then on a 2 MiB array, which
takes the data plane). Meanwhile faults are injected in a seeded random
order at random times:

- ``kill9``: ``kill -9`` of a host, in the middle of the clients' programs;
- ``freeze``: SIGSTOP of a host, held past the controller's heartbeat bound,
  then SIGCONT (the controller has given the host up by then, so it leaves);
- ``cut``: the TCP links of the clients that reach the controller through a
  proxy are cut (the client reconnects);
- ``client``: a client killed with ``kill -9`` mid-program (a fresh one takes
  its place).

Every program must settle within ``--bound`` seconds (else: a hang). A
program either gives the expected value or fails with ``HostLost``,
``ActorStopped`` or a boxed remote error (never a wrong value), and it may
fail only if one of its hosts was lost or its client's link was cut
("independent" results must be right). When every client has closed, every
surviving host store must be empty; when the cluster has stopped, no process
of it may be left, and no shared-memory segment of its processes.

The CI version is ``tests/test_faults.py`` (a short run of this module).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from ..devices import Computation
from ..examples.demo import affine
from ..kernel import ActorStopped, HostLost, RemoteActorError
from ..runtime.connect import connect
from ..transports.capnp import ClusterFile, peer_of

__all__ = ["FAULT_KINDS", "Report", "main", "run_faults"]

FAULT_KINDS = ("kill9", "freeze", "cut", "client")
HEARTBEAT = (0.5, 2.0)  # the controller's host heartbeat in these runs: lost within 2.5 s
STEP = Computation("affine", affine, flops=2e10)  # 20 ms on a simulated device
BIG = (2 << 20) // 4  # float32 elements of a 2 MiB array: beyond the inline limit
DEPENDENT = (HostLost, ActorStopped, RemoteActorError)


@dataclass
class Report:
    """What a run found; the invariants hold when the last five are 0."""

    seconds: float
    seed: int
    faults: dict[str, int] = field(default_factory=dict)
    survived: int = 0  # faults followed by a correct result before the next one
    promises: int = 0  # programs checked (each settles one promise chain)
    correct: int = 0
    failed_dependent: int = 0  # failed with an allowed error, on a lost host or a cut link
    hangs: int = 0
    wrong: int = 0
    failed_independent: int = 0  # failed although none of its hosts was lost
    bytes_leaked: int = 0  # surviving stores' bytes after every client left, plus shm
    orphans: int = 0  # processes of the cluster still alive after it stopped

    def ok(self) -> bool:
        return not (
            self.hangs or self.wrong or self.failed_independent or self.bytes_leaked or self.orphans
        )


# -- the client process ---------------------------------------------------------------------
def expected(start: float, steps: int, size: int) -> np.ndarray:
    """What a chain of ``steps`` affine steps makes of ``np.full(size, start)``."""
    x = np.full(size, start, dtype=np.float32)
    for _ in range(steps):
        x = affine(x)
    return x


def _link_closed(client: Any) -> bool:
    """Whether this client's link to the controller is gone."""
    peer = peer_of(client.node)
    return peer is not None and peer.closed is not None


async def _usage(cluster: Any, timeout: float) -> dict[int, dict[str, int]]:
    """Each host's store usage, for the hosts that answer within ``timeout``
    (a lost host fails at once; a frozen one, not yet given up, times out)."""
    usage: dict[int, dict[str, int]] = {}

    async def ask(host_id: int, host: Any) -> None:
        with contextlib.suppress(*DEPENDENT, TimeoutError):
            with anyio.fail_after(timeout):
                usage[host_id] = await host.store_usage()

    async with anyio.create_task_group() as tg:
        for host_id, host in enumerate(cluster.host_refs):
            tg.start_soon(ask, host_id, host)
    return usage


async def _alive_hosts(cluster: Any) -> set[int]:
    return set(await _usage(cluster, 2.0))


async def _one_program(client: Any, cluster: Any, rng: random.Random, bound: float) -> str:
    """Run one chain on live hosts; its outcome: correct, dependent, independent,
    wrong or hang (see the module docstring)."""
    before = await _alive_hosts(cluster)
    if _link_closed(client):
        return "relink"
    if not before:
        return "no_hosts"
    hosts = [rng.choice(sorted(before)) for _ in range(rng.randint(1, 4))]
    size = BIG if rng.random() < 0.2 else 16
    start = float(rng.randint(0, 1000))
    handle = cluster.put(np.full(size, start, dtype=np.float32), hosts[0])
    for host in hosts:
        handle = cluster.run(STEP, host, [handle])
    try:
        with anyio.fail_after(bound):
            value = await cluster.fetch(handle)
    except TimeoutError:
        return "hang"
    except DEPENDENT:
        if _link_closed(client):
            return "dependent"  # this client's own link went
        after = await _alive_hosts(cluster)
        return "independent" if set(hosts) <= after else "dependent"
    ok = np.array_equal(value, expected(start, len(hosts), size))
    with contextlib.suppress(*DEPENDENT, TimeoutError):
        with anyio.fail_after(bound):
            await cluster.free(handle)
    return "correct" if ok else "wrong"


async def client_loop(
    cluster_file: str, seconds: float, seed: int, bound: float, correct_at: list[float]
) -> Counter[str]:
    """Run programs for ``seconds``, reconnecting when the link goes; the
    wall-clock time of each correct result goes to ``correct_at``."""
    rng, outcomes = random.Random(seed), Counter[str]()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            async with connect(cluster_file) as client:
                cluster = await client.cluster(f"faults{seed}")
                while time.monotonic() < end and not _link_closed(client):
                    outcome = await _one_program(client, cluster, rng, bound)
                    if outcome == "no_hosts":
                        return outcomes
                    if outcome != "relink":
                        outcomes[outcome] += 1
                    if outcome == "correct":
                        correct_at.append(time.time())
            outcomes["reconnects"] += 1
        except (*DEPENDENT, TimeoutError, OSError) as exc:
            outcomes["reconnects"] += 1
            print(f"client {seed}: reconnecting after {exc!r}", file=sys.stderr, flush=True)
            await anyio.sleep(0.2)
    return outcomes


def _client_main(args: argparse.Namespace) -> int:
    correct_at: list[float] = []

    async def body() -> Counter[str]:
        from ..transports.capnp import capnp_runtime

        async with capnp_runtime():
            return await client_loop(
                args.cluster_file, args.seconds, args.seed, args.bound, correct_at
            )

    outcomes = asyncio.run(body())
    print("OUTCOMES " + json.dumps(dict(outcomes)), flush=True)
    print("CORRECT_AT " + json.dumps(correct_at), flush=True)
    return 0


# -- a TCP proxy whose links can be cut -------------------------------------------------
class Proxy:
    """Forwards TCP connections to ``target``; :meth:`cut` drops every live one."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self.writers |= {writer, up_writer}
        await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        self.writers -= {writer, up_writer}

    def cut(self) -> int:
        """Drop every link (an RST, as a cable pulled); returns how many."""
        cut = len(self.writers) // 2
        for writer in list(self.writers):
            writer.transport.abort()
        self.writers.clear()
        return cut

    async def aclose(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    writer.transport.abort()


# -- the cluster -----------------------------------------------------------------------------
def _spawn(args: Sequence[str], env: dict[str, str], **popen: Any) -> subprocess.Popen[str]:
    """``python -m ARGS`` as a child (posix_spawn: no fork of this process)."""
    command = [sys.executable, "-m", *args]
    return subprocess.Popen(command, env=env, close_fds=False, text=True, **popen)


@dataclass
class Cluster:
    """An ``atoll up`` cluster, its host pids, and its files."""

    up: subprocess.Popen[str]
    cluster_file: Path
    proxied_file: Path
    host_pids: list[int]
    env: dict[str, str]


@contextlib.asynccontextmanager
async def up_cluster(hosts: int, workdir: Path, token: str) -> AsyncIterator[Cluster]:
    """``atoll up --hosts HOSTS`` with a fast host heartbeat; stopped on the way out."""
    env = dict(os.environ, ATOLL_TOKEN=token, ATOLL_HOST_HEARTBEAT="{},{}".format(*HEARTBEAT))
    cluster_file = workdir / "cluster.json"
    args = ["up", "--hosts", str(hosts), "--devices-per-host", "1"]
    up = _spawn(
        ["atoll.cli", *args, "--cluster-file", str(cluster_file)], env, stdout=subprocess.PIPE
    )
    try:
        await anyio.to_thread.run_sync(_wait_for, up, "cluster up")
        async with connect(cluster_file) as client:
            rows = await client.status()
        pids = [row["pid"] for row in rows if row["kind"] == "host"]
        yield Cluster(up, cluster_file, workdir / "proxied.json", pids, env)
    finally:
        for pid in _stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        up.send_signal(signal.SIGTERM)
        await anyio.to_thread.run_sync(_wait_exit, up, 60.0)


_stopped: set[int] = set()  # hosts frozen now: woken before the cluster stops


def _wait_for(process: subprocess.Popen[str], text: str) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        if text in line:
            return
    raise RuntimeError(f"atoll up ended before printing {text!r}")


def _wait_exit(process: subprocess.Popen[Any], timeout: float) -> None:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _segments_of(pids: set[int]) -> int:
    """Bytes in ``/dev/shm`` segments made by any of ``pids``."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/dev/shm"):
            parts = entry.name.split("-")
            ours = parts[0] == "atoll" and len(parts) > 1 and parts[1].isdigit()
            if ours and int(parts[1]) in pids:
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat().st_size
    return total


# -- the run -----------------------------------------------------------------------------
class _Run:
    """One run: the clients, the proxy, the faults and the tally."""

    def __init__(self, cluster: Cluster, report: Report, bound: float) -> None:
        self.cluster = cluster
        self.report = report
        self.bound = bound
        self.clients: list[subprocess.Popen[str]] = []
        self.proxied: dict[int, bool] = {}
        self.pids: set[int] = {cluster.up.pid, *cluster.host_pids}
        self.lost: set[int] = set()
        self.outcomes: Counter[str] = Counter()
        self.correct_at: list[float] = []  # wall-clock times of correct results
        self.fault_at: list[float] = []  # ... and of the faults injected
        self.seeds = iter(range(report.seed * 1000, report.seed * 1000 + 1000))

    def start_client(self, proxied: bool, seconds: float) -> None:
        """A client process; ``proxied``: it reaches the controller through the proxy."""
        where = self.cluster.proxied_file if proxied else self.cluster.cluster_file
        args = ["atoll.benchmarks.faults", "--client", "--cluster-file", str(where)]
        args += ["--seconds", f"{seconds:.1f}", "--seed", str(next(self.seeds))]
        args += ["--bound", str(self.bound)]
        client = _spawn(args, self.cluster.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.clients.append(client)
        self.proxied[client.pid] = proxied
        self.pids.add(client.pid)

    def collect(self, client: subprocess.Popen[str]) -> None:
        out, _ = client.communicate(timeout=self.bound * 4)
        for line in out.splitlines():
            if line.startswith("OUTCOMES "):
                self.outcomes.update(json.loads(line.removeprefix("OUTCOMES ")))
            elif line.startswith("CORRECT_AT "):
                self.correct_at += json.loads(line.removeprefix("CORRECT_AT "))

    def live_hosts(self) -> list[int]:
        return [i for i, _ in enumerate(self.cluster.host_pids) if i not in self.lost]

    async def inject(self, kind: str, rng: random.Random, proxy: Proxy, end: float) -> bool:
        """One fault of ``kind``; False when it cannot be had now (no host to spare)."""
        hosts = self.live_hosts()
        if kind in ("kill9", "freeze"):
            if len(hosts) < 2:
                return False  # keep one host for the programs that must still succeed
            host = rng.choice(hosts)
            pid = self.cluster.host_pids[host]
            self.lost.add(host)
            if kind == "kill9":
                os.kill(pid, signal.SIGKILL)
                return True
            os.kill(pid, signal.SIGSTOP)
            _stopped.add(pid)
            await anyio.sleep(sum(HEARTBEAT) + 1.5)  # past the heartbeat bound
            os.kill(pid, signal.SIGCONT)
            _stopped.discard(pid)
            return True
        if kind == "cut":
            return proxy.cut() > 0
        victims = [c for c in self.clients if c.poll() is None]
        if not victims:
            return False
        victim = rng.choice(victims)
        victim.kill()
        victim.wait(10)
        self.clients.remove(victim)
        _close(victim)
        left = max(1.0, end - time.monotonic())
        self.start_client(self.proxied[victim.pid], left)  # its place, on the same path
        return True


def _close(process: subprocess.Popen[str]) -> None:
    if process.stdout is not None:
        process.stdout.close()


async def run_faults(
    seconds: float = 60.0,
    seed: int = 0,
    hosts: int = 4,
    clients: int = 2,
    bound: float = 30.0,
    kinds: Sequence[str] = FAULT_KINDS,
    epoch_s: float = 90.0,
) -> Report:
    """The fault-injection suite for ``seconds``; see the module docstring.

    Lost hosts do not come back, so a long run is a series of epochs of
    about ``epoch_s`` seconds, each on a fresh cluster, each checked in full.
    """
    from ..transports.capnp import capnp_runtime

    rng, total = random.Random(seed), Report(seconds, seed)
    epochs = max(1, round(seconds / epoch_s))
    async with capnp_runtime():
        for _ in range(epochs):
            report = await _epoch(seconds / epochs, rng, hosts, clients, bound, kinds)
            _add(total, report)
    return total


async def _epoch(
    seconds: float,
    rng: random.Random,
    hosts: int,
    clients: int,
    bound: float,
    kinds: Sequence[str],
) -> Report:
    """One cluster, one schedule of faults, every invariant checked."""
    report = Report(seconds, rng.randrange(1 << 30))
    schedule = _schedule(rng, seconds, kinds)
    with tempfile.TemporaryDirectory(prefix="atoll-faults-") as tmp:
        async with up_cluster(hosts, Path(tmp), os.urandom(16).hex()) as cluster:
            run = _Run(cluster, report, bound)
            await _drive(run, rng, schedule, seconds, clients)
            report.bytes_leaked += await _store_bytes(cluster, run.lost)
        await anyio.to_thread.run_sync(_settle_processes, run.pids)
    _tally(run, report)
    report.orphans = sum(_alive(pid) for pid in run.pids)
    report.bytes_leaked += _segments_of(run.pids)
    return report


def _add(total: Report, report: Report) -> None:
    """Sum ``report`` into ``total`` (its counts, and its faults per kind)."""
    for kind, count in report.faults.items():
        total.faults[kind] = total.faults.get(kind, 0) + count
    for name in list(asdict(report))[3:]:
        setattr(total, name, getattr(total, name) + getattr(report, name))


def _schedule(rng: random.Random, seconds: float, kinds: Sequence[str]) -> list[tuple[float, str]]:
    """Faults at random times in the middle of the run, in a random order:
    each kind once, then more picked at random while time allows."""
    order = list(kinds)
    rng.shuffle(order)
    order += [rng.choice(kinds) for _ in range(max(0, int(seconds // 12) - len(order)))]
    times = sorted(rng.uniform(0.15, 0.8) * seconds for _ in order)
    return list(zip(times, order, strict=True))


async def _drive(
    run: _Run, rng: random.Random, schedule: list[tuple[float, str]], seconds: float, clients: int
) -> None:
    """Start the clients, inject the faults on time, wait for the clients."""
    address = ClusterFile.read(run.cluster.cluster_file).address
    host, _, port = address.removeprefix("capnp://").rpartition(":")
    proxy = Proxy((host, int(port)))
    await proxy.start()
    token = ClusterFile.read(run.cluster.cluster_file).token
    ClusterFile(f"capnp://127.0.0.1:{proxy.port}", token).write(run.cluster.proxied_file)
    began = time.monotonic()
    end = began + seconds
    for i in range(clients):
        run.start_client(proxied=i % 2 == 0, seconds=seconds)
    try:
        for at, kind in schedule:
            await anyio.sleep(max(0.0, began + at - time.monotonic()))
            if await run.inject(kind, rng, proxy, end):
                run.report.faults[kind] = run.report.faults.get(kind, 0) + 1
                run.fault_at.append(time.time())
        for client in list(run.clients):
            await anyio.to_thread.run_sync(run.collect, client)
    finally:
        await proxy.aclose()
        for client in run.clients:
            if client.poll() is None:
                client.kill()
            _close(client)


async def _store_bytes(cluster: Cluster, lost: set[int]) -> int:
    """Bytes still held by the stores of surviving hosts (every client has left)."""
    async with connect(cluster.cluster_file) as client:
        handle = await client.cluster("faults-check")
        for _ in range(50):  # sessions end as their links close: give them a moment
            usage = await _usage(handle, 5.0)
            held = sum(int(u["bytes"]) for host, u in usage.items() if host not in lost)
            if held == 0:
                return 0
            await anyio.sleep(0.1)
    return held


def _settle_processes(pids: set[int]) -> None:
    """Give the cluster's processes a few seconds to exit (no reaping here)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)


def _tally(run: _Run, report: Report) -> None:
    outcomes = run.outcomes
    report.correct = outcomes["correct"]
    report.failed_dependent = outcomes["dependent"]
    report.hangs = outcomes["hang"]
    report.wrong = outcomes["wrong"]
    report.failed_independent = outcomes["independent"]
    report.promises = sum(outcomes[k] for k in ("correct", "dependent", "hang", "wrong"))
    report.promises += outcomes["independent"]
    report.survived = _survived(run.fault_at, run.correct_at)


def _survived(fault_at: list[float], correct_at: list[float]) -> int:
    """Faults followed by a correct result before the next fault (or the end)."""
    ends = [*fault_at[1:], float("inf")] if fault_at else []
    return sum(
        any(start < t <= end for t in correct_at) for start, end in zip(fault_at, ends, strict=True)
    )


# -- the command line ---------------------------------------------------------------------------
def _table(report: Report) -> str:
    rows = [("faults injected", sum(report.faults.values()))]
    rows += [(f"  {kind}", report.faults.get(kind, 0)) for kind in FAULT_KINDS]
    rows += [(name, getattr(report, name)) for name in list(asdict(report))[3:]]
    width = max(len(name) for name, _ in rows)
    lines = [f"atoll bench faults: {report.seconds:.0f} s, seed {report.seed}"]
    lines += [f"{name:<{width}}  {value:>8}" for name, value in rows]
    lines.append("invariants hold" if report.ok() else "INVARIANTS BROKEN")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atoll bench faults", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="how long to inject faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--bound", type=float, default=30.0, help="a program settles within this")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cluster-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        return _client_main(args)
    report = asyncio.run(run_faults(args.seconds, args.seed, args.hosts, args.clients, args.bound))
    print(json.dumps(asdict(report)) if args.json else _table(report))
    return 0 if report.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
