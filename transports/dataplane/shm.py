"""Shared-memory segments: large arrays handed between processes of one machine.

A host process keeps the bytes of each large buffer (above :data:`THRESHOLD`)
in a POSIX shared-memory segment of its own, a file in ``/dev/shm`` named
``atoll-<pid>-<tag>-<n>`` after the process that made it. A reader on the
same machine (same :func:`machine_id`) maps that file read-only and reads the
array in place: no copy, no bytes on a socket. A segment is written before
anyone else learns its name, and does not change while it has that name.

Lifetimes:

* the creator takes a segment's name away when its store frees the buffer
  (:func:`release`), or when its own last mapping goes, or at exit;
  a reader's mapping stays valid after that, and the memory is returned
  when the last mapping anywhere goes (or reused, see below);
* a process that dies without unlinking (``kill -9``) leaves its segments
  behind until someone calls :func:`sweep`, which unlinks every segment
  whose creator is gone. Host processes sweep when they start, and the
  launcher sweeps when a host's link drops and when it stops its hosts.

Making a segment costs more than copying into it: the kernel allocates and
clears its pages, and the first write to each faults it in (about 40 ms for
64 MiB here, against 5 ms for the copy). So after a segment of some size is
taken, a worker thread makes a *spare* of that size with its pages already
in place (up to two per size, ``shm_spare_bytes`` in all, from
``ATOLL_SHM_SPARE_BYTES``); the next buffer of that size only pays the
copy. A spare's name is fresh and was never handed out, so nobody can
read it (readers may have its file mapped, see below). The same worker
unmaps mappings that are no longer used, off the event loop.

Mapping a segment costs a reader too: the kernel fills in 16,384 page-table
entries for 64 MiB (about 5.5 ms here, and 2.5 ms more to unmap them). So
segments are *reused*, as in Ray's object store, and readers keep their
mappings of them:

* a freed segment is not removed but renamed to a fresh name that nobody
  was told (so a late reader of the old name finds nothing); once its
  creator's last view went, it is kept (:func:`_recycle`; up to two per
  size, ``shm_spare_bytes`` in all, else it is removed), and the next
  buffer of its size goes into it (:func:`_reusable`, preferred to a spare;
  counted in ``counts["recycled"]``);
* a reader holds a shared ``flock`` on a segment while any view of its
  mapping lives, and the creator reuses a segment only while it can take
  an exclusive one: it never rewrites memory that a reader is looking at;
* a reader keeps a mapping without views for :data:`KEEP_S` (at most
  ``shm_keep_bytes`` of them, from ``ATOLL_SHM_KEEP_BYTES``), by the file's
  identity (device and inode).
  A segment handed out again under a new name is then read through the
  mapping it already has, pages in place (:func:`_reused`, counted in
  ``counts["maps_reused"]``). It checks, holding the shared lock, that the
  name still leads to that file: a name that was taken away since fails,
  and the caller gets the bytes another way.

No resource tracker is involved (``multiprocessing.shared_memory`` on Python
3.11 would unlink a segment when *any* process that opened it exits): files
are made with ``os.open`` and mapped with ``mmap``. Everything here is
synchronous (the worker thread aside); the registry of mappings is per
process and lives on the thread that runs the event loop.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import fcntl
import functools
import itertools
import mmap
import os
import re
import secrets
import socket
import threading
import weakref
from collections import Counter
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from ...kernel import Clock, current_clock
from ...kernel.config import settings
from ..dtypes import dtype_from_wire

__all__ = [
    "THRESHOLD",
    "Segment",
    "attach",
    "counts",
    "enabled",
    "locate",
    "machine_id",
    "release",
    "release_all",
    "share",
    "sweep",
]

THRESHOLD = 1 << 20  # arrays above this many bytes live in shared memory
DIRECTORY = "/dev/shm"
PREFIX = "atoll-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")
_TAG = secrets.token_hex(4)  # tells this process's names from a pid's earlier owner
_numbers = itertools.count()
counts: Counter[str] = Counter()  # maps_reused, recycled (for tests and store_usage)


@cache
def machine_id() -> str:
    """Who "this machine" is: the kernel's boot id and the host name.

    ``ATOLL_MACHINE_ID`` overrides it; its value ``per-process`` makes every
    process a machine of its own (to force the cross-machine path in tests).
    """
    override = settings().machine_id
    if override == "per-process":
        return f"process-{os.getpid()}-{_TAG}"
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{boot}/{socket.gethostname()}"


def enabled() -> bool:
    """Whether this process may make segments (``ATOLL_SHM=0`` turns it off)."""
    return settings().shm and os.access(DIRECTORY, os.W_OK)


class Segment:
    """A segment this process made: the name it was handed out under, whether
    it still has that name (``linked``), and the fresh name it has since."""

    def __init__(self, name: str, nbytes: int, taken_over: bool = False) -> None:
        self.name = name
        self.nbytes = nbytes
        self.linked = True
        self.hidden: str | None = None  # its name once ``name`` was taken away
        # made by another process and taken over (:func:`take_over`): mapped
        # read-only here, so it is removed when freed, never reused
        self.taken_over = taken_over

    def unlink(self) -> None:
        """Take the name away (idempotent): the file gets a fresh name nobody
        knows, so that its memory can be reused. Mappings stay valid."""
        if self.linked:
            self.linked = False
            hidden = _fresh_name()
            with contextlib.suppress(FileNotFoundError):
                os.rename(_path(self.name), _path(hidden))
                self.hidden = hidden

    def remove(self) -> None:
        """Remove the file, under whichever name it has (idempotent)."""
        current = self.name if self.linked else self.hidden
        self.linked, self.hidden = False, None
        if current is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_path(current))


@dataclass(frozen=True)
class _Mapping:
    start: int
    size: int
    name: str
    own: Segment | None  # None: another process's segment


_mappings: dict[int, _Mapping] = {}  # by start address, while mapped here
_own: dict[str, Segment] = {}  # segments this process made, while it maps them


def share(array: np.ndarray) -> tuple[np.ndarray, Segment] | None:
    """A read-only copy of ``array`` in a new segment, and that segment.

    None when no segment can be made (``/dev/shm`` full or missing): the
    caller keeps the array in private memory.
    """
    try:
        view, segment = _take(array.nbytes)
    except OSError:
        return None
    out = view.view(array.dtype).reshape(array.shape)
    np.copyto(out, array, casting="no")
    out.flags.writeable = False
    return out, segment


async def share_off_loop(array: np.ndarray) -> tuple[np.ndarray, Segment] | None:
    """:func:`share`, with the copy done by a worker thread (numpy lets go of
    the GIL for it): the event loop that calls it goes on meanwhile. For
    large arrays that must end up in a segment of this process (a buffer
    that moved here, mapped from another's segment, which that process will
    take back)."""
    try:
        view, segment = _take(array.nbytes)
    except OSError:
        return None
    out = view.view(array.dtype).reshape(array.shape)
    await asyncio.get_running_loop().run_in_executor(None, _copy, out, array)
    out.flags.writeable = False
    return out, segment


def _copy(out: np.ndarray, array: np.ndarray) -> None:
    np.copyto(out, array, casting="no")


def _take(nbytes: int) -> tuple[np.ndarray, Segment]:
    """A writable uint8 view of a segment of ``nbytes`` that nobody reads: a
    freed one whose readers let go of it, or a spare made ahead (then the copy
    into it is a plain memcpy), else one made now; either way another spare
    of that size is made in the background."""
    with _lock:
        made = _reusable(nbytes)
        spares = _spares.get(nbytes)
        if made is None and spares:
            made = spares.pop()
    if made is None:
        made = _make(nbytes, populate=False)  # the copy faults its pages in
    _make_spare_soon(nbytes)
    name, memory = made
    segment = _own[name] = Segment(name, nbytes)
    return _register(memory, name, segment), segment


def _make(nbytes: int, populate: bool) -> tuple[str, mmap.mmap]:
    """A new segment of ``nbytes``, mapped read-write (any thread)."""
    name = _fresh_name()
    fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, not SIGBUS on a write later
        memory = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.unlink(_path(name))
        raise
    finally:
        os.close(fd)
    if populate:
        _fault_in(memory)
    return name, memory


def _fresh_name() -> str:
    return f"{PREFIX}{os.getpid()}-{_TAG}-{next(_numbers)}"


def _fault_in(memory: mmap.mmap) -> None:
    """Map every page of ``memory`` writable now, without holding the GIL.

    (``MAP_POPULATE`` and ``madvise`` would hold it for the whole time: the
    event loop would stall. Reading ``/dev/zero`` into the mapping faults the
    pages in inside a system call that lets go of it.)
    """
    with contextlib.suppress(OSError), memoryview(memory) as view:
        zero = os.open("/dev/zero", os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                done += os.readv(zero, [view[done:]])
        finally:
            os.close(zero)


# -- spares: segments made ahead, in a worker thread ------------------------------
SPARES_PER_SIZE = 2
_lock = threading.Lock()
_spares: dict[int, list[tuple[str, mmap.mmap]]] = {}  # by size, ready to take
_returned: dict[int, list[tuple[str, mmap.mmap]]] = {}  # by size, freed, maybe read
_making: Counter[int] = Counter()  # by size, being made


def _make_spare_soon(nbytes: int) -> None:
    """Have a worker make a spare of ``nbytes`` if there are too few and the
    budget (``shm_spare_bytes``, ``ATOLL_SHM_SPARE_BYTES``) allows."""
    with _lock:
        if len(_spares.get(nbytes, ())) + _making[nbytes] >= SPARES_PER_SIZE:
            return
        held = sum(size * len(ready) for size, ready in _spares.items())
        held += sum(size * count for size, count in _making.items())
        if held + nbytes > settings().shm_spare_bytes:
            return
        _making[nbytes] += 1
    with contextlib.suppress(RuntimeError):  # shutting down: no more spares
        _worker().submit(_make_spare, nbytes)


def _recycle(segment: Segment, memory: mmap.mmap) -> bool:
    """Keep ``segment`` (no longer named, no views here), pages in place, for
    :func:`_reusable`: up to two per size, ``shm_spare_bytes`` in all."""
    with _lock:
        returned = _returned.setdefault(segment.nbytes, [])
        held = sum(n * len(kept) for n, kept in _returned.items())
        if segment.hidden is None or len(returned) >= SPARES_PER_SIZE:
            return False
        if held + segment.nbytes > settings().shm_spare_bytes:
            return False
        returned.append((segment.hidden, memory))
    segment.hidden = None  # kept under that name now
    return True


def _reusable(nbytes: int) -> tuple[str, mmap.mmap] | None:
    """(Holding ``_lock``.) A freed segment of ``nbytes`` that no reader holds
    now, the oldest first. Readers may still have it mapped: they read
    through that mapping again once they are told its new name."""
    returned = _returned.get(nbytes, [])
    for i, (name, _) in enumerate(returned):
        if _unread(name):
            counts["recycled"] += 1
            return returned.pop(i)
    return None


def _unread(name: str) -> bool:
    """Whether no reader holds segment ``name`` now (its exclusive lock can be had)."""
    try:
        fd = os.open(_path(name), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True  # let go of with the file descriptor
    except OSError:
        return False
    finally:
        os.close(fd)


def _make_spare(nbytes: int) -> None:
    """(Worker thread.) Make a segment with its pages in place, for :func:`_take`."""
    try:
        made: tuple[str, mmap.mmap] | None = _make(nbytes, populate=True)
    except OSError:
        made = None  # /dev/shm is full: the next share will see it too
    with _lock:
        _making[nbytes] -= 1
        if made is not None:
            _spares.setdefault(nbytes, []).append(made)


def _drop_spares() -> None:
    with _lock:
        spares = [
            made for kept in (_spares, _returned) for ready in kept.values() for made in ready
        ]
        _spares.clear()
        _returned.clear()
    for name, memory in spares:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path(name))
        with contextlib.suppress(BufferError):  # a view on its way out: it goes with it
            memory.close()


def _worker() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that makes spares and unmaps what is no longer used. It
    runs at the lowest priority, so it takes idle CPU, not a transfer's."""
    if not _workers:
        _workers.append(concurrent.futures.ThreadPoolExecutor(1, "atoll-shm", _idle_priority))
    return _workers[0]


