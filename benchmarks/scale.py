"""The controller's work per computation as the cluster grows (``atoll bench scale``).

Pathways' point is that one controller keeps up with thousands of devices.
What must stay flat is the *control plane's* CPU per computation: the
controller and the island scheduler, which run in one process whatever the
cluster's size. Device work happens on each host's own CPU in a real
cluster; here every simulated host shares this process's one thread, so
each host's work is measured on its own, charged to its own account, and
laid out on a timeline of its own.

The workload is the paper's dispatch microbenchmark: a chain of computations,
each a gang over *every* device of the cluster (4 devices per host), with no
device time. Two forms, in the same run:

* ``compiled``: the chain's plan is installed on the devices once; a run is
  one ``run_plan`` message per device, and the island does not consult a
  gang-FIFO policy per gang (see ``IslandScheduler.run_plan``);
* ``per gang``: every gang goes through the policy and to every device.

How CPU is attributed (a :class:`CpuLedger`, thread CPU time): every metered
frame charges the CPU it spends to one account, and a frame entered inside
another pauses the outer one, so no second is counted twice. The frames:

* the control plane's entry points (``CONTROL_PLANE``: the controller's
  ``run_graph`` and the callbacks it registers, the island's
  ``run_plan``, ``completed``...), wherever they run;
* every message an actor handles, step by step (each resumption of its
  handler's coroutine): a device's or a host's to that host's account (its
  ``host_id``), the controller's and islands' to the control plane's actor
  tasks (mailbox, argument promises, answers: the machinery around the entry
  points), any other actor's to "other actors";
* the host-side callbacks that run when a promise settles, possibly in
  another actor's task (``HOST_SIDE``: ``Device._gang_settled``, ``Pusher._pushed``,
  ``Host._accept``...), to the host of the object they belong to.

What no frame covers (the client's own task, the event loop, callbacks
that are closures) is reported as the unattributed remainder: the thread's
CPU minus everything charged.

Per computation, the parity point's estimate is the larger of the control
plane's CPU and the busiest host's CPU: with dispatch asynchronous, each runs
on a CPU of its own in a real cluster, and the slower one sets the pace (the
device time per computation below which it cannot keep up). The sum of the
two is also given: the bound if controller and hosts never overlapped.

After start-up the cluster's objects are frozen out of the garbage
collector's scans (``gc.freeze()``), as ``atoll up`` does in its controller
process: otherwise the collector's pauses, which grow with the heap, land in
whatever code runs (at 512 devices, 1,040 µs per computation instead of 265).

Each size and form runs twice: once with the control plane's meters only
(the thread's CPU then, against the metered run's, is what the meters cost)
and once with every meter. ``--timeline PATH`` runs one more, recorded, at
``--timeline-hosts`` hosts, and writes its timeline as Chrome trace JSON
(Perfetto, or chrome://tracing): per form, one track for the control
plane's entry points, one for its actor tasks, one per host; each slice is
a stretch of thread CPU time drawn at the wall-clock time it started.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import numpy as np

from atoll.benchmarks._common import Row, emit, system_column, table, unit_column
from atoll.benchmarks.dispatch import DEVICES_PER_HOST, chain_graph, step
from atoll.devices import CostModel, Device, Host
from atoll.devices._push import Pusher
from atoll.kernel import Actor, WallClock
from atoll.kernel.lowlevel import message_handler, set_message_handler
from atoll.runtime import Controller, IslandScheduler, local_cluster

__all__ = ["CpuLedger", "chrome_trace", "main", "measure", "metering", "run"]

HOSTS = (4, 16, 64, 128, 512)
QUICK_HOSTS = (4, 16, 64)
CONTROL_PLANE: dict[type[Any], tuple[str, ...]] = {
    Controller: ("run_graph", "_send_run", "_compiled_sent", "_reported", "_free_held"),
    IslandScheduler: ("run_plan", "completed", "_report", "_send_part"),
}
# synchronous host-side methods that promise callbacks call, maybe in another actor's task
HOST_SIDE: dict[type[Any], tuple[str, ...]] = {
    Device: ("_gang_settled",),
    Pusher: ("_pushed", "drop"),
    Host: ("_unhold", "_accept", "_land", "_from_lane"),
}

Key = int | str  # a host's id, or one of the names below
CONTROL: Final = "control plane"
CONTROL_TASKS: Final = "control plane actor tasks"
OTHER: Final = "other actors"


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of thread CPU charged to one account without a break:
    ``cpu_s`` seconds, from wall-clock time ``wall_s`` (``time.perf_counter``)."""

    key: Key
    name: str
    wall_s: float
    cpu_s: float


