"""The device actor: runs gangs in its island's order, on its host's store.

A *device actor* owns one accelerator (real or simulated). It takes
computations in the order its mailbox delivers them, which is the order its
island scheduler decided; a gang on this device alone whose input is not
there yet waits aside while the ready ones behind it go first (see
``Device.run_plan``), and gangs over several devices keep that order.
Outputs go into the *host's* object store; the device hands back a
:class:`BufferHandle`, a small value that can travel anywhere and names the
host that holds the bytes.

A device reads an input on its own host straight from the store. An input
held on another host is fetched from that host's actor, never through the
controller. The host actor never blocks, so a device waiting for data cannot
deadlock with a device whose data it needs. Outputs that readers elsewhere
wait for are pushed to them (``devices/_push.py``).
"""

from __future__ import annotations

import copy
import functools
import heapq
import itertools
import logging
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import anyio
import numpy as np

from ..kernel import (
    Actor,
    ActorRef,
    ActorStopped,
    AtollError,
    Clock,
    Promise,
    all_settled,
    as_promise,
    endpoint,
    failed,
    first_settled,
    flatten,
    forward,
    then,
    value_of,
    when_settled,
)
from ..transports.dataplane import shm
from ..transports.dtypes import raw_bytes
from . import _checkpoint as checkpoint
from . import _runlane as runlane
from . import timeline
from ._errors import DeviceError, UnsupportedKernel
from ._gang import GangTask, PushTarget
from ._host_api import HostEndpoints
from ._plan import (
    PUSHED_IN,
    DeviceProgram,
    PlannedGang,
    PriorOutput,
    RunReport,
    portable,
    run_key,
)
from ._plane import IN_PROCESS, DataPlane
from ._push import Pusher
from ._shards import ShardedHandle, read_whole
from ._store import BufferMissing, ObjectStore, StoredBuffer
from ._values import Arrival, BufferHandle, Computation, CostModel, DeviceStats

__all__ = ["PLANS_KEPT", "Device", "GangOutputs", "LeanGang", "live_stats"]

T = TypeVar("T")
# a client's call a device answers itself: the client's lanes' name, the
# call's number on its call lane, and the run's outputs, (node, output) each
Reply = tuple[str, int, list[tuple[int, int]]]

_log = logging.getLogger(__name__)

PLANS_KEPT = 256  # compiled plans a device keeps (the controller's plan cache size)
# this process's devices, by (their host's store, device id): their host reads
# their figures without waiting behind their mailboxes (live_stats)
_LIVE: weakref.WeakValueDictionary[tuple[ObjectStore, int], Device] = weakref.WeakValueDictionary()
EARLIER_KEPT = 1024  # recent runs whose outputs a device keeps for later runs (PriorOutput)


