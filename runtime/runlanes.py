"""The calling ends of run lanes and call lanes (``atoll.devices._runlane``).

Two hops of every run go one way, a loop turn's worth per write, instead of
as Cap'n Proto calls (``docs/architecture.md``, "The path of one run"):

* an island sends each device of a host process its parts of runs, its
  plans and their drops over one **run lane** per host process
  (:class:`RunLanes`), and hears the devices' answers back on it;
* a client sends the controller its runs (``run_graph``, ``run_call``) over
  its **call lane** (:func:`call_lane`), and hears their outputs back on it.

A :class:`Caller` is one such link's calling end. It is dialled in the
background; calls made meanwhile wait, in order, and go by it once it is
up, or by Cap'n Proto if it cannot be had (a host in the controller's own
process has none). Each target's calls leave in the order they were made.
A call whose arguments need Cap'n Proto (a reference, a promise, a value
plain pickle cannot take) goes by lane all the same, with a *ticket*, its
arguments beside it by Cap'n Proto (``stash``), where the far end waits for
them. On a run lane, an input that is a promise not yet settled holds its
device's later calls back until it settles (the device would wait for it
first anyway); on a call lane it goes beside the call, so that a client's
later runs are not held back. A link that closes fails every call sent on
it with :class:`~atoll.kernel.HostLost`; calls not sent yet, and later ones,
go by Cap'n Proto.

Everything runs on the process's asyncio loop (where Cap'n Proto runs);
:meth:`Caller.call` is synchronous and returns a promise of the answer.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import secrets
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..devices import Host
from ..devices import _runlane as wire
from ..kernel import ActorRef, AtollError, HostLost, Promise, as_promise, failed, forward, then
from ..kernel.config import settings
from ..kernel.lowlevel import counts
from ..transports import oneway

__all__ = [
    "DIAL_TIMEOUT_S",
    "Caller",
    "HostLanes",
    "RunLanes",
    "call_lane",
    "host_lane",
    "lanes_on",
]

DIAL_TIMEOUT_S = 10.0  # a far end that does not say where its lane is by then is called by capnp

_log = logging.getLogger(__name__)

Fallback = Callable[[], Promise[Any]]
Stash = Callable[[str, tuple[Any, ...]], Promise[None]]
Hosts = Callable[[], Mapping[int, ActorRef[Host]] | Sequence[ActorRef[Host]]]
# kind, arguments, by call, answer, the lane its answer may come by instead
_Call = tuple[int, tuple[Any, ...], Fallback, Promise[Any], "Caller | None"]
_TICKETS = f"{secrets.token_hex(4)}/"
_tickets = itertools.count()


class RunLanes:
    """One island's run lanes, one per host process of its devices."""

    def __init__(
        self, token: bytes, hosts: Mapping[int, ActorRef[Host]], device_hosts: Mapping[int, int]
    ) -> None:
        self._token = token
        self._hosts = hosts  # the island's own table: replaced hosts show up in it
        self._device_hosts = dict(device_hosts)
        self._lanes: dict[int, Caller] = {}

    def start(self) -> None:
        """Dial every host of the island's devices (in the background)."""
        for host_id in sorted(set(self._device_hosts.values())):
            self._open(host_id)

    def replaced(self, host_id: int) -> None:
        """Host ``host_id`` is a new process: dial it afresh."""
        old = self._lanes.pop(host_id, None)
        if old is not None:
            old.close()
        if host_id in set(self._device_hosts.values()):
            self._open(host_id)

    def lost(self, host_id: int) -> None:
        """Host ``host_id`` is lost: what waits on its lane fails, and later
        calls go by Cap'n Proto (and fail there) until it is replaced."""
        lane = self._lanes.get(host_id)
        if lane is not None:
            lane.close()

    def _open(self, host_id: int) -> None:
        host = self._hosts[host_id]
        lane = Caller(f"host {host_id}", host_id, lambda: self._hosts, host.stash, waits=True)
        self._lanes[host_id] = lane
        lane.start(host.run_lane(), self._token)

    def call(
        self, device: int, kind: int, args: tuple[Any, ...], fallback: Fallback
    ) -> Promise[Any]:
        """Ask ``device`` for ``kind`` (``_runlane.RUN``...) with ``args``,
        by lane where its host has one; ``fallback()`` makes the same call
        by Cap'n Proto."""
        lane = self._lanes.get(self._device_hosts.get(device, -1))
        if lane is None or lane.off:
            return fallback()
        return lane.call(kind, device, args, fallback)

    async def aclose(self) -> None:
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()