class CpuLedger:
    """Thread CPU seconds per account; each second goes to the innermost frame.

    :meth:`enter` pauses the frame below (charging it what it spent so far)
    and :meth:`leave` resumes it, so nested frames are never counted twice.
    With ``segments`` set to a list, every stretch between two such events
    is also kept there, for a timeline (which costs a wall-clock read more).
    """

    def __init__(self) -> None:
        self.seconds: defaultdict[Key, float] = defaultdict(float)
        self.frames: defaultdict[tuple[Key, bool], int] = defaultdict(int)  # (key, nested)
        self.segments: list[Segment] | None = None
        self._stack: list[list[Any]] = []  # [key, name, cpu started, wall started]

    def enter(self, key: Key, name: str) -> None:
        now, wall = time.thread_time(), self._wall()
        if self._stack:
            self._charge(self._stack[-1], now)
        self.frames[key, bool(self._stack)] += 1
        self._stack.append([key, name, now, wall])

    def leave(self) -> None:
        now = time.thread_time()
        self._charge(self._stack.pop(), now)
        if self._stack:
            below = self._stack[-1]
            below[2], below[3] = now, self._wall()

    def _charge(self, frame: list[Any], now: float) -> None:
        key, name, started, wall = frame
        self.seconds[key] += now - started
        if self.segments is not None and now > started:
            self.segments.append(Segment(key, name, wall, now - started))

    def _wall(self) -> float:
        return time.perf_counter() if self.segments is not None else 0.0

    def method(self, method: Callable[..., Any], key_of: Callable[[Any], Key]) -> Any:
        """``method`` (synchronous) charging its time to ``key_of(self)``."""
        name = method.__name__

        @functools.wraps(method)
        def metered(this: Any, *args: Any, **kwargs: Any) -> Any:
            self.enter(key_of(this), name)
            try:
                return method(this, *args, **kwargs)
            finally:
                self.leave()

        return metered

    def handler(self, handle: Callable[..., Awaitable[None]]) -> Any:
        """The kernel's message handler (``kernel.lowlevel.message_handler``)
        with every step of a message charged to its actor."""

        @functools.wraps(handle)
        def metered(cell: Any, instance: Actor, call: Any) -> Stepped:
            return Stepped(handle(cell, instance, call), self, actor_key(instance), call.endpoint)

        return metered


def frame_charge(frames: int = 20_000) -> tuple[float, float]:
    """The CPU seconds a ledger charges per empty frame, outermost and nested
    (the nested one's and its parent's together): its own cost, counted in."""
    ledger = CpuLedger()
    for _ in range(frames):
        ledger.enter(0, "empty")
        ledger.leave()
    ledger.enter(1, "outer")
    for _ in range(frames):
        ledger.enter(2, "empty")
        ledger.leave()
    ledger.leave()
    return ledger.seconds[0] / frames, (ledger.seconds[1] + ledger.seconds[2]) / frames


class Stepped:
    """Awaits a coroutine one step at a time, each step a frame of a ledger."""

    __slots__ = ("_coro", "_key", "_ledger", "_name")

    def __init__(self, coro: Any, ledger: CpuLedger, key: Key, name: str) -> None:
        self._coro, self._ledger, self._key, self._name = coro, ledger, key, name

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, ledger = self._coro, self._ledger
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            ledger.enter(self._key, self._name)
            try:
                signal = coro.send(sent) if thrown is None else coro.throw(thrown)
            except StopIteration as stop:
                return stop.value
            finally:
                ledger.leave()
            try:
                sent, thrown = (yield signal), None
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a cancellation, thrown in where it waits
                sent, thrown = None, exc


