"""Run lanes and call lanes: how runs travel between processes, one way.

Over Cap'n Proto each part of a compiled run (``Device.run_plan``) was a
call and its answer: two messages, a ``Finish``, and a wake-up of each
process per run. A run lane (a :mod:`atoll.transports.oneway` link from the
island to the host process) carries the same calls one way, and the
devices' answers (their :class:`~atoll.devices.RunReport`) back one way, a
loop turn's worth in one write each way: under load, one message carries
many runs.

What this module holds:

* the **codec** of both ends: pickles, with a buffer handle of the host at
  the far end sent as its fields (its host is that process's own, or the
  island's reference to it). Anything that needs Cap'n Proto (a reference to
  an actor, an unresolved promise, a handle of another host, a large array)
  raises :class:`Aside`;
* the **receiving ends**: a host process's (calls to its devices, and
  clients' frees at its host) and the controller's (clients' runs). Each
  makes a target's calls in the order they were sent and sends back each
  answer. A call whose arguments needed Cap'n Proto comes with a *ticket*:
  its arguments come through ``Host.stash`` or ``Controller.stash`` instead
  (a Cap'n Proto call that keeps their promises), and the target's calls
  behind it wait until they are there, so the order holds.

A client's lane to a host process also carries its runs under a lease
(``LEASED``: ``devices/_lease.py`` checks each), and the island's drop of
a plan ends a lease that covers it, in order with the runs before it.

The calling ends are :mod:`atoll.runtime.runlanes`. Everything runs on the
process's event loop (asyncio, where Cap'n Proto runs).
"""

from __future__ import annotations

import asyncio
import functools
import io
import itertools
import logging
import pickle
import struct
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import FunctionType
from typing import Any

import numpy as np

from ..kernel import (
    ActorRef,
    AtollError,
    BadCall,
    Promise,
    as_promise,
    failed,
    log_failure,
    when_settled,
)
from ..kernel.lowlevel import counts
from ..transports import oneway
from ..transports._base import by_value
from ..transports._imports import find_class
from . import _lease
from ._host_api import HostEndpoints
from ._values import BufferHandle, _handle

# a call as the host's end keeps it: request, kind, arguments (None while
# its ticket's have not come), ticket, why it cannot be made
_Call = tuple[int, int, Any, "str | None", "BaseException | None"]

__all__ = [
    "DROP",
    "FORGET",
    "INSTALL",
    "LEASED",
    "RUN",
    "Aside",
    "answer",
    "dumps",
    "loads",
    "parse",
]

RUN, INSTALL, DROP, FORGET = 0, 1, 2, 3  # what a message asks of a device
RUN_GRAPH, RUN_CALL = 4, 5  # ... or of the controller
FREE = 6  # ... or of a host (target -1 - host id): a notice, with no answer
SYNC = 7  # answered once every call sent before it on the link was made
HELLO = 9  # a client names its lanes (a notice, first on each of its links)
DONE = 10  # a host answers a client's call to the controller itself (see answer)
RUN_CALL_DIRECT = 11  # a RUN_CALL whose answer may come from the device's host
LEASED = 12  # a client's run of a device under a lease (devices/_lease.py)
ENDPOINTS = {
    RUN: "run_plan",
    INSTALL: "install_plan",
    DROP: "drop_plans",
    RUN_GRAPH: "run_graph",
    RUN_CALL: "run_call",
    FREE: "free_many",
    SYNC: "sync",
    RUN_CALL_DIRECT: "run_call",
    LEASED: "run_plan",
}
DIRECT = "atoll: answered by the device's host"  # a controller's answer that is not sent
_CALL_ARGS = 6  # Controller.run_call's arguments before its reply, as a client sends them
LARGEST_ARRAY = 1 << 16  # larger arrays go by Cap'n Proto (its data plane)
# a message's head: its request (numbered by the sender; an answer has the
# number of its call), what it asks and of which device; a pickle follows
# (a call's arguments or ticket, an answer's error and value)
_HEAD = struct.Struct("!QBq")

_log = logging.getLogger(__name__)
_log_failed_notice = log_failure(_log, "a notice that came by lane")


class Aside(Exception):
    """Something in a message must travel by Cap'n Proto."""


