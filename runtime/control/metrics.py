"""Metrics for a monitoring stack: what a cluster did, in Prometheus' text format.

The controller's process serves ``/metrics`` (``runtime/tools/dashboard.py``).
Each scrape asks the parts of the cluster for their counters at that moment
(:func:`collect`: the devices' stats, the hosts' stores and data planes, the
controller's runs and messages, the sessions' usage, the status rows' host
states) and renders them with ``prometheus-client`` (:func:`render`). Nothing
is sampled between scrapes but the event loop's lag (:class:`LoopLag`), so a
cluster nobody scrapes pays nothing, and the hosts' own figures come from
them, labelled with their host, device and island. ``docs/observability.md``
lists every metric.

What the controller counts itself (:class:`RunCounters`): runs submitted,
runs whose every part a device took (or that failed), the time from one to
the other, and failures by kind. A run's outputs become ready later, on the
devices: their time shows in ``atoll_device_busy_seconds_total``.

What is asynchronous about it: :func:`collect` awaits every part at once,
each within ``timeout``; one that does not answer is left out (its host is
then reported by the status rows as lost), never waited for twice.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...kernel import AtollError, Promise, process_counters
from ...kernel.lowlevel import counts as COUNTS

if TYPE_CHECKING:
    from ...devices import Host
    from ...kernel import ActorRef

__all__ = [
    "LATENCY_BUCKETS",
    "MAX_SESSIONS",
    "LoopLag",
    "RunCounters",
    "Snapshot",
    "collect",
    "controller_metrics",
    "metric_names",
    "render",
    "within",
]

# the upper bounds (seconds) of the run latency histogram's buckets
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
MAX_SESSIONS = 50  # sessions labelled one by one; the rest are summed as "other"
# data-plane byte counters a host reports (store_usage), by path and direction
_PATHS = {
    ("inline", "in"): "inline_in_bytes",
    ("inline", "out"): "inline_out_bytes",
    ("lane", "in"): "lane_in_bytes",
    ("lane", "out"): "lane_out_bytes",
    ("shm", "in"): "shm_in_bytes",
    ("stream", "in"): "stream_in_bytes",
    ("stream", "out"): "stream_out_bytes",
    ("chunks", "in"): "chunks_in_bytes",
}
_HOST_STATES = ("alive", "lost", "draining", "drained", "spare")


class RunCounters:
    """The controller's count of runs (see the module docstring): plain
    numbers bumped on its loop, read by :meth:`snapshot`."""

    def __init__(self) -> None:
        self.submitted = 0
        self.completed = 0
        self.leased_runs = 0  # of those, runs that went straight to their host under a lease
        self.errors: Counter[str] = Counter()  # failed runs' outputs, by exception type
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: above every bound
        self.latency_sum = 0.0

    def observe(self, answer: Promise[Any]) -> None:
        """A run was submitted; ``answer`` settles once its devices took it."""
        self.submitted += 1
        started = time.monotonic()
        answer.add_done_callback(lambda done: self._settled(started, done))

    def _settled(self, started: float, answer: Promise[Any]) -> None:
        took = time.monotonic() - started
        self.completed += 1
        self.latency_sum += took
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS, took)] += 1
        error = answer.exception()
        if error is not None:
            self.errors[type(error).__name__] += 1
            return
        outputs = answer.result()
        for output in outputs if isinstance(outputs, list) else ():
            if isinstance(output, Promise) and output.done() and output.exception() is not None:
                self.errors[type(output.exception()).__name__] += 1

    def leased(self, ran: int, failed: int) -> None:
        """Runs a lease let through (``runtime/control/leases.py``), as their
        host counted them: submitted and completed, with no latency."""
        self.submitted += ran
        self.completed += ran
        self.leased_runs += ran
        if failed:
            self.errors["leased"] += failed

    def snapshot(self) -> dict[str, Any]:
        return {
            "leased": self.leased_runs,
            "submitted": self.submitted,
            "completed": self.completed,
            "errors": dict(self.errors),
            "buckets": list(self.buckets),
            "latency_sum": self.latency_sum,
        }


class LoopLag:
    """How late this event loop runs a callback due now: sampled every
    ``every`` seconds by a task (started with :meth:`start`); the last
    sample and the largest of the last ``window`` seconds (the same for
    every reader: a scrape does not reset it for ``atoll top``)."""

    def __init__(self, every: float = 0.5, window: float = 60.0) -> None:
        self.every = every
        self.last = 0.0
        self._recent: deque[float] = deque(maxlen=max(1, int(window / every)))
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._sample())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.every
            await asyncio.sleep(self.every)
            self.last = max(0.0, loop.time() - due)
            self._recent.append(self.last)

    def read(self) -> tuple[float, float]:
        """(the last lag, the largest of the window)."""
        return self.last, max(self._recent, default=self.last)


@dataclass
class Snapshot:
    """What one scrape gathered (plain values; :func:`render` formats them)."""

    status: list[dict[str, Any]] = field(default_factory=list)
    devices: list[Any] = field(default_factory=list)  # DeviceStats of those that answered
    hosts: dict[int, dict[str, Any]] = field(default_factory=dict)  # store_usage by host id
    controller: dict[str, Any] = field(default_factory=dict)  # Controller.metrics()
    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)  # tenant_usage
    loop_lag: tuple[float, float] = (0.0, 0.0)


async def collect(
    status: Callable[[], Awaitable[list[dict[str, Any]]]],
    hosts: Sequence[ActorRef[Host]],
    controller: Any | None,
    lag: LoopLag | None = None,
    timeout: float = 2.0,
) -> Snapshot:
    """Ask every part at once; what does not answer within ``timeout`` is
    left out. Devices' figures come from their hosts (``Host.device_stats``:
    a device's own mailbox may hold many runs ahead of the question)."""
    deadline = asyncio.get_running_loop().time() + timeout  # one for all of them
    device_stats = [host.device_stats() for host in hosts]
    usage = [host.store_usage() for host in hosts]
    runs = controller.metrics() if controller is not None else None
    tenants = controller.tenant_usage() if controller is not None else None
    snapshot = Snapshot(status=await within(status(), deadline) or [])
    for stats in [await within(answer, deadline) for answer in device_stats]:
        snapshot.devices += stats or []
    for host_id, answer in enumerate(usage):
        found = await within(answer, deadline)
        if found is not None:
            snapshot.hosts[host_id] = found
    if runs is not None and tenants is not None:
        snapshot.controller = await within(runs, deadline) or {}
        snapshot.sessions = await within(tenants, deadline) or {}
    snapshot.loop_lag = lag.read() if lag is not None else (0.0, 0.0)
    return snapshot