class Device(Actor):
    """Base of device actors: stores, handles, transfers and accounting.

    Subclasses implement :meth:`execute`, which runs one computation and
    returns its output and the device seconds it took; they may override
    :meth:`run_shard` for kernels of their own (see ``JaxDevice``).
    ``host_cls`` names the host actor class that fits the device (None: Host).
    """

    host_cls: ClassVar[type[HostEndpoints] | None] = None

    @classmethod
    def available(cls, wanted: int | None = None) -> int | None:
        """How many devices of this kind exist (None: as many as asked for).
        ``wanted``: how many a cluster in this process asks for, which a
        kind that can make devices on request makes if it still may."""
        return None

    @classmethod
    def more_devices_hint(cls, wanted: int) -> str:
        """What a user can do when fewer than ``wanted`` exist ("" if nothing)."""
        return ""

    def __init__(
        self,
        device_id: int,
        host_id: int,
        island: int,
        store: ObjectStore,
        host: ActorRef[HostEndpoints],
        cost: CostModel,
        plane: DataPlane = IN_PROCESS,
    ) -> None:
        self.plane = plane
        self.pusher = Pusher(store, host_id, device_id, island, plane, lambda: self.ctx.system)
        self.device_id = device_id
        self.host_id = host_id
        self.island = island
        self.store = store
        self.host = host
        self.cost = cost
        self.computations = 0
        self.busy_s = 0.0  # device time of work the actor waited for
        self.background_busy_s = 0.0  # device time of work that finished after it moved on
        self.transfer_s = 0.0
        self.started_at = 0.0
        self._plans: dict[int, DeviceProgram] = {}  # installed compiled plans, newest last
        self._release_points: dict[int, list[list[int]]] = {}  # by plan (_release_points)
        self._fused: dict[int, dict[int, Any]] = {}  # by plan: see fused_segments
        # outputs of compiled runs' gangs led here, by (run, node, output): a
        # handle, or the error the gang failed with (see PriorOutput)
        self._earlier: dict[int, dict[tuple[int, int], BufferHandle | BaseException]] = {}
        self._failed_runs: dict[int, AtollError] = {}  # runs that never ran here, by epoch
        # pushes of outputs not computed yet, in the order they were made (see
        # push_outputs): the oldest one's outputs, once they exist, send them
        self._later_pushes: deque[_LaterPush] = deque()
        # gangs that wait aside for their inputs (see run_plan), by run
        self._aside: dict[int, list[_Aside]] = {}
        # gangs aside whose inputs are here, by their number (the island's
        # order), for the one task that runs them (see _run_ready_aside), and
        # what wakes that task when it waits for one
        self._ready_aside: list[tuple[int, _Aside]] = []
        self._aside_seq = itertools.count()
        self._aside_runner = False
        self._aside_wake: Promise[None] | None = None

    @property
    def clock(self) -> Clock:
        return self.ctx.clock

    async def on_start(self) -> None:
        self.started_at = self.clock.now()
        _LIVE[self.store, self.device_id] = self

    async def execute(self, computation: Computation, inputs: list[np.ndarray]) -> np.ndarray:
        """Run ``computation``; must account its device time in ``busy_s``."""
        raise NotImplementedError

    @endpoint
    async def put(self, array: np.ndarray, owner: str = "") -> BufferHandle:
        """Place a host array on this device (its host's store)."""
        return await self._stored(np.asarray(array), owner)

    @endpoint
    async def load_arrays(
        self, directory: str, names: list[str], owner: str = ""
    ) -> dict[str, BufferHandle]:
        """Read arrays ``names`` of a checkpoint directory (``Host.save_arrays``)
        into this device's host, from the disk; their handles by name."""
        arrays = await anyio.to_thread.run_sync(checkpoint.load, directory, names)
        return {name: await self._stored(array, owner) for name, array in arrays.items()}

    @endpoint
    async def adopt(self, buffers: list[tuple[BufferHandle, StoredBuffer, int | str]]) -> int:
        """Copy buffers held by other hosts into this device's host, over the
        data plane: each keeps its id, owner and references, and belongs to
        the place given with it (this device, or a suspended slice's label).
        The bytes copied. Asynchronous: waits for each transfer, and for
        room in the store. A buffer whose session ended is left behind."""
        copied = 0
        for handle, stored, place in buffers:
            array = np.asarray(await self._read(handle))
            await self.store.reserve(array.nbytes)
            # a large array lands as a mapping of the other host's segment:
            # this host takes the segment over (no copy), or else copies it
            # into one of its own, off the loop (it came by stream, from
            # another machine), so that it is read in place here from now on
            shared = await self._shared(array)
            segment = None if shared is None else shared[1]
            array = array if shared is None else shared[0]
            try:
                buffer_id = self.store.put(
                    array,
                    stored.owner,
                    reserved=True,
                    place=place,
                    buffer_id=stored.id,
                    segment=segment,
                )
            except AtollError:
                self.store.unreserve(array.nbytes)
                if segment is not None:
                    shm.release(segment)
                continue
            self.store.set_refs(buffer_id, stored.refs)
            copied += array.nbytes
        return copied

    async def _shared(self, array: np.ndarray) -> tuple[np.ndarray, shm.Segment] | None:
        """``array`` in a segment of this process (taken over, or a copy), if
        the store keeps arrays that large in shared memory (else None)."""
        if not self.store.shared or array.nbytes <= shm.THRESHOLD or not raw_bytes(array.dtype):
            return None
        taken = shm.take_over(array)
        if taken is not None:
            return array, taken
        return await shm.share_off_loop(array)

    async def _run_here(
        self, task: GangTask, inputs: Sequence[Any], owner: str
    ) -> list[BufferHandle]:
        """This shard's part of ``task``, up to its outputs (the leader's handles,
        an empty list elsewhere); pushing them is the caller's. An input that
        failed raises ``_InputFailed`` with its error."""
        if len(task.devices) == 1:  # a gone session's gangs spend no device time (a
            self.store.ledger.check_open(owner)  # wider gang runs: its partners wait)
        leader = self.device_id == task.leader
        taken: list[str] = []  # pushed copies this shard owns and frees
        try:
            try:
                handles = await self._gather(task, inputs, leader, taken)
            except Exception as exc:  # an input failed: so does this shard, as it is
                await self.leave_barriers(task)
                raise _InputFailed(exc) from exc
            if task.collective:
                await self.arrive(task, "in")
            busy, began = self.busy_s, timeline.start()
            outputs = await self.run_shard(task, handles, owner)
            self.ran(task, owner, began, self.busy_s - busy, leader)
        finally:
            for buffer_id in taken:
                with suppress(BufferMissing):  # its owner's session may have ended
                    self.store.decref(buffer_id)
        self.computations += 1
        return outputs

    def ran(self, task: GangTask, owner: str, began: float, busy_s: float, leader: bool) -> None:
        """A shard of ``task`` ran here since ``began`` (``timeline.start()``),
        busy for ``busy_s`` seconds: into the timeline and the session's ledger.
        (A device whose gangs finish after it moved on reports them itself.)"""
        timeline.gang(self.host_id, self.device_id, task, owner, began, leader)
        self.store.ledger.charge(owner, busy_s)  # device time per session

    async def push_outputs(
        self,
        targets: Sequence[PushTarget],
        outputs: list[BufferHandle],
        owner: str,
        held: list[str] | None,
    ) -> Promise[list[BufferHandle]]:
        """Push a gang's outputs to their readers' hosts (``Pusher.push``).

        Outputs that do not exist yet (a device that runs ahead: futures in
        the store) go to readers on this host now, and to readers elsewhere
        once they exist (a task of this device's waits, off its path)."""
        ready = self._pending(outputs)
        remote = [t for t in targets if t.host_id != self.host_id]
        if ready is None or not remote:
            return await self.pusher.push(targets, outputs, owner, held)
        for target in targets:
            if target.host_id == self.host_id:
                self.pusher.deliver_here(target, outputs[target.output])
        later = _LaterPush(ready, remote, outputs, owner, held, Promise("pushed once computed"))
        self._later_pushes.append(later)
        if len(self._later_pushes) == 1:  # (else: it waits behind the one before it)
            ready.add_done_callback(self._send_later_pushes)
        return later.pushed

    def _send_later_pushes(self, _: Promise[None]) -> None:
        """Send the pushes of outputs not computed yet, each once its outputs
        exist, in the order they were made (this device's outputs come to
        exist in the order its gangs were enqueued, so none waits behind one
        that exists later than itself): from the callback of the oldest one's
        outputs, the moment they exist, down lanes open already. A push that
        may have to wait (a lane not open now, a value too large for one, a
        host to dial), and the failure of one whose outputs never came, go
        in a task of their own, in nobody's way."""
        pushes = self._later_pushes
        while pushes:
            later = pushes[0]
            if not later.ready.done():
                later.ready.add_done_callback(self._send_later_pushes)
                return
            pushes.popleft()
            try:
                if self.ctx.stopping:  # (its last gangs ended in on_stop: nothing goes)
                    raise ActorStopped(f"device {self.device_id} stopped")
                ready = later.ready.exception() is None
                if ready and self.pusher.push_now(later.targets, later.outputs, later.owner):
                    later.pushed.set_result(later.outputs)
                else:
                    self.ctx.start_soon(self._push_when_ready, later)
            except Exception as exc:  # that push fails; the ones behind it go on
                later.pushed.set_exception(exc)

    async def _push_when_ready(self, later: _LaterPush) -> None:
        """Push ``later``'s outputs once they exist (their readers fail with
        why if they never will); ``later.pushed`` settles as the push does."""
        try:
            try:
                await later.ready
            except Exception as exc:  # never computed: its readers fail with why
                await self.pusher.fail(later.targets, exc)
                self.pusher.drop(later.outputs)
                raise
            pushed = await self.pusher.push(later.targets, later.outputs, later.owner, later.held)
            forward(pushed, later.pushed)
        except Exception as exc:
            later.pushed.set_exception(exc)
        except BaseException:  # cancelled: the device stopped
            later.pushed.set_exception(ActorStopped(f"device {self.device_id} stopped"))
            raise

    def _pending(self, outputs: Sequence[BufferHandle]) -> Promise[None] | None:
        """One promise that every output here exists (None: they all do)."""
        pending = []
        for handle in outputs:
            with suppress(BufferMissing):
                promise = self.store.pending(handle.id)
                if promise is not None and promise not in pending:
                    pending.append(promise)
        if not pending:
            return None
        return pending[0] if len(pending) == 1 else _every(pending)

    @endpoint
    def install_plan(self, program: DeviceProgram) -> None:
        """Keep this device's part of a compiled plan, for :meth:`run_plan`.

        The island installs it before the plan's first run, on the same link,
        so it is here before any run asks for it. The oldest plans go first
        beyond ``PLANS_KEPT`` (the controller's plan cache holds no more).
        """
        self._plans[program.plan_id] = program
        self._release_points[program.plan_id] = _release_points(program)
        self._fused[program.plan_id] = self.fused_segments(program)
        while len(self._plans) > PLANS_KEPT:
            oldest = next(iter(self._plans))
            del self._release_points[oldest], self._fused[oldest], self._plans[oldest]

    @endpoint
    def drop_plans(self, plan_ids: list[int]) -> None:
        """Forget compiled plans (their slices were released, or they aged out)."""
        for plan_id in plan_ids:
            self._plans.pop(plan_id, None)
            self._release_points.pop(plan_id, None)
            self._fused.pop(plan_id, None)

    @endpoint(resolve_args=False, cancellable=False)
    async def run_plan(
        self,
        plan_id: int,
        epoch: int,
        inputs: Sequence[Any],
        owner: str = "",
        reply: Reply | None = None,
    ) -> RunReport | Promise[RunReport]:
        """Run this device's gangs of an installed plan, as run ``epoch``.

        One message per device per run: the gangs run in the installed order,
        each as its shard of the gang (inputs awaited here, in order,
        pushed ones taken from this host's inbox, the outputs of gangs this
        device led earlier in the run taken as they are), and the answer is
        one :class:`RunReport`, once every gang settled and its pushes were
        answered. A gang that fails before it pushes fails its readers'
        inboxes at once, here and on other hosts, so that no reader waits for
        a run report that waits for it. Outputs that no one keeps are freed
        once the run's last gang here to read them has taken its inputs (a
        gang that waits aside holds what it reads here until it has).

        **A gang may wait aside.** A gang on this device alone one of whose
        inputs is not here yet (a push still on its way, a promise, the
        output of a gang that waits aside) waits for them as a callback of
        what it waits for, then goes in the device's one task for such gangs
        (in the island's order), and the gangs behind it, of this run and of
        the runs after it, go on this device's stream first, as independent work goes on an
        accelerator's other streams: a device is not left idle behind a
        dependency while it has work that is ready. Gangs of one device meet
        no partner, so the island's order still holds where it matters: a
        gang over several devices waits until no gang here waits aside, and
        every device meets its partners in the island's order. Nor does a
        gang wait aside while this host's store is half full or more: work
        out of order keeps more values alive at once.

        ``reply`` (a client's call, when this device makes all of the run's
        outputs): the outputs go straight to the client too, as the answer
        to its call (``RunReport.answered`` says whether they went).
        """
        program = self._plans.get(plan_id)
        if program is None:
            error = AtollError(f"plan {plan_id} is not installed on device {self.device_id}")
            self._failed_runs[epoch] = error  # for later runs that read its outputs
            while len(self._failed_runs) > EARLIER_KEPT:
                del self._failed_runs[next(iter(self._failed_runs))]
            raise error
        values = dict(zip(program.inputs, inputs, strict=True))
        run = _Run(program, epoch, owner, values, run_key(epoch), {}, {}, RunReport(), {})
        release, fused = self._release_points[plan_id], self._fused.get(plan_id, {})
        step = 0
        while step < len(program.gangs):
            segment = fused.get(step)
            if segment is not None and await self.run_segment(
                segment, epoch, run.values, run.made, owner, run.report, run.passed
            ):
                self._release(range(step, segment.end), release, run)
                step = segment.end
                continue
            gang = program.gangs[step]
            given = gang.given(run.values, run.made)
            gang_id = f"{run.prefix}/{gang.node}"
            now = self.alone_now(gang, gang_id, given, run.owner)
            if now is not None:  # (the lean path, with nothing to wait for)
                run.ran[step] = self._took(gang, run, gang_id, [], now)
                self._release([step], release, run)
                step += 1
                continue
            if len(gang.devices) > 1:
                while self._aside:  # (rare: gangs of one device wait aside)
                    await self._ran_aside(*self._aside)
            elif self._gang_waits(gang, run.prefix, given) and self.store.roomy():
                self._wait_aside(run, step, given, release)
                step += 1
                continue
            run.ran[step] = await self._run_program_gang(gang, run, given, [])
            self._release([step], release, run)
            step += 1
        outs = [out for *_, out in run.ran.values()]
        if run.recorded is not None:  # gangs went aside: their reports come in later
            outs += run.recorded
        if all(out.done() for out in outs):  # (most runs: no promise for the answer)
            return self._run_ended(run.report, reply)
        return when_settled(outs, functools.partial(self._run_ended, run.report, reply), "run")

    def _missing(self, gang: PlannedGang, prefix: str, given: Sequence[Any]) -> Iterator[Any]:
        """What ``gang`` would wait for now, lazily: the inbox key (after the
        run's ``prefix``) of each push not landed, the promise of each other
        input not here yet (``given``, see :meth:`input_wait`)."""
        for index, value in enumerate(given):
            if value is None and gang.inputs[index] == PUSHED_IN:
                key = f"{prefix}/{gang.node}/{index}"
                if not self.store.landed(key):
                    yield key
            elif (wait := self.input_wait(value)) is not None and not wait.done():
                yield wait

    def _gang_waits(self, gang: PlannedGang, prefix: str, given: Sequence[Any]) -> bool:
        """Whether ``gang`` would wait for one of its inputs (:meth:`_missing`)."""
        return next(self._missing(gang, prefix, given), None) is not None

    def _waited_for(self, gang: PlannedGang, prefix: str, given: Sequence[Any]) -> list[Any]:
        """The promises ``gang`` waits for now (:meth:`_missing`)."""
        return [
            self.store.arrival(w) if isinstance(w, str) else w  # (the gang takes the key)
            for w in self._missing(gang, prefix, given)
        ]

    def input_wait(self, value: Any) -> Promise[Any] | None:
        """What an input that is not here yet waits for (None: it is here): a
        promise not settled, the gangs that wait aside of the run that makes
        it."""
        if isinstance(value, Promise):
            return None if value.done() else value
        if isinstance(value, PriorOutput) and value.run in self._aside:
            return self._ran_aside(value.run)
        return None

    def _wait_aside(self, run: _Run, step: int, given: list[Any], release: list[list[int]]) -> None:
        """Run gang ``step`` of ``run`` once its inputs are here (see
        :meth:`run_plan`, :meth:`_when_ready`). Meanwhile its outputs are
        promises for the gangs after it, and so is its entry in ``run.ran``,
        settled after the gang's own, so that the run's report takes the
        gang in first."""
        if not self._aside_runner:  # (from the device's own task: its context)
            self.ctx.start_soon(self._run_ready_aside)
            self._aside_runner = True
        aside = _Aside(run, step, release, next(self._aside_seq), given)
        gang = aside.gang
        run.ran[step] = (gang, aside.gang_id, aside.held, aside.outs)
        for value in given:  # what it reads here outlives the later readers' release
            if isinstance(value, Promise):  # (an aside gang's output: once it is known)
                value.add_done_callback(functools.partial(self._hold_when_known, aside))
            else:
                self._hold_for(aside, value)
        if run.recorded is None:
            run.recorded = []
        run.recorded.append(aside.recorded)
        for index in range(len(gang.outputs)):
            run.made[gang.node, index] = then(aside.outs, functools.partial(_item, index))
        self._aside.setdefault(run.epoch, []).append(aside)
        self._when_ready(aside)

    def _hold_for(self, aside: _Aside, value: Any) -> None:
        """Hold ``value`` for ``aside`` if it is a buffer here, until it read it."""
        if _held_here(value, self.host_id, self.store) and not aside.ran.done():
            self.store.incref(value.id)
            aside.kept.append(value.id)

    def _hold_when_known(self, aside: _Aside, value: Promise[Any]) -> None:
        """:meth:`_hold_for` a promise's value, once it settled: at once,
        before the gangs it wakes may free it (callbacks run in order)."""
        if value.exception() is None:
            self._hold_for(aside, value.result())

    def _when_ready(self, aside: _Aside, _: object = None) -> None:
        """Once the inputs of ``aside`` are here, it joins the gangs ready to
        go, for the device's runner (:meth:`_run_ready_aside`). Until then it
        is a callback of what it waits for, not a task: the push that lands,
        or the promise that settles, puts it in line in the same step."""
        if aside.given is None:  # (it went: the device stopped first)
            return
        try:
            waited = self._waited_for(aside.gang, aside.run.prefix, aside.given)
        except Exception as exc:
            self._aside_failed(aside, exc)
            return
        if waited:  # (a failure is the gang's to meet, once it runs)
            again = functools.partial(self._when_ready, aside)
            (waited[0] if len(waited) == 1 else all_settled(waited)).add_done_callback(again)
            return
        heapq.heappush(self._ready_aside, (aside.seq, aside))
        if self._aside_wake is not None:
            wake, self._aside_wake = self._aside_wake, None
            wake.set_result(None)

    async def _run_ready_aside(self) -> None:
        """The device's task that runs the gangs aside whose inputs are here,
        one at a time, the earliest in the island's order first (a gang's
        own awaits, a compile or a lookup on a thread, must not let a later
        one overtake it). Started by the first gang set aside, it waits for
        the next when none is ready, and ends with the device (its stop
        cancels it: the gang it was running fails)."""
        try:
            while True:
                while self._ready_aside:  # (no local keeps a gang's inputs alive after it)
                    try:
                        await self._run_aside(heapq.heappop(self._ready_aside)[1])
                    except Exception:  # (never the runner's end: the gangs behind it still go)
                        _log.exception("device %s: a gang aside failed", self.device_id)
                self._aside_wake = Promise("a gang aside is ready")
                await self._aside_wake
        finally:
            self._aside_runner, self._aside_wake = False, None

    async def _run_aside(self, aside: _Aside) -> None:
        """A gang that waited aside, now that its inputs are here; released
        then, whatever happens (a failure is its own, not the runner's)."""
        if aside.given is None:  # (it went: the device stopped first)
            return
        settled: Promise[Any] = failed(ActorStopped(f"device {self.device_id} stopped"))
        try:
            gang, run, given = aside.gang, aside.run, aside.given
            *_, settled = await self._run_program_gang(gang, run, given, aside.held)
        except Exception as exc:  # (the gang's own failures are in its promise)
            settled = failed(exc)
            self._keep_earlier(aside.run.epoch, aside.gang.node, exc, len(aside.gang.outputs))
        finally:  # cancelled too (the device stopped): its run's report says so
            self._went_aside(aside, settled)

    def _aside_failed(self, aside: _Aside, exc: Exception) -> None:
        """``aside`` cannot run: it fails, as a gang that raised would."""
        try:
            self._keep_earlier(aside.run.epoch, aside.gang.node, exc, len(aside.gang.outputs))
        finally:
            self._went_aside(aside, failed(exc))

    def _went_aside(self, aside: _Aside, settled: Promise[Any]) -> None:
        """A gang that waited aside went (``settled``: its outputs): it is
        released as any gang of its run, and no longer waits aside."""
        if aside.ran.done():  # (the device stopped first)
            return
        aside.given = None  # (what it read is no longer held through it)
        run, step = aside.run, aside.step
        run.ran[step] = (aside.gang, aside.gang_id, aside.held, settled)
        recorded: list[Promise[None]] = []
        try:
            self._release([step], aside.release, run, recorded)
        finally:  # (whatever happens, it no longer waits, nor holds anything)
            for buffer_id in aside.kept:
                with suppress(BufferMissing):
                    self.store.decref(buffer_id)
            forward(all_settled(recorded), aside.recorded)
            forward(settled, aside.outs)
            waiting = self._aside[run.epoch]
            waiting.remove(aside)
            if not waiting:
                del self._aside[run.epoch]
            aside.ran.set_result(None)

    def _ran_aside(self, *epochs: int) -> Promise[Any]:
        """Once the gangs of runs ``epochs`` that wait aside went."""
        return all_settled([aside.ran for e in epochs for aside in self._aside.get(e, ())])

    async def on_stop(self) -> None:
        """Gangs that wait aside fail, whether or not they began, and so do
        pushes of outputs not computed yet (the device stopped)."""
        self._ready_aside.clear()
        for aside in [each for waiting in self._aside.values() for each in waiting]:
            self._went_aside(aside, failed(ActorStopped(f"device {self.device_id} stopped")))
        pushes, self._later_pushes = self._later_pushes, deque()  # not sent: never will be
        for later in pushes:
            later.pushed.set_exception(ActorStopped(f"device {self.device_id} stopped"))
        await super().on_stop()

    def _run_ended(self, report: RunReport, reply: Reply | None) -> RunReport:
        """The run ended here: its report, saying whether the device ran dry,
        and the client's call answered (``reply``), if it can be."""
        report.idle = self.running_dry()
        if reply is not None:
            self._reply(reply, report)
        return report

    def running_dry(self) -> bool:
        """Whether this device, which runs ahead of its host, has nothing in
        flight (it waits for its next gang); False for a device that does not
        run ahead (its queue is its mailbox, which this does not see)."""
        return False

    def _reply(self, reply: Reply, report: RunReport) -> None:
        """Answer a client's call with a run's outputs, unless a gang failed
        (the controller says how, as for any run) or the client has no
        link to this host process."""
        client, request, outputs = reply
        if not report.errors:
            values = [report.outputs[node, index] for node, index in outputs]
            report.answered = runlane.answer(client, request, self.host_id, values)

    async def _run_program_gang(
        self, gang: PlannedGang, run: _Run, given: list[Any], held: list[str]
    ) -> tuple[PlannedGang, str, list[str], Promise[Any]]:
        """One gang of a compiled run (its inputs ``given``), as
        :meth:`run_plan` keeps it; its outputs (or its failure) go into
        ``run.made`` for the gangs after it."""
        if self.runs_alone(gang):  # no barrier, no inbox, no push: the lean path
            gang_id = f"{run.prefix}/{gang.node}"
            out = await self.run_alone(gang, gang_id, given, run.owner)
        else:
            task = gang.task(run.epoch, self.host_id, self.device_id)
            gang_id = task.gang_id
            out = await self._run_gang_task(task, given, run.owner, held)
            early = out.exception() if out.done() else None
            if early is not None:  # failed before pushing
                await self.pusher.fail(task.push, portable(early, gang_id))
        return self._took(gang, run, gang_id, held, out)

    def _took(
        self, gang: PlannedGang, run: _Run, gang_id: str, held: list[str], out: Promise[Any]
    ) -> tuple[PlannedGang, str, list[str], Promise[Any]]:
        """A gang of ``run`` took its inputs (``out``: its outputs, or its
        failure): what it made goes into ``run.made`` for the gangs after it."""
        if isinstance(out, GangOutputs):
            made, node = run.made, gang.node
            for index, handle in enumerate(out.outputs):
                made[node, index] = handle
            if any(gang.keep):  # outputs of the program: later runs may read them
                self._keep_earlier(run.epoch, gang.node, out.outputs)
        elif out.done() and out.exception() is not None:  # so do its readers here
            run.made.update(((gang.node, o), out) for o in range(len(gang.outputs)))
            self._keep_earlier(run.epoch, gang.node, out.exception(), len(gang.outputs))
        return gang, gang_id, held, out

    def _release(
        self,
        steps: Iterable[int],
        release: list[list[int]],
        run: _Run,
        recorded: list[Promise[None]] | None = None,
    ) -> None:
        """``steps`` took their inputs: report and free what they read last
        (a fused gang's outputs are its segment's: those passed on are freed).
        ``recorded`` (a gang that went aside, after its run's end was set):
        a promise for each gang, settled once the report took it in."""
        for step in steps:
            for done in release[step]:
                if done in run.ran:
                    gang, gang_id, held, out = run.ran[done]
                    report_and_free: Callable[[Promise[Any]], None] = functools.partial(
                        self._gang_settled, gang, gang_id, held, run.report
                    )
                    if recorded is not None:
                        report_and_free = _recording(report_and_free, recorded)
                    out.add_done_callback(report_and_free)
                for buffer_id in run.passed.pop(run.program.gangs[done].node, ()):
                    with suppress(BufferMissing):
                        self.store.decref(buffer_id)

    async def run_segment(
        self,
        segment: Any,
        epoch: int,
        values: dict[int, Any],
        made: dict[tuple[int, int] | None, Any],
        owner: str,
        report: RunReport,
        passed: dict[int, list[str]],
    ) -> bool:
        """Gangs run as one computation (a device that fuses them, see
        :meth:`fused_segments`): their outputs into ``made``, the program's
        into ``report``, the others' ids into ``passed`` (by node); False:
        run them gang by gang."""
        return False

    def fused_segments(self, program: DeviceProgram) -> dict[int, Any]:
        """The segments of ``program`` this device runs as one computation
        each, by their first gang's index (none here)."""
        return {}

    def _keep_earlier(
        self,
        run: int,
        node: int,
        outputs: Sequence[BufferHandle] | BaseException | None,
        count: int = 0,
        offset: int = 0,
    ) -> None:
        """Keep a compiled run's gang's outputs (from output ``offset`` on), or
        its error (for ``count`` outputs), for later runs."""
        kept = self._earlier.get(run)
        if kept is None:  # the runs kept are the most recent (a run's outputs, all of them)
            kept = self._earlier[run] = {}
            while len(self._earlier) > EARLIER_KEPT:
                del self._earlier[next(iter(self._earlier))]
        if isinstance(outputs, BaseException) or outputs is None:
            error = outputs or AtollError(f"run {run} node {node} failed")
            kept.update(((node, o), error) for o in range(count))
        else:  # copies: in one process the client counts the handles it holds
            kept.update(((node, o), copy.copy(h)) for o, h in enumerate(outputs, offset))

    def earlier(self, value: PriorOutput) -> BufferHandle | Promise[BufferHandle]:
        """The output a ``PriorOutput`` names, as this device kept it (raising the
        error its gang failed with); else its promise."""
        found = self._earlier.get(value.run, {}).get((value.node, value.index))
        if found is None and value.run in self._aside:  # its gang waits aside: once it ran
            ran = self._ran_aside(value.run)
            return flatten(then(ran, lambda _: as_promise(self.earlier(value))))
        if found is None and value.value is not None:
            promise: Promise[BufferHandle] = as_promise(value.value)
            return promise
        if found is None:
            raise self._failed_runs.get(value.run) or AtollError(
                f"run {value.run} left no output {value.node}/{value.index} on device "
                f"{self.device_id} (too long ago, or it never got here)"
            )
        if isinstance(found, BaseException):
            raise found
        return found

    def runs_alone(self, gang: PlannedGang) -> bool:
        """Whether a planned gang takes :meth:`run_alone`: the lean path of a
        device whose gangs have one (none here)."""
        return False

    async def run_alone(
        self, gang: PlannedGang, gang_id: str, inputs: Sequence[Any], owner: str
    ) -> Promise[list[BufferHandle]]:
        """A planned gang on this device alone, with no barrier, inbox or push
        (:meth:`runs_alone`): its outputs (a ``GangOutputs``), or its error."""
        raise NotImplementedError

    def alone_now(
        self, gang: PlannedGang, gang_id: str, inputs: Sequence[Any], owner: str
    ) -> Promise[list[BufferHandle]] | None:
        """:meth:`run_alone` without a wait, when nothing in it would wait:
        every input already here, room on the device and in the store, the
        executable known. None: a device with no such path (here), or
        anything out of the ordinary; the gang then takes the awaited way
        (:meth:`run_alone`, which also says why one fails, or its wait aside,
        or a gang's task)."""
        return None

    async def _run_gang_task(
        self, task: GangTask, inputs: Sequence[Any], owner: str, held: list[str]
    ) -> Promise[Any]:
        """One gang of a compiled run: the promise of its outputs once pushed
        (a :class:`GangOutputs` when they exist already)."""
        try:
            outputs = await self._run_here(task, inputs, owner)
        except _InputFailed as failure:
            return failed(failure.error)
        except Exception as exc:
            return failed(exc)
        if self.device_id != task.leader:
            return as_promise(outputs)
        if not task.push:
            return self._made_here(outputs)
        made = GangOutputs(outputs, pushed=True)
        later = self.answer_after(outputs)
        try:
            forward(_after(later, await self.push_outputs(task.push, outputs, owner, held)), made)
        except Exception as exc:
            made.set_exception(exc)
        return made

    def _made_here(self, outputs: list[BufferHandle]) -> GangOutputs:
        """A leader's outputs that go to no other host: there at once for the
        run's later gangs here, settled once an answer may name them
        (:meth:`answer_after`)."""
        later = self.answer_after(outputs)
        made = GangOutputs(outputs, pushed=later is not None)
        if later is not None:  # (what _after does, with no promise between)
            later.add_done_callback(functools.partial(_settle_with, made, outputs))
        return made

    async def _lean_input(self, value: Any) -> Any:
        """An input of the lean path (:meth:`run_alone`) as a handle or a
        value: what a ``PriorOutput`` names, a promise's value once it has one."""
        if isinstance(value, PriorOutput):
            value = self.earlier(value)
        if isinstance(value, Promise):
            value = await value
        return value

    def answer_after(self, outputs: Sequence[BufferHandle]) -> Promise[None] | None:
        """What an answer naming ``outputs`` waits for (None: nothing, it may
        go now). A device whose handles carry small values themselves
        (``BufferHandle.of``) answers once those values exist; one whose
        outputs are futures in the store answers at once, and readers wait
        for the bytes where they need them."""
        return None

    def _gang_settled(
        self,
        gang: PlannedGang,
        gang_id: str,
        held: list[str],
        report: RunReport,
        out: Promise[Any],
    ) -> None:
        """A planned gang settled: report its kept outputs, free the others
        (unless a reader elsewhere reads them in place), or report its error."""
        if out.exception() is None and self.device_id != gang.devices[0]:
            return  # only the leader holds outputs
        for buffer_id in report.record(gang, gang_id, out, held):
            try:  # noqa: SIM105 (not a context manager per output of every gang)
                self.store.decref(buffer_id)
            except BufferMissing:
                pass

    async def leave_barriers(self, task: GangTask) -> None:
        """A shard that fails before running still passes its gang's barriers,
        so that the shards that did start are not left waiting there."""
        if task.collective:
            await self.arrive(task, "in")

    async def _gather(
        self, task: GangTask, inputs: Sequence[Any], leader: bool, taken: list[str]
    ) -> list[BufferHandle]:
        """Await the inputs this shard needs; the leader gets every handle.

        A non-leader shard skips *resident* inputs (its part is on this device
        already), waits for the others' promises, and gets no handles: only
        the leader reads data. The leader takes an input with an inbox key
        from the push as soon as it lands, without waiting for the
        controller's promise.
        """
        count = len(inputs)
        keys = task.inbox if leader and self.host_id == task.inbox_host else ()
        keys = keys or (None,) * count
        resident = task.resident or (False,) * count
        handles: list[BufferHandle] = []
        for i, (value, key, local) in enumerate(zip(inputs, keys, resident, strict=True)):
            if local and not leader:
                continue
            try:
                handles.append(await self._input(value, key, taken))
            except BaseException:
                for later in keys[i + 1 :]:  # not waited on yet: free them when they land
                    if later is not None:
                        self.store.abandon(later)
                raise
        return handles if leader else []

    async def _input(self, value: Any, key: str | None, taken: list[str]) -> Any:
        """One input: its promise, or, with an inbox ``key``, what settles the
        inbox (the island sends no promise for those: resolving it would only
        cost messages). The producer pushes its output there, or redirects
        its readers to its own handle when the push was declined; the
        controller fails the inbox when the producer fails.
        """
        if key is None:
            if isinstance(value, PriorOutput):
                value = self.earlier(value)
            return await value_of(value)
        arrival = self.store.arrival(key)
        try:
            if not arrival.done():  # (landed: no wait)
                await first_settled(arrival)
        except BaseException:  # cancelled while waiting: free the copy when it lands
            self.store.abandon(key)
            raise
        return await self._arrived(key, arrival, taken)

    async def _arrived(self, key: str, arrival: Promise[Any], taken: list[str]) -> Any:
        """What settled the inbox ``key``: a pushed copy (this shard now owns
        it), the producer's own handle (a declined push), or its failure."""
        self.store.take(key)
        landed: Arrival = arrival.result()  # raises the producer's failure
        if landed.local:
            taken.append(landed.handle.id)
            await self._charge_transfer(landed.transfer_s)
        return landed.handle

    async def _charge_transfer(self, seconds: float) -> None:
        if seconds > 0:
            await self.clock.sleep(seconds)
            self.transfer_s += seconds

    async def arrive(self, task: GangTask, stage: str) -> None:
        """Wait at the gang's barrier ``stage`` until every shard got there."""
        if task.rendezvous is None:
            raise DeviceError(f"gang {task.gang_id} needs a rendezvous")
        await task.rendezvous.arrive(f"{task.gang_id}/{stage}", len(task.devices))

    async def run_shard(
        self, task: GangTask, inputs: list[BufferHandle], owner: str
    ) -> list[BufferHandle]:
        """Default shard semantics for a :class:`Computation` kernel.

        The leader reads the inputs, computes and stores the output; every
        other shard does its part of the data (which lives on itself, so
        nothing moves, see :meth:`spend`) and stores nothing.
        """
        computation = task.kernel
        if not isinstance(computation, Computation):
            kind = type(computation).__name__
            raise UnsupportedKernel(f"{type(self).__name__} cannot run {kind}")
        if self.device_id != task.leader:
            await self.spend(computation)
            return []
        return [await self._compute(computation, inputs, owner)]

    async def spend(self, computation: Computation) -> None:
        """The device time of ``computation`` on a shard that only takes part
        (not the leader, which runs the function). Real devices have nothing
        to model here; simulated ones sleep the cost model's time."""

    async def _compute(
        self, computation: Computation, inputs: Sequence[BufferHandle], owner: str
    ) -> BufferHandle:
        """Read the inputs, run ``computation``, store its output here."""
        arrays = [await self._read(handle, owner) for handle in inputs]
        return await self._stored(np.asarray(await self.execute(computation, arrays)), owner)

    async def _stored(self, array: Any, owner: str) -> BufferHandle:
        """Store ``array`` once there is room (back-pressure); its handle."""
        self.store.ledger.check(owner, array.nbytes)  # over its quota: fail, never stall
        await self.store.reserve(array.nbytes)
        buffer_id = self.store.put(array, owner, reserved=True, place=self.device_id)
        return self._handle(buffer_id, array)

    async def _keep(
        self, nbytes: int, owner: str, run: Callable[[], Awaitable[Sequence[Any]]]
    ) -> list[BufferHandle]:
        """Reserve ``nbytes`` *before* ``run``, then store the arrays it returns.

        For work whose output size is known ahead (a gang's avals): a full
        store stalls the device before it starts, not after.
        """
        await self.store.reserve(nbytes)
        try:
            outs = await run()
            # over its quota: fail, never stall; checked after the run, which
            # may be one part of a program over several processes
            self.store.ledger.check(owner, nbytes)
        except BaseException:
            self.store.unreserve(nbytes)
            raise
        return [
            self._handle(self.store.put(out, owner, reserved=True, place=self.device_id), out)
            for out in outs
        ]

    @endpoint
    def stats(self) -> DeviceStats:
        return DeviceStats(
            self.device_id,
            self.host_id,
            self.island,
            self.computations,
            self.busy_s + self.background_busy_s,
            self.transfer_s,
            self.clock.now() - self.started_at,
            *self.in_flight(),
        )

    def in_flight(self) -> tuple[int, int]:
        """Gangs enqueued on the accelerator and not known finished: now, and
        at most so far (devices that run each gang to its end: none)."""
        return 0, 0

    async def _read(self, handle: BufferHandle | ShardedHandle, owner: str = "") -> Any:
        """The input's array: from this host's store, carried in its handle
        (small values), or fetched from its holder. A small array passed by
        value in the call (``cluster.run(c, d, [array])``) is used as it is;
        a value split over a slice's devices is assembled from its shards.
        Session ``owner`` reads only its own buffers (``NotYours``)."""
        if isinstance(handle, np.ndarray):
            return handle
        if isinstance(handle, ShardedHandle):
            return await self._assembled(handle, owner)
        if handle.host_id == self.host_id:
            self.store.check_owner(handle.id, owner)
            error = self.store.failure(handle.id)
            if error is not None:  # its computation failed after it was enqueued
                raise error
            return self.store.get(handle.id)
        if handle.value is not None:
            await self._charge_transfer(
                self.cost.transfer_time(handle.nbytes, handle.island != self.island)
            )
            return handle.value
        holder = await self.pusher.host_ref(handle.host_id, handle.address, handle.host)
        began = timeline.start()
        array: np.ndarray = await holder.fetch(handle.id, owner)
        timeline.pulled(self.host_id, self.device_id, handle, began)
        await self._charge_transfer(
            self.cost.transfer_time(handle.nbytes, handle.island != self.island)
        )
        return array

    async def _assembled(self, handle: ShardedHandle, owner: str) -> np.ndarray:
        """A sharded value as one host array: its distinct shards read (each
        once it exists) and put together."""
        return await read_whole(handle, lambda part: self._bytes_of(part, owner), self.host_id)

    async def _bytes_of(self, handle: Any, owner: str) -> np.ndarray:
        """An input's bytes in host memory, once they exist (a buffer of this
        host may still be computing: devices run ahead)."""
        if isinstance(handle, ShardedHandle):
            return await self._assembled(handle, owner)
        if isinstance(handle, BufferHandle) and handle.host_id == self.host_id:
            with suppress(BufferMissing):
                pending = self.store.pending(handle.id)
                if pending is not None:
                    await pending
        return np.asarray(await self._read(handle, owner))

    def _handle(self, buffer_id: str, array: np.ndarray) -> BufferHandle:
        return BufferHandle.of(
            buffer_id,
            array,
            self.host,
            self.host_id,
            self.device_id,
            self.island,
            self.plane.address,
        )


