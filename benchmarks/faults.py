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
  its place);
- ``bulk_cut``: a bulk transfer between processes cut in the middle. Hosts
  see each other as different machines (``ATOLL_MACHINE_ID=per-process``),
  so a 2 MiB array moves between them (and from a client to a host) by the
  bulk stream, which they reach through a relay here
  (``ATOLL_BULK_RELAY``); the relay aborts the next transfer after 1 MiB;
- ``store_full``: a client puts 2 MiB buffers on one host until its store
  (``atoll up --store-bytes``) refuses one with ``StoreFull``, holds them
  a few seconds while the programs go on, then closes: what it held must be
  freed. A program may fail with ``StoreFull`` only while a store is full
  (and ``ATOLL_STORE_WAIT_S`` after);
- ``rejoin``: ``atoll host --join`` of a new host process in the place of a
  lost one (one is killed first if none is lost); it survives only when a
  later program that ran on that host was right.

Every program must settle within ``--bound`` seconds (else: a hang). A
program either gives the expected value or fails with ``HostLost``,
``ActorStopped``, a boxed remote error or (while a store is full)
``StoreFull``, never a wrong value nor another error, and it may fail only
if one of its hosts was lost, its client's link was cut or a store was full
("independent" results must be right). When every client has closed, every
surviving host store must be empty; when the cluster has stopped, no process
of it may be left, and no shared-memory segment of its processes. Each
failure that breaks one of these is printed on stderr, with its error.

The CI version is ``tests/processes/test_faults.py`` (a short run of this module).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from ..devices import Computation, StoreFull
from ..examples.demo import affine
from ..kernel import ActorStopped, AtollError, HostLost, RemoteActorError
from ..runtime.client.connect import connect
from ..transports.capnp import ClusterFile, peer_of
from ..transports.testing import pid_alive
from ._testbed import (
    HEARTBEAT,
    STORE_WAIT_S,
    Proxy,
    Relay,
    Testbed,
    rejoin_host,
    spawn_module,
    stopped_hosts,
    until_lost,
    up_cluster,
    wait_exit,
)

__all__ = ["FAULT_KINDS", "Report", "main", "run_faults"]

FAULT_KINDS = ("kill9", "freeze", "cut", "client", "bulk_cut", "store_full", "rejoin")
STEP = Computation("affine", affine, flops=2e10)  # 20 ms on a simulated device
BIG = (2 << 20) // 4  # float32 elements of a 2 MiB array: beyond the inline limit
DEPENDENT = (HostLost, ActorStopped, RemoteActorError)
STORE_BYTES = 64 << 20  # each host's store: far above what the programs hold at once
FILL_CHUNK = 2 << 20  # what the filler puts at a time (bytes)
FILL_HOLD_S = 4.0  # how long the filler keeps a store full
GAP_S = 2.0  # at least this long between faults: a fault's survival is judged in between


@dataclass
class Report:
    """What a run found; the invariants hold when the last six are 0."""

    seconds: float
    seed: int
    faults: dict[str, int] = field(default_factory=dict)
    survived_by_kind: dict[str, int] = field(default_factory=dict)
    survived: int = 0  # faults followed by a correct result before the next one
    promises: int = 0  # programs checked (each settles one promise chain)
    correct: int = 0
    failed_dependent: int = 0  # failed with an allowed error: a lost host, a cut link, ...
    failed_store_full: int = 0  # ... of those, StoreFull while a store was full
    failed_other_error: int = 0  # failed depending on a fault, with an error not allowed
    hangs: int = 0
    wrong: int = 0
    failed_independent: int = 0  # failed although independent (any error), or a client crashed
    bytes_leaked: int = 0  # surviving stores' bytes after every client left, plus shm
    orphans: int = 0  # processes of the cluster still alive after it stopped

    def ok(self) -> bool:
        broken = (self.failed_other_error, self.hangs, self.wrong, self.failed_independent)
        return not (any(broken) or self.bytes_leaked or self.orphans)