async def within(answer: Awaitable[Any], deadline: float) -> Any:
    """``answer``'s value, or None if it fails or is not there by ``deadline``
    (the loop's clock): the answers were all asked for at once, so they share it."""
    left = max(0.0, deadline - asyncio.get_running_loop().time())
    try:
        return await asyncio.wait_for(_value(answer), left)
    except (AtollError, TimeoutError):
        return None


async def _value(answer: Awaitable[Any]) -> Any:
    return await answer


def render(snapshot: Snapshot) -> bytes:
    """``snapshot`` in Prometheus' text exposition format."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshot))
    return bytes(generate_latest(registry))


def metric_names(snapshot: Snapshot | None = None) -> set[str]:
    """The names of every metric family atoll exports (as a query names
    them: a counter's ``_total`` included, a histogram's ``_bucket``,
    ``_sum`` and ``_count`` too)."""
    names: set[str] = set()
    for family in _families(snapshot or Snapshot()):
        kind = type(family).__name__
        if kind == "CounterMetricFamily":
            names.add(f"{family.name}_total")
        elif kind == "HistogramMetricFamily":
            names.update(f"{family.name}{end}" for end in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


class _Collector:
    """A one-scrape collector over a snapshot (prometheus-client's protocol)."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        yield from _families(self.snapshot)


def _families(s: Snapshot) -> list[Any]:
    return [
        *_device_families(s.devices),
        *_host_families(s.status, s.hosts),
        *_session_families(s.sessions),
        *_island_families(s.status),
        *_controller_families(s.controller, s.loop_lag),
    ]


def _device_families(devices: Sequence[Any]) -> list[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["host", "device", "island"]
    busy = CounterMetricFamily(
        "atoll_device_busy", "Seconds a device spent running gangs", labels=labels, unit="seconds"
    )
    gangs = CounterMetricFamily("atoll_device_gangs", "Gangs a device ran", labels=labels)
    in_flight = GaugeMetricFamily(
        "atoll_device_gangs_in_flight", "Gangs enqueued on a device, not finished", labels=labels
    )
    for stats in devices:
        values = [str(stats.host_id), str(stats.device_id), str(stats.island)]
        busy.add_metric(values, stats.busy_s)
        gangs.add_metric(values, stats.computations)
        in_flight.add_metric(values, stats.in_flight)
    return [busy, gangs, in_flight]


def _host_families(status: Sequence[Mapping[str, Any]], hosts: Mapping[int, Any]) -> list[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    stored = GaugeMetricFamily(
        "atoll_host_store", "Bytes held in a host's object store", labels=["host"], unit="bytes"
    )
    capacity = GaugeMetricFamily(
        "atoll_host_store_capacity",
        "A host store's capacity (0: unbounded)",
        labels=["host"],
        unit="bytes",
    )
    buffers = GaugeMetricFamily(
        "atoll_host_store_buffers", "Buffers in a host's store", labels=["host"]
    )
    moved = CounterMetricFamily(
        "atoll_transfer",
        "Bytes a host process moved, by path (inline in a message, lane, shared memory,"
        " bulk stream, Cap'n Proto chunks) and direction",
        labels=["host", "path", "direction"],
        unit="bytes",
    )
    for host_id, usage in sorted(hosts.items()):
        host = str(host_id)
        stored.add_metric([host], usage.get("bytes", 0))
        capacity.add_metric([host], usage.get("capacity", 0))
        buffers.add_metric([host], usage.get("buffers", 0))
        for (path, direction), key in _PATHS.items():
            moved.add_metric([host, path, direction], usage.get(key, 0))
    states = GaugeMetricFamily("atoll_hosts", "Hosts by state", labels=["state"])
    counts = dict.fromkeys(_HOST_STATES, 0)
    for row in status:
        if row.get("kind") != "host":
            continue
        counts["alive" if row.get("alive") else "lost"] += 1
        for state in (row.get("elastic") or "").split(","):
            if state in counts and state not in ("alive", "lost"):
                counts[state] += 1
    for state, count in counts.items():
        states.add_metric([state], count)
    return [stored, capacity, buffers, moved, states]


def _session_families(sessions: Mapping[str, Mapping[str, Any]]) -> list[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    device_s = CounterMetricFamily(
        "atoll_session_device", "Device seconds a session used", labels=["session"], unit="seconds"
    )
    queued = GaugeMetricFamily(
        "atoll_session_gangs_queued", "A session's gangs held", labels=["session"]
    )
    running = GaugeMetricFamily(
        "atoll_session_gangs_running", "A session's gangs sent", labels=["session"]
    )
    stored = GaugeMetricFamily(
        "atoll_session_store", "Bytes a session holds in stores", labels=["session"], unit="bytes"
    )
    for name, row in _bounded(sessions).items():
        device_s.add_metric([name], row["device_s"])
        queued.add_metric([name], row["queued"])
        running.add_metric([name], row["running"])
        stored.add_metric([name], row["bytes"])
    return [device_s, queued, running, stored]


def _bounded(sessions: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """At most ``MAX_SESSIONS`` labelled sessions (the busiest); the others'
    figures summed under ``other``, so ended and short sessions cannot grow
    the label set without bound."""
    keys = ("device_s", "queued", "running", "bytes")
    rows = {name: {k: float(row.get(k) or 0) for k in keys} for name, row in sessions.items()}
    ranked = sorted(rows, key=lambda n: (-rows[n]["device_s"], n))
    out = {name: rows[name] for name in ranked[:MAX_SESSIONS]}
    if len(ranked) > MAX_SESSIONS:
        out["other"] = {k: sum(rows[n][k] for n in ranked[MAX_SESSIONS:]) for k in keys}
    return out


def _island_families(status: Sequence[Mapping[str, Any]]) -> list[Any]:
    from prometheus_client.core import GaugeMetricFamily

    queued = GaugeMetricFamily(
        "atoll_island_gangs_queued", "Gangs an island holds", labels=["island"]
    )
    running = GaugeMetricFamily(
        "atoll_island_gangs_running", "Gangs an island sent", labels=["island"]
    )
    for row in status:
        if row.get("kind") == "island" and "island" in row:
            queued.add_metric([str(row["island"])], float(row.get("queued") or 0))
            running.add_metric([str(row["island"])], float(row.get("running") or 0))
    return [queued, running]


def _controller_families(runs: Mapping[str, Any], lag: tuple[float, float]) -> list[Any]:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    submitted = CounterMetricFamily("atoll_runs_submitted", "Runs the controller was given")
    submitted.add_metric([], runs.get("submitted", 0))
    completed = CounterMetricFamily(
        "atoll_runs_completed", "Runs whose every part a device took, or that failed"
    )
    completed.add_metric([], runs.get("completed", 0))
    errors = CounterMetricFamily(
        "atoll_run_errors", "Failed runs' outputs, by kind", labels=["kind"]
    )
    for kind, count in sorted(runs.get("errors", {}).items()):
        errors.add_metric([kind], count)
    latency = HistogramMetricFamily(
        "atoll_run_dispatch",
        "Time from a run's submission to its devices taking it",
        unit="seconds",
    )
    counts = runs.get("buckets", [0] * (len(LATENCY_BUCKETS) + 1))
    cumulative, total = [], 0
    for bound, count in zip((*LATENCY_BUCKETS, float("inf")), counts, strict=True):
        total += count
        cumulative.append(("+Inf" if bound == float("inf") else str(bound), total))
    latency.add_metric([], cumulative, sum_value=runs.get("latency_sum", 0.0))
    process = runs.get("process", {})
    messages = CounterMetricFamily(
        "atoll_controller_messages",
        "Messages the controller's process handled, by kind",
        labels=["kind"],
    )
    for kind in COUNTS:
        messages.add_metric([kind], process.get(kind, 0))
    cpu = CounterMetricFamily(
        "atoll_controller_cpu", "CPU time of the controller's process", unit="seconds"
    )
    cpu.add_metric([], process.get("cpu_s", 0.0))
    last = GaugeMetricFamily(
        "atoll_controller_loop_lag", "How late its event loop ran a callback due", unit="seconds"
    )
    last.add_metric([], lag[0])
    peak = GaugeMetricFamily(
        "atoll_controller_loop_lag_max",
        "The largest loop lag of the last minute",
        unit="seconds",
    )
    peak.add_metric([], lag[1])
    return [submitted, completed, errors, latency, messages, cpu, last, peak]


def controller_metrics(runs: RunCounters) -> dict[str, Any]:
    """What ``Controller.metrics`` answers: its run counters and its process's."""
    return {**runs.snapshot(), "process": process_counters()}