def live_stats(store: ObjectStore, device_ids: Iterable[int]) -> list[DeviceStats]:
    """The stats of the devices on ``store``'s host, read now: a device's
    ``stats`` call waits behind every run in its mailbox (a simulated device
    spends its device time in the handler), where a scrape must not."""
    found = [_LIVE.get((store, device_id)) for device_id in device_ids]
    return [device.stats() for device in found if device is not None]


@dataclass(slots=True)
class _Run:
    """A compiled run on this device as :meth:`Device.run_plan` carries it out."""

    program: DeviceProgram
    epoch: int
    owner: str
    values: dict[int, Any]  # the program inputs the run sent this device, by index
    prefix: str  # of its gang ids and inbox keys (run_key)
    # outputs of its gangs here, by (node, output), for the gangs after them
    made: dict[tuple[int, int] | None, Any]
    # its gangs that took their inputs, by step: gang, gang id, held, outputs
    ran: dict[int, tuple[PlannedGang, str, list[str], Promise[Any]]]
    report: RunReport
    passed: dict[int, list[str]]  # by node: what a fused segment passed on here
    # per gang that went aside: settled once the gangs it released were reported
    recorded: list[Promise[None]] | None = None


@dataclass(slots=True, eq=False)
class _Aside:
    """A gang of a run that waits aside for its inputs (:meth:`Device.run_plan`)."""

    run: _Run
    step: int
    release: list[list[int]]  # the run's release points (_release_points)
    seq: int  # its place among the device's gangs aside, in the island's order
    given: list[Any] | None  # its inputs, until it went (None: it went, ``ran`` is set)
    held: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # its inputs here, held until it read them
    outs: Promise[Any] = field(default_factory=lambda: Promise("waits aside"))
    # settled once the gangs it released are in its run's report
    recorded: Promise[None] = field(default_factory=lambda: Promise("recorded"))
    ran: Promise[None] = field(default_factory=lambda: Promise("ran aside"))  # it went

    @property
    def gang(self) -> PlannedGang:
        return self.run.program.gangs[self.step]

    @property
    def gang_id(self) -> str:
        return f"{self.run.prefix}/{self.gang.node}"


