"""Timelines: what each device, host and island did, as Chrome trace events.

Every process of a cluster keeps one :data:`RECORDER`, off by default. While
it is on, the runtime records into it, with wall-clock time in microseconds:

* on devices, each gang shard that ran (:func:`gang`: node name, client,
  gang id) and each push of an output to another host (:func:`push`: bytes,
  source and destination), with the start of a flow arrow;
* on hosts, each push received (:func:`received`), with the arrow's end;
* in the control plane, instants (:func:`control`): a gang dispatched by its
  island (with its position in the island's order), a plan installed on a
  device, a program run by a client.

``Host.timeline`` and ``Controller.timeline`` switch a process's recorder
and hand over what it holds; :func:`chrome_trace` turns the events of every
process into one Chrome trace event file (what Perfetto UI and
``chrome://tracing`` open): one process per host (plus the controller and
the client), one thread per device, flow arrows for transfers. Gangs are
annotated there with what only the control plane knows (program, island
order position), matched by gang id and by the client's own run records.

Recording costs one attribute test when off. Events are plain dicts, so they
cross processes as they are.
"""

from __future__ import annotations

import bisect
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CONTROLLER",
    "RECORDER",
    "Recorder",
    "chrome_trace",
    "control",
    "gang",
    "now_us",
    "pulled",
    "push",
    "pushing",
    "received",
    "start",
]

CONTROLLER = -1  # the host id of control-plane events (the controller's process)
CLIENT = -2  # ... and of the client's own


def now_us() -> float:
    """Wall-clock time in microseconds (the trace format's unit), comparable
    across the processes of one machine."""
    return time.time_ns() / 1000.0


def start() -> float:
    """The start time of an event about to happen: now while recording, else
    0.0 without reading the clock (the call sites are every gang and push)."""
    return now_us() if RECORDER.on else 0.0


@dataclass
class Recorder:
    """One process's events, recorded while ``on``."""

    on: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)

    def switch(self, on: bool) -> list[dict[str, Any]]:
        """Turn recording on or off; returns (and forgets) what was recorded.

        Switching on a recorder that is on keeps what it holds (processes
        that hold several hosts, or the client too, are switched once each).
        """
        if on and self.on:
            return []
        self.on = on
        taken, self.events = self.events, []
        return taken


RECORDER = Recorder()


def _add(event: dict[str, Any]) -> None:
    RECORDER.events.append(event)


def gang(
    host: int,
    device: int,
    task: Any,
    owner: str,
    began: float,
    leader: bool,
    end: float | None = None,
) -> None:
    """A shard of gang ``task`` (a ``GangTask``) ran on ``device`` from
    ``began`` until ``end`` (None: now)."""
    if not RECORDER.on:
        return
    name = getattr(task.kernel, "name", type(task.kernel).__name__)
    _add(
        {
            "kind": "gang",
            "host": host,
            "device": device,
            "gang": task.gang_id,
            "node": str(name),
            "client": owner,
            "leader": leader,
            "ts": began,
            "end": now_us() if end is None else end,
        }
    )


def push(
    host: int, device: int, to_host: int, keys: Sequence[str], nbytes: int, began: float
) -> None:
    """``device`` pushed ``nbytes`` to host ``to_host`` (inbox ``keys``), from
    ``began`` until the receiver answered."""
    if not RECORDER.on:
        return
    _add(
        {
            "kind": "push",
            "host": host,
            "device": device,
            "to_host": to_host,
            "keys": list(keys),
            "bytes": int(nbytes),
            "ts": began,
            "end": now_us(),
        }
    )


def pushing(answer: Any, host: int, device: int, target: Any, nbytes: int) -> None:
    """A push to ``target`` (a ``PushTarget``) was just sent; ``answer`` (its
    promise) settles when the receiver answered, and then :func:`push`
    records it."""
    if not RECORDER.on:
        return
    began, to_host, keys = now_us(), target.host_id, list(target.keys)
    answer.add_done_callback(lambda _: push(host, device, to_host, keys, nbytes, began))


def pulled(host: int, device: int, handle: Any, began: float) -> None:
    """``device`` fetched ``handle`` (a ``BufferHandle`` held by another host)
    from ``began`` until now: a transfer its reader asked for."""
    if not RECORDER.on:
        return
    _add(
        {
            "kind": "pull",
            "host": host,
            "device": device,
            "from_host": handle.host_id,
            "from_device": handle.device_id,
            "buffer": handle.id,
            "bytes": int(handle.nbytes),
            "ts": began,
            "end": now_us(),
        }
    )


def received(host: int, keys: Sequence[str], nbytes: int, began: float) -> None:
    """Host ``host`` took a pushed array (``nbytes``) into its inbox ``keys``."""
    if not RECORDER.on:
        return
    _add(
        {
            "kind": "received",
            "host": host,
            "keys": list(keys),
            "bytes": int(nbytes),
            "ts": began,
            "end": now_us(),
        }
    )


