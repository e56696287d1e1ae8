"""``atoll status``, ``atoll timeline`` and ``atoll down``: a running cluster, seen,
recorded and stopped from outside.

Both find the cluster the way ``atoll.connect()`` does: the cluster file
given, else the one ``atoll up`` wrote last on this machine. ``down`` asks the
controller to stop (its ``shutdown`` endpoint, which does what SIGTERM to
``atoll up`` does: the hosts are stopped and reaped, then the launcher
exits), waits for the launcher's process to be gone, and signals it only if
it does not go by itself, or if the controller no longer answers at all.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import anyio

from ...kernel import AtollError
from ...transports.capnp import ClusterFile
from ...transports.capnp.clusterfile import find_cluster_file
from ..client.connect import connect

__all__ = [
    "cluster_file_of",
    "config_rows",
    "drain_host",
    "open_dashboard",
    "record_timeline",
    "shut_down",
    "status_rows",
]


def cluster_file_of(path: str | os.PathLike[str] | None) -> Path:
    """``path``, or the cluster file of the cluster ``atoll up`` started last here."""
    return Path(path) if path is not None else find_cluster_file()


async def status_rows(path: str | os.PathLike[str] | None, timeout: float = 5.0) -> Any:
    """The rows of ``Client.status`` for the cluster at ``path`` (see ``status.py``)."""
    async with connect(cluster_file_of(path)) as client:
        with anyio.fail_after(timeout * 4):
            return await client.status()


async def config_rows(
    path: str | os.PathLike[str] | None, timeout: float = 5.0
) -> list[tuple[str, str, str, str, str]]:
    """The settings of the cluster at ``path`` (``atoll config --cluster``)."""
    async with connect(cluster_file_of(path)) as client:
        with anyio.fail_after(timeout):
            rows = await client.node.lookup("cluster").config_rows()
    return [(a, b, c, d, e) for a, b, c, d, e in rows]


async def record_timeline(
    path: str | os.PathLike[str] | None, output: str | os.PathLike[str], seconds: float | None
) -> str:
    """``atoll timeline``: record the cluster's timeline for ``seconds`` (or until
    SIGINT/SIGTERM) and write it to ``output``; what was written, in words."""
    from ...transports.capnp import stop_on_signals

    stop = stop_on_signals()
    async with connect(cluster_file_of(path)) as client:
        cluster = await client.cluster(owner="atoll-timeline")
        async with cluster.recording(output) as log:
            until = f"for {seconds:g} s" if seconds is not None else "until Ctrl-C"
            print(f"atoll timeline: recording {until}", flush=True)
            with anyio.move_on_after(seconds if seconds is not None else math.inf):
                await stop.wait()
        await client.node.lookup("cluster").keep_timeline(log.document)  # for the dashboard
    gangs = sum(1 for e in log.events if e.get("cat") == "gang")
    return f"atoll timeline: {len(log.events)} events ({gangs} gangs) written to {output}"


async def open_dashboard(
    path: str | os.PathLike[str] | None, host: str = "127.0.0.1", port: int = 0
) -> str:
    """Have the controller serve its dashboard; the URL, with the token to log in once."""
    where = cluster_file_of(path)
    async with connect(where) as client:
        url: str = await client.node.lookup("cluster").dashboard(host, port)
    return f"{url}?token={ClusterFile.read(where).token.hex()}"


async def drain_host(path: str | os.PathLike[str] | None, host: int, timeout: float) -> str:
    """``atoll drain``: move every slice and buffer off ``host``, which then
    leaves; what moved, in words."""
    async with connect(cluster_file_of(path)) as client:
        with anyio.fail_after(timeout):
            report = await client.node.lookup("cluster").drain(host)
    return (
        f"atoll drain: host {host} drained in {report['seconds']:.2f} s "
        f"({report['buffers']} buffers moved); it leaves the cluster"
    )


async def shut_down(path: str | os.PathLike[str] | None, wait: float = 30.0) -> str:
    """Stop the cluster whose cluster file is ``path``; what happened, in words.

    Raises ``AtollError`` if the cluster could not be stopped.
    """
    where = cluster_file_of(path)
    spec = ClusterFile.read(where)
    how = "stopped"
    try:
        async with connect(where) as client:
            with anyio.fail_after(wait):
                if not await client.node.lookup("cluster").shutdown():
                    raise AtollError(f"the node at {spec.address} is not one `atoll up` started")
    except (AtollError, OSError, TimeoutError) as exc:
        if spec.pid is None or not _is_atoll(spec.pid):
            raise AtollError(f"cannot stop the cluster at {spec.address}: {exc}") from None
        os.kill(spec.pid, signal.SIGTERM)  # it does not answer: as Ctrl-C would
        how = f"sent SIGTERM ({exc})"
    if spec.pid is not None and not await anyio.to_thread.run_sync(_gone, spec.pid, wait):
        os.kill(spec.pid, signal.SIGKILL)
        how = f"killed (still running after {wait:.0f} s)"
    with contextlib.suppress(AtollError, OSError):
        if ClusterFile.read(where) == spec:  # the launcher removes it; a killed one cannot
            where.unlink()
    return f"atoll down: cluster at {spec.address} {how}"


def _is_atoll(pid: int) -> bool:
    """Whether ``pid`` runs atoll here (a stale cluster file's pid may be reused)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"atoll" in command


def _gone(pid: int, wait: float) -> bool:
    """Wait up to ``wait`` s for process ``pid`` to exit; whether it did.

    Only a local ``atoll up`` (one this machine can see in /proc) is waited for.
    """
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if not _is_atoll(pid):
            return True
        time.sleep(0.05)
    return False