_NOT_COUNTS = ("seconds", "seed", "faults", "survived_by_kind")
_COUNTS = [name for name in Report.__dataclass_fields__ if name not in _NOT_COUNTS]  # in order


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


def _store_full(error: BaseException) -> bool:
    """Whether ``error`` is ``StoreFull``: as itself, or boxed (a device's
    endpoint that raised it answers with a ``RemoteActorError``)."""
    if isinstance(error, RemoteActorError):
        return error.exc_type == f"{StoreFull.__module__}.{StoreFull.__qualname__}"
    return isinstance(error, StoreFull)


async def _alive_hosts(cluster: Any) -> set[int]:
    return set(await _usage(cluster, 2.0))


@dataclass
class _Tally:
    """What a client process saw: outcomes, and when its programs settled."""

    outcomes: Counter[str] = field(default_factory=Counter)
    correct_at: list[float] = field(default_factory=list)  # wall-clock times of right results
    correct_hosts: list[list[int]] = field(default_factory=list)  # ... and the hosts they used
    store_full_at: list[float] = field(default_factory=list)  # times of StoreFull failures
    failures: list[tuple[float, str, str]] = field(default_factory=list)  # time, outcome, why

    def lines(self) -> list[str]:
        """The tally as the lines the suite reads from the client's output."""
        return [
            "OUTCOMES " + json.dumps(dict(self.outcomes)),
            "CORRECT_AT " + json.dumps(self.correct_at),
            "CORRECT_HOSTS " + json.dumps(self.correct_hosts),
            "STORE_FULL_AT " + json.dumps(self.store_full_at),
            "FAILURES " + json.dumps(self.failures),
        ]


async def _one_program(
    client: Any, cluster: Any, rng: random.Random, bound: float
) -> tuple[str, list[int], str]:
    """Run one chain on live hosts; its outcome (correct, dependent,
    independent, store_full, unexpected, wrong or hang; see the module
    docstring), the hosts it ran on, and what went wrong, if anything.
    Every buffer of the chain is freed afterwards."""
    before = await _alive_hosts(cluster)
    if _link_closed(client):
        return "relink", [], ""
    if not before:
        return "no_hosts", [], ""
    hosts = [rng.choice(sorted(before)) for _ in range(rng.randint(1, 4))]
    size = BIG if rng.random() < 0.2 else 16
    start = float(rng.randint(0, 1000))
    chain = [cluster.put(np.full(size, start, dtype=np.float32), hosts[0])]
    for host in hosts:
        chain.append(cluster.run(STEP, host, [chain[-1]]))
    value, outcome, why = await _settle(client, cluster, chain[-1], hosts, bound)
    if value is not None:
        outcome = "correct" if np.array_equal(value, expected(start, len(hosts), size)) else "wrong"
    for handle in chain:
        with contextlib.suppress(AtollError, TimeoutError):  # a failed one holds nothing
            with anyio.fail_after(bound):
                await cluster.free(handle)
    return outcome, hosts, f"{why} (hosts {hosts}, {size * 4} bytes)"


async def _settle(
    client: Any, cluster: Any, last: Any, hosts: list[int], bound: float
) -> tuple[np.ndarray | None, str, str]:
    """The value of the chain ending in ``last``, or None, how it failed
    (hang, store_full, unexpected, or dependent / independent of a lost
    host) and the error."""
    try:
        with anyio.fail_after(bound):
            return await cluster.fetch(last), "", ""
    except TimeoutError:
        return None, "hang", ""
    except (StoreFull, *DEPENDENT) as exc:
        if _store_full(exc):
            return None, "store_full", repr(exc)[:300]  # the suite judges it (_while_full)
        if _link_closed(client):
            return None, "dependent", repr(exc)[:300]  # this client's own link went
        after = await _alive_hosts(cluster)
        return None, "independent" if set(hosts) <= after else "dependent", repr(exc)[:300]
    except Exception as exc:  # an error that no fault may cause, on a lost host or not
        lost = _link_closed(client) or not set(hosts) <= await _alive_hosts(cluster)
        return None, "other_error" if lost else "unexpected", repr(exc)[:300]