def _here(buffer_id: str, host_id: int, *rest: Any) -> BufferHandle:
    """A handle of the far end's host, as :func:`loads` reads it: its host's
    reference from the hosts that call was given."""
    hosts = getattr(_decoding, "hosts", None)
    if hosts is None:
        raise AtollError("a run lane's handle was decoded without its hosts")
    return _handle(buffer_id, hosts[host_id], host_id, *rest)


_decoding = threading.local()  # the hosts of the message loads() reads now, if any


def _same(value: Any) -> Any:
    return value


class _Pickler(pickle.Pickler):
    def __init__(self, out: io.BytesIO, host_id: int | None, far_handles: bool) -> None:
        super().__init__(out, pickle.HIGHEST_PROTOCOL)
        self.host_id = host_id
        self.far_handles = far_handles
        self.array_bytes = 0  # arrays in the message (counted once it is made)

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _PICKLED_AS_IS:  # (a run's report, its errors...) one look-up
            return NotImplemented
        if kind is FunctionType or isinstance(obj, type):  # named by the message
            if obj in _BY_REFERENCE:  # (each of its functions and classes, every time)
                return NotImplemented
            if by_value(obj):
                from ..transports.capnp import _byvalue  # (cloudpickle: only when needed)

                return _byvalue.reduce(obj, _aside)  # what it captures that is _aside raises
            if len(_BY_REFERENCE) < _AS_IS_KEPT:
                _BY_REFERENCE.add(obj)
            return NotImplemented
        if isinstance(obj, BufferHandle):
            _, (buffer_id, _ref, *rest) = obj.__reduce__()
            if self.host_id is None or obj.host_id == self.host_id:
                return _here, (buffer_id, *rest)
            if not self.far_handles:
                raise Aside(obj)
            return _far, (buffer_id, *rest)
        if isinstance(obj, (ActorRef, asyncio.Future)):
            raise Aside(obj)
        if isinstance(obj, Promise):
            if not obj.done():
                raise Aside(obj)
            error = obj.exception()
            return (_same, (obj.result(),)) if error is None else (failed, (error,))
        if isinstance(obj, np.ndarray):
            if obj.nbytes > LARGEST_ARRAY:
                raise Aside(obj)
            self.array_bytes += obj.nbytes
            return NotImplemented
        if len(_PICKLED_AS_IS) < _AS_IS_KEPT:  # none of the above: nor is its kind, ever
            _PICKLED_AS_IS.add(kind)
        return NotImplemented


# what the pickler passes to pickle's own reduction, found so as they came:
# kinds of values, and functions and classes that travel by reference
_PICKLED_AS_IS: set[type] = set()
_BY_REFERENCE: set[Any] = set()
_AS_IS_KEPT = 4096


def _far(buffer_id: str, *rest: Any) -> BufferHandle:
    """A handle of another host than the lane's, as a host's device reads it:
    without that host's reference (a reader reaches it by address,
    ``DataPlane.host_ref``, as it would anyway: bytes never take a proxied
    path)."""
    no_ref: Any = None
    return _handle(buffer_id, no_ref, *rest)


def _aside(obj: Any) -> bool:
    """What a function sent by value may capture and still go by lane: no
    reference, no promise; caught by the pickler (it raises :class:`Aside`)."""
    return isinstance(obj, (ActorRef, Promise))


def dumps(
    message: Any,
    host_id: int | None,
    request: int = 0,
    kind: int = 0,
    target: int = -1,
    far_handles: bool = False,
) -> bytes:
    """``message`` with its head, encoded for the link whose far end (or
    this end, for a host's answers) is host ``host_id``: handles of that
    host go as their fields (None: every handle as its fields, for links to
    and from the controller, which knows every host). Those of other hosts go
    by Cap'n Proto, or, with ``far_handles`` (work sent to a host's devices,
    which read another host's buffers by its address), as their fields
    without their host's reference. Raises :class:`Aside` (or what pickle
    raises) when it must go by Cap'n Proto."""
    out = io.BytesIO()
    out.write(_HEAD.pack(request, kind, target))
    pickler = _Pickler(out, host_id, far_handles)
    pickler.dump(message)
    counts["array_bytes_out"] += pickler.array_bytes
    return out.getvalue()


def parse(data: bytes) -> tuple[int, int, int, bytes]:
    """A message's head (request, kind, target) and its pickle."""
    request, kind, device = _HEAD.unpack_from(data)
    return request, kind, device, data[_HEAD.size :]


