"""``atoll dashboard``: a small web page served from the controller process.

:class:`Dashboard` runs inside the process of ``atoll up`` (the
``ClusterBuilder`` starts it on request). It serves, on 127.0.0.1 by default:

* ``/``: one page (HTML and a little JavaScript, no external assets) that
  polls the API every two seconds and draws hosts and their health, device
  utilization over the last minute, sessions, store usage, and the last
  recorded timeline;
* ``/api/status``: ``{"rows": [...], "utilization": {device: fraction},
  "window_s": ...}``; the rows are ``atoll status``'s;
* ``/api/timeline``: the last timeline ``atoll timeline`` recorded (Chrome
  trace JSON).

Every request must show the cluster token: header ``X-Atoll-Token: HEX`` or
cookie ``atoll_token=HEX``. Opening ``/?token=HEX`` once sets the cookie.
Utilization comes from sampling every device's busy time once a second.

The HTTP is asyncio's streams and a few lines of parsing: GET only, one
request per connection. It needs no package beyond atoll's own.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..devices import Device
from ..kernel import ActorRef, AtollError

__all__ = ["Dashboard", "timeline_page"]

WINDOW_S = 60.0  # utilization is over this much of the past
_MAX_REQUEST = 16 << 10


class Dashboard:
    """The web page of one cluster, served from the controller's loop."""

    def __init__(
        self,
        token: bytes,
        status: Callable[[], Awaitable[list[dict[str, Any]]]],
        devices: Sequence[ActorRef[Device]],
    ) -> None:
        self.token = token
        self.status = status
        self.devices = list(devices)
        self.samples: dict[int, deque[tuple[float, float]]] = {}  # device -> (t, busy_s)
        self.timeline: dict[str, Any] = {"traceEvents": []}
        self.server: asyncio.Server | None = None
        self._sampler: asyncio.Task[None] | None = None
        self.address = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen (once); the page's URL."""
        if self.server is None:
            self.server = await asyncio.start_server(self._serve, host, port)
            bound = self.server.sockets[0].getsockname()
            self.address = f"http://{host}:{bound[1]}/"
            self._sampler = asyncio.ensure_future(self._sample_forever())
        return self.address

    async def aclose(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with suppress(asyncio.CancelledError):
                await self._sampler
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    # -- utilization -------------------------------------------------------------
    async def _sample_forever(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(1.0)

    async def sample(self) -> None:
        """Record every device's busy time now (a device that fails is skipped)."""
        now = time.monotonic()
        for promise in [device.stats() for device in self.devices]:
            with suppress(AtollError):
                stats = await promise
                window = self.samples.setdefault(stats.device_id, deque())
                window.append((now, stats.busy_s))
                while window and window[0][0] < now - WINDOW_S:
                    window.popleft()

    def utilization(self) -> dict[int, float]:
        """Per device: busy time over wall time, over the samples in the window."""
        out = {}
        for device, window in sorted(self.samples.items()):
            if len(window) >= 2 and window[-1][0] > window[0][0]:
                busy = window[-1][1] - window[0][1]
                out[device] = max(0.0, min(1.0, busy / (window[-1][0] - window[0][0])))
            else:
                out[device] = 0.0
        return out

    # -- HTTP --------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            if len(head) > _MAX_REQUEST:
                raise ValueError("request too large")
            status, headers, body = await self._answer(head.decode("latin-1"))
        except (ValueError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            status, headers, body = "400 Bad Request", {}, b"bad request"
        headers.setdefault("Content-Type", "text/plain; charset=utf-8")
        lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Connection: close"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        with suppress(ConnectionError):
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()
        writer.close()

    async def _answer(self, head: str) -> tuple[str, dict[str, str], bytes]:
        method, target, _ = head.split("\r\n", 1)[0].split(" ", 2)
        headers = _headers(head)
        url = urlsplit(target)
        given = parse_qs(url.query).get("token", [""])[0]
        if method != "GET":
            return "405 Method Not Allowed", {}, b"GET only"
        if given and self._allowed(given):  # log in once: the cookie carries it
            cookie = f"atoll_token={given}; HttpOnly; SameSite=Strict; Path=/"
            return "303 See Other", {"Location": "/", "Set-Cookie": cookie}, b""
        if not self._allowed(headers.get("x-atoll-token") or _cookie(headers)):
            return "401 Unauthorized", {}, b"the cluster token is needed (X-Atoll-Token or ?token=)"
        if url.path == "/":
            return "200 OK", {"Content-Type": "text/html; charset=utf-8"}, PAGE.encode()
        if url.path == "/api/status":
            data = {
                "rows": await self.status(),
                "utilization": self.utilization(),
                "window_s": WINDOW_S,
            }
            return "200 OK", {"Content-Type": "application/json"}, json.dumps(data).encode()
        if url.path == "/api/timeline":
            body = json.dumps(self.timeline).encode()
            return "200 OK", {"Content-Type": "application/json"}, body
        return "404 Not Found", {}, b"not found"

    def _allowed(self, given: str) -> bool:
        try:
            return hmac.compare_digest(bytes.fromhex(given), self.token)
        except ValueError:
            return False


def _headers(head: str) -> dict[str, str]:
    out = {}
    for line in head.split("\r\n")[1:]:
        name, sep, value = line.partition(":")
        if sep:
            out[name.strip().lower()] = value.strip()
    return out


def _cookie(headers: dict[str, str]) -> str:
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == "atoll_token":
            return value
    return ""


def timeline_page(document: dict[str, Any], title: str = "atoll timeline") -> str:
    """A standalone HTML page that draws ``document`` (a timeline, as Chrome
    trace JSON) as the dashboard does: one lane per device, gangs as bars,
    transfers as arrows. (``atoll demo --timeline-page``; a headless browser
    can screenshot it.)"""
    data = json.dumps(document).replace("</", "<\\/")
    return TIMELINE_PAGE.replace("%TITLE%", title).replace("%TIMELINE%", data)


TIMELINE_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>%TITLE%</title>
<style>body{font:13px system-ui,sans-serif;margin:12px;color:#222}
svg text{font:11px sans-serif}</style></head>
<body><h3>%TITLE%</h3><svg id="timeline" width="1100" height="40"></svg>
<script>
const timeline = %TIMELINE%;
const names = {};
for (const e of timeline.traceEvents)
  if (e.ph === "M" && e.name === "thread_name") names[e.pid + "/" + e.tid] = e.args.name;
  else if (e.ph === "M" && e.name === "process_name") names[e.pid] = e.args.name;
const slices = timeline.traceEvents.filter(e => e.ph === "X");
const lanes = [...new Set(slices.map(e => e.pid + "/" + e.tid))]
  .sort((a, b) => a.split("/").map(Number) < b.split("/").map(Number) ? -1 : 1);
const end = Math.max(...slices.map(e => e.ts + e.dur)), x = 900 / end, h = 22;
const svg = document.getElementById("timeline");
svg.setAttribute("height", h * lanes.length + 40);
let out = "";
lanes.forEach((l, i) => {
  const [pid] = l.split("/");
  out += `<text x=0 y=${h * i + 15}>${names[pid] || pid} · ${names[l] || l}</text>`;
  out += `<line x1=150 x2=1060 y1=${h * i + h} y2=${h * i + h} stroke="#eee"/>`;
});
const lane = e => lanes.indexOf(e.pid + "/" + e.tid);
for (const e of slices) {
  const gang = e.cat === "gang";
  out += `<rect x=${150 + e.ts * x} y=${h * lane(e) + (gang ? 3 : 12)}
    width=${Math.max(1.5, e.dur * x)} height=${gang ? 16 : 7}
    fill="${gang ? "#4682b4" : "#e0803c"}">
    <title>${e.name} ${JSON.stringify(e.args)}</title></rect>`;
}
const flows = {};
for (const e of timeline.traceEvents.filter(e => e.ph === "s" || e.ph === "f"))
  (flows[e.id] = flows[e.id] || {})[e.ph] = e;
for (const f of Object.values(flows)) if (f.s && f.f)
  out += `<line x1=${150 + f.s.ts * x} y1=${h * lane(f.s) + 11} x2=${150 + f.f.ts * x}
    y2=${h * lane(f.f) + 11} stroke="#c33" stroke-width=1 marker-end="url(#a)"/>`;
out += `<defs><marker id=a markerWidth=6 markerHeight=6 refX=5 refY=3 orient=auto>
  <path d="M0,0 L6,3 L0,6 z" fill="#c33"/></marker></defs>`;
out += `<text x=150 y=${h * lanes.length + 30}>0 ms</text>
  <text x=1000 y=${h * lanes.length + 30}>${(end / 1000).toFixed(1)} ms</text>`;
svg.innerHTML = out;
document.body.dataset.slices = slices.length;
</script></body></html>
"""


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>atoll</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
.lost{color:#b00;font-weight:bold}.alive{color:#070}
.bar{display:inline-block;height:10px;background:#48c;vertical-align:middle}
svg text{font:10px sans-serif}
</style></head>
<body><h1>atoll</h1>
<h2>hosts</h2><table id="hosts"></table>
<h2>devices (utilization, last minute)</h2><table id="devices"></table>
<h2>sessions</h2><table id="sessions"></table>
<h2>last recorded timeline</h2><svg id="timeline" width="900" height="40"></svg>
<script>
function table(id, rows) {
  const el = document.getElementById(id); el.innerHTML = "";
  if (!rows.length) { el.innerHTML = "<tr><td>none</td></tr>"; return; }
  const cols = [...new Set(rows.flatMap(r => Object.keys(r)))].filter(c => c !== "kind");
  el.insertRow().innerHTML = cols.map(c => "<th>" + c + "</th>").join("");
  for (const r of rows) {
    const tr = el.insertRow();
    if ("alive" in r) tr.className = r.alive ? "alive" : "lost";
    tr.dataset.kind = r.kind || "";
    for (const c of cols) {
      const v = r[c];
      tr.insertCell().textContent = c === "alive" ? (v ? "alive" : "lost")
        : v === null || v === undefined ? "" : Array.isArray(v) ? v.join(",") : String(v);
    }
  }
}
async function refresh() {
  const s = await (await fetch("/api/status")).json();
  table("hosts", s.rows.filter(r => r.kind === "host"));
  table("sessions", s.rows.filter(r => r.kind === "session"));
  const dev = document.getElementById("devices");
  dev.innerHTML = "<tr><th>device</th><th>busy</th></tr>";
  for (const [d, u] of Object.entries(s.utilization)) {
    dev.insertRow().innerHTML = "<td>" + d + "</td><td><span class=bar style='width:" +
      Math.round(200 * u) + "px'></span> " + (100 * u).toFixed(1) + "%</td>";
  }
  document.body.dataset.hosts = s.rows.filter(r => r.kind === "host").length;
  document.body.dataset.lost = s.rows.filter(r => r.kind === "host" && !r.alive).length;
}
async function timeline() {
  const t = await (await fetch("/api/timeline")).json();
  const gangs = t.traceEvents.filter(e => e.cat === "gang");
  const svg = document.getElementById("timeline"); svg.innerHTML = "";
  if (!gangs.length) return;
  const lanes = [...new Set(gangs.map(e => e.pid + "/" + e.tid))].sort();
  const end = Math.max(...gangs.map(e => e.ts + e.dur)), x = 800 / end;
  svg.setAttribute("height", 14 * lanes.length + 10);
  lanes.forEach((l, i) => svg.innerHTML += `<text x=0 y=${14 * i + 11}>${l}</text>`);
  for (const e of gangs) {
    const y = 14 * lanes.indexOf(e.pid + "/" + e.tid);
    svg.innerHTML += `<rect x=${90 + e.ts * x} y=${y + 2} width=${Math.max(1, e.dur * x)}
      height=10 fill="#48c"><title>${e.name} ${JSON.stringify(e.args)}</title></rect>`;
  }
}
refresh(); timeline();
setInterval(refresh, 2000); setInterval(timeline, 10000);
</script></body></html>
"""