def actor_key(instance: Actor) -> Key:
    """The account an actor's messages are charged to."""
    if isinstance(instance, Device | Host):
        return int(instance.host_id)
    if isinstance(instance, Controller | IslandScheduler):
        return CONTROL_TASKS
    return OTHER


@contextmanager
def metering(per_host: bool) -> Iterator[CpuLedger]:
    """Meter the control plane's entry points while inside, and with
    ``per_host`` every actor's messages and the host-side callbacks too
    (class attributes replaced, and put back on the way out)."""
    ledger = CpuLedger()
    saved: list[tuple[Any, str, Any]] = []

    def patch(cls: Any, name: str, wrapped: Any) -> None:
        saved.append((cls, name, getattr(cls, name)))
        setattr(cls, name, wrapped)

    for cls, names in CONTROL_PLANE.items():
        for name in names:
            patch(cls, name, ledger.method(getattr(cls, name), lambda _: CONTROL))
    if per_host:
        for cls, names in HOST_SIDE.items():
            for name in names:
                patch(cls, name, ledger.method(getattr(cls, name), lambda this: this.host_id))
    handler = message_handler()
    if per_host:
        set_message_handler(ledger.handler(handler))
    try:
        yield ledger
    finally:
        set_message_handler(handler)
        for cls, name, method in reversed(saved):
            setattr(cls, name, method)


@dataclass
class Pass:
    """One metered pass of ``runs`` runs: what each account and the thread spent."""

    seconds: dict[Key, float]
    thread_s: float
    wall_s: float
    frames: dict[tuple[Key, bool], int] = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)

    def meters_share(self, key: Key, charge: tuple[float, float]) -> float:
        """The seconds of ``key``'s account that its meters themselves spent
        (frames counted, times the calibrated charge of an empty frame)."""
        outermost, nested = charge
        return (
            self.frames.get((key, False), 0) * outermost + self.frames.get((key, True), 0) * nested
        )


async def metered_pass(
    once: Callable[[], Awaitable[None]], runs: int, per_host: bool, record: bool = False
) -> Pass:
    """Run ``once`` ``runs`` times inside :func:`metering` (with ``record``,
    segment by segment)."""
    with metering(per_host) as ledger:
        if record:
            ledger.segments = []
        started, cpu = time.perf_counter(), time.thread_time()
        for _ in range(runs):
            await once()
        wall, cpu = time.perf_counter() - started, time.thread_time() - cpu
    return Pass(dict(ledger.seconds), cpu, wall, dict(ledger.frames), ledger.segments or [])


async def measure(
    hosts: int,
    nodes: int,
    runs: int,
    compiled: bool,
    charge: tuple[float, float],
    recorded: list[Pass] | None = None,
) -> list[Row]:
    """One cluster size and form: the rows of :func:`figures` (``charge``: see
    :func:`frame_charge`). With ``recorded``, one more run is recorded segment
    by segment and appended there."""
    devices = hosts * DEVICES_PER_HOST
    cost = CostModel(flops_per_s=1e12, link_latency_s=0.0, link_bytes_per_s=float("inf"))
    async with local_cluster(
        1, hosts, DEVICES_PER_HOST, clock=WallClock(0.0), cost=cost, push=True
    ) as cluster:
        await cluster.controller.set_compile(compiled)
        everything = await cluster.devices(devices)
        graph = chain_graph([everything] * nodes, step(0.0))
        x = await cluster.put(np.zeros(1, np.float32), 0)

        async def once() -> None:
            [out] = cluster.run_graph(graph, [x])
            await cluster.fetch(out)
            await cluster.free(out)

        await once()  # plans (and installs) once
        gc.freeze()  # the cluster's own objects out of the collector's scans, as `atoll up` does
        try:
            bare = await metered_pass(once, runs, per_host=False)
            full = await metered_pass(once, runs, per_host=True)
            if recorded is not None:
                recorded.append(await metered_pass(once, 1, per_host=True, record=True))
        finally:
            gc.unfreeze()
    form = "compiled" if compiled else "per gang"
    return figures(hosts, form, runs * nodes, bare, full, charge)


