"""A host's object store: buffers by handle, reference-counted, owner-labelled.

Each host keeps the outputs of its devices here, under an opaque id. Readers
on the same host take the array directly; readers elsewhere fetch it through
the host actor. Every buffer carries an owner label (a client or program) so
that everything a client owned can be freed at once when it goes away.

The store is bounded: :meth:`ObjectStore.reserve` waits while the bytes in use
plus the request would exceed the capacity. That wait is the back-pressure that
stalls new work instead of running out of memory.

In a host process (``shared``), the bytes of each large numpy buffer live in
a shared-memory segment (:mod:`atoll.transports.dataplane.shm`), so that readers in
other processes of the machine map them instead of copying them; the segment
loses its name when the buffer is freed (and is reused for a later buffer once
no reader holds it).

It is also where pushed inputs land. A device that will read a value produced
elsewhere waits on :meth:`ObjectStore.arrival` for a key the controller chose;
the producer's host pushes the bytes here and :meth:`ObjectStore.deliver`
settles that promise, whichever of the two comes first. What each notice
about a key means (a landing, a redirect, a failure, the reader taking it or
giving up) is decided by the host's :class:`~._inbox.Inboxes` state machine;
the store carries out its instructions.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from ..kernel import AtollError, Clock, Promise, current_clock, move_on_after
from ..kernel.config import settings
from ..transports.dataplane import shm
from ..transports.dtypes import raw_bytes
from ..transports.inproc import read_only
from ._inbox import (
    Abandoned,
    Drop,
    Failed,
    Inboxes,
    Instruction,
    Landed,
    Redirected,
    Reject,
    Settle,
    Taken,
)
from ._ledger import OwnerLedger, check_owner

__all__ = ["BufferMissing", "ObjectStore", "StoreFull", "StoredBuffer"]


_FAILED_KEPT = 1024  # buffers dropped after their computation failed, remembered with why
HOLD_TTL_S = 30.0  # a hold for a push not taken within this lapses


class StoreFull(AtollError):
    """No room in a host's store within the store's bound (``ObjectStore.wait_s``)."""


class BufferMissing(AtollError, KeyError):
    """No buffer with that id (never stored, or already freed)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "buffer missing"


@dataclass(frozen=True)
class StoredBuffer:
    """What a move needs to know of one stored buffer."""

    id: str
    owner: str
    refs: int
    place: int | str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


@dataclass
class _Entry:
    array: Any  # numpy (read-only) or another array type with ``nbytes``
    owner: str
    refs: int
    nbytes: int
    segment: shm.Segment | None = None  # the shared memory it lives in, if its own
    ready: Promise[None] | None = None  # a device's future: settles once it exists
    # the device it belongs to (-1: host memory, a landed push), or where a
    # suspended slice parked it (a label; ``runtime/control/elastic.py``)
    place: int | str = -1


