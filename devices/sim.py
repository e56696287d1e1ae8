"""Simulated devices: real results, modelled timing.

A :class:`SimDevice` computes each computation's value with numpy (keep the
arrays small) and spends the device time its cost model gives on its clock.
No host CPU is used for that time, so thousands of simulated devices fit in
one process; under a :class:`VirtualClock` the waits take no real time at
all and timings are exact and repeatable.

**It runs ahead of its host, as an accelerator does.** A gang on this device
alone is *enqueued* on the device's stream: its value is computed at once,
but it enters the store as a future that exists only once the stream reaches
its end. The stream runs its gangs back to back, each from when it was
enqueued or when the one before it ended, whichever is later; so the host's
own work between two gangs (taking the next run off its lane, the actor's
turn) overlaps the device time of the one before, and a late wake-up of the
host costs the device nothing. Readers that need the value wait for it: a
fetch, a push to another host. A gang on another device of the same host
does not: it goes on its own device's stream at once, to start once the
one it reads ended (as a stream waits for another's event on an
accelerator), so a chain over a host's devices costs the host no turn
between its steps. A timer on
the clock settles each gang when its time is up (on the loop's ``timerfd``
under asyncio, to within tens of microseconds), and charges its device
time to its session then. At most ``WINDOW`` gangs are in flight, so a host
that outruns its device stalls. Gangs over several devices (collectives)
meet their partners in real time: the device's stream first runs dry, and
the shards then sleep their device time together.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernel import Promise, Timer, failed
from ..kernel.lowlevel import call_later_precisely
from . import timeline
from ._device import Device, LeanGang
from ._gang import GangTask
from ._inflight import WINDOW
from ._plan import PUSHED_IN, PlannedGang
from ._values import BufferHandle, Computation

__all__ = ["SimDevice"]

_SLACK_S = 1e-9  # a virtual clock's time, summed from device times, may fall short by rounding
# when each gang on a simulated device's stream in this process ends (clock
# time), by the id of the promise that its output exists (_enqueue): a reader
# on another device of the same host goes on its own stream at once, to
# start no earlier than that, as a stream waits for another's event on an
# accelerator, with no turn of the host in between (the promise is kept with
# its end, so that no other object takes its id while the entry is there)
_ENDS: dict[int, tuple[Promise[None], float]] = {}


@dataclass(slots=True)
class _Gang:
    """A gang enqueued on a simulated device's stream."""

    ready: Promise[None]  # settles once the stream reached its end
    task: GangTask | LeanGang
    owner: str
    seconds: float
    end: float  # clock time the stream reaches its end


def _end_of(pending: Promise[None] | None) -> float | None:
    """When the gang whose output ``pending`` says exists ends on its
    simulated stream (None: it is on none)."""
    entry = _ENDS.get(id(pending)) if pending is not None else None
    return entry[1] if entry is not None and entry[0] is pending else None