async def _fresh(client: Any, cluster: Any) -> Any:
    """The cluster handle again, in the same session: a host that rejoined
    has new references, which a handle taken before does not know."""
    info = await client.node.lookup("cluster").cluster()
    return info.client(client.system, cluster.owner)


async def client_loop(cluster_file: str, seconds: float, seed: int, bound: float) -> _Tally:
    """Run programs for ``seconds``, reconnecting when the link goes, and
    taking the cluster handle afresh once a second, so that a host that
    rejoined is used again."""
    rng, tally = random.Random(seed), _Tally()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            async with connect(cluster_file) as client:
                cluster = await client.cluster(f"faults{seed}")
                fresh_at = time.monotonic()
                while time.monotonic() < end and not _link_closed(client):
                    outcome, hosts, why = await _one_program(client, cluster, rng, bound)
                    if outcome == "no_hosts":
                        return tally
                    if outcome != "relink":
                        tally.outcomes[outcome] += 1
                    if outcome == "correct":
                        tally.correct_at.append(time.time())
                        tally.correct_hosts.append(sorted(set(hosts)))
                    elif outcome == "store_full":
                        tally.store_full_at.append(time.time())
                    if outcome not in ("correct", "relink"):
                        tally.failures.append((time.time(), outcome, why))
                    if time.monotonic() - fresh_at > 1.0:
                        cluster, fresh_at = await _fresh(client, cluster), time.monotonic()
            tally.outcomes["reconnects"] += 1
        except (*DEPENDENT, TimeoutError, OSError) as exc:
            tally.outcomes["reconnects"] += 1
            print(f"client {seed}: reconnecting after {exc!r}", file=sys.stderr, flush=True)
            await anyio.sleep(0.2)
    return tally