def lanes_on() -> bool:
    """Whether runs go by lane (``ATOLL_RUN_LANES=0``: all by call, for A/B runs)."""
    return settings().run_lanes


def host_lane(
    host_id: int, host: ActorRef[Host], token: bytes, answers: Caller | None = None
) -> Caller:
    """A client's lane to host ``host_id``'s process (for its frees, sent as
    notices), over ``host``, a reference on the client's own link to it.
    ``answers``: the client's call lane, whose calls the host's devices may
    answer down this lane (named as that lane is)."""
    lane = Caller(f"host {host_id}", host_id, lambda: {host_id: host}, host.stash, waits=False)
    if answers is not None:
        lane.hello, lane.done_to = answers.hello, answers
    lane.start(host.run_lane(), token)
    return lane


class HostLanes:
    """Lanes to the host processes for a client in the controller's own
    process (``process_cluster``): its references to the hosts are its own
    links already (:meth:`get` gives none), and its calls under a lease
    (``runtime/client/leases.py``) go down a lane to each host process,
    dialled the first time one is asked for (:meth:`answering`). Frees go
    by call, as before."""

    def __init__(self, hosts: Sequence[ActorRef[Host]], token: bytes) -> None:
        self._hosts = hosts  # the cluster's own list: a replaced host shows up in it
        self._token = token
        self._by_id: dict[int, tuple[ActorRef[Host], Caller]] = {}

    def get(self, address: str, host_id: int) -> ActorRef[Host] | None:
        """The host's reference here (this process's own link to it)."""
        return self._hosts[host_id] if 0 <= host_id < len(self._hosts) else None

    def lane(self, host: ActorRef[Host]) -> Caller | None:
        return None  # (frees go by call)

    def answering(self, host_id: int) -> Caller | None:
        """The lane to host ``host_id``'s process if it is up (else one is
        dialled, once per process of that host, and None for now)."""
        host = self._hosts[host_id]
        found = self._by_id.get(host_id)
        if found is None or found[0] is not host:
            if found is not None:
                found[1].close()
            self._by_id[host_id] = (host, host_lane(host_id, host, self._token))
            return None
        return found[1] if found[1].up else None

    def lanes(self) -> list[Caller]:
        return [lane for _, lane in self._by_id.values()]

    def aclose(self) -> None:
        for _, lane in self._by_id.values():
            lane.close()
        self._by_id.clear()


def call_lane(
    controller: ActorRef[Any], hosts: Sequence[ActorRef[Host]], token: bytes, dialled: str = ""
) -> Caller:
    """A client's call lane to ``controller`` (dialled in the background);
    ``dialled``: the controller's capnp address as the client reached it,
    whose host stands in for a listener on every interface."""
    lane = Caller("the controller", None, lambda: hosts, controller.stash, waits=False)
    lane.hello = secrets.token_hex(8)  # the name of this client's lanes, at every far end
    host = dialled.split("://", 1)[-1].rpartition(":")[0]
    lane.start(then(controller.call_lane(), functools.partial(_reachable, host)), token)
    return lane


def _reachable(host: str, where: tuple[str, int]) -> tuple[str, int]:
    """``where`` (address, target) with a wildcard interface made ``host``."""
    address, target = where
    listening, _, port = address.rpartition(":")
    if address and host and listening in ("0.0.0.0", "::", "[::]"):
        address = f"{host}:{port}"
    return address, target