class SimDevice(Device):
    """A device whose time comes from ``CostModel.compute_time(flops)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stream_end = 0.0  # clock time the last gang enqueued ends
        self._flight: deque[_Gang] = deque()  # oldest first
        self._enqueued: set[str] = set()  # gangs enqueued; they report when they end
        self._timer: Timer | None = None  # set for the oldest gang's end while any is in flight
        self._peak = 0

    async def execute(self, computation: Computation, inputs: list[np.ndarray]) -> np.ndarray:
        out = np.asarray(computation.fn(*inputs))
        await self.spend(computation)
        return out

    async def spend(self, computation: Computation) -> None:
        """Sleep the cost model's device time for ``computation`` (no CPU used)."""
        seconds = self.cost.compute_time(computation.flops)
        await self.clock.sleep(seconds)
        self.busy_s += seconds

    def answer_after(self, outputs: Sequence[BufferHandle]) -> Promise[None] | None:
        """A small output rides in its handle: the answer waits until it exists."""
        return self._pending(outputs)

    def running_dry(self) -> bool:
        return not self._flight

    def in_flight(self) -> tuple[int, int]:
        return len(self._flight), self._peak

    async def run_shard(
        self, task: GangTask, inputs: list[BufferHandle], owner: str
    ) -> list[BufferHandle]:
        """A gang on this device alone is enqueued (see the module's text);
        a wider one waits for the stream to run dry, then runs to its end;
        one of no device time, with nothing in flight, runs at once."""
        computation = task.kernel
        if not self._flight and self._costs_nothing(computation):
            return await super().run_shard(task, inputs, owner)  # nothing to run ahead of
        wide = len(task.devices) > 1 or not isinstance(computation, Computation)
        for handle in inputs:  # made here and not done yet (wide: on a stream too)
            waited = self._pending_here(handle) if wide else self._elsewhere(handle)
            if waited is not None:
                await waited
        if wide:
            await self._drained()
            return await super().run_shard(task, inputs, owner)
        self._enqueued.add(task.gang_id)
        try:
            return [await self._enqueue(computation, inputs, owner, task, self._after(inputs))]
        except BaseException:
            self._enqueued.discard(task.gang_id)
            raise

    def runs_alone(self, gang: PlannedGang) -> bool:
        """A one-device gang of a compiled run that neither pushes nor takes a
        push goes on the stream with no task (:meth:`run_alone`); one of no
        device time with nothing in flight takes the full path, which runs
        it at once."""
        return (
            len(gang.devices) == 1
            and isinstance(gang.kernel, Computation)
            and not gang.push
            and PUSHED_IN not in gang.inputs
            and (bool(self._flight) or not self._costs_nothing(gang.kernel))
        )

    async def run_alone(
        self, gang: PlannedGang, gang_id: str, inputs: Sequence[Any], owner: str
    ) -> Promise[list[BufferHandle]]:
        """The lean path: the gang's inputs as they are (handles, values, or
        what a promise or a ``PriorOutput`` names, each once it exists), its
        computation enqueued on the stream; it answers once its output
        exists, as :meth:`answer_after` says."""
        computation = gang.kernel
        try:
            self.store.ledger.check_open(owner)
            handles = [await self._alone_input(value) for value in inputs]
            ran = LeanGang(gang_id, computation)
            out = await self._enqueue(computation, handles, owner, ran, self._after(handles))
        except Exception as exc:
            failure: Promise[list[BufferHandle]] = failed(exc)
            return failure
        self.computations += 1
        return self._made_here([out])

    async def _alone_input(self, value: Any) -> Any:
        """A lean gang's input once it exists (:meth:`Device._lean_input`);
        one that a device of this host computes on its stream is taken as
        it is (:meth:`_after` says when the gang may start)."""
        value = await self._lean_input(value)
        waited = self._elsewhere(value)
        if waited is not None:
            await waited
        return value

    def input_wait(self, value: Any) -> Promise[Any] | None:
        """... and an output of this host still computed, not on a stream."""
        wait = super().input_wait(value)
        return wait if wait is not None else self._elsewhere(value)

    def _costs_nothing(self, computation: Any) -> bool:
        return isinstance(computation, Computation) and not self.cost.compute_time(
            computation.flops
        )

    def ran(self, task: GangTask, owner: str, began: float, busy_s: float, leader: bool) -> None:
        if task.gang_id in self._enqueued:  # its timer reports it once it ended
            self._enqueued.discard(task.gang_id)
            return
        super().ran(task, owner, began, busy_s, leader)

    async def _enqueue(
        self,
        computation: Computation,
        inputs: Sequence[BufferHandle],
        owner: str,
        task: GangTask | LeanGang,
        after: float = 0.0,
    ) -> BufferHandle:
        """Compute ``computation`` now, and store its output as a future that
        exists once this device's stream has spent its device time on it,
        starting no earlier than clock time ``after`` (its inputs' end)."""
        while len(self._flight) >= WINDOW:  # back-pressure: the oldest ends first
            await self._flight[0].ready
        arrays = [await self._read(handle, owner) for handle in inputs]
        out = np.asarray(computation.fn(*arrays))
        self.store.ledger.check(owner, out.nbytes)  # over its quota: fail, never stall
        await self.store.reserve(out.nbytes)
        seconds = self.cost.compute_time(computation.flops)
        now = self.clock.now()
        self._stream_end = max(now, self._stream_end, after) + seconds
        ready: Promise[None] = Promise(computation.name)
        buffer_id = self.store.put(out, owner, reserved=True, ready=ready, place=self.device_id)
        self._flight.append(_Gang(ready, task, owner, seconds, self._stream_end))
        if self._timer is None:
            self._arm(now)
        _ENDS[id(ready)] = (ready, self._stream_end)
        self._peak = max(self._peak, len(self._flight))
        return self._handle(buffer_id, out)

    def _pending_here(self, handle: Any) -> Promise[None] | None:
        """The promise that an input held on this host exists, while a
        device here still computes it (None: it exists, or is elsewhere)."""
        if not isinstance(handle, BufferHandle) or handle.host_id != self.host_id:
            return None
        return self.store.pending(handle.id) if handle.id in self.store else None

    def _elsewhere(self, handle: Any) -> Promise[None] | None:
        """What an input computed on this host must be waited for: one not
        on a simulated stream (a stream's output is read as it is, and its
        reader starts after its end: :meth:`_after`)."""
        pending = self._pending_here(handle)
        return None if pending is None or _end_of(pending) is not None else pending

    def _after(self, handles: Sequence[Any]) -> float:
        """When the inputs still on simulated streams of this host end (0.0:
        none is), this stream's own included."""
        after = 0.0
        for handle in handles:
            end = _end_of(self._pending_here(handle))
            if end is not None:
                after = max(after, end)
        return after

    def _arm(self, now: float) -> None:
        """Wake (to within tens of microseconds) when the oldest gang ends."""
        delay = self._flight[0].end - now
        self._timer = call_later_precisely(self.clock, delay, self._ended)

    def _ended(self) -> None:
        """The stream reached the end of its oldest gang (on the loop): the
        gangs that ended by now are done; wake again for the next."""
        self._timer = None
        now = self.clock.now()
        while self._flight and self._flight[0].end <= now + _SLACK_S:
            self._finish(self._flight.popleft())
        if self._flight:
            self._arm(now)

    def _finish(self, gang: _Gang) -> None:
        """A gang ended: its outputs exist now, and its device time is charged."""
        _ENDS.pop(id(gang.ready), None)
        self.background_busy_s += gang.seconds
        self.store.ledger.charge(gang.owner, gang.seconds)
        if timeline.RECORDER.on:
            end = timeline.now_us()
            start = end - gang.seconds * 1e6
            timeline.gang(self.host_id, self.device_id, gang.task, gang.owner, start, True, end)
        gang.ready.set_result(None)

    async def _drained(self) -> None:
        """Once every gang enqueued here ended."""
        while self._flight:
            await self._flight[-1].ready

    async def on_stop(self) -> None:
        """Gangs still in flight end now: their readers are not left waiting."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._flight:
            self._finish(self._flight.popleft())
        await super().on_stop()
