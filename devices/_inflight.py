"""Work a device has enqueued on its accelerator and not yet seen finish.

An accelerator runs ahead of its host: dispatching a computation returns at
once with its outputs as futures, and the accelerator orders dependent work
by itself (for JAX, by the buffers' definition events). A device actor that
waited for each computation before taking the next would leave the
accelerator idle through all of the host's work between them, so it does
not: it enqueues and moves on, and hands each enqueued gang's outputs to its
:class:`InFlight`.

A watcher thread (one per device, started on first use) waits for the
outputs in the order they were enqueued, which is the order the device runs
them, and hands finished gangs back to the event loop in batches: one loop
wake-up for every gang that finished by then. There, each gang's ``done``
callback settles what needs a finished value (fetches, pushes to other
hosts, busy time, timelines, the per-session ledger, errors).

Back-pressure: :meth:`InFlight.room` waits while ``window`` gangs are in
flight (XLA's own GPU queue is 32 deep), so a host that outruns its
accelerator stalls there instead of queueing without bound.

Everything here but the thread runs on the event loop's thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from ..kernel.lowlevel import threadsafe_caller

__all__ = ["WINDOW", "InFlight"]

_log = logging.getLogger(__name__)

WINDOW = 32  # gangs a device keeps in flight at most
# what the device's ``done`` callback gets: the error the outputs failed
# with (None: they exist), and the perf_counter time the watcher saw it
Done = Callable[[BaseException | None, float], None]


@dataclass(slots=True)
class _Entry:
    outputs: Sequence[Any]
    done: Done


class InFlight:
    """One device's enqueued gangs, oldest first (see the module docstring).

    ``wait(outputs)`` blocks a thread until ``outputs`` exist, and raises
    the error they failed with (``jax.block_until_ready``).
    """

    def __init__(
        self, wait: Callable[[Sequence[Any]], object], window: int = WINDOW, name: str = "device"
    ) -> None:
        self.window = window
        self.count = 0  # in flight now
        self.peak = 0  # the most that were in flight at once
        self._wait = wait
        self._name = name
        self._queue: queue.SimpleQueue[_Entry | None] = queue.SimpleQueue()
        self._finished: list[tuple[_Entry, BaseException | None, float]] = []
        self._lock = threading.Lock()
        self._posted = False
        self._post: Callable[[Callable[[], object]], object] | None = None
        self._thread: threading.Thread | None = None
        self._room: deque[anyio.Event] = deque()
        self._closed = False

    def add(self, outputs: Sequence[Any], done: Done) -> None:
        """Track a gang just enqueued; ``done`` runs on the loop once it finished."""
        if self._thread is None:
            self._start()
        self.count += 1
        self.peak = max(self.peak, self.count)
        self._queue.put(_Entry(outputs, done))

    async def room(self) -> None:
        """Return once fewer than ``window`` gangs are in flight."""
        while self.count >= self.window and not self._closed:
            event = anyio.Event()
            self._room.append(event)
            await event.wait()

    def close(self) -> None:
        """Stop watching: the thread ends after the gang it waits for; gangs
        still in flight are not reported."""
        self._closed = True
        self._queue.put(None)
        while self._room:
            self._room.popleft().set()

    def _start(self) -> None:
        self._post = threadsafe_caller()
        self._thread = threading.Thread(
            target=self._watch, name=f"atoll-inflight-{self._name}", daemon=True
        )
        self._thread.start()

    def _watch(self) -> None:
        """The watcher thread: wait for each entry in order, post the finished."""
        while (entry := self._queue.get()) is not None:
            error: BaseException | None = None
            try:
                self._wait(entry.outputs)
            except Exception as exc:  # the computation failed: its outputs carry why
                error = exc
            finished_at = time.perf_counter()
            with self._lock:
                self._finished.append((entry, error, finished_at))
                post, self._posted = not self._posted, True
            if post and not self._closed:
                try:
                    assert self._post is not None
                    self._post(self._settle)
                except RuntimeError:  # the loop is gone: nobody is left to tell
                    return

    def _settle(self) -> None:
        """On the loop: report every gang that finished since the last call."""
        with self._lock:
            batch, self._finished, self._posted = self._finished, [], False
        if self._closed:
            return
        for entry, error, finished_at in batch:
            self.count -= 1
            try:
                entry.done(error, finished_at)
            except Exception:  # one broken report must not stop the others
                _log.exception("reporting a finished gang failed")
        while self._room and self.count < self.window:
            self._room.popleft().set()