class ObjectStore:
    """Buffers of one host; see the module docstring. Not an actor: the host
    actor and its device actors (same process) share one instance.

    ``shared``: keep large numpy buffers in shared memory (if this machine
    has it; ``ATOLL_SHM=0`` turns it off).
    """

    def __init__(
        self,
        name: str,
        capacity_bytes: int | None = None,
        *,
        shared: bool = False,
        clock: Clock | None = None,
    ) -> None:
        self.name = name
        # the time of waits for room and of holds: the timeouts' clock where
        # it was made (a simulated device's time may jump while a thread works)
        self.clock = clock if clock is not None else current_clock()
        self.capacity_bytes = capacity_bytes
        # how long reserve() waits for room before it raises StoreFull
        self.wait_s = settings().store_wait_s  # ATOLL_STORE_WAIT_S
        self.shared = shared and shm.enabled()
        self.used_bytes = 0
        self.peak_bytes = 0  # the most used at once since the last reset_peak
        self.reserved_bytes = 0
        self._entries: dict[str, _Entry] = {}
        self._ids = itertools.count()
        self._room: deque[anyio.Event] = deque()
        # inbox keys: what their notices mean is the Inboxes machine's to say;
        # the store keeps the readers' promises and carries out its instructions
        self.inboxes = Inboxes()
        self._arrivals: dict[str, Promise[Any]] = {}
        self.ledger = OwnerLedger()  # per-owner bytes, device time and quotas
        self._holds: dict[int, tuple[int, float]] = {}  # id -> (bytes, lapses at)
        # buffers dropped because their computation failed, oldest first: a
        # reader that comes later gets that error, not BufferMissing
        self._failed: dict[str, Promise[None]] = {}
        # buffers that moved to another host (runtime/control/elastic.py), oldest
        # first, with the host actor they went to: a stale handle's reads and
        # frees are sent on there (until one comes back)
        self.moved_out: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, buffer_id: object) -> bool:
        return buffer_id in self._entries

    async def reserve(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more fit; then hold them for a :meth:`put`.

        The wait is bounded (:attr:`wait_s`): work that holds some buffers
        while it waits for room that only other waiting work could free
        would otherwise wait for ever. Past the bound it raises
        :class:`StoreFull`, so the work fails, lets go of what it held, and
        the rest goes on: every promise settles.
        """
        if self.reserve_now(nbytes):  # it fits now: no timer to set
            return
        cap = self.capacity_bytes
        if cap is not None and nbytes > cap:
            raise AtollError(f"{nbytes} bytes can never fit in store {self.name} ({cap} bytes)")
        with move_on_after(self.clock, self.wait_s) as waited:
            while cap is not None and self.used_bytes + self.reserved_bytes + nbytes > cap:
                await self._wait_for_room()
        if waited.cancelled_caught:
            raise StoreFull(
                f"store {self.name}: no room for {nbytes} bytes within {self.wait_s} s "
                f"({self.used_bytes} used, {self.reserved_bytes} reserved of {cap})"
            )
        self.reserved_bytes += nbytes

    def reserve_now(self, nbytes: int) -> bool:
        """:meth:`reserve`, if ``nbytes`` fit now (nobody waits for room
        before them); False, holding nothing, if they do not."""
        cap = self.capacity_bytes
        if cap is not None and (self._room or self.used_bytes + self.reserved_bytes + nbytes > cap):
            return False
        self.reserved_bytes += nbytes
        return True

    async def _wait_for_room(self) -> None:
        event = anyio.Event()
        self._room.append(event)
        try:
            with move_on_after(self.clock, HOLD_TTL_S):  # then look again: holds lapse
                await event.wait()
            self._lapse_holds()
        finally:
            if not event.is_set():  # given up: it must not hold back fits()
                self._room.remove(event)

    def waiting(self) -> int:
        """How many reservations wait for room now."""
        return len(self._room)

    def unreserve(self, nbytes: int) -> None:
        """Give back a reservation that will not be :meth:`put` (the work failed)."""
        self.reserved_bytes -= nbytes
        self._wake()

    # -- holds: room promised to a push before its bytes are pulled ------------
    def hold(self, nbytes: int) -> int | None:
        """Reserve ``nbytes`` for a push that is yet to come, if they fit now
        (:meth:`fits`); the hold's id, or None. A hold that is not taken
        within :data:`HOLD_TTL_S` (its producer died, say) lapses."""
        self._lapse_holds()
        if not self.fits(nbytes):
            return None
        self.reserved_bytes += nbytes
        hold_id = next(self._ids)
        self._holds[hold_id] = (nbytes, self.clock.now() + HOLD_TTL_S)
        return hold_id

    def take_hold(self, hold_id: int, nbytes: int) -> bool:
        """Turn hold ``hold_id`` into a reservation of ``nbytes`` for a
        :meth:`put` with ``reserved=True``; False if it lapsed or is for
        another size (then nothing is reserved)."""
        held = self._holds.pop(hold_id, None)
        if held is None:
            return False
        if held[0] != nbytes:
            self.unreserve(held[0])
            return False
        return True

    def release_hold(self, hold_id: int) -> None:
        """Give hold ``hold_id`` back unused (its push failed)."""
        held = self._holds.pop(hold_id, None)
        if held is not None:
            self.unreserve(held[0])

    def _lapse_holds(self) -> None:
        now = self.clock.now()
        for hold_id, (nbytes, until) in list(self._holds.items()):
            if until < now:
                del self._holds[hold_id]
                self.unreserve(nbytes)

    def roomy(self) -> bool:
        """Whether the store is unbounded, or under half full with no one
        waiting for room (devices run work out of order only then)."""
        cap = self.capacity_bytes
        return cap is None or (not self._room and 2 * (self.used_bytes + self.reserved_bytes) < cap)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit now, without waiting, and without
        getting ahead of anyone already waiting for room."""
        cap = self.capacity_bytes
        if cap is None:
            return True
        return not self._room and self.used_bytes + self.reserved_bytes + nbytes <= cap

    def put(
        self,
        array: Any,
        owner: str = "",
        *,
        reserved: bool = False,
        ready: Promise[None] | None = None,
        nbytes: int | None = None,
        place: int | str = -1,
        buffer_id: str | None = None,
        segment: shm.Segment | None = None,
    ) -> str:
        """Store ``array`` and return its id.

        Any array with ``nbytes`` may be stored (a ``jax.Array`` stays on its
        device); numpy arrays are stored as read-only views, so no holder can
        change what others read. A shared store copies a large numpy array
        into a segment of its own first, unless it is in shared memory already.
        ``ready``: the array is a future that an accelerator is still
        computing; the promise settles once it exists (or fails with why it
        never will). Readers that need its bytes wait for it (:meth:`pending`).
        ``nbytes``: its size, when the caller knows it already.
        ``place``: the device it belongs to (-1: none, host memory), or a
        suspended slice's label for it.
        ``buffer_id``: the id it keeps, when it moved here from another host
        (``runtime/control/elastic.py``); else a new one. ``segment``: the segment of
        this process the array was copied into already.
        """
        if segment is None and isinstance(array, np.ndarray):
            array, segment = self._placed(array)
        nbytes = int(array.nbytes) if nbytes is None else nbytes
        if reserved:
            self.reserved_bytes -= nbytes
        try:
            self.ledger.check(owner, 0)  # its session ended: store nothing more for it
        except AtollError:
            if segment is not None:
                shm.release(segment)
            self._wake()
            raise
        if buffer_id is None:
            buffer_id = f"{self.name}:{next(self._ids)}"
        elif buffer_id in self._entries and buffer_id not in self.moved_out:
            raise AtollError(f"buffer {buffer_id!r} is already in store {self.name}")
        else:  # it moved here: here it is again, if it had been here before
            if self.moved_out.pop(buffer_id, None) is not None and buffer_id in self._entries:
                self._drop(buffer_id)  # its old copy, handed over and not dropped yet
        self._entries[buffer_id] = _Entry(array, owner, 1, nbytes, segment, ready, place)
        self.used_bytes += nbytes
        if self.used_bytes > self.peak_bytes:
            self.peak_bytes = self.used_bytes
        self.ledger.added(owner, nbytes)
        return buffer_id

    def reset_peak(self) -> int:
        """The peak since the last reset; from now on, the peak is what is used."""
        peak, self.peak_bytes = self.peak_bytes, self.used_bytes
        return peak

    def get(self, buffer_id: str) -> Any:
        """The array of ``buffer_id`` (raising why it was never made, if its
        computation failed and it was dropped since)."""
        failed = self._failed.get(buffer_id)
        if failed is not None and buffer_id not in self._entries:
            raise failed.exception() or BufferMissing(buffer_id)
        return self._entry(buffer_id).array

    def readable(self, buffer_id: str, owner: str) -> Any:
        """The array of ``buffer_id``, maybe still being computed, when session
        ``owner`` may read it and its computation is not known to have failed;
        None otherwise (:meth:`get`, :meth:`check_owner` and :meth:`failure`
        say why). For the paths that must not wait."""
        entry = self._entries.get(buffer_id)
        if entry is None or (owner and entry.owner and entry.owner != owner):
            return None
        ready = entry.ready
        if ready is not None and ready.exception() is not None:
            return None
        return entry.array

    def pending(self, buffer_id: str) -> Promise[None] | None:
        """The promise that buffer ``buffer_id`` exists, while an accelerator
        still computes it (or after it failed); None once it is there."""
        ready = self._ready(buffer_id)
        return None if ready is None or (ready.done() and ready.exception() is None) else ready

    def failure(self, buffer_id: str) -> BaseException | None:
        """Why buffer ``buffer_id`` will never exist, once that is known."""
        ready = self._ready(buffer_id)
        return None if ready is None or not ready.done() else ready.exception()

    def _ready(self, buffer_id: str) -> Promise[None] | None:
        entry = self._entries.get(buffer_id)
        if entry is None and buffer_id in self._failed:
            return self._failed[buffer_id]
        return self._entry(buffer_id).ready

    def check_owner(self, buffer_id: str, asker: str) -> None:
        """Raise ``NotYours`` unless session ``asker`` ('' : the runtime) may
        use buffer ``buffer_id`` (see ``devices/_ledger.py``)."""
        entry = self._entries.get(buffer_id)
        if entry is None and buffer_id in self._failed:
            return  # its readers get the error it failed with
        if entry is None:
            self._entry(buffer_id)  # raises BufferMissing
        else:
            check_owner(buffer_id, entry.owner, asker)

    def incref(self, buffer_id: str) -> None:
        self._entry(buffer_id).refs += 1

    def decref(self, buffer_id: str) -> bool:
        """Drop one reference; free the buffer at zero. True if it was freed."""
        entry = self._entry(buffer_id)
        entry.refs -= 1
        if entry.refs > 0:
            return False
        self._drop(buffer_id)
        return True

    def placed_at(self, places: Collection[int | str] | None) -> list[StoredBuffer]:
        """The buffers that belong to ``places`` (None: every buffer), as a
        move needs to know them."""
        return [
            StoredBuffer(bid, e.owner, e.refs, e.place, e.nbytes, _shape(e.array), _dtype(e.array))
            for bid, e in self._entries.items()
            if places is None or e.place in places
        ]

    def place_of(self, buffer_id: str) -> int | str:
        return self._entry(buffer_id).place

    def retag(self, buffer_id: str, place: int | str, array: Any = None) -> None:
        """Buffer ``buffer_id`` belongs to ``place`` now, as ``array`` if
        given (the same value, held elsewhere: on another device, in host
        memory)."""
        entry = self._entry(buffer_id)
        entry.place = place
        if array is not None:
            entry.array = array

    def remove(self, buffer_id: str) -> int:
        """Drop a buffer whatever its references (it moved to another
        host); its references, which the new copy holds now."""
        refs = self._entry(buffer_id).refs
        self._drop(buffer_id)
        return refs

    def set_refs(self, buffer_id: str, refs: int) -> None:
        self._entry(buffer_id).refs = refs

    def free_owner(self, owner: str) -> int:
        """Free every buffer labelled ``owner``; return how many."""
        doomed = [bid for bid, e in self._entries.items() if e.owner == owner]
        for buffer_id in doomed:
            self._drop(buffer_id)
        return len(doomed)

    # -- pushed inputs ------------------------------------------------------
    def arrival(self, key: str) -> Promise[Any]:
        """The promise of what is pushed under ``key`` (made on first ask)."""
        promise = self._arrivals.get(key)
        if promise is None:
            promise = self._arrivals[key] = Promise(f"arrival {key}")
        return promise

    def landed(self, key: str) -> bool:
        """Whether what is pushed under ``key`` is here (or its failure is)."""
        promise = self._arrivals.get(key)
        return promise is not None and promise.done()

    def deliver(self, key: str, value: Any, buffer_id: str) -> None:
        """A push for ``key`` landed as one reference to buffer ``buffer_id``
        (dropped at once if its reader is done with the key, or the key was
        settled already: see ``_inbox.py``)."""
        self._carry_out(self.inboxes.handle(Landed(key, buffer_id, value)))

    def redirect(self, key: str, value: Any) -> None:
        """Nothing will land under ``key``: its reader takes ``value`` instead
        (the producer's own handle, when the push was declined)."""
        self._carry_out(self.inboxes.handle(Redirected(key, value)))

    def fail(self, key: str, error: BaseException) -> None:
        """Nothing will land under ``key``: its producer failed with ``error``."""
        self._carry_out(self.inboxes.handle(Failed(key, error)))

    def take(self, key: str) -> None:
        """Remove a settled ``key``: its reader now owns what landed (if anything)."""
        self._carry_out(self.inboxes.handle(Taken(key)))

    def abandon(self, key: str) -> None:
        """The reader gave up: free what landed, or free it when it lands."""
        self._carry_out(self.inboxes.handle(Abandoned(key)))

    def _carry_out(self, instructions: list[Instruction]) -> None:
        for instruction in instructions:
            if isinstance(instruction, Settle):
                self.arrival(instruction.key).set_result(instruction.value)
            elif isinstance(instruction, Reject):
                self.arrival(instruction.key).set_exception(instruction.error)
            elif isinstance(instruction, Drop):
                self.decref(instruction.buffer_id)
            else:
                self._arrivals.pop(instruction.key, None)

    def pending_arrivals(self) -> int:
        """Keys waited on, delivered and not taken, or given up on (for tests)."""
        return len(self._arrivals) + self.inboxes.abandoned

    def _entry(self, buffer_id: str) -> _Entry:
        try:
            return self._entries[buffer_id]
        except KeyError:
            raise BufferMissing(f"no buffer {buffer_id!r} in store {self.name}") from None

    def _placed(self, array: np.ndarray) -> tuple[np.ndarray, shm.Segment | None]:
        """``array`` as stored (read-only), and the segment it was copied into."""
        big = array.nbytes > shm.THRESHOLD and raw_bytes(array.dtype)
        if self.shared and big and not shm.locate(array):
            moved = shm.share(array)
            if moved is not None:  # else /dev/shm is full: keep it private
                return moved
        return read_only(array), None

    def shared_usage(self) -> tuple[int, int]:
        """How many buffers, and bytes, live in segments of this store."""
        segments = [e.nbytes for e in self._entries.values() if e.segment is not None]
        return len(segments), sum(segments)

    def _drop(self, buffer_id: str) -> None:
        entry = self._entries.pop(buffer_id)
        if entry.ready is not None and entry.ready.done() and entry.ready.exception():
            self._failed[buffer_id] = entry.ready
            while len(self._failed) > _FAILED_KEPT:
                del self._failed[next(iter(self._failed))]
        self.used_bytes -= entry.nbytes
        self.ledger.removed(entry.owner, entry.nbytes)
        if entry.segment is not None:
            shm.release(entry.segment)  # readers' mappings stay valid
        self._wake()

    def _wake(self) -> None:
        """Room was made: every waiter checks again."""
        while self._room:
            self._room.popleft().set()


def _shape(array: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in getattr(array, "shape", ()))


def _dtype(array: Any) -> str:
    return str(getattr(array, "dtype", "object"))
