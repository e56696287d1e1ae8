"""A cluster of real processes: ``atoll up`` and ``atoll host --join``.

The controller process serves its actor system over Cap'n Proto and runs a
:class:`ClusterBuilder` (named ``"cluster"``). Each host process serves a node
of its own, connects to the controller and calls ``cluster.join(node)``; the
builder spawns a ``Host`` actor (with its devices) *on that node*, over the
wire. Once every expected host has joined, the builder starts the island
schedulers and the controller actor in the controller process, with the
remote device references. Clients then get the same :class:`Cluster` handle
as in-process, through ``atoll.connect``: the actor code is the same, only the
transport differs.

A host whose process dies (its connection drops) fails the calls pending on
it with ``HostLost``. :meth:`ClusterBuilder.status` asks every host, with a
timeout, and reports the ones that died or stopped answering as lost. A host
that freezes without its connection dropping (SIGSTOP, a link that goes
silent) is noticed by the controller's heartbeat on each host link
(:func:`host_heartbeat`): the link is given up and its pending calls fail
with ``HostLost`` too. A new host process that joins once the cluster is
complete takes the place of a lost host (:meth:`ClusterBuilder.join`), with
its host id and device ids and an empty store.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
import itertools
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from ...devices import Device, Host
from ...devices._host import on_leave
from ...devices._plane import ProcessPlane, use_plane
from ...kernel import Actor, ActorRef, ActorSystem, AtollError, NodeActor, Promise, endpoint, logs
from ...kernel.config import env_name, launched, settings
from ...transports.capnp import (
    CapnpListener,
    CapnpTransport,
    ClusterFile,
    capnp_runtime,
    default_token,
    directory,
    peer_of,
    stop_on_signals,
)
from ...transports.dataplane import shm
from ...transports.processes import reap
from ..control.controller import Controller, spawn_control
from ..control.island import IslandScheduler
from ..control.metrics import Snapshot, collect
from ..control.sessions import SessionWatcher
from ..runlanes import HostLanes, lanes_on
from ..tools.dashboard import Dashboard
from ..tools.status import cluster_status
from ..topology import Topology
from .spec import ClusterSpec

if TYPE_CHECKING:
    from ..client.client import Cluster, HostLinks
    from ..runlanes import Caller

_log = logging.getLogger(__name__)

__all__ = [
    "ClusterBuilder",
    "ClusterInfo",
    "process_cluster",
    "run_host",
    "run_up",
]


@dataclass(frozen=True)
class ClusterInfo:
    """What a client needs to drive the cluster (travels as a pickled value).

    ``sessions`` is where a remote client opens its session, which gives it an
    owner label of its own and frees what it owns when its connection closes.
    """

    controller: ActorRef[Controller]
    topology: Topology
    devices: list[ActorRef[Device]]
    hosts: list[ActorRef[Host]]
    sessions: ActorRef[SessionWatcher]

    def client(
        self,
        system: ActorSystem,
        owner: str,
        direct: HostLinks | None = None,
        lane: Caller | None = None,
    ) -> Cluster:
        """A :class:`Cluster` handle on this cluster, for ``owner``, in
        ``system``; ``direct``: host processes over the client's own links;
        ``lane``: its call lane to the controller."""
        from ..client.client import Cluster

        return Cluster(
            system,
            self.controller,
            self.topology,
            self.devices,
            self.hosts,
            owner,
            direct=direct,
            lane=lane,
        )


class ClusterBuilder(Actor):
    """Collects hosts as they join; builds the cluster when all are in.

    Building starts the island schedulers, the controller and the
    :class:`SessionWatcher` (``"sessions"``) as children of this actor.
    """

    def __init__(
        self,
        spec: ClusterSpec,
        on_shutdown: Callable[[], None] | None = None,
        token: bytes = b"",
        jax_env: Mapping[str, str] | None = None,
        interface: str = "",
    ) -> None:
        self.spec = spec
        self.jax_env = dict(jax_env or {})  # the JAX runtime the launcher serves, if any
        self.token = token  # what the dashboard asks of its visitors
        self.interface = interface  # where the controller listens: clients' call lanes too
        self.web: Dashboard | None = None
        self.last_timeline: dict[str, Any] = {"traceEvents": []}
        self.on_shutdown = on_shutdown  # what `atoll down` (shutdown) sets off
        self.jax_ids = itertools.count(spec.local_hosts)  # JAX process ids of joiners
        self.islands: list[ActorRef[IslandScheduler]] = []
        self.sessions: ActorRef[SessionWatcher] | None = None
        self.topology = spec.topology
        self.hosts: list[ActorRef[Host]] = []
        self.labels: list[str] = []
        self.devices: list[ActorRef[Device]] = []
        self.lost: dict[int, str] = {}
        self.ready: Promise[ClusterInfo] = Promise("cluster ready")

    @endpoint
    async def join(self, node: ActorRef[NodeActor], label: str) -> int:
        """A host offers its node; returns the host id it was given.

        Once every host has joined, a host can still join in the place of
        one that was lost (:meth:`_rejoin`); otherwise the cluster is full.
        """
        host_id, spec = len(self.hosts), self.spec
        if host_id >= spec.hosts:
            return await self._rejoin(node, label)
        host = await self._spawn_host(node, host_id)
        self.devices += await host.devices()
        self.hosts.append(host)
        self.labels.append(label)
        if len(self.hosts) == spec.hosts:
            self._build()
        return host_id

    async def _spawn_host(self, node: ActorRef[NodeActor], host_id: int) -> ActorRef[Host]:
        """Host ``host_id``'s actor (and its devices) on ``node``, its link watched."""
        spec = self.spec
        host_cls = spec.host_cls
        host: ActorRef[Host] = await node.spawn(
            f"{host_cls.__module__}:{host_cls.__qualname__}",
            host_id,
            self.topology.island_of_host(host_id),
            self.topology.on_host(host_id),
            spec.device_cls,
            spec.cost,
            spec.store_bytes,
            name=f"host{host_id}",
            settings=spec.settings.cluster(),
        )
        link = peer_of(node)
        if link is not None:  # a dead host's shared memory goes with it
            link.on_close(_sweep)
            link.on_close(functools.partial(self._host_gone, host_id))
            link.watch(node, *host_heartbeat())  # a frozen host is lost too
        return host

    async def _rejoin(self, node: ActorRef[NodeActor], label: str) -> int:
        """A new host process takes the place of a lost one: same host id,
        same device ids, a fresh (empty) store. The controller and the
        islands are told (``Controller.replace_host``); clients get the new
        references from ``cluster()`` (a handle taken before keeps the old
        ones, which fail with ``HostLost``). Not for a JAX runtime, whose
        process count is fixed at its start."""
        if self.spec.device_cls.host_cls is not None:  # a JaxHost: see docs/reliability.md
            raise AtollError("the cluster is full: a lost JAX host cannot rejoin its runtime")
        host_id = next((i for i, ref in enumerate(self.hosts) if _link_lost(ref)), None)
        if host_id is None:
            raise AtollError(f"the cluster is full ({self.spec.hosts} hosts)")
        host = await self._spawn_host(node, host_id)
        devices = await host.devices()
        for device_id, ref in zip(self.topology.on_host(host_id), devices, strict=True):
            self.devices[device_id] = ref
        self.hosts[host_id], self.labels[host_id] = host, label
        self.lost.pop(host_id, None)
        info = self.ready.result()
        await info.controller.replace_host(host_id, host, devices)
        _log.info("host %s rejoined (%s)", host_id, label)
        return host_id

    def _host_gone(self, host_id: int, _: str) -> None:
        """A host's link closed: the controller re-places its slices (onto
        spares), unless it left because it was drained."""
        if self.ready.done() and self.ready.exception() is None:
            lost = self.ready.result().controller.host_lost(host_id)
            lost.add_done_callback(_drop)

    def _build(self) -> None:
        controller = spawn_control(
            self.ctx.spawn,
            self.topology,
            self.devices,
            self.hosts,
            self.spec.policies,
            push=self.spec.push,
            spare_hosts=self.spec.spare_hosts,
            token=self.token,
            interface=self.interface,
        )
        sessions = self.ctx.spawn(SessionWatcher, controller, name="sessions")
        self.sessions = sessions
        self.islands = [
            ref for ref in self.ctx.children if re.fullmatch(r"island\d+", ref.name.split("/")[-1])
        ]
        info = ClusterInfo(controller, self.topology, self.devices, self.hosts, sessions)
        self.ready.set_result(info)

    @endpoint
    def cluster(self) -> Promise[ClusterInfo]:
        """The cluster, once every host has joined (a promise until then)."""
        return self.ready

    @endpoint
    def config_rows(self) -> list[tuple[str, str, str, str, str]]:
        """The settings this cluster runs with (``atoll config --cluster``):
        the launcher's, whose cluster-scoped ones every host took when it
        joined; (variable, value, default, scope, doc) each."""
        return self.spec.settings.rows()

    @endpoint
    async def status(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Rows for ``atoll status`` (see ``runtime/tools/status.py``): every joined
        host (lost if it did not answer within ``timeout``), every island's
        queued and running gangs, every open session, what changed lately
        (moves, drains: ``runtime/control/elastic.py``)."""
        return await self._status(timeout)

    @endpoint
    async def drain(self, host_id: int) -> dict[str, Any]:
        """Drain host ``host_id`` (``Controller.drain_host``): what a host
        asked to stop calls, and ``atoll drain``."""
        info = await self.ready
        report: dict[str, Any] = await info.controller.drain_host(host_id)
        return report

    @endpoint
    def jax_runtime(self) -> dict[str, str]:
        """What a host joining from elsewhere needs to join the hosts' JAX
        runtime (``atoll up --device jax``): the coordinator, the number of
        processes and an id of its own. Empty when there is no such runtime."""
        from ...devices.jax.multi import COORDINATOR, LOCAL, PROCESS_ID, PROCESSES

        runtime = self.jax_env or {
            k: os.environ[k] for k in (COORDINATOR, PROCESSES) if k in os.environ
        }
        if COORDINATOR not in runtime or PROCESSES not in runtime:
            return {}
        return {**runtime, PROCESS_ID: str(next(self.jax_ids)), LOCAL: "1"}

    @endpoint
    async def dashboard(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve the dashboard from this process (once); its URL
        (``runtime/tools/dashboard.py``). It asks for the cluster token."""
        if not self.token:
            raise AtollError("this cluster has no token to protect a dashboard with")
        if self.web is None:
            web = Dashboard(self.token, self._status_now, self.hosts, self._controller)
            web.timeline = self.last_timeline
            self.web = web
        return await self.web.start(host, port)

    @endpoint
    def metrics(self) -> Promise[Snapshot]:
        """What ``/metrics`` shows, as values (``runtime/control/metrics.py``): for
        ``atoll top``, which needs no web server. Gathered beside the message
        loop (a host's ``join`` does not wait behind a slow scrape)."""
        answer: Promise[Snapshot] = Promise("metrics")
        self.ctx.start_soon(self._collect, answer)
        return answer

    async def _collect(self, answer: Promise[Snapshot]) -> None:
        lag = self.web.lag if self.web is not None else None
        try:
            answer.set_result(await collect(self._status_now, self.hosts, self._controller(), lag))
        except Exception as exc:  # said to the asker, not lost in a task
            answer.set_exception(exc)

    def _controller(self) -> ActorRef[Controller] | None:
        """The controller, once the cluster is built."""
        ready = self.ready
        return ready.result().controller if ready.done() and not ready.exception() else None

    async def _status_now(self) -> list[dict[str, Any]]:
        return await self._status(2.0)

    async def _status(self, timeout: float) -> list[dict[str, Any]]:
        ready = self.ready
        built = ready.done() and not ready.exception()
        controller = ready.result().controller if built else None
        hosts, labels, lost = self.hosts, self.labels, self.lost
        return await cluster_status(
            hosts, labels, self.topology, lost, self.islands, self.sessions, timeout, controller
        )

    @endpoint
    def keep_timeline(self, document: dict[str, Any]) -> None:
        """Keep the last recorded timeline (``atoll timeline``), for the dashboard."""
        self.last_timeline = document
        if self.web is not None:
            self.web.timeline = document

    async def on_stop(self) -> None:
        if self.web is not None:
            await self.web.aclose()

    @endpoint
    def log(self, host_id: int, level: int, line: str) -> None:
        """A record a host on another machine logged: print it here, after
        ``host N | ``, as the hosts started here print theirs."""
        print(f"host {host_id} | {line}", file=sys.stderr, flush=True)

    @endpoint
    def shutdown(self) -> bool:
        """Stop the cluster, as SIGTERM to ``atoll up`` does (``atoll down``).

        The launcher stops its hosts and exits; the connection this call came
        over then closes. False if this builder has no launcher to stop.
        """
        if self.on_shutdown is None:
            return False
        self.on_shutdown()
        return True


async def _take_jax_runtime(builder: Any) -> None:
    """A joining host takes the JAX runtime's parameters from the controller,
    unless it was given them (``--jax-coordinator``, or started by ``atoll up``)."""
    from ...devices.jax.multi import COORDINATOR

    if COORDINATOR not in os.environ:
        os.environ.update(await builder.jax_runtime())


def _forward_log(
    loop: asyncio.AbstractEventLoop, builder: Any, host_id: int, _: str, level: int, line: str
) -> None:
    """A host's log record, sent to the controller from the loop (whatever
    thread logged it); a send that fails is dropped, not logged again."""
    loop.call_soon_threadsafe(lambda: builder.log(host_id, level, line).add_done_callback(_drop))


def _drop(sent: Promise[Any]) -> None:
    sent.exception()  # observed: a lost log line is not worth a warning of its own


def host_heartbeat() -> tuple[float, float]:
    """How often the controller pings each host, and how long it waits for
    the answer before the host counts as lost (``HostLost``): seconds, from
    ``ATOLL_HOST_HEARTBEAT="EVERY,TIMEOUT"``, by default every 2 s with 8 s
    to answer. A frozen host is noticed within their sum. The timeout must
    exceed the longest time a host's event loop can be busy (a long compile
    that holds it), or a busy host is taken for a frozen one."""
    return settings().host_heartbeat


def _sweep(_: str) -> None:
    shm.sweep()


def _collect_garbage_on_loop(loop: asyncio.AbstractEventLoop, every: float = 0.05) -> None:
    """Collect cyclic garbage on ``loop``'s thread only, from now on.

    A pycapnp object must be destroyed on the thread of its event loop. Left
    to itself, the collector runs on whichever thread allocates past its
    threshold: a device's worker thread (where JAX runs) would then destroy
    capnp objects in garbage cycles (a failed call's error and traceback),
    and the process abort ("No event loop is running on this thread"). So
    automatic collection is off, and the loop collects instead, by the
    collector's own thresholds, looked at every ``every`` seconds.
    """
    gc.disable()

    def check() -> None:
        counts, limits = gc.get_count(), gc.get_threshold()
        due = [g for g in (2, 1, 0) if limits[g] and counts[g] > limits[g]]
        if due:
            gc.collect(due[0])
        loop.call_later(every, check)

    loop.call_later(every, check)


def _link_lost(host: ActorRef[Host]) -> bool:
    """Whether ``host`` is a host process whose link is gone (dead or given up)."""
    link = peer_of(host)
    return link is not None and link.closed is not None


# -- processes ---------------------------------------------------------------------
def _die_with_parent() -> None:
    """In a host process: get SIGINT (stop at once) when the launcher dies (Linux).

    Set by the child itself (a ``preexec_fn`` would force a plain fork, which
    JAX's at-fork hook rightly warns about). ``ATOLL_PARENT_PID`` closes the
    race in which the launcher died before this ran.
    """
    with suppress(OSError):  # not Linux: the parent's own cleanup has to do
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG
    expected = launched("parent_pid")
    if expected is not None and os.getppid() != expected:
        raise SystemExit("atoll host: the launcher is already gone")


def _start_hosts(
    count: int, address: str, token: bytes, devices: int, jax_env: Mapping[str, str]
) -> list[subprocess.Popen[bytes]]:
    """Start ``count`` host processes here that join the controller at ``address``.

    They also get the parameters of one ``jax.distributed`` runtime (see
    ``devices/jax/multi.py``; ``atoll up`` with remote hosts sets them in this
    process's environment first): JAX hosts join it when their devices
    start, so that a gang over several hosts runs as one SPMD program;
    simulated hosts ignore it. Each gets its start index as its JAX process id.
    ``jax_env``: the runtime this process serves (:func:`_jax_runtime`), if any.
    """
    from ...devices.jax.multi import LOCAL, PROCESS_ID, coordinator_env

    env = dict(os.environ, **settings().to_env())  # this process's settings, as they are
    env.update({env_name("token"): token.hex(), env_name("parent_pid"): str(os.getpid())})
    env[LOCAL] = "1"  # a JaxDevice takes its host's own JAX devices
    env.update(coordinator_env(count))
    env.update(jax_env)
    if "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
        # without accelerators, give each host process enough fake CPU devices
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    command = [sys.executable, "-m", "atoll.cli", "host", "--join", address]
    # close_fds=False lets subprocess use posix_spawn: no fork, so no at-fork
    # hooks (JAX warns in one, rightly, for forks of a threaded process). Our
    # own descriptors are non-inheritable anyway.
    return [
        subprocess.Popen(command, env=dict(env, **{PROCESS_ID: str(i)}), close_fds=False)
        for i in range(count)
    ]


async def _stop_hosts(processes: list[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
    """SIGINT every host (stop now: SIGTERM would have each drain itself
    first), give them ``grace`` s in all to exit, then SIGKILL the rest; then
    sweep the shared-memory segments of dead processes.

    The waiting happens in a worker thread, so this event loop keeps serving
    (the hosts' goodbyes included) meanwhile; shielded, so that a cancelled
    caller still reaps them. The first host stops last: when a coordinator
    was named (``--jax-coordinator``), JAX process 0 serves the hosts'
    ``jax.distributed`` runtime, which the others leave as they exit, and
    which does not wait for them (recoverability is on): one that finds it
    gone aborts.
    """
    deadline = time.monotonic() + grace
    with anyio.CancelScope(shield=True):
        for group in (processes[1:], processes[:1]):
            for process in group:
                if process.poll() is None:
                    process.send_signal(signal.SIGINT)
            await anyio.to_thread.run_sync(reap, group, deadline)
    shm.sweep()  # what hosts that died without cleaning up left in shared memory


@asynccontextmanager
async def _controller(
    spec: ClusterSpec,
    address: str,
    token: bytes,
    start_timeout: float,
    on_listening: Callable[[CapnpListener], None] | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> AsyncIterator[tuple[ActorSystem, CapnpListener, ClusterInfo]]:
    """Serve a controller here, start the host processes, wait until all joined.

    ``on_shutdown`` is what the builder's ``shutdown`` endpoint (``atoll
    down``) calls.
    """
    jax_env, service = _jax_runtime(spec, address)
    try:
        async with capnp_runtime(), ActorSystem("controller") as system:
            listener = await CapnpTransport(token).serve(system, address)
            builder = await listener.node.spawn(
                f"{__name__}:ClusterBuilder",
                spec,
                on_shutdown,
                token,
                jax_env,
                listener.address.split("://", 1)[-1].rpartition(":")[0],
                name="cluster",
            )
            if on_listening is not None:
                on_listening(listener)
            processes = _start_hosts(
                spec.local_hosts, listener.address, token, spec.devices_per_host, jax_env
            )
            try:
                info = await asyncio.wait_for(builder.cluster(), start_timeout)
                yield system, listener, info
            finally:
                await _stop_hosts(processes)
                await listener.aclose()
    finally:
        if service is not None:
            service.shutdown()


def _jax_runtime(spec: ClusterSpec, address: str) -> tuple[dict[str, str], Any]:
    """For JAX hosts, the coordination service of their runtime, served here
    (``devices/_jax_multi.serve_coordination``), and the environment that
    tells them so; nothing for simulated hosts, or when a coordinator was
    named (``--jax-coordinator``: JAX process 0 serves it there)."""
    from ...devices.jax.multi import COORDINATOR, serve_coordination

    if spec.device_cls.host_cls is None or COORDINATOR in os.environ:
        return {}, None
    host = address.split("://", 1)[-1].rpartition(":")[0] or "127.0.0.1"
    processes = launched("jax_processes") or spec.local_hosts
    return serve_coordination(processes, host)


@asynccontextmanager
async def process_cluster(
    spec: ClusterSpec | None = None,
    *,
    owner: str = "client0",
    start_timeout: float = 120.0,
) -> AsyncIterator[Cluster]:
    """Like ``local_cluster``, with every host in a process of its own.

    This process is the controller (served on 127.0.0.1, a fresh token); the
    hosts join it over Cap'n Proto. Yields the same :class:`Cluster` client.
    asyncio only. The host processes stop when the block ends.
    """
    spec = spec or ClusterSpec()
    spec.check_for("capnp")
    address, token = "capnp://127.0.0.1:0", default_token()
    async with _controller(spec, address, token, start_timeout) as (system, _, info):
        lanes = HostLanes(info.hosts, token) if lanes_on() else None
        try:  # (its calls under a lease go to the hosts by lane: runtime/client/leases.py)
            yield info.client(system, owner, lanes)
        finally:
            if lanes is not None:
                lanes.aclose()


async def run_up(
    spec: ClusterSpec,
    address: str,
    cluster_file: str,
    timeout: float = 600,
    http: tuple[str, int] | None = None,
) -> None:
    """``atoll up``: serve the controller, start the hosts, wait for a signal
    (SIGTERM, SIGINT) or for ``atoll down``. ``http``: (address, port) to
    serve the dashboard and ``/metrics`` on from the start.

    The cluster file is written as soon as the controller listens, so hosts on
    other machines can take the token from it and join; it names this
    process, and is removed when the cluster stops (unless another ``atoll
    up`` has overwritten it meanwhile).
    """
    token = default_token()
    stop = stop_on_signals()
    written = ClusterFile("", token, os.getpid())

    def listening(listener: CapnpListener) -> None:
        nonlocal written
        written = ClusterFile(listener.address, token, os.getpid())
        written.write(cluster_file)
        waiting = f"; waiting for {spec.remote_hosts} more" if spec.remote_hosts else ""
        print(
            f"atoll controller listening at {listener.address}; cluster file "
            f"{cluster_file}{waiting}",
            flush=True,
        )

    spec.check_for("capnp")
    try:
        async with _controller(spec, address, token, timeout, listening, stop.set) as (
            _,
            listener,
            info,
        ):
            total = spec.hosts
            print(
                f"atoll cluster up at {listener.address}: {total} hosts, "
                f"{len(info.topology.devices)} devices",
                flush=True,
            )
            if http is not None:
                url = await listener.node.lookup("cluster").dashboard(*http)
                print(f"atoll web at {url} (/, /metrics; the cluster token)", flush=True)
            # this process is ours: its long-lived objects (actors, proxies,
            # topology) leave the collector's scans, whose pauses otherwise
            # grow with the cluster (docs/dispatch.md, "Scale")
            gc.freeze()
            await stop.wait()
            # the file goes first: a client that sees its link end then finds
            # it gone, and says the cluster was stopped (connect._stopped)
            _remove_if_ours(cluster_file, written)
            print("atoll: stopping hosts", flush=True)
    finally:
        _remove_if_ours(cluster_file, written)


def drain_grace_s() -> float:
    """How long a host asked to stop (SIGTERM) spends draining first:
    ``ATOLL_DRAIN_GRACE_S``, 20 s by default (SLURM and Kubernetes kill
    30 s after their SIGTERM)."""
    return settings().drain_grace_s


async def _drain_on(term: asyncio.Event, stop: asyncio.Event, builder: Any, host_id: int) -> None:
    """On ``term``: have this host drained (its slices and buffers moved to
    other hosts) within the grace period, then stop."""
    await term.wait()
    print(f"atoll host {host_id}: asked to stop, draining first", flush=True)
    try:
        with anyio.move_on_after(drain_grace_s()):  # real preemption: wall time
            report = await builder.drain(host_id)
            print(f"atoll host {host_id}: drained ({report['buffers']} buffers moved)", flush=True)
    except Exception as exc:  # stop anyway: the grace period is the scheduler's
        print(f"atoll host {host_id}: drain failed: {exc}", flush=True)
    stop.set()


def _remove_if_ours(path: str, written: ClusterFile) -> None:
    """Remove the cluster file this launcher wrote, not a later launcher's."""
    with suppress(AtollError, OSError):
        if ClusterFile.read(path) == written:
            os.unlink(path)


async def run_host(
    join: str, token: bytes, listen: str = "capnp://127.0.0.1:0", forward_logs: bool = False
) -> None:
    """``atoll host --join ADDR``: serve a node, join the cluster, wait.

    The node is served at ``listen`` so that other hosts can pull buffers
    from this one directly, not through the controller. Starting, it sweeps
    the shared memory that killed processes left; stopping, it unlinks its own.
    Its log lines start with ``host N | `` once it has joined; with
    ``forward_logs`` (a host on another machine) they are also sent to the
    controller, whose terminal shows them.
    """
    _die_with_parent()
    shm.sweep()  # segments of earlier processes that were killed
    loop = asyncio.get_running_loop()
    stop, term = asyncio.Event(), asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, stop.set)  # stop now
    loop.add_signal_handler(signal.SIGTERM, term.set)  # be drained first (preemption)
    try:
        await _serve_host(join, token, listen, stop, term, forward_logs)
    finally:
        shm.release_all()  # this host's buffers in shared memory


async def _serve_host(
    join: str,
    token: bytes,
    listen: str,
    stop: asyncio.Event,
    term: asyncio.Event,
    forward_logs: bool = False,
) -> None:
    """Serve a host until ``stop`` is set (SIGINT), its controller goes, or
    it is told to leave (it was drained). Once ``term`` is set (SIGTERM), it
    asks to be drained first, within ``drain_grace_s()``, as a preempted
    host should, then stops."""
    async with capnp_runtime(), ActorSystem("host") as system:
        _collect_garbage_on_loop(asyncio.get_running_loop())
        transport = CapnpTransport(token)
        listener = await transport.serve(system, listen)
        directory.announce(listener.address, token)
        use_plane(ProcessPlane(listener.address, token))
        connection = await transport.connect(join, system)
        try:
            await _take_jax_runtime(connection.node.lookup("cluster"))
            host_id = await connection.node.lookup("cluster").join(
                listener.node, f"pid {os.getpid()}"
            )
            print(f"atoll host {host_id} joined {join}, serving {listener.address}", flush=True)
            logs.set_prefix(f"host {host_id} | ")
            # what the imports (JAX's many thousand objects) and the start made
            # leaves the collector's scans: a run's garbage is collected
            # without walking it (the controller does the same, atoll up)
            gc.collect()
            gc.freeze()
            if forward_logs:
                builder = connection.node.lookup("cluster")
                send = functools.partial(_forward_log, asyncio.get_running_loop(), builder, host_id)
                remove = logs.add_sink(send)
                connection.peer.on_close(lambda _: remove())
            # a host never outlives its controller: the link's heartbeat closes
            # it when the controller dies or stops answering
            connection.peer.on_close(lambda _: stop.set())
            on_leave(stop.set)  # drained: Host.leave
            builder = connection.node.lookup("cluster")
            drain = asyncio.ensure_future(_drain_on(term, stop, builder, host_id))
            await stop.wait()
            drain.cancel()
        finally:
            await directory.close_all()
            await connection.aclose()
            await listener.aclose()