class Caller:
    """One link's calling end: dialling, up, or off (see the module docstring).

    ``far``: the host whose handles go as their fields (None: every host's,
    on a link to the controller); ``hosts()``: how answers' handles find
    their hosts; ``stash(ticket, args)``: sends a call's arguments by Cap'n
    Proto; ``waits``: an input that is an unsettled promise holds its
    target's later calls back (True) or goes beside its call (False).
    """

    def __init__(self, name: str, far: int | None, hosts: Hosts, stash: Stash, waits: bool) -> None:
        self.name = name
        self.far = far
        self.hosts = hosts
        self.stash = stash
        self.waits = waits
        self.task: asyncio.Future[None] | None = None
        self.link: oneway.Link | None = None
        self.target = 0  # on a call lane: the controller's id at the far end
        self.off = False
        self.queued: dict[int, deque[_Call]] = {}  # by target
        self.waiting: dict[int, Promise[Any]] = {}  # the input a target's first call waits for
        self.pending: dict[int, Promise[Any]] = {}
        self._requests = itertools.count(1)
        self.hello: str | None = None  # the name of this client's lanes, said first
        self.done_to: Caller | None = None  # whose calls this lane's DONEs answer
        self.direct: dict[int, Caller] = {}  # calls a host may answer, by request: its lane

    def start(self, where: Promise[Any], token: bytes) -> None:
        """Dial where the far end says (``"host:port"``, or with its target
        id), in the background."""
        self.task = asyncio.ensure_future(self._dial(where, token))

    async def _dial(self, where: Promise[Any], token: bytes) -> None:
        try:
            self.link = await asyncio.wait_for(self._connect(where, token), DIAL_TIMEOUT_S)
        except Exception as exc:  # no lane: Cap'n Proto does it all
            _log.info("no lane to %s: %s", self.name, exc)
        if self.link is None:
            self.off = True
        elif self.hello is not None:  # before anything else on the link
            hello = ((self.hello,), None)
            self.link.send(wire.dumps(hello, self.far, 0, wire.HELLO, self.target))
        for target in list(self.queued):
            self._drain(target)

    @property
    def up(self) -> bool:
        """Whether the link is up (and said its hello)."""
        return self.link is not None and not self.off

    async def _connect(self, where: Promise[Any], token: bytes) -> oneway.Link | None:
        address = await where
        if isinstance(address, tuple):
            address, self.target = address
        if not address:
            return None
        return await oneway.connect(address, token, self._answers, self._lost)

    def call(
        self,
        kind: int,
        target: int,
        args: tuple[Any, ...],
        fallback: Fallback,
        direct: Caller | None = None,
    ) -> Promise[Any]:
        """``kind`` of ``target`` with ``args``; ``fallback()`` makes the same
        call by Cap'n Proto, if the lane cannot. ``direct``: the lane of the
        host process that may answer it instead (``wire.RUN_CALL_DIRECT``)."""
        promise: Promise[Any] = Promise(f"{self.name}: {wire.ENDPOINTS[kind]}")
        if self.off:
            forward(fallback(), promise)
            return promise
        self.queued.setdefault(target, deque()).append((kind, args, fallback, promise, direct))
        if self.link is not None:  # else the dial sends it
            self._drain(target)
        return promise

    def sync(self, notices: bool = False) -> Promise[Any] | None:
        """A promise that settles once every call sent before now reached
        the far end's actor (None: nothing is on its way; with ``notices``,
        notices sent before it too, which leave no trace here). A caller
        awaits it before a Cap'n Proto call that must come after them (they
        travel on another connection)."""
        if self.off or (not notices and not self.pending and not self.queued):
            return None
        return self.call(wire.SYNC, 0, (), lambda: as_promise(None))

    @property
    def to_host(self) -> bool:
        """A link to a host process: its devices read another host's buffers
        by that host's address, so its handles need no reference to it."""
        return self.far is not None

    def notify(self, kind: int, target: int, args: tuple[Any, ...]) -> bool:
        """Send a notice (no answer comes back) if the lane is up and holds
        nothing back for ``target``, and its arguments travel by lane; False
        if not (the caller sends it by call)."""
        if self.link is None or self.off or target in self.queued:
            return False
        try:
            data = wire.dumps((args, None), self.far, 0, kind, target, self.to_host)
        except Exception:  # what needs Cap'n Proto goes by call
            return False
        self.link.send(data)
        return True

    def _drain(self, target: int) -> None:
        """Send a target's queued calls in order, until one waits for an input."""
        queued = self.queued.get(target)
        while queued and target not in self.waiting:
            kind, args, fallback, promise, direct = queued[0]
            if self.off or self.link is None:  # no lane (any more): by call, in order
                queued.popleft()
                forward(fallback(), promise)
                continue
            unsettled = self._send(kind, target, args, promise, direct)
            if unsettled is not None:
                self.waiting[target] = unsettled
                unsettled.add_done_callback(functools.partial(self._settled, target))
                return
            queued.popleft()
        if not queued:
            self.queued.pop(target, None)

    def _settled(self, target: int, _: Promise[Any]) -> None:
        self.waiting.pop(target, None)
        if self.link is not None or self.off:
            self._drain(target)

    def _send(
        self,
        kind: int,
        target: int,
        args: tuple[Any, ...],
        promise: Promise[Any],
        direct: Caller | None = None,
    ) -> Promise[Any] | None:
        """Send one call; or the unsettled promise among its inputs it must wait for."""
        assert self.link is not None
        request = next(self._requests)  # (one that waits leaves a gap: no matter)
        far_target = self.target or target
        try:
            data = wire.dumps((args, None), self.far, request, kind, far_target, self.to_host)
        except wire.Aside as aside:
            (why,) = aside.args
            if self.waits and isinstance(why, Promise) and not why.done():
                return why
            data = b""
        except Exception:  # what plain pickle cannot take
            data = b""
        if len(data) > oneway.MAX_MESSAGE:  # too large for a lane: beside it, by call
            data = b""
        self.pending[request] = promise
        if direct is not None:
            if not direct.up:  # its lane fell meanwhile: the controller answers
                kind = wire.RUN_CALL
                data = data and wire.dumps(
                    (args, None), self.far, request, kind, far_target, self.to_host
                )
            else:
                self.direct[request] = direct
        if data:
            self.link.send(data)
            return None
        # its arguments go by Cap'n Proto, the call itself by lane, in its place
        ticket = f"{_TICKETS}{next(_tickets)}"
        self.link.send(wire.dumps((None, ticket), self.far, request, kind, far_target))
        try:
            stashed = self.stash(ticket, args)
        except Exception as exc:  # arguments that cannot go at all
            stashed = failed(exc)
        stashed.add_done_callback(functools.partial(self._unless_stashed, ticket))
        return None

    def _unless_stashed(self, ticket: str, sent: Promise[None]) -> None:
        """A stash that failed: the far end stops waiting for it."""
        error = sent.exception()
        if error is None or self.link is None:
            return
        try:
            data = wire.dumps((error, ticket), self.far, 0, wire.FORGET)
        except Exception:  # an error that does not pickle: its text
            data = wire.dumps((AtollError(str(error)), ticket), self.far, 0, wire.FORGET)
        self.link.send(data)

    def _answers(self, link: oneway.Link, messages: list[bytes]) -> None:
        for data in messages:
            request, kind, _, body = wire.parse(data)
            if kind == wire.DONE and self.done_to is not None:  # a call to the controller's
                counts["answers_from_hosts"] += 1
                self.done_to.answered(request, body, self.name)
            else:
                self.answered(request, body, self.name)

    def answered(self, request: int, body: bytes, by: str) -> None:
        """The answer to call ``request`` came (from ``by``)."""
        promise = self.pending.pop(request, None)
        self.direct.pop(request, None)
        if promise is None:
            return
        try:
            error, value = wire.loads(body, self.hosts())
        except Exception as exc:  # this answer fails; the others go on
            error = AtollError(f"an answer from {by} cannot be read: {exc!r}")
        if error is not None:
            promise.set_exception(error)
        else:
            promise.set_result(value)

    def lost_lane(self, lane: Caller) -> None:
        """``lane`` (to a host process) closed: the calls it was to answer
        fail, as their runs on that host do."""
        for request in [r for r, by in self.direct.items() if by is lane]:
            del self.direct[request]
            promise = self.pending.pop(request, None)
            if promise is not None and not promise.done():
                promise.set_exception(
                    HostLost(f"{lane.name} is gone or cut off: its answer did not come")
                )

    def _lost(self, link: oneway.Link) -> None:
        """Calls sent fail (the far process is gone, or cut off); those not
        sent yet go by Cap'n Proto, in order, whatever they waited for."""
        self.off = True
        self.link = None
        pending, self.pending = self.pending, {}
        self.direct.clear()
        if self.done_to is not None:
            self.done_to.lost_lane(self)
        for promise in pending.values():
            if not promise.done():
                promise.set_exception(HostLost(f"{self.name} is gone or cut off (its lane closed)"))
        self.waiting.clear()
        for target in list(self.queued):
            self._drain(target)

    def close(self) -> None:
        """Give the lane up: what was sent on it or waits for it fails with
        ``HostLost`` now (its far end is lost, replaced, or this end goes)."""
        self.off = True
        if self.task is not None:
            self.task.cancel()
        lost = HostLost(f"the lane to {self.name} was closed")
        queued, self.queued = self.queued, {}
        pending, self.pending = self.pending, {}
        self.waiting.clear()
        self.direct.clear()
        if self.done_to is not None:
            self.done_to.lost_lane(self)
        for calls in queued.values():
            for _, _, _, promise, _ in calls:
                promise.set_exception(lost)
        for promise in pending.values():
            if not promise.done():
                promise.set_exception(lost)
        if self.link is not None:
            self.link.abort()
