"""What ``atoll status`` shows: one row per host, island and session.

:func:`cluster_status` asks every part of a running cluster for its state and
returns plain rows (dicts of JSON values), each with a ``"kind"``: ``"host"``
(alive or lost, address, pid, island, devices, object-store usage, its last
error), ``"island"`` (scheduler, queued and running gangs) and ``"session"``
(owner label, and whatever else the session watcher reports). With the
controller, each host row also says whether it is a spare, draining, drained
or lost (``"elastic"``), and the latest moves, suspends, resumes and drains
follow as ``"change"`` rows (``runtime/control/elastic.py``).
``Client.status`` returns these rows; the CLI renders them as tables, one per
kind, with a column for every key it meets, so rows that other parts of the
runtime add later show up without a change here.

A host that does not answer within the timeout, or whose connection is gone,
is reported lost, and stays lost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from ...devices import Host
from ...kernel import ActorRef, AtollError, Promise
from ..control.controller import Controller
from ..control.island import IslandScheduler
from ..control.sessions import SessionWatcher
from ..topology import Topology

__all__ = ["cluster_status", "host_rows", "kind_of", "render"]


def kind_of(row: Mapping[str, Any]) -> str:
    """The kind of a status row: its ``"kind"``, else guessed from its keys."""
    kind = row.get("kind")
    if isinstance(kind, str):
        return kind
    for key in ("host", "island", "session"):
        if key in row:
            return key
    return "other"


async def host_rows(
    hosts: Sequence[ActorRef[Host]],
    labels: Sequence[str],
    topology: Topology,
    lost: dict[int, str],
    timeout: float,
) -> list[dict[str, Any]]:
    """One row per joined host; a host that fails to answer joins ``lost``.

    Every host is asked at once and all share one deadline, so a few frozen
    hosts cost ``timeout`` in all, not each."""
    asked = {
        host_id: (host.store_usage(), host.address())
        for host_id, host in enumerate(hosts)
        if host_id not in lost
    }
    deadline = anyio.current_time() + timeout
    rows = []
    for host_id in range(len(hosts)):
        usage: dict[str, Any] = {}
        address = ""
        if host_id in asked:
            try:
                usage, address = [await _by(answer, deadline) for answer in asked[host_id]]
            except TimeoutError:
                lost[host_id] = f"no answer within {timeout} s"
            except AtollError as exc:
                lost[host_id] = str(exc)
        rows.append(_host_row(host_id, labels[host_id], topology, lost, usage, address))
    return rows


async def _by(answer: Promise[Any], deadline: float) -> Any:
    """``answer``'s value, waiting no later than ``deadline`` (anyio's clock)."""
    if answer.done():
        return answer.result()
    with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
        return await answer


def _host_row(
    host_id: int,
    label: str,
    topology: Topology,
    lost: dict[int, str],
    usage: Mapping[str, Any],
    address: str,
) -> dict[str, Any]:
    words = label.split()
    pid = int(words[1]) if len(words) == 2 and words[0] == "pid" and words[1].isdigit() else None
    return {
        "kind": "host",
        "host": host_id,
        "label": label,
        "alive": host_id not in lost,
        "pid": pid,
        "address": address or None,
        "island": topology.island_of_host(host_id),
        "devices": list(topology.on_host(host_id)),
        "buffers": usage.get("buffers"),
        "bytes": usage.get("bytes"),
        "error": lost.get(host_id),
    }


async def cluster_status(
    hosts: Sequence[ActorRef[Host]],
    labels: Sequence[str],
    topology: Topology,
    lost: dict[int, str],
    islands: Sequence[ActorRef[IslandScheduler]] = (),
    sessions: ActorRef[SessionWatcher] | None = None,
    timeout: float = 5.0,
    controller: ActorRef[Controller] | None = None,
) -> list[dict[str, Any]]:
    """Host rows, then island rows, then session rows, then the elastic
    changes (see the module docstring)."""
    rows = await host_rows(hosts, labels, topology, lost, timeout)
    elastic: dict[str, Any] = {}
    if controller is not None:
        with anyio.move_on_after(timeout):
            elastic = await controller.elastic_status()
        _mark_hosts(rows, elastic, topology)
    loads = [island.load() for island in islands]
    deadline = anyio.current_time() + timeout
    for answer in loads:
        load: dict[str, Any] = await _by(answer, deadline)
        rows.append({"kind": "island", **load})
    if sessions is not None:
        rows += await _session_rows(sessions, timeout)
    rows += [{"kind": "change", **change} for change in elastic.get("changes", [])]
    return rows


def _mark_hosts(rows: list[dict[str, Any]], elastic: Mapping[str, Any], topology: Topology) -> None:
    """Say of each host row whether it is a spare, draining, drained or lost."""
    spares = {topology.device(d).host for d in elastic.get("spares", [])}
    for row in rows:
        host = row["host"]
        states = [
            name
            for name, hosts in (
                ("draining", elastic.get("draining", [])),
                ("drained", elastic.get("drained", [])),
                ("lost", elastic.get("lost", [])),
            )
            if host in hosts
        ]
        if host in spares:
            states.append("spare")
        row["elastic"] = ",".join(states) or None
        if "drained" in states:
            row["error"] = None  # it left on purpose


async def _session_rows(sessions: ActorRef[SessionWatcher], timeout: float) -> list[dict[str, Any]]:
    """One row per open session; if the watcher cannot say (a host it asks
    for usage is gone, say), one row that says why, so the hosts' rows,
    which matter most then, still show."""
    try:
        with anyio.fail_after(timeout):
            open_sessions: dict[int, Any] = await sessions.usage()  # no owner labels
    except (AtollError, TimeoutError) as exc:
        return [{"kind": "session", "error": f"session usage unavailable: {exc}"}]
    return [_session_row(i, value) for i, value in sorted(open_sessions.items())]


def _session_row(session_id: int, value: Any) -> dict[str, Any]:
    """A session: its owner label, or the richer record the watcher may give."""
    if isinstance(value, Mapping):
        return {"kind": "session", "session": session_id, **value}
    return {"kind": "session", "session": session_id, "owner": value}


def render(rows: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The rows as rich tables, one per kind (hosts first), for a terminal.

    Columns are every key the rows of a kind carry, in the order met, so a
    field another part of the runtime adds to its rows shows up unasked.
    """
    from rich.table import Table

    kinds: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        kinds.setdefault(kind_of(row), []).append(row)
    tables = []
    for kind, group in kinds.items():
        columns = list(dict.fromkeys(key for row in group for key in row if key != "kind"))
        table = Table(title=f"{kind}s ({len(group)})", title_justify="left")
        for column in columns:
            table.add_column(column, overflow="fold")
        for row in group:
            table.add_row(*(_cell(column, row.get(column)) for column in columns))
        tables.append(table)
    return tables


def _cell(column: str, value: Any) -> str:
    """One value as a table cell: lost hosts in red, byte counts readable."""
    if value is None:
        return ""
    if column == "alive":
        return "[green]alive[/]" if value else "[bold red]lost[/]"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and "bytes" in column:
        return _bytes(value)
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    from rich.markup import escape

    return escape(str(value))  # an error's text may hold [brackets]


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