# hosts by id: a mapping, or a list indexed by id
Hosts = Mapping[int, "ActorRef[HostEndpoints]"] | Sequence["ActorRef[HostEndpoints]"]


class _Unpickler(pickle.Unpickler):
    """Reads a message again when plain ``pickle.loads`` could not import
    something it names: this one says what, where, and what to do."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))

    def find_class(self, module: str, name: str) -> Any:
        return find_class(super().find_class, module, name)  # says what is missing


def loads(data: bytes, hosts: Hosts) -> Any:
    """A message :func:`dumps` made; its handles' hosts from ``hosts``.

    Plain ``pickle.loads`` (no unpickler of our own per message, whose
    ``find_class`` runs in Python for every name): :func:`_here` finds the
    hosts where this call left them. What it cannot import is read again
    by an unpickler that says so (:class:`~atoll.transports._imports.CannotImport`).
    """
    before = getattr(_decoding, "hosts", None)  # (a message read while reading one)
    _decoding.hosts = hosts
    try:
        return pickle.loads(data)
    except (ImportError, AttributeError):
        return _Unpickler(data).load()
    finally:
        _decoding.hosts = before


# -- the receiving ends ----------------------------------------------------------
_hosts: dict[int, ActorRef[HostEndpoints]] = {}  # the hosts of this process, by id
_devices: dict[int, ActorRef[Any]] = {}  # their devices, by id (called by endpoint name)
_device_host: dict[int, int] = {}  # the host of each of them
_controllers: dict[
    int, tuple[ActorRef[Any], Sequence[ActorRef[HostEndpoints]]]
] = {}  # by target id
_controller_ids = itertools.count(1)  # never reused: a stale lane cannot reach a newer one
_stashed: dict[str, tuple[Any, ...]] = {}  # arguments that came by Cap'n Proto, by ticket
_forgotten: dict[str, BaseException] = {}  # tickets whose arguments will not come
_arrived: dict[str, float] = {}  # when each of those came (monotonic), oldest first
KEPT_S = 300.0  # a ticket's arguments whose call has not come by then never will (its lane died)
_waiting: set[_End] = set()  # ends where a target's next call waits for its ticket
_clients: dict[str, oneway.Link] = {}  # clients' links to this process, by their lanes' name


def register(
    host_id: int, host: ActorRef[HostEndpoints], devices: Mapping[int, ActorRef[Any]]
) -> None:
    """Deliver calls for ``devices`` (of host ``host_id``) that come by lane."""
    _hosts[host_id] = host
    _devices.update(devices)
    _device_host.update(dict.fromkeys(devices, host_id))


def unregister(host_id: int, devices: Iterable[int]) -> None:
    _hosts.pop(host_id, None)
    for device in devices:
        _devices.pop(device, None)
        _device_host.pop(device, None)


def register_controller(controller: ActorRef[Any], hosts: Sequence[ActorRef[HostEndpoints]]) -> int:
    """Deliver clients' calls to ``controller`` (whose hosts are ``hosts``, a
    live list); returns the target id its clients name."""
    target = next(_controller_ids)
    _controllers[target] = (controller, hosts)
    return target


def unregister_controller(target: int) -> None:
    _controllers.pop(target, None)


async def serve_runs(host: str, token: bytes) -> str:
    """Take islands' run lanes on ``host`` (once per loop); ``"host:port"``."""
    return await oneway.serve("runs", host, token, *_ends(_DeviceEnd))


async def serve_calls(host: str, token: bytes) -> str:
    """Take clients' call lanes on ``host`` (once per loop); ``"host:port"``."""
    return await oneway.serve("calls", host, token, *_ends(_ControllerEnd))


def _ends(
    kind: type[_End],
) -> tuple[Callable[[oneway.Link, list[bytes]], None], Callable[[oneway.Link], None]]:
    ends: dict[oneway.Link, _End] = {}

    def received(link: oneway.Link, messages: list[bytes]) -> None:
        end = ends.get(link)
        if end is None:
            end = ends[link] = kind(link)
        end.received(messages)

    def lost(link: oneway.Link) -> None:
        end = ends.pop(link, None)
        if end is not None:
            _waiting.discard(end)
            if end.client is not None and _clients.get(end.client) is link:
                del _clients[end.client]

    return received, lost