def _client_main(args: argparse.Namespace) -> int:
    # still here long after its programs' bounds: say where every thread waits
    faulthandler.dump_traceback_later(args.seconds + 2 * args.bound)

    async def body() -> _Tally:
        from ..transports.capnp import capnp_runtime

        async with capnp_runtime():
            return await client_loop(args.cluster_file, args.seconds, args.seed, args.bound)

    for line in asyncio.run(body()).lines():
        print(line, flush=True)
    return 0


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
    """One run: the clients, the proxy, the relay, the faults and the tally."""

    def __init__(self, cluster: Testbed, report: Report, bound: float, relay: Relay) -> None:
        self.cluster = cluster
        self.report = report
        self.bound = bound
        self.relay = relay
        self.clients: list[subprocess.Popen[str]] = []
        self.joiners: list[subprocess.Popen[str]] = []  # hosts started by rejoin
        self.proxied: dict[int, bool] = {}
        self.errors: dict[int, Path] = {}  # each client's stderr, by pid
        self.pids: set[int] = {cluster.up.pid, *cluster.host_pids}
        self.lost: set[int] = set()
        self.tally = _Tally()  # every client's, summed
        self.fault_at: list[float] = []  # wall-clock times of the faults injected
        self.fault_host: list[int | None] = []  # ... and the host a right result must use
        self.fault_kind: list[str] = []  # ... and their kinds
        self.needs: int | None = None  # that host, for the fault being injected
        self.full: list[tuple[float, float]] = []  # when a store was full (start, end)
        self.seeds = iter(range(report.seed * 1000, report.seed * 1000 + 1000))

    def start_client(self, proxied: bool, seconds: float) -> None:
        """A client process; ``proxied``: it reaches the controller through the proxy."""
        where = self.cluster.proxied_file if proxied else self.cluster.cluster_file
        args = ["atoll.benchmarks.faults", "--client", "--cluster-file", str(where)]
        args += ["--seconds", f"{seconds:.1f}", "--seed", str(next(self.seeds))]
        args += ["--bound", str(self.bound)]
        errors = self.cluster.cluster_file.parent / f"client-{len(self.clients)}.err"
        with errors.open("w") as stderr:  # the child keeps its own copy of the file
            client = spawn_module(args, self.cluster.env, stdout=subprocess.PIPE, stderr=stderr)
        self.errors[client.pid] = errors
        self.clients.append(client)
        self.proxied[client.pid] = proxied
        self.pids.add(client.pid)

    def collect(self, client: subprocess.Popen[str]) -> None:
        """Add a client's tally, once it ended; one that reported none crashed."""
        try:
            out, _ = client.communicate(timeout=self.bound * 4)
        except subprocess.TimeoutExpired:
            client.kill()
            client.communicate()
            tail = self.errors[client.pid].read_text(errors="replace")[-4000:]
            why = f"a fault client did not end in time; its stderr ends:\n{tail}"
            raise AtollError(why) from None
        tally = self.tally
        if "OUTCOMES " not in out:
            tally.outcomes["crashed"] += 1
        for line in out.splitlines():
            name, _, data = line.partition(" ")
            if name == "OUTCOMES":
                tally.outcomes.update(json.loads(data))
            elif name == "CORRECT_AT":
                tally.correct_at += json.loads(data)
            elif name == "CORRECT_HOSTS":
                tally.correct_hosts += json.loads(data)
            elif name == "STORE_FULL_AT":
                tally.store_full_at += json.loads(data)
            elif name == "FAILURES":
                tally.failures += [tuple(failure) for failure in json.loads(data)]

    def live_hosts(self) -> list[int]:
        return [i for i, _ in enumerate(self.cluster.host_pids) if i not in self.lost]

    async def inject(self, kind: str, rng: random.Random, proxy: Proxy, end: float) -> bool:
        """One fault of ``kind``; False when it cannot be had now (no host to
        spare, no bulk transfer to cut, a store that would not fill)."""
        self.needs = None
        if kind in ("kill9", "freeze"):
            return await self._lose_host(kind, rng)
        if kind == "cut":
            return proxy.cut() > 0
        if kind == "bulk_cut":
            return await self.relay.cut_next(timeout=15.0)
        if kind == "store_full":
            return await self._fill(rng)
        if kind == "rejoin":
            return await self._rejoin(rng)
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

    async def _lose_host(self, kind: str, rng: random.Random) -> bool:
        """``kill -9`` of a live host, or SIGSTOP past the heartbeat bound and SIGCONT."""
        hosts = self.live_hosts()
        if len(hosts) < 2:
            return False  # keep one host for the programs that must still succeed
        host = rng.choice(hosts)
        pid = self.cluster.host_pids[host]
        self.lost.add(host)
        if kind == "kill9":
            os.kill(pid, signal.SIGKILL)
            return True
        os.kill(pid, signal.SIGSTOP)
        stopped_hosts.add(pid)
        await anyio.sleep(sum(HEARTBEAT) + 1.5)  # past the heartbeat bound
        os.kill(pid, signal.SIGCONT)
        stopped_hosts.discard(pid)
        return True

    async def _rejoin(self, rng: random.Random) -> bool:
        """A new host process joins in the place of a lost host (one is
        killed first when none is lost); a right result must use it. A
        joiner that fails to join counts as a fault not survived."""
        if not self.lost and not await self._lose_host("kill9", rng):
            return False
        try:
            for host in sorted(self.lost):
                await until_lost(self.cluster, host)
            joiner, host = await rejoin_host(self.cluster)
        except (RuntimeError, TimeoutError) as exc:
            print(f"atoll bench faults: a host failed to rejoin: {exc}", file=sys.stderr)
            self.needs = -1  # no result runs there: not survived
            return True
        self.joiners.append(joiner)
        self.pids.add(joiner.pid)
        self.cluster.host_pids[host] = joiner.pid
        self.lost.discard(host)
        self.needs = host
        return True

    async def _fill(self, rng: random.Random) -> bool:
        """A client fills a live host's store until ``StoreFull``, holds it
        ``FILL_HOLD_S``, and closes; what it held must then be freed (else
        it counts as leaked)."""
        host = rng.choice(self.live_hosts())
        began = time.time()
        async with connect(self.cluster.cluster_file) as client:
            handle = await client.cluster("filler")
            held: list[Any] = []  # the filler's buffers, kept until it closes
            device = handle.topology.on_host(host)[0]
            full = await _fill_until_full(handle, device, self.bound, held)
            if full:
                await anyio.sleep(FILL_HOLD_S)  # the programs go on meanwhile
            owner = handle.owner
        self.full.append((began, time.time()))
        self.report.bytes_leaked += await _owner_bytes(self.cluster, host, owner)
        return full