def figures(
    hosts: int, form: str, computations: int, bare: Pass, full: Pass, charge: tuple[float, float]
) -> list[Row]:
    """The rows of one size and form, per computation (see ``CASES``)."""
    n = computations
    per_host = [full.seconds.get(h, 0.0) / n for h in range(hosts)]
    unmetered = [per_host[h] - full.meters_share(h, charge) / n for h in range(hosts)]
    control = full.seconds.get(CONTROL, 0.0) / n
    busiest = max(per_host)
    charged = sum(full.seconds.values()) / n
    values = {
        "control plane CPU": control * 1e6,
        "control plane actor tasks CPU": full.seconds.get(CONTROL_TASKS, 0.0) / n * 1e6,
        "busiest host's CPU": busiest * 1e6,
        "median host's CPU": statistics.median(per_host) * 1e6,
        "busiest host's CPU, less its meters": max(unmetered) * 1e6,
        "all hosts' CPU together": sum(per_host) * 1e6,
        "unattributed (client, event loop)": (full.thread_s / n - charged) * 1e6,
        "thread CPU, every meter on": full.thread_s / n * 1e6,
        "meters' cost (thread CPU, vs control only)": (full.thread_s - bare.thread_s) / n * 1e6,
        "parity point (max: control, busiest host)": max(control, busiest) * 1e3,
        "parity point, no overlap (sum)": (control + busiest) * 1e3,
        "wall, one process, control meters only": bare.wall_s / n * 1e3,
    }
    sized = functools.partial(
        Row, "scale", system=form, devices=hosts * DEVICES_PER_HOST, hosts=hosts
    )
    return [sized(case, value=values[case], unit=unit) for case, unit in CASES]


CASES: tuple[tuple[str, str], ...] = (
    ("control plane CPU", "us"),
    ("control plane actor tasks CPU", "us"),
    ("busiest host's CPU", "us"),
    ("median host's CPU", "us"),
    ("busiest host's CPU, less its meters", "us"),
    ("all hosts' CPU together", "us"),
    ("unattributed (client, event loop)", "us"),
    ("thread CPU, every meter on", "us"),
    ("meters' cost (thread CPU, vs control only)", "us"),
    ("parity point (max: control, busiest host)", "ms"),
    ("parity point, no overlap (sum)", "ms"),
    ("wall, one process, control meters only", "ms"),
)