def _idle_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # Linux: per thread
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


_workers: list[concurrent.futures.ThreadPoolExecutor] = []


def _register(memory: mmap.mmap, name: str, own: Segment) -> np.ndarray:
    """The uint8 array over ``memory`` (a segment of ours), known to
    :func:`locate` while any view of it lives."""
    base = np.frombuffer(memory, dtype=np.uint8)
    start = int(base.ctypes.data)
    _mappings[start] = _Mapping(start, len(memory), name, own)
    weakref.finalize(base, _unused, start, own, memory)
    return base


def _unused(start: int, own: Segment, memory: mmap.mmap) -> None:
    """No view of a segment of ours is left: forget it, take its name away,
    and keep it for reuse (:func:`_recycle`), or remove it and unmap it."""
    _mappings.pop(start, None)
    _own.pop(own.name, None)
    own.unlink()
    if not _recycle(own, memory):
        own.remove()
        _retire_soon(memory)


def _retire_soon(memory: mmap.mmap) -> None:
    """Unmap ``memory`` soon, off the event loop (unmapping 64 MiB takes
    milliseconds, which the answer that dropped the last view should not
    wait for)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return  # no loop: unmapped now, with the last view
    loop.call_later(_UNMAP_AFTER_S, _retire, memory)  # once the last view is gone


_UNMAP_AFTER_S = 0.005


def _retire(memory: mmap.mmap) -> None:
    """Hand ``memory`` to the worker thread, which unmaps it."""
    with contextlib.suppress(RuntimeError):  # shutting down: it goes with this frame
        _worker().submit(_unmap, memory)


def _unmap(memory: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # still exported: it goes with its user
        memory.close()  # munmap, without holding the GIL


# -- readers: mappings of other processes' segments, kept for reuse ------------------
KEEP_S = 1.0  # how long a reader keeps a mapping without views


@dataclass(eq=False)
class _Read:
    """A reader's mapping of a segment; ``fd`` holds a shared lock on the
    file while ``views`` > 0."""

    memory: mmap.mmap
    fd: int
    key: tuple[int, int]  # the file's device and inode
    loop: asyncio.AbstractEventLoop | None  # where it was mapped
    clock: Clock  # the current_clock() where it was mapped: how long it is kept
    views: int = 1
    idle_since: float = 0.0


_reads: dict[tuple[int, int], _Read] = {}  # by file, mapped here


def attach(name: str, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Map ``nbytes`` of segment ``name`` from ``offset``, read-only, as an array.

    Raises ``OSError`` if the segment is gone (its creator freed it) or too
    short. A mapping kept of the same file is reused; a mapping is let go of
    when the array (and every view of it) goes, and kept :data:`KEEP_S`.
    """
    if not _NAME.match(name) or "/" in name:
        raise FileNotFoundError(f"not an atoll segment: {name!r}")
    read = _reused(name, offset + nbytes) or _map(name, offset + nbytes)
    base = _view(read, name)
    return base[offset : offset + nbytes].view(dtype_from_wire(dtype)).reshape(shape)


