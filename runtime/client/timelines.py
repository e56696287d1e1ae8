"""Recording a cluster's timeline from a client: ``async with cluster.recording(path)``.

``devices/timeline.py`` records events in each process; this module switches
the recorders of every process of a cluster (this one, the controller's, each
host's) on and off, gathers what they hold, and writes the Chrome trace event
file. ``Cluster.recording``, ``Cluster.run(..., record=True)``, ``atoll timeline``
and ``atoll demo --timeline`` all come here. See ``docs/observability.md``.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...devices import timeline
from ...kernel import Promise, all_settled

if TYPE_CHECKING:
    from .client import Cluster

__all__ = ["Timeline", "record", "start", "stop", "write_timeline"]


class Timeline:
    """What a ``recording`` block recorded: ``document`` (the Chrome trace
    event file, as a dict) once the block has ended."""

    def __init__(self) -> None:
        self.document: dict[str, Any] = {"traceEvents": []}

    @property
    def events(self) -> list[dict[str, Any]]:
        """The recorded events (metadata included)."""
        events: list[dict[str, Any]] = self.document["traceEvents"]
        return events


def _switch(cluster: Cluster, on: bool) -> list[Promise[list[dict[str, Any]]]]:
    """Send every process of ``cluster`` the switch; the promises of what each held."""
    calls: list[Promise[list[dict[str, Any]]]] = [cluster.controller.timeline(on)]
    calls += [host.timeline(on) for host in cluster.host_refs]
    return calls


def start(cluster: Cluster) -> Promise[Any]:
    """Switch recording on everywhere (what came before is dropped); the
    promise that every process has.

    Messages from one sender arrive in order, so the controller records
    whatever this client sends it afterwards even without waiting.
    """
    timeline.RECORDER.switch(True)
    return all_settled(_switch(cluster, True))


async def stop(cluster: Cluster) -> dict[str, Any]:
    """Switch recording off everywhere; the Chrome trace of what was recorded.

    A host that is gone gives nothing (its events are lost with it).
    """
    events = timeline.RECORDER.switch(False)
    calls = _switch(cluster, False)
    await all_settled(calls)
    for call in calls:
        if call.exception() is None:
            events += call.result()
    return timeline.chrome_trace(events)


def write_timeline(document: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``document`` (a Chrome trace event file) as JSON (what Perfetto UI
    and chrome://tracing open)."""
    target = Path(path)
    target.write_text(json.dumps(document))
    return target


@asynccontextmanager
async def record(
    cluster: Cluster, path: str | os.PathLike[str] | None = None
) -> AsyncIterator[Timeline]:
    """Record the cluster's timeline for the block; write it to ``path`` at the end."""
    log = Timeline()
    await start(cluster)
    try:
        yield log
    finally:
        log.document = await stop(cluster)
        if path is not None:
            write_timeline(log.document, path)