def chrome_trace(passes: Sequence[tuple[str, Pass]]) -> dict[str, Any]:
    """Recorded passes as Chrome trace JSON: a process per pass (its label),
    a track per account (control plane, its actor tasks, each host); each
    slice's length is thread CPU time, drawn at the wall time it began, or
    where the one before it on its track ended if that is later (in this VM
    the thread's CPU clock runs ahead of the wall clock now and then, by up
    to tens of µs, which would otherwise overlap slices)."""
    events: list[dict[str, Any]] = []
    starts = [s.wall_s for _, p in passes for s in p.segments]
    origin = min(starts, default=0.0)
    for pid, (label, recorded) in enumerate(passes, start=1):
        events.append(_meta("process_name", pid, 0, label))
        tracks: dict[Key, int] = {}
        free_from: dict[Key, float] = {}  # where each track's last slice ended
        for segment in recorded.segments:
            tid = tracks.get(segment.key)
            if tid is None:
                tid = tracks[segment.key] = _track(segment.key)
                name = f"host {segment.key}" if isinstance(segment.key, int) else segment.key
                events.append(_meta("thread_name", pid, tid, name))
                events.append(_meta("thread_sort_index", pid, tid, tid, "sort_index"))
            begins = max(segment.wall_s - origin, free_from.get(segment.key, 0.0))
            free_from[segment.key] = begins + segment.cpu_s
            events.append(
                {
                    "name": segment.name,
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": round(begins * 1e6, 3),
                    "dur": round(segment.cpu_s * 1e6, 3),
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def _track(key: Key) -> int:
    """Control plane first, then its actor tasks, other actors, then hosts in order."""
    if isinstance(key, int):
        return 10 + key
    return {CONTROL: 1, CONTROL_TASKS: 2}.get(key, 3)


def _meta(kind: str, pid: int, tid: int, value: Any, arg: str = "name") -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {arg: value}}


async def run(
    sizes: Sequence[int],
    nodes: int,
    progress: Callable[[str], None],
    timeline_hosts: int | None = None,
    timelines: list[tuple[str, Pass]] | None = None,
) -> list[Row]:
    """Both forms at every size; the largest sizes run fewer times. At
    ``timeline_hosts`` hosts, a recorded run of each form goes into ``timelines``."""
    rows: list[Row] = []
    charge = frame_charge()
    for hosts in sizes:
        runs = 5 if hosts <= 16 else 2
        for compiled in (True, False):
            form = "compiled" if compiled else "per gang"
            progress(f"scale: {hosts} hosts, {form}")
            recorded: list[Pass] | None = [] if hosts == timeline_hosts else None
            measured = await measure(hosts, nodes, runs, compiled, charge, recorded)
            if timelines is not None and recorded:
                timelines.append((f"{form}, {hosts} hosts", recorded[0]))
            rows += measured
            got = {row.case: row.value or 0.0 for row in measured}
            control, busiest = got["control plane CPU"], got["busiest host's CPU"]
            progress(
                f"  control plane {control:,.1f} us, busiest host {busiest:,.1f} us per computation"
            )
    return rows


def format_table(rows: Sequence[Row]) -> str:
    def figure(value: float) -> str:
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"

    width = max(len(case) for case, _ in CASES)
    columns = [
        system_column("compiled", 10, figure),
        system_column("per gang", 10, figure),
        unit_column(6),
    ]

    def key(row: Row) -> tuple[str, int | None]:
        return (row.case, row.devices)

    text = table(rows, columns, case_width=width, key=key)
    lines = text.splitlines()
    keyed = list(dict.fromkeys(key(r) for r in rows))
    header = lines[0][:width] + f" {'devices':>8}" + lines[0][width:]
    body = [
        line[:width] + f" {k[1]:>8}" + line[width:]
        for line, k in zip(lines[1:], keyed, strict=True)
    ]
    return "\n".join([header, *body])


def main(argv: Sequence[str] | None = None) -> int:
    """``atoll bench scale [--quick] [--json] [--nodes N] [--timeline PATH]``."""
    parser = argparse.ArgumentParser(prog="atoll bench scale", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"hosts {QUICK_HOSTS} only")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--nodes", type=int, default=32, help="computations per program")
    parser.add_argument("--hosts", type=int, nargs="+", help="these host counts instead")
    parser.add_argument(
        "--timeline", type=Path, help="write per-host timelines (Chrome trace JSON)"
    )
    parser.add_argument(
        "--timeline-hosts", type=int, default=16, help="the size --timeline records"
    )
    args = parser.parse_args(argv)
    sizes = args.hosts or (QUICK_HOSTS if args.quick else HOSTS)
    if args.timeline and args.timeline_hosts not in sizes:
        parser.error(f"--timeline-hosts {args.timeline_hosts} is not among the sizes {sizes}")

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    timelines: list[tuple[str, Pass]] = []
    timeline_hosts = args.timeline_hosts if args.timeline else None
    rows = anyio.run(run, sizes, args.nodes, progress, timeline_hosts, timelines)
    if args.timeline:
        args.timeline.write_text(json.dumps(chrome_trace(timelines)))
        progress(f"scale: per-host timelines of {args.timeline_hosts} hosts in {args.timeline}")
    emit(rows, args.json, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
