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
timeout, and reports the ones that died or stopped answering as lost. (Hosts
that freeze without their connection dropping are only seen by ``status``;
a heartbeat on the controller's side of host links is still to come.)
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from ..devices import Device, Host
from ..kernel import Actor, ActorRef, ActorSystem, AtollError, NodeActor, Promise, endpoint
from ..transports import shm
from ..transports.capnp import (
    CapnpListener,
    CapnpTransport,
    ClusterFile,
    capnp_runtime,
    default_token,
    directory,
    peer_of,
    stop_on_signals,
)
from .controller import Controller, spawn_control
from .sessions import SessionWatcher
from .spec import ClusterSpec
from .topology import Topology

if TYPE_CHECKING:
    from .client import Cluster

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

    def client(self, system: ActorSystem, owner: str) -> Cluster:
        """A :class:`Cluster` handle on this cluster, for ``owner``, in ``system``."""
        from .client import Cluster

        return Cluster(system, self.controller, self.topology, self.devices, self.hosts, owner)


class ClusterBuilder(Actor):
    """Collects hosts as they join; builds the cluster when all are in.

    Building starts the island schedulers, the controller and the
    :class:`SessionWatcher` (``"sessions"``) as children of this actor.
    """

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.topology = spec.topology
        self.hosts: list[ActorRef[Host]] = []
        self.labels: list[str] = []
        self.devices: list[ActorRef[Device]] = []
        self.lost: dict[int, str] = {}
        self.ready: Promise[ClusterInfo] = Promise("cluster ready")

    @endpoint
    async def join(self, node: ActorRef[NodeActor], label: str) -> int:
        """A host offers its node; returns the host id it was given."""
        host_id, spec = len(self.hosts), self.spec
        if host_id >= spec.hosts:
            raise AtollError(f"the cluster is full ({spec.hosts} hosts)")
        host_cls = spec.device_cls.host_cls or Host
        host = await node.spawn(
            f"{host_cls.__module__}:{host_cls.__qualname__}",
            host_id,
            self.topology.island_of_host(host_id),
            self.topology.on_host(host_id),
            spec.device_cls,
            spec.cost,
            spec.store_bytes,
            name=f"host{host_id}",
        )
        self.devices += await host.devices()
        self.hosts.append(host)
        link = peer_of(node)
        if link is not None:  # a dead host's shared memory goes with it
            link.on_close(_sweep)
        self.labels.append(label)
        if len(self.hosts) == spec.hosts:
            self._build()
        return host_id

    def _build(self) -> None:
        controller = spawn_control(
            self.ctx.spawn,
            self.topology,
            self.devices,
            self.hosts,
            self.spec.policies,
            push=self.spec.push,
        )
        sessions = self.ctx.spawn(SessionWatcher, controller, name="sessions")
        info = ClusterInfo(controller, self.topology, self.devices, self.hosts, sessions)
        self.ready.set_result(info)

    @endpoint
    def cluster(self) -> Promise[ClusterInfo]:
        """The cluster, once every host has joined (a promise until then)."""
        return self.ready

    @endpoint
    async def status(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Every joined host: its label and whether it answered within ``timeout``."""
        report = []
        for host_id, host in enumerate(self.hosts):
            if host_id not in self.lost:
                try:
                    with anyio.fail_after(timeout):
                        await host.store_usage()
                except TimeoutError:
                    self.lost[host_id] = f"no answer within {timeout} s"
                except AtollError as exc:
                    self.lost[host_id] = str(exc)
            report.append(
                {
                    "host": host_id,
                    "label": self.labels[host_id],
                    "alive": host_id not in self.lost,
                    "error": self.lost.get(host_id),
                }
            )
        return report


def _sweep(_: str) -> None:
    shm.sweep()


# -- processes ---------------------------------------------------------------------
def _die_with_parent() -> None:
    """In a host process: get SIGTERM when the launcher dies (Linux).

    Set by the child itself (a ``preexec_fn`` would force a plain fork, which
    JAX's at-fork hook rightly warns about). ``ATOLL_PARENT_PID`` closes the
    race in which the launcher died before this ran.
    """
    with suppress(OSError):  # not Linux: the parent's own cleanup has to do
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    expected = os.environ.get("ATOLL_PARENT_PID")
    if expected and os.getppid() != int(expected):
        raise SystemExit("atoll host: the launcher is already gone")


def _start_hosts(
    count: int, address: str, token: bytes, devices: int
) -> list[subprocess.Popen[bytes]]:
    """Start ``count`` host processes here that join the controller at ``address``.

    They also get the parameters of one ``jax.distributed`` runtime (see
    ``devices/_jax_multi``; ``atoll up`` with remote hosts sets them in this
    process's environment first): JAX hosts join it when their devices
    start, so that a gang over several hosts runs as one SPMD program;
    simulated hosts ignore it. Each gets its start index as its JAX process id.
    """
    from ..devices._jax_multi import LOCAL, PROCESS_ID, coordinator_env

    env = dict(os.environ, ATOLL_TOKEN=token.hex(), ATOLL_PARENT_PID=str(os.getpid()))
    env[LOCAL] = "1"  # a JaxDevice takes its host's own JAX devices
    env.update(coordinator_env(count))
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
    """SIGTERM every host, give them ``grace`` s in all to exit, then SIGKILL the
    rest; then sweep the shared-memory segments of dead processes.

    The waiting happens in a worker thread, so this event loop keeps serving
    (the hosts' goodbyes included) meanwhile; shielded, so that a cancelled
    caller still reaps them.
    """
    for process in processes:
        if process.poll() is None:
            process.terminate()
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(_reap, processes, time.monotonic() + grace)
    shm.sweep()  # what hosts that died without cleaning up left in shared memory


def _reap(processes: list[subprocess.Popen[bytes]], deadline: float) -> None:
    """Wait for each process until ``deadline``; SIGKILL those still running then."""
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@asynccontextmanager
async def _controller(
    spec: ClusterSpec,
    address: str,
    token: bytes,
    start_timeout: float,
    on_listening: Callable[[CapnpListener], None] | None = None,
) -> AsyncIterator[tuple[ActorSystem, CapnpListener, ClusterInfo]]:
    """Serve a controller here, start the host processes, wait until all joined."""
    async with capnp_runtime(), ActorSystem("controller") as system:
        listener = await CapnpTransport(token).serve(system, address)
        builder = await listener.node.spawn(f"{__name__}:ClusterBuilder", spec, name="cluster")
        if on_listening is not None:
            on_listening(listener)
        processes = _start_hosts(spec.local_hosts, listener.address, token, spec.devices_per_host)
        try:
            info = await asyncio.wait_for(builder.cluster(), start_timeout)
            yield system, listener, info
        finally:
            await _stop_hosts(processes)
            await listener.aclose()


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
        yield info.client(system, owner)


async def run_up(spec: ClusterSpec, address: str, cluster_file: str, timeout: float = 600) -> None:
    """``atoll up``: serve the controller, start the hosts, wait for a signal.

    The cluster file is written as soon as the controller listens, so hosts on
    other machines can take the token from it and join.
    """
    token = default_token()
    stop = stop_on_signals()

    def listening(listener: CapnpListener) -> None:
        ClusterFile(listener.address, token).write(cluster_file)
        waiting = f"; waiting for {spec.remote_hosts} more" if spec.remote_hosts else ""
        print(
            f"atoll controller listening at {listener.address}; cluster file "
            f"{cluster_file}{waiting}",
            flush=True,
        )

    spec.check_for("capnp")
    async with _controller(spec, address, token, timeout, listening) as (_, listener, info):
        total = spec.hosts
        print(
            f"atoll cluster up at {listener.address}: {total} hosts, "
            f"{len(info.topology.devices)} devices",
            flush=True,
        )
        await stop.wait()
        print("atoll: stopping hosts", flush=True)


async def run_host(join: str, token: bytes, listen: str = "capnp://127.0.0.1:0") -> None:
    """``atoll host --join ADDR``: serve a node, join the cluster, wait.

    The node is served at ``listen`` so that other hosts can pull buffers
    from this one directly, not through the controller. Starting, it sweeps
    the shared memory that killed processes left; stopping, it unlinks its own.
    """
    _die_with_parent()
    shm.sweep()  # segments of earlier processes that were killed
    stop = stop_on_signals()
    try:
        await _serve_host(join, token, listen, stop)
    finally:
        shm.release_all()  # this host's buffers in shared memory


async def _serve_host(join: str, token: bytes, listen: str, stop: asyncio.Event) -> None:
    async with capnp_runtime(), ActorSystem("host") as system:
        transport = CapnpTransport(token)
        listener = await transport.serve(system, listen)
        directory.announce(listener.address, token)
        connection = await transport.connect(join, system)
        try:
            host_id = await connection.node.lookup("cluster").join(
                listener.node, f"pid {os.getpid()}"
            )
            print(f"atoll host {host_id} joined {join}, serving {listener.address}", flush=True)
            # a host never outlives its controller: the link's heartbeat closes
            # it when the controller dies or stops answering
            connection.peer.on_close(lambda _: stop.set())
            await stop.wait()
        finally:
            await directory.close_all()
            await connection.aclose()
            await listener.aclose()