def stash(ticket: str, args: tuple[Any, ...]) -> None:
    """The arguments of the call sent with ``ticket`` (see the module docstring)."""
    _stashed[ticket] = args
    _kept(ticket)
    loop = asyncio.get_running_loop()
    for end in [end for end in list(_waiting) if end.loop is loop]:
        end.drain_all()


def answer(client: str, request: int, host_id: int, values: list[Any]) -> bool:
    """Answer call ``request`` of the client whose lanes are named ``client``
    (its call to the controller) from this host process, down the client's
    own link here; False if it has none (the controller answers then)."""
    link = _clients.get(client)
    if link is None:
        return False
    try:
        data = dumps((None, values), host_id, request, DONE)
    except Exception:  # handles of another host, or what pickle cannot take
        return False
    link.send(data)
    return True


def _kept(ticket: str) -> None:
    """Note when ``ticket``'s arguments (or why they will not come) arrived,
    and drop those that waited ``KEPT_S`` for a call that never came."""
    now = time.monotonic()
    _arrived[ticket] = now
    while _arrived:
        oldest, since = next(iter(_arrived.items()))
        if now - since < KEPT_S:
            break
        del _arrived[oldest]
        _stashed.pop(oldest, None)
        _forgotten.pop(oldest, None)


class _End:
    """One link's receiving end: calls in, each target's in order; answers out."""

    def __init__(self, link: oneway.Link) -> None:
        self.link = link
        self.loop = asyncio.get_running_loop()
        self.calls: dict[int, deque[_Call]] = {}  # by target
        self.client: str | None = None  # the name of the client's lanes, once it said it

    def hosts(
        self, target: int
    ) -> Mapping[int, ActorRef[HostEndpoints]] | Sequence[ActorRef[HostEndpoints]]:
        """How a call's handles for ``target`` find their hosts."""
        raise NotImplementedError

    def here(self, target: int) -> int | None:
        """The host whose handles an answer of ``target`` sends as fields."""
        raise NotImplementedError

    def deliver(self, kind: int, target: int, args: Any, request: int) -> Promise[Any]:
        """Make call ``request``; the promise of its answer."""
        raise NotImplementedError

    def received(self, messages: list[bytes]) -> None:
        targets: dict[int, None] = {}
        for data in messages:
            request, kind, target, body = parse(data)
            error: BaseException | None = None
            try:
                args, ticket = loads(body, self.hosts(target))
            except AtollError as exc:  # this call fails; the ones after go on
                args, ticket, error = None, None, exc
            except Exception as exc:  # the same, boxed
                args, ticket, error = None, None, _unreadable(exc, target, kind)
            if kind == HELLO and error is None:  # a client's lanes, by name
                self.client = str(args[0])
                _clients[self.client] = self.link
                continue
            if kind == FORGET:  # its ticket's arguments will not come: args is why
                _forgotten[ticket] = args
                _kept(ticket)
                targets.update(dict.fromkeys(self.calls))
                continue
            self.calls.setdefault(target, deque()).append((request, kind, args, ticket, error))
            targets[target] = None
        for target in targets:
            self.drain(target)

    def drain_all(self) -> None:
        _waiting.discard(self)
        for target in list(self.calls):
            self.drain(target)

    def drain(self, target: int) -> None:
        """Make a target's calls in order; stop at one whose ticket has not come."""
        calls = self.calls.get(target)
        while calls:
            request, kind, args, ticket, error = calls[0]
            if ticket is not None and error is None:
                if ticket in _forgotten:
                    error = _forgotten.pop(ticket)
                    _arrived.pop(ticket, None)
                elif ticket in _stashed:
                    args = _stashed.pop(ticket)
                    _arrived.pop(ticket, None)
                else:
                    _waiting.add(self)
                    return
            calls.popleft()
            try:
                if error is not None:
                    raise error
                answer = self.deliver(kind, target, args, request)
            except Exception as exc:  # said in the answer
                answer = failed(exc)
            if request:
                answer.add_done_callback(functools.partial(self._answer, request, target))
            else:  # a notice: nobody waits for its answer
                answer.add_done_callback(_log_failed_notice)
        self.calls.pop(target, None)

    def _answer(self, request: int, target: int, answer: Promise[Any]) -> None:
        error = answer.exception()
        if error is None and _is_direct(answer.result()):  # the client has it already
            return
        here = self.here(target)
        try:
            data = dumps((error, None if error else answer.result()), here, request)
        except Exception as exc:  # an answer that cannot travel says why
            unsent = error if error is not None else answer.result()
            data = dumps((_cannot_send(unsent, exc), None), here, request)
        self.link.send(data)


