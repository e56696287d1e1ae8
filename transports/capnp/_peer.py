"""One Cap'n Proto connection's worth of atoll: servers, remote channels, tasks.

A :class:`Peer` exists on each end of a connection. It turns local actors
and promises into capabilities (:class:`ActorServer`, :class:`LaterServer`,
:class:`BufferServer`) and remote capabilities into kernel objects
(:class:`RemoteChannel` behind an ``ActorRef``; kernel promises settled by the
callback of the capnp answer's future, see :class:`_Awaiting`).

Everything here runs on the one asyncio thread that runs capnp's loop. When the
connection ends, :meth:`Peer.close` fails what is still pending with
``HostLost``, drops every capnp object it handed out, so none is collected
after the loop is gone, and then runs the callbacks registered with
:meth:`Peer.on_close` (how a server learns that a client went away).
:func:`peer_of` tells which connection a reference arrived over.

Back-pressure per connection, two bounds of ``max_calls`` each:

- calls not answered yet (``calls_in``: ``Actor.call``, ``Actor.send`` until
  admitted, ``Later.get``): at the bound the peer stops reading that
  connection's socket (``hold_reading``) and reads again once a quarter of
  them were answered. The far side's calls wait in TCP and in its own
  process; nothing is refused. While this side awaits an answer from the far
  side (``asking``: a callback, a promise or a buffer that peer serves) the
  socket is read regardless, since that answer may be behind the held calls.
  A hold that lasts ``HOLD_S`` (the calls are not being answered) ends, so
  heartbeats get through, and further calls beyond the bound are refused.
- answers the far side has not taken yet (``answers_out``: an
  ``Actor.call``'s ``Later`` lives here until the far side read the answer and
  let go of it; till then capnp keeps the answer, about 15 KiB of it). They
  go only as the far side reads, and its ``Finish`` may be behind the unread
  calls, so holding cannot bound them: at the bound each further
  ``Actor.call``/``send`` is refused at once with ``MailboxFull`` (nothing
  enqueued, nothing run).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import math
import sys
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import capnp
import numpy as np
import sniffio

from ...kernel import (
    ActorRef,
    AtollError,
    Call,
    CallCancelled,
    EndpointSpec,
    HostLost,
    MailboxFull,
    Promise,
    Timer,
    TransportError,
    current_clock,
    fail_after,
    failed,
)
from ...kernel.lowlevel import (
    attach_pipeline,
    channel_of,
    counts,
    detach_wait_counter,
    holds_promises,
    pipeline_answer,
    resolve_arguments,
    set_canceller,
)
from ..dataplane import bulk, shm
from ..dtypes import dtype_from_wire
from ._codec import (
    decode,
    decode_error,
    encode,
    encode_actor,
    encode_error,
    escaped_error,
    undecodable,
)
from ._schema import schema

__all__ = ["ActorServer", "HostLost", "Peer", "RemoteChannel", "heartbeat", "peer_of"]

_log = logging.getLogger("atoll.transports.capnp")
CHUNK = 1 << 20
IN_FLIGHT = 4
HOLD_S = 2.0  # a hold on reading this long turns into refusals (heartbeats: 6 s)
ACTORS_KEPT = 1024  # actors a connection keeps a capability and endpoint names for


@dataclass(frozen=True)
class _Answer:
    """A pending remote answer, as a promise carries it: whose, and its ``Later``."""

    peer: Peer
    later: Any


class _Awaiting:
    """One capnp answer awaited with no task (:meth:`Peer.settle_later`).

    :meth:`start`, called in the loop's turn after the call was sent, takes
    the answer's future (pycapnp pipelines on an answer until it is
    awaited); the future's callback settles the promise. Like a task, it can
    be asked whether it is :meth:`done` and be :meth:`cancel`-led (a cancelled
    call, a closed connection): the capnp question is then dropped.
    """

    __slots__ = ("_done", "answer", "context", "future", "peer", "promise")

    def __init__(self, peer: Peer, answer: Any, promise: Promise[Any]) -> None:
        self.peer, self.answer, self.promise = peer, answer, promise
        self.context = contextvars.copy_context()
        self.context.run(_detached)
        self.future: asyncio.Future[Any] | None = None
        self._done = False

    def start(self) -> None:
        if self._done:  # cancelled before it began
            return
        peer, answer = self.peer, self.answer
        self.answer = None
        peer.asking += 1
        if peer.held:
            peer._hold(False)
        try:
            future = answer.__await__().send(None)  # (pending: the future itself)
        except StopIteration as answered:  # (answered already)
            self._ended()
            peer._answered(self.promise, answered.value)
            return
        except Exception as exc:  # (it cannot be awaited: a broken question)
            self._ended()
            self.promise.set_exception(peer._lost(exc) if _kj(exc) else exc)
            return
        if not isinstance(future, asyncio.Future):  # (a pycapnp this was not made for)
            self._ended()
            error = TransportError(f"a Cap'n Proto answer awaits {future!r}, not a future")
            self.promise.set_exception(error)
            return
        self.future = future
        future.add_done_callback(self._settled, context=self.context)

    def _settled(self, future: asyncio.Future[Any]) -> None:
        self._ended()
        if future.cancelled() or self.promise.done():  # (cancelled, or its peer closed:
            return  # whoever did that settled the promise; nothing of the answer is read)
        error = future.exception()
        if error is not None:
            self.promise.set_exception(self.peer._lost(error) if _kj(error) else error)
            return
        self.peer._answered(self.promise, future.result())

    def _ended(self) -> None:
        self._done = True
        self.peer.asking -= 1
        self.peer._tasks.discard(self)

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        if self._done:
            return False
        if self.future is None:  # (not begun: nothing asked for it)
            self._done = True
            self.peer._tasks.discard(self)
        else:  # (its callback ends it)
            self.future.cancel()
        return True


def _kj(error: BaseException) -> bool:
    return isinstance(error, capnp.KjException)


def _detached() -> None:
    """An answer's context: its waits are not the app's waits, and anyio
    learns the library from sniffio's variable (no task runs its callbacks)."""
    detach_wait_counter()
    sniffio.current_async_library_cvar.set("asyncio")


