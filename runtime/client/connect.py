"""``atoll.connect``: reach a running atoll node or cluster from user code.

A *cluster file* is the JSON that ``atoll up`` (or ``atoll node
--cluster-file``) writes: the controller's address and the cluster token. It is
written readable by its owner only, since the token is the key to the cluster;
``atoll up`` keeps it in a private directory unless told otherwise (see
``transports.capnp.clusterfile.default_cluster_file``) and prints its path.

A client that asks for the cluster (:meth:`Client.cluster`) opens a session
with the controller (see ``runtime/control/sessions.py``): it gets an owner label of its own,
and whatever it holds under that label is freed when its connection closes,
cleanly or not.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import anyio
import sniffio

from ...kernel import ActorRef, ActorSystem, AtollError, NodeActor
from ...transports.capnp import CapnpConnection, CapnpTransport, ClusterFile, capnp_runtime
from ...transports.capnp.bridge import CapnpBridge
from ...transports.capnp.clusterfile import find_cluster_file
from ..runlanes import Caller, call_lane, host_lane, lanes_on
from .anchor import SessionAnchor

if TYPE_CHECKING:
    from ...devices import Host
    from ..control.sessions import SessionWatcher
    from ..deploy.process import ClusterInfo
    from .client import Cluster

__all__ = ["Client", "ClusterFile", "connect"]


@dataclass
class Client:
    """A connection from user code: the remote node, and a local actor system."""

    node: ActorRef[NodeActor]
    system: ActorSystem
    address: str
    weight: float = 1.0  # this client's share of device time (see runtime/control/sessions.py)
    _anchor: ActorRef[SessionAnchor] | None = field(default=None, repr=False)
    _transport: CapnpTransport | None = field(default=None, repr=False)
    _direct: DirectHosts | None = field(default=None, repr=False)  # links to host processes
    _lane: Caller | None = field(default=None, repr=False)  # runs to the controller, one way

    def spawn(self, target: str, *args: Any, name: str | None = None, **kwargs: Any) -> Any:
        """Start an actor on the remote node (``"module:Class"``); a promise."""
        return self.node.spawn(target, *args, name=name, **kwargs)

    def lookup(self, name: str) -> Any:
        """A named actor on the remote node; a promise."""
        return self.node.lookup(name)

    async def cluster(self, owner: str | None = None) -> Cluster:
        """The cluster this node controls (started by ``atoll up``), in a session.

        Waits until every host has joined. The controller makes ``owner``
        (default ``"client"``) unique to this session, e.g. ``"client#3"``
        (``cluster.owner`` tells it), and frees every slice and buffer under
        that label once this connection closes, however it closes.
        """
        info: ClusterInfo = await self.node.lookup("cluster").cluster()  # one round trip
        label = await self._open_session(info.sessions, owner)
        if self._direct is None and self._transport is not None:
            self._direct = DirectHosts(self._transport, self.system)
        if self._lane is None and self._transport is not None and lanes_on():
            token = self._transport.token
            self._lane = call_lane(info.controller, info.hosts, token, self.address)
            if self._direct is not None:  # hosts answer its calls down their lanes
                self._direct.answers = self._lane
        return info.client(self.system, label, self._direct, self._lane)

    async def _open_session(self, sessions: ActorRef[SessionWatcher], owner: str | None) -> str:
        """A session's owner label; the anchor that binds it is made once."""
        if self._anchor is None:
            self._anchor = self.system.spawn(SessionAnchor)
        label: str = await sessions.open(self._anchor, owner or "client", self.weight)
        return label

    async def set_weight(self, session: int | str, weight: float) -> float:
        """Administration: change a session's weight (by id or public name,
        as ``status()`` shows them); its next gangs carry the new weight."""
        info: ClusterInfo = await self.node.lookup("cluster").cluster()
        changed: float = await info.sessions.set_weight(session, weight)
        return changed

    async def set_quota(
        self, session: int | str, max_gangs: int | None = None, max_bytes: int | None = None
    ) -> None:
        """Administration: a session's quotas, gangs queued or running at
        once and bytes held per host store (None: no limit)."""
        info: ClusterInfo = await self.node.lookup("cluster").cluster()
        await info.sessions.set_quota(session, max_gangs, max_bytes)

    async def set_default_quota(
        self, max_gangs: int | None = None, max_bytes: int | None = None
    ) -> None:
        """Administration: the quotas of every session opened from now on."""
        info: ClusterInfo = await self.node.lookup("cluster").cluster()
        await info.sessions.set_default_quota(max_gangs, max_bytes)

    async def status(self) -> list[dict[str, Any]]:
        """What ``atoll status`` shows, as rows with a ``"kind"``: every host
        (alive or lost, address, pid, devices, store usage, last error), every
        island's queued and running gangs, every session (``runtime/tools/status.py``)."""
        report: list[dict[str, Any]] = await self.node.lookup("cluster").status()
        return report


