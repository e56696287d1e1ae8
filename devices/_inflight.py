"""Work a device has enqueued on its accelerator and not yet seen finish.

An accelerator runs ahead of its host: dispatching a computation returns at
once with its outputs as futures, and the accelerator orders dependent work
by itself (for JAX, by the buffers' definition events). A device actor that
waited for each computation before taking the next would leave the
accelerator idle through all of the host's work between them, so it does
not: it enqueues and moves on, and hands each enqueued gang's outputs to its
:class:`InFlight`. Once a gang's outputs exist, its ``done`` callback runs on
the event loop and settles what needs a finished value (fetches, pushes to
other hosts, busy time, timelines, the per-session ledger, errors).

Seeing a gang finish must cost the host little, or it would slow the very
path it keeps off the accelerator's. So finished gangs are found two ways:

* every :meth:`InFlight.add` first asks the oldest gangs whether they are
  done (``is_ready``, no waiting): while the host outruns the accelerator,
  that is where most are found;
* a watcher thread (one per device, started on first use) blocks until the
  *newest* gang in flight is done, then wakes the loop once, which settles
  everything done by then, and gives the thread the newest gang again. It
  wakes about once per pass over what is queued, not once per gang.

Back-pressure: :meth:`InFlight.room` waits while ``window`` gangs are in
flight (XLA's own GPU queue is 32 deep), so a host that outruns its
accelerator stalls there instead of queueing without bound.

Everything here but the thread runs on the event loop's thread.
"""

from __future__ import annotations

import contextlib
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
# with (None: they exist), and the perf_counter time they were seen done
Done = Callable[[BaseException | None, float], None]


@dataclass(slots=True)
class _Entry:
    outputs: Sequence[Any]
    done: Done


class InFlight:
    """One device's enqueued gangs, oldest first (see the module docstring).

    ``wait(outputs)`` blocks a thread until ``outputs`` exist, and raises
    the error they failed with (``jax.block_until_ready``); ``ready(output)``
    says, without waiting, whether one exists (``jax.Array.is_ready``).
    """

    def __init__(
        self,
        wait: Callable[[Sequence[Any]], object],
        ready: Callable[[Any], bool],
        window: int = WINDOW,
        name: str = "device",
    ) -> None:
        self.window = window
        self.peak = 0  # the most that were in flight at once
        self.wakes = 0  # times the watcher woke the loop
        self._wait = wait
        self._ready = ready
        self._name = name
        self._entries: deque[_Entry] = deque()
        self._orders: queue.SimpleQueue[Sequence[Any] | None] = queue.SimpleQueue()
        self._watching = False  # the thread waits for an entry now
        self._post: Callable[[Callable[[], object]], object] | None = None
        self._thread: threading.Thread | None = None
        self._room: deque[anyio.Event] = deque()
        self._closed = False

    @property
    def count(self) -> int:
        """Gangs in flight now."""
        return len(self._entries)

    def add(self, outputs: Sequence[Any], done: Done) -> None:
        """Track a gang just enqueued; ``done`` runs on the loop once it finished."""
        entries = self._entries
        entries.append(_Entry(outputs, done))
        if len(entries) > self.peak:
            self.peak = len(entries)
        self._settle_ready()
        self._watch()

    async def room(self) -> None:
        """Return once fewer than ``window`` gangs are in flight."""
        self._settle_ready()
        while len(self._entries) >= self.window and not self._closed:
            event = anyio.Event()
            self._room.append(event)
            await event.wait()

    async def close(self, timeout: float = 10.0) -> None:
        """Stop watching, and wait (up to ``timeout``) for the thread to end,
        after the gang it waits for: a thread still inside the accelerator's
        runtime when the interpreter exits aborts the process. Gangs still in
        flight are not reported."""
        self._closed = True
        self._orders.put(None)
        while self._room:
            self._room.popleft().set()
        thread, self._thread = self._thread, None
        if thread is not None:
            await anyio.to_thread.run_sync(thread.join, timeout)

    # -- on the loop ---------------------------------------------------------
    def _settle_ready(self) -> None:
        """Report the oldest gangs that are done by now (no waiting)."""
        entries, ready = self._entries, self._ready
        while entries:
            for output in entries[0].outputs:  # (a loop: no generator per gang)
                if not ready(output):
                    break
            else:
                self._report(entries.popleft())
                continue
            break
        while self._room and len(entries) < self.window:
            self._room.popleft().set()

    def _report(self, entry: _Entry) -> None:
        error: BaseException | None = None
        try:
            self._wait(entry.outputs)  # done: returns at once, or raises why it failed
        except Exception as exc:
            error = exc
        try:
            entry.done(error, time.perf_counter())
        except Exception:  # one broken report must not stop the others
            _log.exception("reporting a finished gang failed")

    def _watch(self) -> None:
        """Have the thread wait for the newest gang, unless it waits already
        (or, when the newest is done before an older one, for the oldest,
        which :meth:`_settle_ready` just found not done): it only ever waits
        for a gang that was not done a moment ago."""
        if self._watching or not self._entries or self._closed:
            return
        newest = self._entries[-1]
        done = all(self._ready(output) for output in newest.outputs)
        if self._thread is None:
            self._post = threadsafe_caller()
            self._thread = threading.Thread(
                target=self._watcher, name=f"atoll-inflight-{self._name}", daemon=True
            )
            self._thread.start()
        self._watching = True
        # only the arrays go to the thread: an entry's report may hold capnp
        # objects, which must never be released off the loop (the process
        # aborts), and the thread's reference could be an entry's last
        self._orders.put((self._entries[0] if done else newest).outputs)

    def _woken(self) -> None:
        """The thread saw its gang finish: settle what is done, watch again."""
        self._watching = False
        if self._closed:
            return
        self.wakes += 1
        self._settle_ready()
        self._watch()

    # -- the watcher thread ---------------------------------------------------
    def _watcher(self) -> None:
        while (outputs := self._orders.get()) is not None:
            with contextlib.suppress(Exception):  # failed: the loop finds out which, and why
                self._wait(outputs)
            if self._closed:
                return
            try:
                assert self._post is not None
                self._post(self._woken)
            except RuntimeError:  # the loop is gone: nobody is left to tell
                return