class _DeviceEnd(_End):
    """An island's link to this host process: calls to its devices."""

    def hosts(self, target: int) -> Mapping[int, ActorRef[HostEndpoints]]:
        return _hosts

    def here(self, target: int) -> int | None:
        return _device_host.get(target, -1)  # -1: no handle is of it

    def deliver(self, kind: int, target: int, args: Any, request: int) -> Promise[Any]:
        if kind == SYNC:  # what came before it on the link went to its actors
            # (or waits for its turn on a device that leases share: until it went)
            return _lease.handed_over(self) or as_promise(None)
        if target < 0 and kind == FREE:  # a client's frees at this host
            host = _hosts.get(-1 - target)
            if host is None:
                raise AtollError(f"host {-1 - target} is not this process")
            freed: Promise[Any] = host.free_many(*args)
            return freed
        ref = _devices.get(target)
        if ref is None:
            raise AtollError(f"device {target} is not in this host process")
        if kind == LEASED:  # a client's, under a lease (checked there)
            return _lease.run(ref, target, args, self)
        if kind == DROP:  # (in order with the runs that came before it)
            _lease.dropped(target, args[0])
        answer: Promise[Any] = getattr(ref, ENDPOINTS[kind])(*args)
        return answer


class _ControllerEnd(_End):
    """A client's link to the controller's process: its runs."""

    def hosts(self, target: int) -> Sequence[ActorRef[HostEndpoints]]:
        return self._controller(target)[1]

    def here(self, target: int) -> int | None:
        return None

    def deliver(self, kind: int, target: int, args: Any, request: int) -> Promise[Any]:
        controller, _ = self._controller(target)
        if kind == SYNC:  # the calls before it are in the controller's mailbox
            return as_promise(None)
        if kind == RUN_CALL_DIRECT and self.client is not None and len(args) == _CALL_ARGS:
            # its host may answer it; by position (a keyword costs a signature check)
            return _settled(controller.run_call(*args, (self.client, request)))
        if kind not in (RUN_GRAPH, RUN_CALL, RUN_CALL_DIRECT):
            raise AtollError(f"a call lane does not take calls of kind {kind}")
        return _settled(getattr(controller, ENDPOINTS[kind])(*args))

    @staticmethod
    def _controller(target: int) -> tuple[ActorRef[Any], Sequence[ActorRef[HostEndpoints]]]:
        found = _controllers.get(target)
        if found is None:
            raise AtollError("the controller this call lane named is gone")
        return found


def _settled(answer: Promise[Any]) -> Promise[Any]:
    """A run's answer (a list of handles, or of their promises) once every
    promise in it settled: an answer goes whole, as values and failures."""
    out: Promise[Any] = Promise("answer")

    def whole(done: Promise[Any]) -> None:
        error = done.exception()
        if error is not None:
            out.set_exception(error)
            return
        values = done.result()
        try:
            inner = [] if _is_direct(values) else [v for v in values if isinstance(v, Promise)]
        except Exception as exc:  # not a list: said as the answer
            out.set_exception(exc)
            return
        when_settled(inner, lambda: values, into=out)

    answer.add_done_callback(whole)
    return out


def _cannot_send(value: Any, error: Exception) -> BadCall:
    """What the caller gets for an answer that cannot be pickled (as Cap'n
    Proto's codec says it)."""
    kind = f"{type(error).__module__}.{type(error).__qualname__}"
    text = "".join(traceback.format_exception(error))
    return BadCall(f"cannot send a {type(value).__name__} over the wire: {error}", kind, text)


def _unreadable(error: Exception, target: int, kind: int) -> BadCall:
    """What a call whose arguments cannot be decoded here answers: what
    Cap'n Proto's codec answers then (its error's type, message and traceback)."""
    from ..transports.capnp._codec import undecodable  # loaded wherever lanes run

    return undecodable(error, f"target{target}", ENDPOINTS.get(kind, str(kind)))


def _is_direct(value: Any) -> bool:
    """Whether a controller's answer says the device's host sent it."""
    return isinstance(value, str) and value == DIRECT