async def _fill_until_full(cluster: Any, device: int, bound: float, held: list[Any]) -> bool:
    """Put ``FILL_CHUNK`` buffers on ``device`` until its store refuses one
    with ``StoreFull`` (True), or its host is lost, or it does not fill.
    Their handles go to ``held``: a buffer is freed when its client no longer
    holds it, so the caller keeps them while the store is to stay full."""
    chunk = np.zeros(FILL_CHUNK // 4, dtype=np.float32)
    try:
        for _ in range(2 * STORE_BYTES // FILL_CHUNK):
            with anyio.fail_after(STORE_WAIT_S + bound):
                held.append(await cluster.put(chunk, device))
    except (StoreFull, *DEPENDENT) as exc:
        return _store_full(exc)
    except TimeoutError:
        pass
    return False


async def _owner_bytes(cluster: Testbed, host: int, owner: str, timeout: float = 10.0) -> int:
    """Bytes ``owner`` still holds on ``host`` once its session has had
    ``timeout`` to end (0 as soon as it holds none; 0 if the host is gone)."""
    async with connect(cluster.cluster_file) as client:
        handle = await client.cluster("faults-check")
        ref = handle.host_refs[host]
        held = 0
        with contextlib.suppress(*DEPENDENT, TimeoutError):
            with anyio.fail_after(timeout):
                while held := int((await ref.owner_usage()).get(owner, {}).get("bytes", 0)):
                    await anyio.sleep(0.1)
        return held


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

    A long run is a series of epochs of about ``epoch_s`` seconds, each on a
    fresh cluster, each checked in full (hosts lost are not all replaced).
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
    relay = Relay()
    await relay.start()
    token = os.urandom(16).hex()
    with tempfile.TemporaryDirectory(prefix="atoll-faults-") as tmp:
        try:
            async with up_cluster(hosts, Path(tmp), token, relay.address, STORE_BYTES) as cluster:
                run = _Run(cluster, report, bound, relay)
                await _drive(run, rng, schedule, seconds, clients)
                report.bytes_leaked += await _store_bytes(cluster, run.lost)
            await anyio.to_thread.run_sync(_settle_processes, run.pids)
        finally:
            await relay.aclose()
    _tally(run, report)
    report.orphans = sum(pid_alive(pid) for pid in run.pids)
    report.bytes_leaked += _segments_of(run.pids)
    for joiner in run.joiners:  # reaped (after the count: one left running is an orphan)
        await anyio.to_thread.run_sync(wait_exit, joiner, 5.0)
    return report


def _add(total: Report, report: Report) -> None:
    """Sum ``report`` into ``total`` (its counts, and its faults per kind)."""
    for kind, count in report.faults.items():
        total.faults[kind] = total.faults.get(kind, 0) + count
    for kind, count in report.survived_by_kind.items():
        total.survived_by_kind[kind] = total.survived_by_kind.get(kind, 0) + count
    for name in _COUNTS:
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
        last = began
        for at, kind in schedule:
            await anyio.sleep(max(0.0, max(began + at, last + GAP_S) - time.monotonic()))
            if await run.inject(kind, rng, proxy, end):
                run.report.faults[kind] = run.report.faults.get(kind, 0) + 1
                run.fault_at.append(time.time())
                run.fault_host.append(run.needs)
                run.fault_kind.append(kind)
            last = time.monotonic()
        for client in list(run.clients):
            await anyio.to_thread.run_sync(run.collect, client)
    finally:
        await proxy.aclose()
        for client in run.clients:
            if client.poll() is None:
                client.kill()
            _close(client)


async def _store_bytes(cluster: Testbed, lost: set[int]) -> int:
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
    while time.monotonic() < deadline and any(pid_alive(pid) for pid in pids):
        time.sleep(0.1)


def _tally(run: _Run, report: Report) -> None:
    outcomes, tally = run.tally.outcomes, run.tally
    full = [_while_full(t, run.full) for t in tally.store_full_at]
    report.correct = outcomes["correct"]
    report.failed_store_full = sum(full)
    report.failed_dependent = outcomes["dependent"] + sum(full)
    report.failed_other_error = outcomes["other_error"]
    report.hangs = outcomes["hang"]
    report.wrong = outcomes["wrong"]
    report.failed_independent = outcomes["independent"] + full.count(False)
    report.failed_independent += outcomes["unexpected"] + outcomes["crashed"]
    report.promises = sum(outcomes[k] for k in ("correct", "dependent", "hang", "wrong"))
    report.promises += outcomes["independent"] + outcomes["store_full"] + outcomes["unexpected"]
    report.promises += outcomes["other_error"]
    each = _survived_each(run.fault_at, tally.correct_at, run.fault_host, tally.correct_hosts)
    report.survived = sum(each)
    for kind, survived in zip(run.fault_kind, each, strict=True):
        report.survived_by_kind[kind] = report.survived_by_kind.get(kind, 0) + survived
    _explain(run)


def _explain(run: _Run) -> None:
    """On stderr: every failure that breaks an invariant, what it raised,
    and the faults' times (wall clock), to tell what it followed."""
    allowed = ("dependent", "store_full")
    bad = [
        (at, outcome, why)
        for at, outcome, why in run.tally.failures
        if outcome not in allowed or (outcome == "store_full" and not _while_full(at, run.full))
    ]
    if not bad and not run.tally.outcomes["crashed"]:
        return
    faults = ", ".join(f"{k} {t:.1f}" for k, t in zip(run.fault_kind, run.fault_at, strict=True))
    full = ", ".join(f"{start:.1f}-{end:.1f}" for start, end in run.full)
    print(f"faults: {faults}; stores full: {full}", file=sys.stderr, flush=True)
    for at, outcome, why in bad:
        print(f"  {outcome} at {at:.1f}: {why}", file=sys.stderr, flush=True)


def _while_full(at: float, full: list[tuple[float, float]]) -> bool:
    """Whether a ``StoreFull`` at ``at`` came while a store was full (or
    within ``STORE_WAIT_S`` and a little after the filler let go)."""
    return any(start <= at <= end + STORE_WAIT_S + 2.0 for start, end in full)


def _survived(fault_at: list[float], correct_at: list[float]) -> int:
    """Faults followed by a correct result before the next fault (or the end)."""
    return sum(_survived_each(fault_at, correct_at))


def _survived_each(
    fault_at: list[float],
    correct_at: list[float],
    fault_host: Sequence[int | None] = (),
    correct_hosts: Sequence[Sequence[int]] = (),
) -> list[bool]:
    """Per fault: whether a correct result followed it before the next fault
    (or the end); for a fault with a host in ``fault_host`` (a rejoin), a
    correct result that ran on that host (``correct_hosts``, by result)."""
    ends = [*fault_at[1:], float("inf")] if fault_at else []
    needs = list(fault_host) or [None] * len(fault_at)
    results = list(zip(correct_at, list(correct_hosts) or [[]] * len(correct_at), strict=True))
    return [
        any(start < t <= end and (host is None or host in used) for t, used in results)
        for start, end, host in zip(fault_at, ends, needs, strict=True)
    ]


# -- the command line ---------------------------------------------------------------------------
def _table(report: Report) -> str:
    rows = [("faults injected / survived", f"{sum(report.faults.values())} / {report.survived}")]
    rows += [
        (f"  {kind}", f"{report.faults.get(kind, 0)} / {report.survived_by_kind.get(kind, 0)}")
        for kind in FAULT_KINDS
    ]
    rows += [(name, str(getattr(report, name))) for name in _COUNTS if name != "survived"]
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