def _recording(
    report: Callable[[Promise[Any]], None], recorded: list[Promise[None]]
) -> Callable[[Promise[Any]], None]:
    """``report``, which settles a promise (added to ``recorded``) once it ran."""
    done: Promise[None] = Promise("recorded")
    recorded.append(done)

    def run(out: Promise[Any]) -> None:
        try:
            report(out)
        finally:
            done.set_result(None)

    return run


def _held_here(value: Any, host_id: int, store: ObjectStore) -> bool:
    """Whether ``value`` is a handle of a buffer in this host's ``store``."""
    return isinstance(value, BufferHandle) and value.host_id == host_id and value.id in store


def _item(index: int, values: Sequence[T]) -> T:
    return values[index]


@dataclass(slots=True)
class _LaterPush:
    """A gang's pushes to other hosts, waiting for its outputs to exist."""

    ready: Promise[None]
    targets: Sequence[PushTarget]
    outputs: list[BufferHandle]
    owner: str
    held: list[str] | None
    pushed: Promise[list[BufferHandle]]


class _InputFailed(Exception):
    """An input of a gang failed: the gang fails with the input's error, as it is."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True, slots=True)
class LeanGang:
    """What a timeline needs of a gang that ran without a task (a device's
    lean path, :meth:`Device.run_alone`): its id and what it ran."""

    gang_id: str
    kernel: Any


class GangOutputs(Promise[list[BufferHandle]]):
    """A leader's gang in a compiled run: its output handles at once (for
    later gangs of the run on this device), and the promise that they were
    pushed to their readers."""

    def __init__(self, outputs: list[BufferHandle], pushed: bool = False) -> None:
        super().__init__("made")
        self.outputs = outputs
        if not pushed:
            self.set_result(outputs)


def _release_points(program: DeviceProgram) -> list[list[int]]:
    """Per gang of a device's program, in order: the gangs whose outputs may
    be reported and freed once it has taken its inputs (those it is the
    last local reader of, and itself if no later gang here reads it)."""
    last: dict[int, int] = {}  # node -> the step of its last reader here
    for step, gang in enumerate(program.gangs):
        for source in gang.local:
            if source is not None:
                last[source[0]] = step
    points: list[list[int]] = [[] for _ in program.gangs]
    index = {gang.node: step for step, gang in enumerate(program.gangs)}
    for step, gang in enumerate(program.gangs):
        points[max(step, last.get(gang.node, step))].append(step)
    assert all(index[node] <= at for node, at in last.items())
    return points


def _every(promises: Sequence[Promise[None]]) -> Promise[None]:
    """Settles once all of ``promises`` did: with the first error, if any."""
    out: Promise[None] = Promise("every output")

    def settled(_: Promise[None]) -> None:
        errors = [e for p in promises if (e := p.exception()) is not None]
        if errors:
            out.set_exception(errors[0])
        else:
            out.set_result(None)

    all_settled(promises).add_done_callback(settled)
    return out


def _settle_with(out: Promise[T], value: T, later: Promise[Any]) -> None:
    """Settle ``out`` with ``value`` now that ``later`` did (with its error,
    if it failed)."""
    error = later.exception()
    if error is not None:
        out.set_exception(error)
    else:
        out.set_result(value)


def _after(later: Promise[None] | None, promise: Promise[T]) -> Promise[T]:
    """``promise``, settled no sooner than ``later`` (failed with its error, if
    it fails: the outputs it stands for never came to exist)."""
    return promise if later is None else flatten(then(later, lambda _: promise))