class Peer:
    """What one end of a connection knows; see the module docstring.

    ``max_calls``: the bound on the far side's calls not answered yet and on
    its answers not taken yet (None: no bound, as on a client's end). The hold
    on reading needs ``hold_reading``, set by whoever owns the socket.
    """

    def __init__(self, label: str, max_calls: int | None = None) -> None:
        self.label = label
        self.clock = current_clock()  # of the context that made it: holds and heartbeats
        self.closed: str | None = None
        self.calls_sent = 0  # calls made through this peer (harnesses settle on it)
        self.calls_in = 0  # the far side's calls in flight here, not answered yet
        self.answers_out = 0  # answers (their Laters) the far side has not let go of
        self.asking = 0  # this side's questions to the far side, not answered yet
        self.holds = 0  # how many times reading was held (tests and benchmarks read it)
        self.refused = 0  # calls refused beyond a bound
        self.held = False
        self.refusing = False
        self._hold_timer: Timer | None = None
        self.max_calls = sys.maxsize if max_calls is None else max_calls
        self._resume_at = self.max_calls - max(1, self.max_calls // 4)
        # set by whoever owns the socket: stop (True) or resume (False) reading it
        self.hold_reading: Callable[[bool], None] | None = None
        # what the connection's end means, as its owner can tell (a cluster
        # that was stopped): reason -> the reason the errors carry
        self.explain: Callable[[str], str] | None = None
        self._tasks: set[asyncio.Future[Any] | _Awaiting] = set()
        self._pending: weakref.WeakSet[Promise[Any]] = weakref.WeakSet()
        self._holders: weakref.WeakSet[RemoteChannel] = weakref.WeakSet()
        self._on_close: dict[int, Callable[[str], None]] = {}
        self._servers: dict[int, tuple[Any, Any]] = {}  # local channel -> (it, its capability)
        self._named: dict[str, None] = {}  # actors whose endpoint names went over this link
        self._endpoints_of: dict[str, dict[str, EndpointSpec | None]] = {}  # came over it
        self._callback_ids = 0
        # set by whoever owns the socket: drops it (after :meth:`close`, see :meth:`lose`)
        self.abort: Callable[[], None] | None = None

    # -- local things out ------------------------------------------------
    def actor_cap(self, ref: ActorRef[Any]) -> Any:
        """The capability for ``ref`` on this connection: a remote actor's own,
        or, for a local one, one server made on first use and kept, so that
        every later send reuses its export (a new server each time cost a
        server, an export and the far side's import per message)."""
        channel = channel_of(ref)
        if isinstance(channel, RemoteChannel) and channel.cap is not None:
            return channel.cap
        kept = self._servers.get(id(channel))
        if kept is None:
            kept = self._servers[id(channel)] = (
                channel,
                schema.Actor._new_client(ActorServer(channel, self)),
            )
            _bound(self._servers)  # (each keeps its actor's cell alive)
        return kept[1]

    def endpoint_names(self, ref: ActorRef[Any]) -> list[str]:
        """The endpoint names to send with ``ref``: all of them the first time
        it goes over this connection, none after (the far side keeps them by
        actor id, see :meth:`remote_ref`; a handle's host is sent with
        every buffer handle)."""
        if ref.id in self._named:
            return []
        endpoints = channel_of(ref).endpoints
        if endpoints is None:
            return []
        self._named[ref.id] = None
        _bound(self._named)
        return sorted(endpoints)

    def later_cap(self, promise: Promise[Any]) -> Any:
        """The ``Later`` that stands for ``promise`` on this connection.

        A promise of an answer from this same peer goes back as that peer's
        own ``Later``, which it resolves locally. A promise of any other
        connection's answer is served here: passing the other peer's
        capability on would make every ``get`` a proxied round trip through
        this process to the producer (Cap'n Proto has no three-party
        hand-off), while this process hears the answer anyway. The price: a
        third peer's call on the value waits here for the whole answer (a
        large array included) instead of queueing at the producer.
        """
        held = pipeline_answer(promise)
        if isinstance(held, _Answer) and held.peer is self:
            return held.later
        return LaterServer(promise, self)

    def serve_buffer(self, array: np.ndarray) -> Any:
        return BufferServer(array)

    # -- remote things in ------------------------------------------------
    def remote_ref(self, reader: Any) -> ActorRef[Any]:
        actor_id = reader.id
        names = reader.endpoints
        endpoints: dict[str, EndpointSpec | None] | None
        if len(names):
            endpoints = self._endpoints_of[actor_id] = dict.fromkeys(names)
            _bound(self._endpoints_of)
        else:  # sent before on this connection (or an actor that has none)
            endpoints = self._endpoints_of.get(actor_id)
        channel = RemoteChannel(self, reader.cap, actor_id, reader.name, endpoints)
        return ActorRef(channel)

    def remote_promise(self, later: Any) -> Promise[Any]:
        promise: Promise[Any] = Promise("remote")
        counts["capnp_calls_out"] += 1
        self.attach(promise, later.get(), later)
        return promise

    def attach(self, promise: Promise[Any], answer: Any, later: Any) -> _Awaiting:
        """Make ``promise`` follow a remote ``Later``: usable for pipelining and
        for passing on before ``answer`` settles it."""
        pipe = functools.partial(RemoteChannel.promised, self, answer)
        attach_pipeline(promise, pipe, _Answer(self, later))
        return self.settle_later(answer, promise)

    def track(self, promise: Promise[Any]) -> None:
        """Fail ``promise`` with ``HostLost`` if this connection closes first."""
        self._pending.add(promise)

    def pull_buffer(self, reader: Any) -> np.ndarray | Promise[np.ndarray]:
        """A ``BufferRef``'s array: at once, mapped read-only, if its shared-memory
        segment is on this machine; else a promise, settled by a task that
        streams the bytes (or, if no stream can be had, pulls them in chunks)."""
        shape, nbytes = _buffer_layout(reader)
        mapped = _mapped(reader, shape, nbytes)
        if mapped is not None:
            return mapped
        promise: Promise[np.ndarray] = Promise("buffer")
        self.track(promise)
        self.spawn(self.asked(_fetch(reader.source, reader.dtype, shape, nbytes, promise)))
        return promise

    # -- answers -------------------------------------------------------------
    def settle_later(self, answer: Any, promise: Promise[Any]) -> _Awaiting:
        """Resolve ``promise`` from a capnp answer carrying a ``result`` Value.

        No task per answer: the answer is awaited from a callback of the
        loop's next turn (until then it may still be pipelined on, as
        :meth:`RemoteChannel.promised` says), and settles ``promise`` from
        its future's callback; only a value that holds promises takes a task.
        """
        self.track(promise)
        awaiting = _Awaiting(self, answer, promise)
        self._tasks.add(awaiting)
        asyncio.get_running_loop().call_soon(awaiting.start, context=awaiting.context)
        return awaiting

    def _answered(self, promise: Promise[Any], response: Any) -> None:
        """What a capnp answer (``response``) says, into ``promise`` (see :class:`_Awaiting`)."""
        reader = response.result
        if reader.which() == "error":
            promise.set_exception(decode_error(reader.error))
            return
        try:
            value = decode(self, reader)
        except Exception as exc:
            promise.set_exception(exc)
            return
        if holds_promises(value):
            self.spawn(self._resolved(value, promise))
        else:
            promise.set_result(value)

    async def _resolved(self, value: Any, promise: Promise[Any]) -> None:
        try:
            value = await resolve_arguments(value)
        except Exception as exc:
            promise.set_exception(exc)
            return
        promise.set_result(value)

    def _lost(self, exc: BaseException) -> AtollError:
        """The atoll error for a capnp failure: ``HostLost`` if the link broke."""
        if self.closed is not None:
            return HostLost(f"connection to {self.label} lost: {self.closed}")
        kind = str(getattr(exc, "type", ""))
        text = str(getattr(exc, "description", exc))
        description = text.splitlines()[0] if text else text
        if "DISCONNECTED" in kind:
            return HostLost(f"connection to {self.label} lost: {description}")
        escaped = escaped_error(text, self.label)  # a Python error the server let out
        if escaped is not None:
            return escaped
        return TransportError(f"call to {self.label} failed: {description}")

    # -- back-pressure (see the module docstring) ---------------------------------
    def call_arrived(self) -> bool:
        """Count a call from the far side; at ``max_calls``, hold the socket.

        False (not counted): refuse the call, too many answers not taken yet
        or a hold having lasted ``HOLD_S``.
        """
        if self.answers_out >= self.max_calls:
            self.refused += 1
            return False
        if self.calls_in >= self.max_calls:
            if self.refusing:
                self.refused += 1
                return False
            if not self.held and not self.asking:
                self._hold(True)
        self.calls_in += 1
        return True

    def call_answered(self) -> None:
        """Uncount it; read again once the calls in flight fell by a quarter."""
        self.calls_in -= 1
        if self.calls_in <= self._resume_at and (self.held or self.refusing):
            self.refusing = False
            self._hold(False)

    def refusal(self, actor: str) -> MailboxFull:
        """The error a call refused by :meth:`call_arrived` is answered with."""
        where = f"{actor}, over a connection with {self.max_calls} calls or answers pending"
        return MailboxFull(f"{where} (ATOLL_CONNECTION_CALLS)", self.max_calls)

    def _hold(self, held: bool) -> None:
        if self.hold_reading is None or self.closed is not None or held == self.held:
            return
        self.held = held
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        if held:
            self.holds += 1
            self._hold_timer = self.clock.call_later(HOLD_S, self._overheld)
        self.hold_reading(held)

    def _overheld(self) -> None:
        """A hold lasted ``HOLD_S``: read again, refusing what is beyond the bound."""
        self._hold_timer = None
        if self.held:
            self.refusing = True
            self._hold(False)

    async def asked(self, answer: Awaitable[Any]) -> Any:
        """Await ``answer``, which comes from the far side, keeping this
        connection's socket read meanwhile (never held)."""
        self.asking += 1
        if self.held:
            self._hold(False)
        try:
            return await answer
        finally:
            self.asking -= 1

    # -- lifecycle -----------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Future[Any]:
        """Run ``coro`` as a task owned by this peer (cancelled at close)."""
        context = contextvars.copy_context()
        context.run(detach_wait_counter)  # its waits are not the app's waits
        task = asyncio.get_running_loop().create_task(coro, context=context)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def close(self, reason: str) -> None:
        """Fail what is pending and drop every capnp object (loop thread only)."""
        if self.closed is not None:
            return
        if self.explain is not None:
            with suppress(Exception):  # an explanation that fails leaves the reason as it was
                reason = self.explain(reason)
        self.closed = reason
        if self._hold_timer is not None:
            self._hold_timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        for promise in list(self._pending):
            promise.set_exception(HostLost(f"connection to {self.label} lost: {reason}"))
        for channel in list(self._holders):
            channel.cap = None
        self._servers.clear()
        callbacks, self._on_close = list(self._on_close.values()), {}
        for callback in callbacks:
            _run_close_callback(callback, reason)

    def lose(self, reason: str) -> None:
        """Give the link up although its socket did not say so (a heartbeat
        went unanswered): :meth:`close`, then drop the socket, so that the
        far side, if it ever wakes, finds the link gone too."""
        self.close(reason)
        abort, self.abort = self.abort, None
        if abort is not None:
            asyncio.get_running_loop().call_soon(abort)  # not inside a capnp callback

    def watch(self, node: ActorRef[Any], every: float, timeout: float) -> None:
        """Ping ``node`` (a ``NodeActor`` reached over this link) every
        ``every`` seconds; no answer within ``timeout`` loses the link
        (:meth:`lose`): pending calls fail with ``HostLost`` within
        ``every + timeout`` seconds of the far side freezing."""
        self.spawn(heartbeat(self, node, every, timeout, self.lose))

    def on_close(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call ``callback(reason)`` once, when this connection closes.

        Synchronous, on the loop thread, after pending calls failed; at once if
        the connection is already closed. Returns a function that unregisters
        it. A callback that raises is logged, and the others still run.
        """
        if self.closed is not None:
            _run_close_callback(callback, self.closed)
            return _nothing
        self._callback_ids += 1
        key = self._callback_ids
        self._on_close[key] = callback

        def unregister() -> None:
            self._on_close.pop(key, None)

        return unregister


async def heartbeat(
    peer: Peer, node: ActorRef[Any], every: float, timeout: float, lose: Callable[[str], None]
) -> None:
    """Ping ``node`` every ``every`` s until ``peer`` closes; ``lose(reason)``
    when an answer takes more than ``timeout`` s. A process that is frozen
    (SIGSTOP) or cut off without a TCP reset answers nothing, while its
    kernel still acknowledges TCP keepalives: only this notices it. Both
    times are the peer's clock's."""
    while peer.closed is None:
        await peer.clock.sleep(every)
        try:
            with fail_after(peer.clock, timeout):
                await node.ping()
        except TimeoutError:
            lose(f"no heartbeat answer within {timeout} s")
            return
        except Exception:
            continue  # a broken link closes the peer (the loop then ends)


def _bound(kept: dict[Any, Any]) -> None:
    """Drop the oldest entries of a per-connection cache beyond ``ACTORS_KEPT``
    (a dropped one only costs its next send what the first one cost)."""
    while len(kept) > ACTORS_KEPT:
        del kept[next(iter(kept))]


def _run_close_callback(callback: Callable[[str], None], reason: str) -> None:
    try:
        callback(reason)
    except Exception:
        _log.exception("a connection-close callback raised")


def _nothing() -> None:
    """What unregistering a callback that already ran does."""


def peer_of(ref: ActorRef[Any]) -> Peer | None:
    """The connection ``ref`` arrived over, or None for a local actor.

    A reference decoded from a call's arguments belongs to the connection the
    call came in on, so a server can tie what a client asked for to the life
    of that client's connection (:meth:`Peer.on_close`).
    """
    channel = channel_of(ref)
    return channel.peer if isinstance(channel, RemoteChannel) else None


def _buffer_layout(reader: Any) -> tuple[tuple[int, ...], int]:
    """A ``BufferRef``'s shape and size, once they agree with its dtype.

    Checked before any byte is pulled: a reference whose size does not match
    its shape, or whose dtype is not a plain one, fails the call that carries
    it at once (found after the pull, it would leave its promise pending).
    """
    shape = tuple(int(n) for n in reader.shape)
    nbytes = int(reader.nbytes)
    try:
        dtype = dtype_from_wire(str(reader.dtype))
    except TypeError as exc:
        raise TransportError(f"bad buffer dtype {str(reader.dtype)[:40]!r}: {exc}") from None
    if dtype.hasobject or math.prod(shape) * dtype.itemsize != nbytes:
        raise TransportError(f"bad buffer: {nbytes} bytes for shape {shape} of {dtype}")
    return shape, nbytes


def _mapped(reader: Any, shape: tuple[int, ...], nbytes: int) -> np.ndarray | None:
    """The array in place, if its segment is on this machine and still there."""
    if not reader.shm or reader.machine != shm.machine_id():
        return None
    try:
        array = shm.attach(reader.shm, int(reader.shmOffset), nbytes, reader.dtype, shape)
    except (OSError, ValueError):
        return None  # freed meanwhile: the holder can still stream the bytes
    bulk.counts["shm_in"] += 1
    bulk.counts["shm_in_bytes"] += nbytes
    return array


async def _fetch(
    source: Any, dtype: str, shape: tuple[int, ...], nbytes: int, promise: Promise[np.ndarray]
) -> None:
    """Settle ``promise`` with the bytes of ``source``: streamed, else pulled."""
    try:
        try:
            data = await _stream(source, nbytes)
        except (capnp.KjException, OSError, TimeoutError, TransportError) as exc:
            _log.debug("no bulk stream (%s): pulling the buffer in chunks", exc)
            data = await _pull(source, nbytes)
    except capnp.KjException as exc:
        promise.set_exception(HostLost(f"buffer transfer failed: {exc}"))
        return
    except Exception as exc:  # a short or malformed chunk: fail, never hang
        promise.set_exception(TransportError(f"buffer transfer failed: {exc!r}"))
        return
    try:
        array = data.view(dtype_from_wire(dtype)).reshape(shape)
    except (TypeError, ValueError) as exc:  # bytes that do not make the array: fail
        promise.set_exception(TransportError(f"buffer transfer failed: {exc}"))
        return
    array.flags.writeable = False
    promise.set_result(array)


async def _stream(source: Any, nbytes: int) -> np.ndarray:
    """The bytes over a bulk stream that ``source`` opens (``transports.dataplane.bulk``)."""
    response = await source.open()
    address, ticket = str(response.address), bytes(response.ticket)
    del response
    return await bulk.receive(address, ticket, nbytes)


async def _pull(source: Any, nbytes: int) -> np.ndarray:
    """The bytes in 1 MiB chunks over capnp, ``IN_FLIGHT`` at a time."""
    out = np.empty(nbytes, dtype=np.uint8)
    offsets = list(range(0, nbytes, CHUNK))

    async def fetch(offset: int) -> None:
        length = min(CHUNK, nbytes - offset)
        response = await source.read(offset=offset, length=length)
        chunk = response.get_data_as_view("data")  # no copy: straight into `out`
        if len(chunk) != length:
            raise TransportError(f"chunk at {offset}: {len(chunk)} bytes, not {length}")
        out[offset : offset + length] = np.frombuffer(chunk, dtype=np.uint8)
        del chunk, response

    window = asyncio.Semaphore(IN_FLIGHT)  # a sliding window of chunks in flight

    async def windowed(offset: int) -> None:
        async with window:
            await fetch(offset)

    await asyncio.gather(*(windowed(o) for o in offsets))
    bulk.counts["chunks_in"] += 1
    bulk.counts["chunks_in_bytes"] += nbytes
    return out


class RemoteChannel:
    """A kernel :class:`Channel` whose actor lives at the other end of a Peer."""

    def __init__(
        self,
        peer: Peer,
        cap: Any,
        actor_id: str,
        name: str,
        endpoints: Mapping[str, EndpointSpec | None] | None,
    ) -> None:
        self.peer = peer
        self.cap = cap
        self._id = actor_id
        self._name = name
        self._endpoints = endpoints
        peer._holders.add(self)

    @classmethod
    def promised(cls, peer: Peer, answer: Any) -> RemoteChannel | None:
        """The actor a pending answer will hold, usable now (pipelining); None
        once the answer is being awaited (pycapnp then refuses to pipeline
        on it: the call waits for the value instead)."""
        try:
            actor = answer.actor
        except capnp.KjException:
            return None
        return cls(peer, actor, f"promised@{id(answer):x}", "<promised actor>", None)

    @property
    def actor_id(self) -> str:
        return self._id

    @property
    def actor_name(self) -> str:
        return self._name

    @property
    def endpoints(self) -> Mapping[str, EndpointSpec | None] | None:
        """Endpoint names only (None values): calls are checked by name here."""
        return self._endpoints

    def _request(self, method: str, call: Call) -> Any:
        cap = self._live()
        self.peer.calls_sent += 1
        counts["capnp_calls_out"] += 1
        request = getattr(cap, f"{method}_request")()
        request.endpoint = call.endpoint
        request.callId = call.meta["call_id"] = self.peer.calls_sent
        for builder, arg in zip(request.init("args", len(call.args)), call.args, strict=True):
            encode(self.peer, builder, arg)
        entries = request.init("kwargs", len(call.kwargs))
        for entry, (key, value) in zip(entries, call.kwargs.items(), strict=True):
            entry.key.text = key
            encode(self.peer, entry.value, value)
        return request

    def submit(self, call: Call) -> None:
        try:
            answer = self._request("call", call).send()
        except HostLost as exc:
            call.promise.set_exception(exc)
            return
        self._track(call, answer, answer.later)

    async def submit_wait(self, call: Call) -> None:
        try:
            response = await self.peer.asked(self._request("send", call).send())
        except HostLost as exc:
            call.promise.set_exception(exc)
            return
        except capnp.KjException as exc:
            call.promise.set_exception(self.peer._lost(exc))
            return
        later = response.later
        counts["capnp_calls_out"] += 1
        self._track(call, later.get(), later)

    def _track(self, call: Call, answer: Any, later: Any) -> None:
        promise = call.promise
        task = self.peer.attach(promise, answer, later)
        set_canceller(promise, functools.partial(self._cancel_call, task, answer, call))

    def _cancel_call(self, task: _Awaiting, answer: Any, call: Call, reason: str) -> bool:
        """Cancel one call: say so on the wire first, then drop the question.

        ``cancelCall`` goes out synchronously, so it reaches the actor before
        any call made after this one ("cancel the queued call, then release
        the actor" must not let the queued call run).
        """
        if task.done() or call.promise.done() or self.cap is None:
            return False
        notice = self.cap.cancelCall(callId=call.meta["call_id"], reason=reason)
        self.peer.spawn(_ignore(notice))
        answer.cancel()
        task.cancel()
        call.promise.set_exception(CallCancelled(self._name, call.endpoint, reason))
        return True

    async def stop(self, grace: float | None) -> None:
        await self._control(self._live().stop(grace=-1.0 if grace is None else grace))

    async def cancel(self, reason: str) -> None:
        await self._control(self._live().cancel(reason=reason))

    def _live(self) -> Any:
        if self.cap is None:
            raise HostLost(f"connection to {self.peer.label} is closed: {self.peer.closed}")
        return self.cap

    async def _control(self, answer: Any) -> None:
        try:
            await self.peer.asked(answer)
        except capnp.KjException as exc:
            raise self.peer._lost(exc) from None


async def _ignore(answer: Any) -> None:
    with suppress(Exception):
        await answer


# -- capnp servers ---------------------------------------------------------------
class ActorServer(schema.Actor.Server):  # type: ignore[misc]
    """Exposes one local actor (its kernel channel) as an ``Actor`` capability."""

    def __init__(self, channel: Any, peer: Peer) -> None:
        self._ref: ActorRef[Any] = ActorRef(channel)
        self._peer = peer
        self._calls: dict[int, Promise[Any]] = {}  # by the client's call id

    def _remember(self, call_id: int, promise: Promise[Any]) -> None:
        self._calls[call_id] = promise
        promise.add_done_callback(functools.partial(self._forget, call_id))

    def _forget(self, call_id: int, _: Promise[Any]) -> None:
        self._calls.pop(call_id, None)

    def _prepare(
        self, endpoint: str, args: Any, kwargs: Any
    ) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        target = getattr(self._ref, endpoint)
        try:
            values = tuple(decode(self._peer, a) for a in args)
            named = {e.key.text: decode(self._peer, e.value) for e in kwargs}
        except AtollError:
            raise
        except Exception as exc:  # e.g. a pickled class this process cannot import
            raise undecodable(exc, self._ref.name, endpoint) from exc
        return target, values, named

    async def call_context(self, context: Any) -> None:
        """``Actor.call``: enqueue, then answer once the call settled.

        Takes the whole context (pycapnp's ``*_context`` form: no wrapper task,
        no dict of parameters). The parameters are let go once decoded, and the
        results message is made only when the answer is known, so a call that
        waits in a mailbox holds neither (``Peer.call_arrived`` bounds how many
        may wait).
        """
        peer = self._peer
        counts["capnp_calls_in"] += 1
        if not peer.call_arrived():
            error = peer.refusal(self._ref.name)
            encode_error(context.results.result.init("error"), error, self._ref.name)
            return
        try:
            params = context.params
            endpoint = params.endpoint
            try:
                target, values, named = self._prepare(endpoint, params.args, params.kwargs)
                promise: Promise[Any] = target(*values, **named)
            except Exception as exc:
                encode_error(context.results.result.init("error"), exc, self._ref.name, endpoint)
                return
            self._remember(params.callId, promise)
            del params
            context.release_params()
            await _answer(peer, promise, context, actor=self._ref.name, endpoint=endpoint)
        finally:
            peer.call_answered()

    async def send(
        self, endpoint: str, args: Any, kwargs: Any, callId: int, _context: Any, **_: Any
    ) -> None:
        counts["capnp_calls_in"] += 1
        if not self._peer.call_arrived():  # waiting for room counts: it holds state
            refused = failed(self._peer.refusal(self._ref.name), "refused")
            _context.results.later = LaterServer(refused, self._peer)
            return
        try:
            try:
                target, values, named = self._prepare(endpoint, args, kwargs)
                promise: Promise[Any] = await target.send(*values, **named)
            except Exception as exc:  # answered by `later.get()`, boxed there if need be
                promise = failed(exc, "refused")
            self._remember(callId, promise)
            # not counted: this answer is only the Later (the mailbox bounds those)
            _context.results.later = LaterServer(promise, self._peer)
        finally:
            self._peer.call_answered()

    async def stop(self, grace: float, _context: Any, **_: Any) -> None:
        await self._ref.stop(None if grace < 0 else grace)

    async def cancel(self, reason: str, _context: Any, **_: Any) -> None:
        await self._ref.cancel(reason)

    async def cancelCall(self, callId: int, reason: str, _context: Any, **_: Any) -> None:
        promise = self._calls.get(callId)
        if promise is not None:
            promise.cancel(reason)


class LaterServer(schema.Later.Server):  # type: ignore[misc]
    """A kernel promise as a ``Later`` capability.

    ``counted``: the ``Later`` of a call's answer, which counts in the peer's
    ``answers_out`` until capnp drops this object (the far side let go of it,
    and of the answer that carried it).
    """

    def __init__(self, promise: Promise[Any], peer: Peer, counted: bool = False) -> None:
        self._promise = promise
        self._peer = peer
        self._counted = counted
        peer.answers_out += counted

    def __del__(self) -> None:
        self._peer.answers_out -= self._counted

    async def get(self, _context: Any, **_: Any) -> None:
        # a reader that goes away does not cancel the call: others may hold it
        counts["capnp_calls_in"] += 1
        counted = self._peer.call_arrived()  # never refused: the call itself ran
        try:
            await _answer(self._peer, self._promise, _context, cancel_on_drop=False, later=False)
        finally:
            if counted:
                self._peer.call_answered()


async def _answer(
    peer: Peer,
    promise: Promise[Any],
    context: Any,
    cancel_on_drop: bool = True,
    actor: str = "",
    endpoint: str = "",
    later: bool = True,
) -> None:
    """Wait for ``promise`` and write it into ``context``'s results (result,
    actor, and with ``later`` the ``Later`` that stands for it).

    The results message is made only once ``promise`` settled: a call waiting
    in a mailbox holds no results message (capnp gives each an 8 KiB first
    segment). ``cancel_on_drop``: the caller dropped its question, so cancel
    the call (for ``Actor.call``; not for ``Later.get``, whose promise others
    share). Nothing raises out of here into capnp (which would cut the error
    to a line of text): a failure, or a value that cannot be encoded, is
    answered as an ``error`` Value, boxed with ``actor`` and ``endpoint`` if
    not atoll's own.
    """
    detach_wait_counter()
    try:
        value = await promise
    except asyncio.CancelledError:
        if cancel_on_drop:
            promise.cancel("cancelled by the remote caller")
        raise
    except Exception as exc:
        results = context.results
        if later:
            results.later = LaterServer(promise, peer, counted=True)
        encode_error(results.result.init("error"), exc, actor, endpoint)
        return
    results = context.results
    if later:
        results.later = LaterServer(promise, peer, counted=True)
    try:
        encode(peer, results.result, value)
    except Exception as exc:  # e.g. BadCall: the value cannot be pickled
        encode_error(results.result.init("error"), exc, actor, endpoint)
        return
    if isinstance(value, ActorRef):
        results.actor = peer.actor_cap(value)


class BufferServer(schema.Buffer.Server):  # type: ignore[misc]
    """An array's bytes: over a bulk stream (``open``), or in chunks (``read``)."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array  # keeps the memory alive while the reader pulls
        self._bytes = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data

    async def read(self, offset: int, length: int, _context: Any, **_: Any) -> None:
        if offset > len(self._bytes):
            raise TransportError(f"offset {offset} beyond {len(self._bytes)} bytes")
        _context.results.data = self._bytes[offset : offset + length]

    async def open(self, _context: Any, **_: Any) -> None:
        address, ticket = bulk.offer(self._bytes)  # raises OSError if no listener
        _context.results.address = address
        _context.results.ticket = ticket


class GateServer(schema.Gate.Server):  # type: ignore[misc]
    """Hands out the node only to a peer that shows the cluster token."""

    def __init__(self, token: bytes, node: ActorRef[Any], peer: Peer, on_refused: Any) -> None:
        self._token = token
        self._node = node
        self._peer = peer
        self._on_refused = on_refused
        self.logged_in = asyncio.Event()

    async def login(self, token: bytes, _context: Any, **_: Any) -> None:
        import hmac

        if not hmac.compare_digest(bytes(token), self._token):
            self._on_refused("wrong token")
            raise PermissionError("wrong cluster token")
        self.logged_in.set()
        encode_actor(self._peer, _context.results.node, self._node)
