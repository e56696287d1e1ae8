"""``atoll dashboard`` and ``/metrics``: the controller process's web server.

:class:`Dashboard` runs inside the process of ``atoll up`` (the
``ClusterBuilder`` starts it with ``atoll up --http`` or on request, with
``atoll dashboard``). It serves, on 127.0.0.1 by default:

* ``/``: one page (HTML and a little JavaScript, no external assets) that
  polls the API every two seconds and draws hosts and their health, device
  utilization over the last minute, sessions, store usage, and the last
  recorded timeline;
* ``/api/status``: ``{"rows": [...], "utilization": {device: fraction},
  "window_s": ...}``; the rows are ``atoll status``'s;
* ``/api/timeline``: the last timeline ``atoll timeline`` recorded (Chrome
  trace JSON);
* ``/metrics``: the cluster's metrics in Prometheus' text format
  (``runtime/control/metrics.py``), gathered from every part at each scrape.

Every request must show the cluster token: header ``Authorization: Bearer
HEX`` (what Prometheus sends), header ``X-Atoll-Token: HEX`` or cookie
``atoll_token=HEX``. Opening ``/?token=HEX`` once sets the cookie.
Utilization comes from sampling every device's busy time once a second.

The HTTP is starlette's, served by hypercorn on the controller's asyncio
loop (keep-alive, ``HEAD``, limits and errors as they do them): the
``dashboard`` extra, ``pip install 'atoll[dashboard]'``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from ...devices import Host
from ...kernel import ActorRef, AtollError
from ..control.metrics import LoopLag, collect, render, within

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

__all__ = ["Dashboard", "timeline_page"]

WINDOW_S = 60.0  # utilization is over this much of the past
SAMPLE_TIMEOUT_S = 2.0  # a host that does not answer a sample by then is skipped
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_log = logging.getLogger("atoll.web")


class Dashboard:
    """The web page and the metrics of one cluster, served from the
    controller's loop. ``controller`` gives the controller once the cluster
    is built (None until then)."""

    def __init__(
        self,
        token: bytes,
        status: Callable[[], Awaitable[list[dict[str, Any]]]],
        hosts: Sequence[ActorRef[Host]],
        controller: Callable[[], Any | None] = lambda: None,
    ) -> None:
        self.token = token
        self.status = status
        self.hosts = hosts  # the builder's own list: a host that rejoined shows
        self.controller = controller
        self.samples: dict[int, deque[tuple[float, float]]] = {}  # device -> (t, busy_s)
        self.timeline: dict[str, Any] = {"traceEvents": []}
        self.lag = LoopLag()
        self.address = ""
        self._stop: asyncio.Event | None = None
        self._server: asyncio.Task[None] | None = None
        self._sampler: asyncio.Task[None] | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen (once); the page's URL."""
        if self._server is None:
            config, bound = _config(host, port)
            from hypercorn.asyncio import serve

            self._stop = asyncio.Event()
            self._server = asyncio.ensure_future(
                serve(self.app(), config, shutdown_trigger=self._stop.wait)
            )
            self._server.add_done_callback(_log_if_failed)
            self.address = f"http://{host}:{bound}/"
            self._sampler = asyncio.ensure_future(self._sample_forever())
            self.lag.start()
        return self.address

    async def aclose(self) -> None:
        await self.lag.stop()
        if self._sampler is not None:
            self._sampler.cancel()
            with suppress(asyncio.CancelledError):
                await self._sampler
        if self._server is not None and self._stop is not None:
            self._stop.set()
            with suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._server, 5.0)

    # -- utilization -------------------------------------------------------------
    async def _sample_forever(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(1.0)

    async def sample(self) -> None:
        """Record every device's busy time now, as its host reads it (a host
        that fails is skipped)."""
        now = time.monotonic()
        deadline = asyncio.get_running_loop().time() + SAMPLE_TIMEOUT_S
        for promise in [host.device_stats() for host in self.hosts]:
            for stats in await within(promise, deadline) or []:  # a silent host: skipped
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
    def app(self) -> Any:
        """The ASGI application (starlette): routes behind the token."""
        from starlette.applications import Starlette
        from starlette.routing import Route

        routes = [
            Route("/", self._page),
            Route("/api/status", self._api_status),
            Route("/api/timeline", self._api_timeline),
            Route("/metrics", self._metrics),
        ]
        return Starlette(routes=routes)

    def _refused(self, request: Request) -> Response | None:
        """None if ``request`` shows the token; else the answer that says so."""
        from starlette.responses import PlainTextResponse

        bearer = request.headers.get("authorization", "")
        given = (
            bearer[7:].strip()
            if bearer[:7].lower() == "bearer "
            else request.headers.get("x-atoll-token") or request.cookies.get("atoll_token", "")
        )
        if self._allowed(given):
            return None
        return PlainTextResponse(
            "the cluster token is needed (Authorization: Bearer, X-Atoll-Token or ?token=)",
            401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    async def _page(self, request: Request) -> Response:
        from starlette.responses import HTMLResponse, RedirectResponse

        given = request.query_params.get("token", "")
        if given and self._allowed(given):  # log in once: the cookie carries it
            answer = RedirectResponse("/", 303)
            answer.set_cookie("atoll_token", given, httponly=True, samesite="strict")
            return answer
        return self._refused(request) or HTMLResponse(PAGE)

    async def _api_status(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        if (refused := self._refused(request)) is not None:
            return refused
        data = {
            "rows": await self.status(),
            "utilization": self.utilization(),
            "window_s": WINDOW_S,
        }
        return JSONResponse(data)

    async def _api_timeline(self, request: Request) -> Response:
        from starlette.responses import Response

        if (refused := self._refused(request)) is not None:
            return refused
        return Response(json.dumps(self.timeline), media_type="application/json")

    async def _metrics(self, request: Request) -> Response:
        from starlette.responses import Response

        if (refused := self._refused(request)) is not None:
            return refused
        controller = self.controller()
        snapshot = await collect(self.status, self.hosts, controller, self.lag)
        return Response(render(snapshot), media_type=METRICS_TYPE)

    def _allowed(self, given: str) -> bool:
        try:
            return hmac.compare_digest(bytes.fromhex(given), self.token)
        except ValueError:
            return False


def _log_if_failed(server: asyncio.Task[None]) -> None:
    """The server stopped by itself: say why (it is not asked again)."""
    if not server.cancelled() and server.exception() is not None:
        _log.error("the web server stopped: %s", server.exception())


def _config(host: str, port: int) -> tuple[Any, int]:
    """Hypercorn's configuration, with a socket bound here (so that port 0
    gives a port we know), and that port."""
    try:
        from hypercorn.config import Config
    except ImportError:  # the extra is not installed
        raise AtollError(
            "the dashboard and /metrics need the dashboard extra: pip install 'atoll[dashboard]'"
        ) from None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    bound = sock.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns it from here
    config.accesslog = None
    config.errorlog = _log
    config.graceful_timeout = 1.0
    return config, bound


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