def control(name: str, lane: str, **args: Any) -> None:
    """A control-plane instant: ``name`` (e.g. ``"dispatch"``) in ``lane``
    (e.g. ``"island0"``), with ``args``. A ``client`` lane is the client's."""
    if not RECORDER.on:
        return
    host = CLIENT if lane == "client" else CONTROLLER
    _add({"kind": "control", "name": name, "lane": lane, "host": host, "ts": now_us(), **args})


# -- the Chrome trace event file -------------------------------------------------
def chrome_trace(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Recorded events (from any processes) as a Chrome trace event file.

    Process ids: 0 the client, 1 the controller, 2 + k host k. Thread ids: on
    a host, 0 for the host itself and 1 + d for device d; in the controller,
    one per lane (island). Times are relative to the first event.
    """
    events = sorted(events, key=lambda e: float(e["ts"]))
    origin = float(events[0]["ts"]) if events else 0.0
    info = _GangInfo.of(events)
    ends: dict[tuple[int, int], list[float]] = {}  # (host, device) -> when its gangs ended
    for event in events:
        if event["kind"] == "gang":
            ends.setdefault((event["host"], event["device"]), []).append(event["end"])
    for made in ends.values():
        made.sort()  # searched by bisection, per fetch
    out: list[dict[str, Any]] = []
    names: dict[tuple[int, int], str] = {}
    lanes: dict[str, int] = {}
    for event in events:
        kind = event["kind"]
        if kind == "gang":
            out += _gang_events(event, origin, info, names)
        elif kind == "push":
            out += _push_events(event, origin, names)
        elif kind == "pull":
            out += _pull_events(event, origin, names, ends)
        elif kind == "received":
            out += _received_events(event, origin, names)
        elif kind == "control":
            out.append(_control_event(event, origin, lanes, names))
    return {"traceEvents": _metadata(names) + out, "displayTimeUnit": "ms"}


def _pid(host: int) -> int:
    return {CLIENT: 0, CONTROLLER: 1}.get(host, host + 2)


def _process_name(pid: int) -> str:
    return {0: "client", 1: "controller"}.get(pid, f"host {pid - 2}")


def _metadata(names: dict[tuple[int, int], str]) -> list[dict[str, Any]]:
    meta: list[dict[str, Any]] = []
    for pid in sorted({pid for pid, _ in names}):
        meta.append(_meta("process_name", pid, 0, _process_name(pid)))
        meta.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": pid},
            }
        )
    for (pid, tid), name in sorted(names.items()):
        meta.append(_meta("thread_name", pid, tid, name))
        meta.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": pid,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    return meta


def _meta(what: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"ph": "M", "name": what, "pid": pid, "tid": tid, "args": {"name": name}}


@dataclass
class _GangInfo:
    """What the control plane knows of each gang: its island order position,
    and, from the client's run records, its program."""

    position: dict[str, int]
    island: dict[str, int]
    # (client, node name) -> the runs that have such a node: their times, programs
    runs: dict[tuple[Any, Any], tuple[list[float], list[Any]]]

    @classmethod
    def of(cls, events: Sequence[dict[str, Any]]) -> _GangInfo:
        """From ``events`` sorted by time."""
        dispatches = [e for e in events if e["kind"] == "control" and e["name"] == "dispatch"]
        runs: dict[tuple[Any, Any], tuple[list[float], list[Any]]] = {}
        for e in events:
            if e["kind"] == "control" and e["name"] == "run":
                for node in dict.fromkeys(e.get("nodes", ())):
                    times, programs = runs.setdefault((e.get("client"), node), ([], []))
                    times.append(float(e["ts"]))
                    programs.append(e.get("program"))
        return cls(
            {e["gang"]: int(e["position"]) for e in dispatches},
            {e["gang"]: int(e["island"]) for e in dispatches},
            runs,
        )

    def program(self, event: dict[str, Any]) -> str | None:
        """The program of the latest run by the gang's client, before the gang,
        that has a node of the gang's name."""
        times, programs = self.runs.get((event["client"], event["node"]), ([], []))
        found = bisect.bisect_right(times, float(event["ts"]))
        return programs[found - 1] if found else None


def _gang_events(
    event: dict[str, Any], origin: float, info: _GangInfo, names: dict[tuple[int, int], str]
) -> list[dict[str, Any]]:
    pid, tid = _pid(event["host"]), event["device"] + 1
    names[pid, tid] = f"device {event['device']}"
    args = {k: event[k] for k in ("gang", "node", "client", "device", "leader")}
    args["host"] = event["host"]
    gang_id = event["gang"]
    if gang_id in info.position:
        args["position"] = info.position[gang_id]
        args["island"] = info.island[gang_id]
    program = info.program(event)
    if program is not None:
        args["program"] = program
    return [
        {
            "ph": "X",
            "cat": "gang",
            "name": event["node"],
            "pid": pid,
            "tid": tid,
            "ts": event["ts"] - origin,
            "dur": max(event["end"] - event["ts"], 1.0),
            "args": args,
        }
    ]


def _flow_id(key: str) -> int:
    return zlib.crc32(key.encode())


def _push_events(
    event: dict[str, Any], origin: float, names: dict[tuple[int, int], str]
) -> list[dict[str, Any]]:
    pid, tid = _pid(event["host"]), event["device"] + 1
    names[pid, tid] = f"device {event['device']}"
    ts = event["ts"] - origin
    args = {
        "bytes": event["bytes"],
        "src_host": event["host"],
        "src_device": event["device"],
        "dst_host": event["to_host"],
        "keys": event["keys"],
    }
    out: list[dict[str, Any]] = [
        {
            "ph": "X",
            "cat": "transfer",
            "name": "push",
            "pid": pid,
            "tid": tid,
            "ts": ts,
            "dur": max(event["end"] - event["ts"], 1.0),
            "args": args,
        }
    ]
    for key in event["keys"]:
        out.append(_flow("s", key, pid, tid, ts))
    return out


def _pull_events(
    event: dict[str, Any],
    origin: float,
    names: dict[tuple[int, int], str],
    ends: dict[tuple[int, int], list[float]],
) -> list[dict[str, Any]]:
    """A fetch: a slice on the reader's device, an arrow from the holder's device."""
    pid, tid = _pid(event["host"]), event["device"] + 1
    src_pid, src_tid = _pid(event["from_host"]), event["from_device"] + 1
    names[pid, tid] = f"device {event['device']}"
    names[src_pid, src_tid] = f"device {event['from_device']}"
    ts, key = event["ts"] - origin, f"pull/{event['buffer']}/{event['device']}/{event['ts']}"
    args = {
        "bytes": event["bytes"],
        "src_host": event["from_host"],
        "src_device": event["from_device"],
        "dst_host": event["host"],
        "dst_device": event["device"],
    }
    pull = {"ph": "X", "cat": "transfer", "name": "fetch", "pid": pid, "tid": tid, "ts": ts}
    pull.update({"dur": max(event["end"] - event["ts"], 1.0), "args": args})
    # the arrow leaves the end of the gang that made the value, on its device
    made = ends.get((event["from_host"], event["from_device"]), [])
    last = bisect.bisect_right(made, event["ts"])  # the gangs that ended by then
    leaves = (made[last - 1] - origin - 0.5) if last else ts
    return [
        pull,
        _flow("s", key, src_pid, src_tid, leaves, "fetch"),
        _flow("f", key, pid, tid, ts, "fetch"),
    ]


def _received_events(
    event: dict[str, Any], origin: float, names: dict[tuple[int, int], str]
) -> list[dict[str, Any]]:
    pid = _pid(event["host"])
    names[pid, 0] = "host"
    ts = event["ts"] - origin
    slice_ = {
        "ph": "X",
        "cat": "transfer",
        "name": "receive",
        "pid": pid,
        "tid": 0,
        "ts": ts,
        "dur": max(event["end"] - event["ts"], 1.0),
        "args": {"bytes": event["bytes"], "dst_host": event["host"], "keys": event["keys"]},
    }
    return [slice_, *(_flow("f", key, pid, 0, ts) for key in event["keys"])]


def _flow(
    phase: str, key: str, pid: int, tid: int, ts: float, name: str = "push"
) -> dict[str, Any]:
    """One end of a flow arrow (``s`` its start, ``f`` its end), bound to the
    slice around it."""
    flow = {"ph": phase, "cat": "transfer", "name": name, "id": _flow_id(key)}
    flow.update({"pid": pid, "tid": tid, "ts": ts})
    if phase == "f":
        flow["bp"] = "e"  # binds to the enclosing slice (the receive)
    return flow


def _control_event(
    event: dict[str, Any], origin: float, lanes: dict[str, int], names: dict[tuple[int, int], str]
) -> dict[str, Any]:
    pid = _pid(event["host"])
    tid = lanes.setdefault(event["lane"], len(lanes))
    names[pid, tid] = event["lane"]
    args = {k: v for k, v in event.items() if k not in ("kind", "name", "lane", "host", "ts")}
    return {
        "ph": "i",
        "s": "t",
        "cat": "control",
        "name": event["name"],
        "pid": pid,
        "tid": tid,
        "ts": event["ts"] - origin,
        "args": args,
    }
