"""Shared-memory segments: large arrays handed between processes of one machine.

A host process keeps the bytes of each large buffer (above :data:`THRESHOLD`)
in a POSIX shared-memory segment of its own, a file in ``/dev/shm`` named
``atoll-<pid>-<tag>-<n>`` after the process that made it. A reader on the
same machine (same :func:`machine_id`) maps that file read-only and reads the
array in place: no copy, no bytes on a socket. Segments are written once,
before anyone else learns their name, and never change after.

Lifetimes:

* the creator unlinks a segment when its store frees the buffer
  (:func:`release`), or when its own last mapping goes, or at exit;
  a reader's mapping stays valid after that, and the memory is returned
  when the last mapping anywhere goes;
* a process that dies without unlinking (``kill -9``) leaves its segments
  behind until someone calls :func:`sweep`, which unlinks every segment
  whose creator is gone. Host processes sweep when they start, and the
  launcher sweeps when a host's link drops and when it stops its hosts.

Making a segment costs more than copying into it: the kernel allocates and
clears its pages, and the first write to each faults it in (about 40 ms for
64 MiB here, against 5 ms for the copy). So after a segment of some size is
taken, a worker thread makes a *spare* of that size with its pages already
in place (up to two per size, :data:`SPARE_BYTES` in all); the next buffer of
that size only pays the copy. A spare's name is fresh and was never handed
out, so nobody else can have it mapped. The same worker unmaps mappings that
are no longer used, off the event loop.

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

__all__ = [
    "THRESHOLD",
    "Segment",
    "attach",
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


@cache
def machine_id() -> str:
    """Who "this machine" is: the kernel's boot id and the host name.

    ``ATOLL_MACHINE_ID`` overrides it; its value ``per-process`` makes every
    process a machine of its own (to force the cross-machine path in tests).
    """
    override = os.environ.get("ATOLL_MACHINE_ID", "")
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
    return os.environ.get("ATOLL_SHM", "1") != "0" and os.access(DIRECTORY, os.W_OK)


class Segment:
    """A segment this process made: its name, and whether it is still linked."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.name = name
        self.nbytes = nbytes
        self.linked = True

    def unlink(self) -> None:
        """Remove the name (idempotent); mappings stay valid until they go."""
        if self.linked:
            self.linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_path(self.name))


@dataclass(frozen=True)
class _Mapping:
    start: int
    size: int
    name: str
    own: Segment | None  # None: another process's segment


_mappings: dict[int, _Mapping] = {}  # by start address, while mapped here
_own: dict[str, Segment] = {}  # linked segments this process made


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


def _take(nbytes: int) -> tuple[np.ndarray, Segment]:
    """A writable uint8 view of a fresh segment of ``nbytes``: a spare made
    ahead if there is one (then the copy into it is a plain memcpy), else one
    made now; either way another spare of that size is made in the background."""
    with _lock:
        spares = _spares.get(nbytes)
        made = spares.pop() if spares else None
    if made is None:
        made = _make(nbytes, populate=False)  # the copy faults its pages in
    _make_spare_soon(nbytes)
    name, memory = made
    segment = _own[name] = Segment(name, nbytes)
    return _register(memory, name, segment), segment


def _make(nbytes: int, populate: bool) -> tuple[str, mmap.mmap]:
    """A new segment of ``nbytes``, mapped read-write (any thread)."""
    name = f"{PREFIX}{os.getpid()}-{_TAG}-{next(_numbers)}"
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
SPARE_BYTES = int(os.environ.get("ATOLL_SHM_SPARE_BYTES", 256 << 20))
SPARES_PER_SIZE = 2
_lock = threading.Lock()
_spares: dict[int, list[tuple[str, mmap.mmap]]] = {}  # by size, ready to take
_making: Counter[int] = Counter()  # by size, being made


def _make_spare_soon(nbytes: int) -> None:
    """Have a worker make a spare of ``nbytes`` if there are too few and the
    budget (:data:`SPARE_BYTES`, ``ATOLL_SHM_SPARE_BYTES``) allows."""
    with _lock:
        have = len(_spares.get(nbytes, ())) + _making[nbytes]
        held = sum(size * len(ready) for size, ready in _spares.items())
        held += sum(size * count for size, count in _making.items())
        if have >= SPARES_PER_SIZE or held + nbytes > SPARE_BYTES:
            return
        _making[nbytes] += 1
    with contextlib.suppress(RuntimeError):  # shutting down: no more spares
        _worker().submit(_make_spare, nbytes)


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
        spares = [made for ready in _spares.values() for made in ready]
        _spares.clear()
    for name, memory in spares:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path(name))
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


def attach(name: str, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Map ``nbytes`` of segment ``name`` from ``offset``, read-only, as an array.

    Raises ``OSError`` if the segment is gone (its creator freed it) or too
    short. The mapping is released when the array (and every view of it) goes.
    """
    if not _NAME.match(name) or "/" in name:
        raise FileNotFoundError(f"not an atoll segment: {name!r}")
    fd = os.open(_path(name), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if offset + nbytes > size:
            raise OSError(f"segment {name} holds {size} bytes, not {offset + nbytes}")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        memory = mmap.mmap(fd, size, flags, mmap.PROT_READ)
    finally:
        os.close(fd)
    base = _register(memory, name, None)
    array = base[offset : offset + nbytes].view(np.dtype(dtype)).reshape(shape)
    return array


def _register(memory: mmap.mmap, name: str, own: Segment | None) -> np.ndarray:
    """The uint8 array over ``memory``, known to :func:`locate` while any view
    of it lives."""
    base = np.frombuffer(memory, dtype=np.uint8)
    start = int(base.ctypes.data)
    _mappings[start] = _Mapping(start, len(memory), name, own)
    weakref.finalize(base, _unused, start, own, memory)
    return base


def _unused(start: int, own: Segment | None, memory: mmap.mmap) -> None:
    """No view of a mapping is left: forget it, unlink it if it was ours, and
    unmap it soon, off the event loop (unmapping 64 MiB takes milliseconds,
    which the answer that dropped the last view should not wait for)."""
    _mappings.pop(start, None)
    if own is not None:
        own.unlink()
        _own.pop(own.name, None)
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
    """Unlink ``segment`` (its buffer was freed)."""
    segment.unlink()
    _own.pop(segment.name, None)


def release_all() -> None:
    """Unlink every segment this process made, spares too (on the way out)."""
    for segment in list(_own.values()):
        release(segment)
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