def _reused(name: str, needed: int) -> _Read | None:
    """The mapping kept of segment ``name``'s file, held for one more view;
    None if there is none. Raises ``OSError`` if ``name`` is gone or short."""
    found = os.stat(_path(name))
    if found.st_size < needed:
        raise OSError(f"segment {name} holds {found.st_size} bytes, not {needed}")
    with _lock:
        read = _reads.get((found.st_dev, found.st_ino))
        if read is None or not _hold(read, name):
            return None
    counts["maps_reused"] += 1
    return read


def _hold(read: _Read, name: str) -> bool:
    """(Holding ``_lock``.) Count one more view of ``read`` if ``name`` still
    leads to its file, checked under the shared lock (the first view takes it)."""
    if read.views == 0:
        try:
            fcntl.flock(read.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return False  # its creator is taking it back
    if not _leads_to(name, read.key):
        if read.views == 0:
            fcntl.flock(read.fd, fcntl.LOCK_UN)
        return False
    read.views += 1
    return True


def _leads_to(name: str, key: tuple[int, int]) -> bool:
    try:
        found = os.stat(_path(name))
    except OSError:
        return False
    return (found.st_dev, found.st_ino) == key


def _map(name: str, needed: int) -> _Read:
    """A new mapping of segment ``name``, pages in place, held for one view."""
    fd = os.open(_path(name), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        found = os.fstat(fd)
        key = (found.st_dev, found.st_ino)
        if not _leads_to(name, key):
            raise FileNotFoundError(f"segment {name} was freed")
        if found.st_size < needed:
            raise OSError(f"segment {name} holds {found.st_size} bytes, not {needed}")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        memory = mmap.mmap(fd, found.st_size, flags, mmap.PROT_READ)
    except BaseException:
        os.close(fd)
        raise
    read = _Read(memory, fd, key, _running_loop(), current_clock())
    _keep(read)
    return read


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _keep(read: _Read) -> None:
    """Remember ``read`` for reuse; drop kept mappings without views beyond
    ``shm_keep_bytes`` (the oldest first), whose file is gone, or whose loop
    (which would have dropped them after :data:`KEEP_S`) is closed."""
    with _lock:
        replaced = _reads.get(read.key)
        _reads[read.key] = read
        idle = sorted((r for r in _reads.values() if not r.views), key=lambda r: -r.idle_since)
        room, doomed = settings().shm_keep_bytes, []
        for kept in idle:
            if len(kept.memory) > room or _stale(kept):
                doomed.append(_reads.pop(kept.key))
            else:
                room -= len(kept.memory)
        if replaced is not None and not replaced.views:
            doomed.append(replaced)  # (with views: dropped when they go)
    for kept in doomed:
        _drop(kept)


def _stale(read: _Read) -> bool:
    closed = read.loop is None or read.loop.is_closed()
    return closed or os.fstat(read.fd).st_nlink == 0


def _view(read: _Read, name: str) -> np.ndarray:
    """The uint8 array over ``read``'s mapping (its view already counted),
    known to :func:`locate` as segment ``name`` while any view lives."""
    base = np.frombuffer(read.memory, dtype=np.uint8)
    start = int(base.ctypes.data)
    _mappings[start] = _Mapping(start, len(read.memory), name, None)
    weakref.finalize(base, _let_go, read, start)
    return base


def _let_go(read: _Read, start: int) -> None:
    """A view of ``read`` went. After the last, the file's creator may reuse
    it: let go of the lock, and keep the mapping :data:`KEEP_S` for reuse."""
    with _lock:
        read.views -= 1
        if read.views:
            return
        _mappings.pop(start, None)
        fcntl.flock(read.fd, fcntl.LOCK_UN)
        read.idle_since = read.clock.now()
        kept = _reads.get(read.key) is read
    if not kept:
        _drop(read)  # another mapping of the file replaced it meanwhile
    elif not _expire_later(read):
        _forget(read)


def _expire_later(read: _Read) -> bool:
    """Have :func:`_expire` look at ``read`` in :data:`KEEP_S`; False if its
    loop is gone."""
    loop = read.loop
    if loop is None or loop.is_closed():
        return False
    later = functools.partial(read.clock.call_later, KEEP_S, functools.partial(_expire, read))
    if _running_loop() is loop:
        later()
        return True
    with contextlib.suppress(RuntimeError):  # closed meanwhile
        loop.call_soon_threadsafe(later)
        return True
    return False


def _expire(read: _Read) -> None:
    """Drop ``read`` if it had no view for :data:`KEEP_S` (if it was used
    since, a later call looks again)."""
    if read.clock.now() - read.idle_since >= KEEP_S - 0.01:
        _forget(read)


def _forget(read: _Read) -> None:
    """Drop ``read`` if it is kept and has no views."""
    with _lock:
        if read.views or _reads.get(read.key) is not read:
            return
        del _reads[read.key]
    _drop(read)


def _drop(read: _Read) -> None:
    """Close ``read``'s file and unmap it soon (it has no views, and is no
    longer kept)."""
    os.close(read.fd)
    _retire_soon(read.memory)


def locate(array: Any) -> tuple[str, int] | None:
    """The segment and offset that hold ``array``'s bytes, if any can be named.

    Only C-contiguous numpy arrays wholly inside one mapping qualify; a
    segment of this process that was already unlinked does not.
    """
    if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
        return None
    address = int(array.ctypes.data)
    for mapping in list(_mappings.values()):  # a copy: views may go on another thread
        if mapping.start <= address and address + array.nbytes <= mapping.start + mapping.size:
            if mapping.own is not None and not mapping.own.linked:
                return None
            return mapping.name, address - mapping.start
    return None


def release(segment: Segment) -> None:
    """Take ``segment``'s name away (its buffer was freed); its memory is
    reused or removed once no view of it is left here (one taken over from
    another process is removed now: readers' mappings stay valid)."""
    if segment.taken_over:
        _taken.pop(segment.name, None)
        segment.remove()
    else:
        segment.unlink()


def take_over(array: np.ndarray) -> Segment | None:
    """Make the segment of another process of this machine that ``array``
    (a read-only mapping of all of it, from :func:`attach`) lives in this
    process's: it gets a name of this process's (so its maker no longer
    frees or reuses it, and a sweep after that process is gone leaves it),
    and readers find it under that name. Returns the segment, to
    :func:`release` when the buffer is freed; None when ``array`` is not a
    whole segment mapped here, or its maker took its name away meanwhile
    (then copy it). For a buffer that moved here (``runtime/control/elastic.py``):
    no byte is copied."""
    if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
        return None
    start = int(array.ctypes.data)
    mapping = _mappings.get(start)
    if mapping is None or mapping.own is not None or mapping.size != array.nbytes:
        return None
    fresh = _fresh_name()
    try:
        os.rename(_path(mapping.name), _path(fresh))
    except OSError:
        return None
    _mappings[start] = _Mapping(start, mapping.size, fresh, None)
    counts["taken_over"] += 1
    segment = _taken[fresh] = Segment(fresh, array.nbytes, taken_over=True)
    return segment


_taken: dict[str, Segment] = {}  # segments taken over and not freed yet


def release_all() -> None:
    """Remove every segment this process made, spares too (on the way out)."""
    for segment in [*_own.values(), *_taken.values()]:
        segment.remove()
    _taken.clear()
    _drop_spares()


def sweep() -> list[str]:
    """Unlink the segments of processes that are gone; their names.

    A creator counts as gone if no process has its pid, if that process is a
    zombie, or if it started after the segment was made (the pid was reused).
    """
    swept = []
    for name in _listing():
        found = _NAME.match(name)
        if found is None:
            continue
        path = _path(name)
        try:
            made = os.stat(path).st_ctime
        except FileNotFoundError:
            continue
        if not _alive(int(found.group(1)), made):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                swept.append(name)
    return swept


def _listing() -> list[str]:
    try:
        return [name for name in os.listdir(DIRECTORY) if name.startswith(PREFIX)]
    except OSError:
        return []


def _alive(pid: int, made: float) -> bool:
    """Whether process ``pid`` exists, is not a zombie, and is older than ``made``."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True  # cannot tell: keep it
    if fields[0] in ("Z", "X"):
        return False
    started = _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return started <= made + 1.0  # 1 s: boot time is known to the second


@cache
def _boot_time() -> float:
    with open("/proc/stat") as file:
        for line in file:
            if line.startswith("btime "):
                return float(line.split()[1])
    return 0.0


def _path(name: str) -> str:
    return os.path.join(DIRECTORY, name)


atexit.register(release_all)
