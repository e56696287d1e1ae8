"""``atoll top``: a running cluster in the terminal, refreshed every second.

Each refresh asks the controller's process for the same figures ``/metrics``
serves (``ClusterBuilder.metrics``, over the admin connection: no web server
needed) and draws the change since the last one: each device's utilization
and gangs a second, each session's share of the device time and its queue,
the rates of runs and of bytes moved, and the hosts' states. ``--once``
draws one frame, from two samples ``interval`` apart, and exits.

What is asynchronous about it: the samples are awaited on the caller's loop
(asyncio: the admin connection is Cap'n Proto); rich's ``Live`` redraws in
place between them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..client.connect import connect
from ..control.metrics import Snapshot
from .admin import cluster_file_of

__all__ = ["frame", "top"]

_BAR = 20  # characters of a full utilization bar


async def top(
    path: str | os.PathLike[str] | None,
    interval: float = 1.0,
    once: bool = False,
    console: Console | None = None,
) -> None:
    """Draw the cluster at ``path`` until interrupted (or once)."""
    console = console or Console()
    async with connect(cluster_file_of(path)) as client:
        builder = client.node.lookup("cluster")
        last: Snapshot = await builder.metrics()
        at = time.monotonic()
        if once:
            await anyio.sleep(interval)
            console.print(frame(last, await builder.metrics(), time.monotonic() - at))
            return
        with Live(console=console, auto_refresh=False) as live:
            while True:
                await anyio.sleep(interval)
                now: Snapshot = await builder.metrics()
                now_at = time.monotonic()
                live.update(frame(last, now, now_at - at), refresh=True)
                last, at = now, now_at


def frame(before: Snapshot, after: Snapshot, seconds: float) -> Group:
    """What changed from ``before`` to ``after``, ``seconds`` apart, drawn."""
    seconds = max(seconds, 1e-9)
    return Group(
        _summary(before, after, seconds), _devices(before, after, seconds), _sessions(before, after)
    )


def _summary(before: Snapshot, after: Snapshot, seconds: float) -> Text:
    hosts = [row for row in after.status if row.get("kind") == "host"]
    alive = sum(1 for row in hosts if row.get("alive"))
    runs = _delta(before.controller, after.controller, "submitted") / seconds
    moved = sum(
        _delta(before.hosts.get(h, {}), usage, key) / seconds
        for h, usage in after.hosts.items()
        for key in usage
        if key.endswith("_bytes") and key.split("_")[-2] in ("in", "out")
    )
    lag = after.loop_lag[1]
    line = (
        f"atoll top  hosts {alive}/{len(hosts)} alive   runs {runs:,.0f}/s   "
        f"moved {_size(moved)}/s   controller loop lag {1e3 * lag:.1f} ms"
    )
    return Text(line, style="bold")


def _devices(before: Snapshot, after: Snapshot, seconds: float) -> Table:
    table = Table("device", "host", "island", "busy", "", "gangs/s", "in flight", box=None)
    earlier = {s.device_id: s for s in before.devices}
    for stats in sorted(after.devices, key=lambda s: s.device_id):
        old = earlier.get(stats.device_id, stats)
        busy = min(1.0, max(0.0, (stats.busy_s - old.busy_s) / seconds))
        filled = round(busy * _BAR)
        table.add_row(
            str(stats.device_id),
            str(stats.host_id),
            str(stats.island),
            Text("█" * filled + "·" * (_BAR - filled), style="green" if busy > 0.5 else "yellow"),
            f"{100 * busy:5.1f}%",
            f"{(stats.computations - old.computations) / seconds:,.0f}",
            str(stats.in_flight),
        )
    return table


def _sessions(before: Snapshot, after: Snapshot) -> Table:
    table = Table("session", "share", "device s", "queued", "running", "stored", box=None)
    used = {
        name: _delta(before.sessions.get(name, {}), row, "device_s")
        for name, row in after.sessions.items()
    }
    total = sum(used.values())
    for name, row in sorted(after.sessions.items(), key=lambda kv: -used[kv[0]]):
        share = used[name] / total if total > 0 else 0.0
        table.add_row(
            name,
            f"{100 * share:5.1f}%",
            f"{float(row.get('device_s') or 0):.2f}",
            str(row.get("queued", 0)),
            str(row.get("running", 0)),
            _size(float(row.get("bytes") or 0)),
        )
    if not after.sessions:
        table.add_row("(no session)", "", "", "", "", "")
    return table


def _delta(before: Mapping[str, Any], after: Mapping[str, Any], key: str) -> float:
    return float(after.get(key) or 0) - float(before.get(key) or 0)


def _size(nbytes: float, units: Sequence[str] = ("B", "KiB", "MiB", "GiB", "TiB")) -> str:
    for unit in units[:-1]:
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} {units[-1]}"
