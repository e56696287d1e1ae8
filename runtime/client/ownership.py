"""Buffers freed when their last reference goes: what a client owns, and for how long.

Every promise a client hands out for a buffer (an ``ArrayRef``'s, a
``cluster.run``'s, a ``put``'s), and every ``BufferHandle`` such a promise
settles with, is a *reference* to it. While one is reachable in the
client's program, the buffer stays in its host's store; once Python has
collected the last one, :class:`Ownership` frees it there, as Ray's
ownership does. Two rules make that safe and cheap:

* a buffer that a run reads is kept until that run has taken it (its
  devices read it, or enqueued the computation that reads it: the run's
  ``done`` promise), so ``x = cluster.run(f, d, [x])`` can drop each link
  as soon as the next call is made;
* the frees of one loop turn leave together, one ``free_many`` per host;
  to a host in another process at most one every ``FREE_EVERY_S`` while
  frees keep coming (each is a message that wakes that host, and this
  client for its answer), unless ``FREE_AT_ONCE`` buffers, or
  ``FREE_BYTES_AT_ONCE`` bytes of them, are waiting.

Explicit ``cluster.free`` and ``cluster.close`` keep working: a buffer freed
by hand is not freed again when its references go.

A buffer may move to another host (``runtime/control/elastic.py``): its old host
sends the free on while it lives; once it has left, the free fails there,
and the buffers are looked up (``locate``) and freed where they are now.

What is asynchronous about it: Python may collect a reference at any moment
and on any thread; that only notes the buffer and asks the event loop
(thread-safely) to do the rest in a turn of its own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ...devices import BufferHandle
from ...devices._shards import ShardedHandle
from ...kernel import ActorRef, ActorStopped, HostLost, Promise, all_settled, log_failure
from ...kernel.lowlevel import running_asyncio_loop, threadsafe_caller

__all__ = ["FREE_AT_ONCE", "FREE_BYTES_AT_ONCE", "FREE_EVERY_S", "Ownership"]

FREE_EVERY_S = 0.05  # the least time between two frees sent to one remote host
FREE_AT_ONCE = 256  # ... unless this many buffers wait to be freed there
FREE_BYTES_AT_ONCE = 1 << 20  # ... or this many bytes of them (a session's byte quota counts them)

_log = logging.getLogger(__name__)
_log_unfreed = log_failure(_log, "a free", logging.DEBUG)


class _Reference:
    """What a collected reference leaves behind: the buffer it named, once known."""

    __slots__ = ("buffer_id",)

    def __init__(self) -> None:
        self.buffer_id: str | None = None


class Ownership:
    """The references one client holds, by buffer (see the module docstring).

    Made on the event loop's thread; every method but the collection
    callbacks runs there.
    """

    def __init__(
        self,
        owner: str,
        locate: Callable[[list[str]], Promise[dict[str, BufferHandle]]] | None = None,
        host_of: Callable[[BufferHandle], ActorRef[Any]] | None = None,
        free: Callable[[ActorRef[Any], list[str], str], Promise[Any]] | None = None,
    ) -> None:
        """``locate``: where buffers that moved are now (the controller's);
        ``host_of``: the reference to free a handle's buffer at (default:
        the handle's own); ``free(host, ids, owner)``: how (default: its
        ``free_many``)."""
        self.owner = owner
        self._locate = locate
        self._host_of = host_of or _own_host
        self._free = free or _free_many
        self.freed = 0  # buffers freed because their references went
        self._post = threadsafe_caller()
        # on the loop's own thread (where most references go) asyncio's plain
        # call_soon, which does not wake the loop through its self-pipe
        self._loop, self._thread = running_asyncio_loop(), threading.get_ident()
        self._live: dict[str, int] = {}  # buffer id -> references alive
        self._hosts: dict[str, ActorRef[Any]] = {}  # buffer id -> its host
        self._sizes: dict[str, int] = {}  # buffer id -> its bytes, until its free is sent
        self._readers: dict[str, list[Promise[Any]]] = {}  # buffer id -> runs reading it
        self._prune_at: dict[str, int] = {}  # buffer id -> readers before the next prune
        self._handles: set[int] = set()  # ids of the handle objects counted as references
        self._by_hand: set[str] = set()  # freed by the caller: not to be freed again
        self._dying: set[str] = set()  # released, their free not sent yet
        self._gone: deque[str] = deque()  # collected references' buffers, for the loop
        self._doomed: dict[ActorRef[Any], list[str]] = {}  # to free at the end of the turn
        self._sent_at: dict[ActorRef[Any], float] = {}  # remote host -> its last free's time
        self._held: dict[ActorRef[Any], list[str]] = {}  # frees put off, by remote host
        self._held_bytes: dict[ActorRef[Any], int] = {}  # and their bytes
        self._timer: asyncio.TimerHandle | None = None  # the frees put off (FREE_EVERY_S)
        self._scheduled = False
        self._closed = False

    def track(self, promise: Promise[BufferHandle]) -> Promise[BufferHandle]:
        """Count ``promise`` as a reference to the buffer it settles with; returns it."""
        reference = _Reference()
        promise.add_done_callback(lambda done: self._settled(reference, done))
        weakref.finalize(promise, self._collected, reference)
        return promise

    def reading(self, values: Iterable[Any], done: Promise[Any]) -> None:
        """A run reads ``values`` (handles, or promises of them): their buffers
        stay until ``done`` settles (the run took its inputs)."""
        for value in values:
            if isinstance(value, Promise):
                value.add_done_callback(lambda settled: self._read_by(settled, done))
            else:
                self._add_readers(value, done)

    def by_hand(self, handle: BufferHandle) -> None:
        """The caller freed ``handle``'s buffer itself (``cluster.free``)."""
        if handle.id in self._live:
            self._by_hand.add(handle.id)
        else:  # released already: no free will be sent for it
            self._sizes.pop(handle.id, None)
        self._dying.discard(handle.id)

    def close(self) -> None:
        """The client went: its buffers are freed with its session, not here."""
        self._closed = True
        self._live.clear()
        self._sizes.clear()
        self._readers.clear()
        self._doomed.clear()
        self._held.clear()
        self._held_bytes.clear()
        self._dying.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- on the loop ---------------------------------------------------------
    def _settled(self, reference: _Reference, promise: Promise[BufferHandle]) -> None:
        if promise.exception() is not None:
            return
        handle = promise.result()
        if not isinstance(handle, BufferHandle):
            return
        reference.buffer_id = handle.id
        self._count(handle)
        if id(handle) not in self._handles:  # the handle is a reference of its own
            self._handles.add(id(handle))
            self._count(handle)
            weakref.finalize(handle, self._handle_collected, id(handle), handle.id)

    def _count(self, handle: BufferHandle) -> None:
        """One more reference to ``handle``'s buffer (one released but not yet
        freed comes back: a program that passes an input through to an
        output hands out a new reference to it)."""
        self._live[handle.id] = self._live.get(handle.id, 0) + 1
        if handle.id not in self._hosts:
            self._hosts[handle.id] = self._host_of(handle)
            self._sizes[handle.id] = handle.nbytes
        self._dying.discard(handle.id)

    def _read_by(self, value: Promise[Any], done: Promise[Any]) -> None:
        if value.exception() is not None:
            return
        self._add_readers(value.result(), done)

    def _add_readers(self, value: Any, done: Promise[Any]) -> None:
        """``value``'s buffers are read until ``done`` (a value split over
        devices: each of its shards)."""
        if isinstance(value, BufferHandle):
            self._add_reader(value.id, done)
        elif isinstance(value, ShardedHandle):
            for part in value.parts:
                self._add_reader(part.id, done)

    def _add_reader(self, buffer_id: str, done: Promise[Any]) -> None:
        """One more run reading ``buffer_id``; the ones that took it are let go
        of now and then (a buffer every step reads, a weight, gathers many).
        A buffer no reference here holds (another session's) is not tracked."""
        if buffer_id not in self._live:
            return
        readers = self._readers.setdefault(buffer_id, [])
        readers.append(done)
        if len(readers) >= self._prune_at.get(buffer_id, 16):  # amortized: at most twice
            readers[:] = [r for r in readers if not r.done()]  # those still running
            self._prune_at[buffer_id] = max(16, 2 * len(readers))

    def _drain(self) -> None:
        """Take in the references collected since the last turn."""
        self._scheduled = False
        while self._gone:
            self._release(self._gone.popleft())
        self._flush()

    def _release(self, buffer_id: str) -> None:
        left = self._live.get(buffer_id, 0) - 1
        if left > 0:
            self._live[buffer_id] = left
            return
        self._live.pop(buffer_id, None)
        host = self._hosts.pop(buffer_id, None)
        readers = [r for r in self._readers.pop(buffer_id, ()) if not r.done()]
        self._prune_at.pop(buffer_id, None)
        if self._closed or host is None or buffer_id in self._by_hand:
            self._by_hand.discard(buffer_id)
            self._sizes.pop(buffer_id, None)
            return
        self._dying.add(buffer_id)
        if not readers:
            self._doomed.setdefault(host, []).append(buffer_id)
            return
        all_settled(readers).add_done_callback(lambda _: self._doom(host, buffer_id))

    def _doom(self, host: ActorRef[Any], buffer_id: str) -> None:
        """Free ``buffer_id`` with this turn's frees (its last reader took it)."""
        if self._closed:
            return
        self._doomed.setdefault(host, []).append(buffer_id)
        self._schedule()

    def send_put_off(self) -> list[Promise[Any]]:
        """Send the frees put off now (a count of what hosts hold must not
        see them); the promise of each (a notice's settles as it leaves)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._gone:  # (collected since the loop's last turn)
            self._release(self._gone.popleft())
        return self._flush(put_off=False)

    def _flush(self, put_off: bool = True) -> list[Promise[Any]]:
        """One ``free_many`` per host for every buffer doomed this turn, and
        those put off before (each still released: a reference that came
        back since keeps it), unless they are ``put_off`` again; the frees
        sent. Each turn looks at its own frees only: those put off wait aside
        with their count of bytes."""
        doomed, self._doomed = self._doomed, {}
        loop = running_asyncio_loop() if put_off else None
        if loop is None or self._timer is None:  # (the timer's turn, or all at once)
            for host in self._held:
                doomed.setdefault(host, [])
        frees: list[Promise[Any]] = []
        for host, buffer_ids in doomed.items():
            dying = [b for b in dict.fromkeys(buffer_ids) if b in self._dying]
            if not dying and host not in self._held:
                continue
            if loop is not None and self._put_off(loop, host, dying):
                continue
            held = self._held.pop(host, None)
            self._held_bytes.pop(host, None)
            if held:
                dying = [b for b in dict.fromkeys(held + dying) if b in self._dying]
            if not dying:
                continue
            self._dying.difference_update(dying)
            for buffer_id in dying:
                self._sizes.pop(buffer_id, None)
            self.freed += len(dying)
            sent = self._free(host, dying, self.owner)
            sent.add_done_callback(functools.partial(self._unfreed, dying))
            frees.append(sent)
        return frees

    def _put_off(
        self, loop: asyncio.AbstractEventLoop, host: ActorRef[Any], dying: list[str]
    ) -> bool:
        """Whether the frees ``dying`` at remote ``host`` wait (its last free
        left less than ``FREE_EVERY_S`` ago, and fewer than ``FREE_AT_ONCE``
        buffers and ``FREE_BYTES_AT_ONCE`` bytes wait): they are kept, and a
        timer sends them."""
        if not _remote(host):  # a local actor: a free is a mailbox entry, no wake-up
            return False
        now = loop.time()
        wait = self._sent_at.get(host, -FREE_EVERY_S) + FREE_EVERY_S - now
        held = self._held.get(host, ())
        count = len(held) + len(dying)
        nbytes = self._held_bytes.get(host, 0) + self._bytes(dying)
        if wait <= 0 or count >= FREE_AT_ONCE or nbytes >= FREE_BYTES_AT_ONCE:
            self._sent_at[host] = now
            return False
        if dying:
            self._held.setdefault(host, []).extend(dying)
            self._held_bytes[host] = nbytes
        if self._timer is not None and self._timer.when() > now + wait:  # (sooner for this host)
            self._timer.cancel()
            self._timer = None
        if self._timer is None:
            self._timer = loop.call_later(wait, self._put_off_over)
        return True

    def _bytes(self, buffer_ids: list[str]) -> int:
        sizes = self._sizes
        return sum(sizes.get(b, 0) for b in buffer_ids)

    def _put_off_over(self) -> None:
        self._timer = None
        if not self._closed:
            self._flush()

    def _unfreed(self, buffer_ids: Sequence[str], sent: Promise[Any]) -> None:
        """A ``free_many`` failed: if its host is gone, the buffers that moved
        off it before are freed where they are now."""
        error = sent.exception()
        if not isinstance(error, (HostLost, ActorStopped)) or self._locate is None:
            _log_unfreed(sent)
            return
        self._locate(list(buffer_ids)).add_done_callback(self._free_found)

    def _free_found(self, found: Promise[dict[str, BufferHandle]]) -> None:
        if found.exception() is not None:
            _log_unfreed(found)
            return
        by_host: dict[ActorRef[Any], list[str]] = {}
        for handle in found.result().values():
            by_host.setdefault(self._host_of(handle), []).append(handle.id)
        for host, buffer_ids in by_host.items():
            host.free_many(buffer_ids, self.owner).add_done_callback(_log_unfreed)

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            try:
                if self._loop is not None and threading.get_ident() == self._thread:
                    self._loop.call_soon(self._drain)
                else:
                    self._post(self._drain)
            except RuntimeError:  # the loop is gone, and the cluster with it
                self._scheduled = False

    # -- from the garbage collector, on any thread ----------------------------
    def _collected(self, reference: _Reference) -> None:
        if reference.buffer_id is not None:  # it never settled: nothing to free
            self._gone.append(reference.buffer_id)
            self._schedule()

    def _handle_collected(self, handle_id: int, buffer_id: str) -> None:
        self._handles.discard(handle_id)
        self._gone.append(buffer_id)
        self._schedule()


def _remote(ref: ActorRef[Any]) -> bool:
    """Whether ``ref`` is an actor in another process. Without Cap'n Proto
    loaded there is none (and ``import atoll`` does not load it)."""
    peers = sys.modules.get("atoll.transports.capnp._peer")
    return peers is not None and peers.peer_of(ref) is not None


def _own_host(handle: BufferHandle) -> ActorRef[Any]:
    return handle.host


def _free_many(host: ActorRef[Any], buffer_ids: list[str], owner: str) -> Promise[Any]:
    freed: Promise[Any] = host.free_many(buffer_ids, owner)
    return freed