class DirectHosts:
    """Host processes over this client's own links, by address, dialled in
    the background the first time a handle names one.

    A reference to a host that came through the controller is proxied by it
    (Cap'n Proto has no three-party hand-off), so every fetch and free
    would cost the controller a message each way. :meth:`get` never waits:
    until a link is up (or where none can be had) the caller uses the
    reference it has. What is asynchronous about it: each dial is a task of
    this client's loop, and :meth:`aclose` ends them and the links.
    """

    def __init__(self, transport: CapnpTransport, system: ActorSystem) -> None:
        self._transport = transport
        self._system = system
        self._links: dict[str, tuple[CapnpConnection, ActorRef[Host]]] = {}
        self._tried: dict[str, float] = {}  # address -> when a dial began
        self._tasks: set[asyncio.Task[None]] = set()
        self._lanes: dict[ActorRef[Host], Caller] = {}  # by the host's reference here
        self._by_id: dict[int, Caller] = {}  # the same, by host id (the newest)
        self.answers: Caller | None = None  # the call lane whose calls hosts may answer

    def answering(self, host_id: int) -> Caller | None:
        """The lane host ``host_id`` can answer this client's calls down, if up."""
        lane = self._by_id.get(host_id)
        return lane if lane is not None and lane.up and self.answers is not None else None

    def lane(self, host: ActorRef[Host]) -> Caller | None:
        """The lane to the host process ``host`` names (a reference :meth:`get`
        gave), if there is one."""
        return self._lanes.get(host)

    def lanes(self) -> list[Caller]:
        """Every lane to a host process this client has (each once)."""
        return list({id(lane): lane for lane in self._lanes.values()}.values())

    def _close_lane(self, host: ActorRef[Host]) -> None:
        lane = self._lanes.pop(host, None)
        if lane is not None:
            lane.close()
            if self._by_id.get(lane.far or 0) is lane:
                del self._by_id[lane.far or 0]

    def get(self, address: str, host_id: int) -> ActorRef[Host] | None:
        """The host at ``address`` over a link of this client's, if one is up;
        else None, and a dial begins (at most one per address, and again
        only ``REDIAL_S`` after the last)."""
        found = self._links.get(address)
        if found is not None and found[0].peer.closed is None:
            return found[1]
        now = time.monotonic()
        if now - self._tried.get(address, -REDIAL_S) >= REDIAL_S:
            self._tried[address] = now
            task = asyncio.get_running_loop().create_task(self._dial(address, host_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return None

    async def _dial(self, address: str, host_id: int) -> None:
        try:
            with anyio.fail_after(DIAL_TIMEOUT_S):
                link = await self._transport.connect(address, self._system)
        except (OSError, AtollError, TimeoutError):
            return
        try:
            with anyio.fail_after(DIAL_TIMEOUT_S):
                ref: ActorRef[Host] = await link.node.lookup(f"host{host_id}")
        except (AtollError, TimeoutError):
            await link.aclose()
            return
        old = self._links.get(address)
        self._links[address] = (link, ref)
        if lanes_on():  # frees go to it one way (Cluster.free_at)
            lane = host_lane(host_id, ref, self._transport.token, self.answers)
            self._lanes[ref] = self._by_id[host_id] = lane
        if old is not None:
            self._close_lane(old[1])
            await old[0].aclose()

    async def aclose(self) -> None:
        """End the dials under way and close every link."""
        for task in list(self._tasks):
            task.cancel()
        for host in list(self._lanes):
            self._close_lane(host)
        links, self._links = list(self._links.values()), {}
        for link, _ in links:
            await link.aclose()


REDIAL_S = 1.0  # a host whose link failed or fell is dialled again after this long
DIAL_TIMEOUT_S = 5.0


def _stopped(path: str, spec: ClusterFile, reason: str) -> str:
    """Why the connection to the cluster of cluster file ``path`` ended: its
    ``atoll up`` removes that file as it stops (first, before it closes any
    connection), so a file gone, or written by another ``atoll up``, means
    the cluster was stopped."""
    try:
        now = ClusterFile.read(path)
    except AtollError:
        now = None
    if now is not None and now.pid == spec.pid and now.address == spec.address:
        return reason
    return (
        f"the cluster at {spec.address} was stopped (atoll down, or its atoll up ended: "
        f"{path} is gone); start it again with atoll up ({reason})"
    )


@asynccontextmanager
async def connect(
    target: str | os.PathLike[str] | None = None,
    *,
    token: bytes | None = None,
    weight: float = 1.0,
) -> AsyncIterator[Client]:
    """Connect to ``capnp://HOST:PORT`` or to the cluster a cluster file names.

    Without ``target``, to the cluster that ``atoll up`` started last on this
    machine (its cluster file in the private runtime directory, see
    ``find_cluster_file``), as ``ray.init(address="auto")`` does.

    An async context manager, on asyncio and on trio. Under trio the client
    lives on an asyncio loop thread (pycapnp runs only on asyncio) and the
    ``client`` given, and everything reached through it (its cluster,
    promises, outputs), are proxies with the same methods
    (``transports.capnp.bridge.Bridged``). The token is ``token=`` if given,
    else the cluster file's, else the ``ATOLL_TOKEN`` environment variable.
    ``weight`` is the share of device time the client's session gets against
    other clients' (default 1; see ``runtime/control/sessions.py``).
    """
    if sniffio.current_async_library() == "trio":
        again = functools.partial(connect, target, token=token, weight=weight)
        async with CapnpBridge.enter(again) as bridged:
            yield cast(Client, bridged)  # a proxy with the same methods
        return
    text = os.fspath(find_cluster_file() if target is None else target)
    spec: ClusterFile | None = None
    if text.startswith("capnp://"):
        address, found = text, token
    else:
        spec = ClusterFile.read(text)
        address, found = spec.address, token or spec.token
    transport = CapnpTransport(found)
    async with capnp_runtime(), ActorSystem("client") as system:
        connection = await transport.connect(address, system)
        if spec is not None:
            connection.peer.explain = functools.partial(_stopped, text, spec)
        client = Client(connection.node, system, address, weight, _transport=transport)
        connection.peer.on_close(lambda _: client._lane.close() if client._lane else None)
        try:
            yield client
        finally:
            if client._lane is not None:
                client._lane.close()
            if client._direct is not None:
                await client._direct.aclose()
            await connection.aclose()
