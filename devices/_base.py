"""The device protocol: buffers by handle, computations, and the host around them.

A *device actor* owns one accelerator (real or simulated). It runs
computations strictly in the order its mailbox delivers them, which is the
order its island scheduler decided. Outputs go into the *host's* object store;
the device hands back a :class:`BufferHandle`, a small value that can travel
anywhere and names the host that holds the bytes.

A device reads an input on its own host straight from the store. An input
held on another host is fetched from that host's :class:`Host` actor, never
through the controller. The host actor never blocks, so a device waiting for
data cannot deadlock with a device whose data it needs.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..kernel import (
    Actor,
    ActorRef,
    AtollError,
    Clock,
    HostLost,
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
)
from ..transports import bulk, lane, shm
from ..transports.inproc import read_only
from ..transports.lane import LaneMessage
from . import timeline
from ._errors import DeviceError, UnsupportedKernel
from ._gang import GangTask, PushTarget
from ._plan import DeviceProgram, PlannedGang, RunReport, portable
from ._store import BufferMissing, ObjectStore

_log = logging.getLogger(__name__)

__all__ = [
    "BufferHandle",
    "Computation",
    "CostModel",
    "Device",
    "DeviceStats",
    "Host",
]


_LANES: dict[str, tuple[str, ActorRef[Host]] | tuple[()]] = {}  # by capnp address
LANES_ON = os.environ.get("ATOLL_PUSH_LANES", "1") != "0"  # 0: every push by call (A/B runs)
PLANS_KEPT = 256  # compiled plans a device keeps (the controller's plan cache size)
_RECENT_GANGS = 64  # finished gangs whose outputs a late push_output can still find
INLINE_VALUE_BYTES = 1 << 14  # outputs up to this size ride along in their handle
assert INLINE_VALUE_BYTES <= lane.MAX_BODY  # a lane's value can always ride in a handle
# pushes above this size (what Cap'n Proto sends as a pulled buffer, not
# inline) ask the reader's host for room first (Host.hold)
HOLD_ABOVE_BYTES = 1 << 20


@dataclass(frozen=True)
class BufferHandle:
    """Where a buffer lives: its id in the store of ``host``, and its type.

    A small output (up to ``INLINE_VALUE_BYTES``) also carries its value
    (read-only): whoever gets the handle, in this process or across the
    wire, reads it without asking the holder, so fetching a scalar result
    or chaining small values between hosts costs no extra round trip. The
    buffer still lives in the store, for reference counts and owners; since
    a stored value never changes, a small handle still reads after its
    buffer was freed (a large one then raises ``BufferMissing``).
    """

    id: str
    host: ActorRef[Host]
    host_id: int
    device_id: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    island: int = 0
    address: str = ""  # the holder's capnp address, in multi-process clusters
    value: np.ndarray | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(
        cls,
        buffer_id: str,
        array: Any,
        host: ActorRef[Host],
        host_id: int,
        device_id: int,
        island: int,
    ) -> BufferHandle:
        """The handle of ``array``, stored as ``buffer_id`` on that host (and
        this process's capnp address, if it announced one)."""
        shape, dtype, nbytes = tuple(array.shape), str(array.dtype), int(array.nbytes)
        small = isinstance(array, np.ndarray) and nbytes <= INLINE_VALUE_BYTES
        value = read_only(array) if small else None  # nobody writes into a stored value
        return cls(
            buffer_id,
            host,
            host_id,
            device_id,
            shape,
            dtype,
            nbytes,
            island,
            _local_address(),
            value,
        )


@dataclass(frozen=True)
class Computation:
    """A function to run on a device, with the work it represents.

    ``fn`` maps numpy inputs to one numpy output. ``flops`` is what the cost
    model turns into device time (simulated devices spend exactly that).
    ``collective``: run as a gang over several devices, its shards first meet
    at a barrier, like the participants of an all-reduce.
    """

    name: str
    fn: Callable[..., Any]
    flops: float = 0.0
    collective: bool = False


@dataclass(frozen=True)
class CostModel:
    """How long things take on a simulated device.

    compute time = flops / flops_per_s; a transfer between hosts takes
    link_latency_s + bytes / link_bytes_per_s; on one host it is free. A
    transfer between islands crosses the "datacenter network" instead, with
    ``dcn_*`` figures (None: the same as the link inside an island).
    """

    flops_per_s: float = 1e12
    link_bytes_per_s: float = 10e9
    link_latency_s: float = 20e-6
    dcn_bytes_per_s: float | None = None
    dcn_latency_s: float | None = None

    def compute_time(self, flops: float) -> float:
        return flops / self.flops_per_s

    def transfer_time(self, nbytes: int, across_islands: bool = False) -> float:
        if across_islands:
            latency = self.dcn_latency_s if self.dcn_latency_s is not None else self.link_latency_s
            rate = (
                self.dcn_bytes_per_s if self.dcn_bytes_per_s is not None else self.link_bytes_per_s
            )
            return latency + nbytes / rate
        return self.link_latency_s + nbytes / self.link_bytes_per_s


@dataclass(frozen=True)
class DeviceStats:
    """How busy a device was: busy time over the time since it started."""

    device_id: int
    host_id: int
    island: int
    computations: int
    busy_s: float
    transfer_s: float
    elapsed_s: float

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.elapsed_s if self.elapsed_s > 0 else 0.0


class Device(Actor):
    """Base of device actors: stores, handles, transfers and accounting.

    Subclasses implement :meth:`execute`, which runs one computation and
    returns its output and the device seconds it took; they may override
    :meth:`run_shard` for kernels of their own (see ``JaxDevice``).
    ``host_cls`` names the host actor class that fits the device (None: Host).
    """

    host_cls: ClassVar[type[Host] | None] = None

    @classmethod
    def available(cls) -> int | None:
        """How many devices of this kind exist (None: as many as asked for)."""
        return None

    def __init__(
        self,
        device_id: int,
        host_id: int,
        island: int,
        store: ObjectStore,
        host: ActorRef[Host],
        cost: CostModel,
    ) -> None:
        self.device_id = device_id
        self.host_id = host_id
        self.island = island
        self.store = store
        self.host = host
        self.cost = cost
        self.computations = 0
        self.busy_s = 0.0
        self.transfer_s = 0.0
        self.started_at = 0.0
        self._recent: dict[str, list[BufferHandle]] = {}  # gang id -> outputs, newest last
        self._plans: dict[int, DeviceProgram] = {}  # installed compiled plans, newest last

    @property
    def clock(self) -> Clock:
        return self.ctx.clock

    async def on_start(self) -> None:
        self.started_at = self.clock.now()

    async def execute(self, computation: Computation, inputs: list[np.ndarray]) -> np.ndarray:
        """Run ``computation``; must account its device time in ``busy_s``."""
        raise NotImplementedError

    @endpoint
    async def put(self, array: np.ndarray, owner: str = "") -> BufferHandle:
        """Place a host array on this device (its host's store)."""
        return await self._stored(np.asarray(array), owner)

    @endpoint
    async def run(
        self, computation: Computation, inputs: Sequence[BufferHandle], owner: str = ""
    ) -> BufferHandle:
        """Run after every input is here; returns the output's handle."""
        handle = await self._compute(computation, inputs, owner)
        self.computations += 1
        return handle

    @endpoint(resolve_args=False)
    async def run_gang(
        self, task: GangTask, inputs: Sequence[Any], owner: str = ""
    ) -> list[BufferHandle] | Promise[list[BufferHandle]]:
        """This device's shard of a gang, once the inputs it needs are here.

        Inputs come as promises and are awaited here, in the device's own
        order of work (see :meth:`_gather` for which shard waits for what). A
        collective gang then waits at its barrier: the device takes no other
        message until all shards of the gang arrived. The leader returns the
        output handles, once it has pushed them to their readers (so the
        handles reach anyone only after the pushes landed); the other shards
        return an empty list.
        """
        return await self._run_gang(task, inputs, owner)

    async def _run_gang(
        self,
        task: GangTask,
        inputs: Sequence[Any],
        owner: str,
        remember: bool = True,
        held: list[str] | None = None,
    ) -> list[BufferHandle] | Promise[list[BufferHandle]]:
        """The body of :meth:`run_gang`, also run per gang by :meth:`run_plan`
        (which does not ``remember`` the outputs for ``push_output``, and
        collects in ``held`` the outputs a reader elsewhere reads in place)."""
        if len(task.devices) == 1:  # a gone session's gangs spend no device time (a
            self.store.ledger.check_open(owner)  # wider gang runs: its partners wait)
        leader = self.device_id == task.leader
        taken: list[str] = []  # pushed copies this shard owns and frees
        try:
            try:
                handles = await self._gather(task, inputs, leader, taken)
            except Exception as exc:  # an input failed: so does this shard, as it is
                await self.leave_barriers(task)
                return failed(exc)
            if task.collective:
                await self.arrive(task, "in")
            busy, began = self.busy_s, timeline.start()
            outputs = await self.run_shard(task, handles, owner)
            timeline.gang(self.host_id, self.device_id, task, owner, began, leader)
            self.store.ledger.charge(owner, self.busy_s - busy)  # device time per session
        finally:
            for buffer_id in taken:
                with suppress(BufferMissing):  # its owner's session may have ended
                    self.store.decref(buffer_id)
        self.computations += 1
        if leader and remember:
            self._remember(task.gang_id, outputs)
        if leader and task.push:
            return await self._push(task.push, outputs, owner, held)
        return outputs

    def _remember(self, gang_id: str, outputs: list[BufferHandle]) -> None:
        """Keep a finished gang's output handles a little, for ``push_output``."""
        self._recent[gang_id] = outputs
        while len(self._recent) > _RECENT_GANGS:
            del self._recent[next(iter(self._recent))]

    @endpoint
    async def push_output(
        self, gang_id: str, target: PushTarget, owner: str = ""
    ) -> Promise[list[BufferHandle]] | bool:
        """Push an output of gang ``gang_id``, which ran here, to a reader that
        appeared after it was dispatched (a ``cluster.run`` chain).

        The island sends this right after the gang itself, so it is handled
        once the gang finished. False: the gang failed, or ran too long ago to
        be remembered (the controller then fails or redirects the reader's
        inbox itself); otherwise it settles like a dispatch push.
        """
        outputs = self._recent.get(gang_id)  # kept: another reader may ask too
        if outputs is None:  # failed, or no longer remembered: the controller redirects
            return False
        return await self._push((target,), outputs, owner)

    @endpoint
    def install_plan(self, program: DeviceProgram) -> None:
        """Keep this device's part of a compiled plan, for :meth:`run_plan`.

        The island installs it before the plan's first run, on the same link,
        so it is here before any run asks for it. The oldest plans go first
        beyond ``PLANS_KEPT`` (the controller's plan cache holds no more).
        """
        self._plans[program.plan_id] = program
        while len(self._plans) > PLANS_KEPT:
            del self._plans[next(iter(self._plans))]

    @endpoint
    def drop_plans(self, plan_ids: list[int]) -> None:
        """Forget compiled plans (their slices were released, or they aged out)."""
        for plan_id in plan_ids:
            self._plans.pop(plan_id, None)

    @endpoint(resolve_args=False)
    async def run_plan(
        self, plan_id: int, epoch: int, inputs: Sequence[Any], owner: str = ""
    ) -> Promise[RunReport]:
        """Run this device's gangs of an installed plan, as run ``epoch``.

        One message per device per run: the gangs run in the installed order,
        each as :meth:`run_gang` would run it (inputs awaited here, in order,
        pushed ones taken from this host's inbox), and the answer is one
        :class:`RunReport`, once every gang settled and its pushes were
        answered. A gang that fails before it pushes fails its readers'
        inboxes at once, here and on other hosts, so that no reader waits for
        a run report that waits for it.
        """
        program = self._plans.get(plan_id)
        if program is None:
            raise AtollError(f"plan {plan_id} is not installed on device {self.device_id}")
        report = RunReport()
        values = dict(zip(program.inputs, inputs, strict=True))
        settled: list[Promise[Any]] = []
        for gang in program.gangs:
            task = gang.task(epoch, self.host_id, self.device_id)
            held: list[str] = []
            try:
                out = as_promise(await self._run_gang(task, gang.given(values), owner, False, held))
            except Exception as exc:
                out = failed(exc)
            early = out.exception() if out.done() else None  # failed before pushing
            if early is not None:
                await self._fail_targets(task.push, portable(early, task.gang_id))
            out.add_done_callback(functools.partial(self._planned, gang, task, held, report))
            settled.append(out)
        return then(all_settled(settled), lambda _: report)

    def _planned(
        self,
        gang: PlannedGang,
        task: GangTask,
        held: list[str],
        report: RunReport,
        out: Promise[Any],
    ) -> None:
        """A planned gang settled: report its kept outputs, free the others
        (unless a reader elsewhere reads them in place), or report its error."""
        if out.exception() is None and self.device_id != task.leader:
            return  # only the leader holds outputs
        for buffer_id in report.record(gang, task.gang_id, out, held):
            with suppress(BufferMissing):
                self.store.decref(buffer_id)

    async def _fail_targets(self, targets: Sequence[PushTarget], error: BaseException) -> None:
        """Fail the inboxes a failed gang's outputs were due in (no reply awaited)."""
        for target in targets:
            if target.host_id == self.host_id:
                for key in target.keys:
                    self.store.fail(key, error)
                continue
            try:
                host = await self._host_ref(target.host_id, target.address, target.host)
            except Exception as exc:  # unreachable: its readers fail with the host
                _log.warning("cannot fail inboxes on host %s: %s", target.host_id, exc)
                continue
            host.fail_inbox(list(target.keys), error).add_done_callback(_log_unsent)

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
            return await value_of(value)
        arrival = self.store.arrival(key)
        try:
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

    async def _push(
        self,
        targets: Sequence[PushTarget],
        outputs: list[BufferHandle],
        owner: str,
        held: list[str] | None = None,
    ) -> Promise[list[BufferHandle]]:
        """Send outputs to the hosts that read them; the promise of ``outputs``
        settles when every push was answered (landed, declined or failed).
        ``held`` collects the outputs whose push was declined: a reader reads
        them where they are, so they must outlive the push."""
        answers: list[Promise[Any]] = []
        sent: list[str] = []
        unreachable: list[Exception] = []
        for target in targets:
            handle = outputs[target.output]
            if target.host_id == self.host_id:
                for key in target.keys:
                    self.store.incref(handle.id)
                    self.store.deliver(key, Arrival(handle, 0.0), handle.id)
                continue
            array = np.asarray(self.store.get(handle.id))
            began = timeline.start()
            if await self._by_lane(target, array, owner):
                timeline.push(
                    self.host_id, self.device_id, target.host_id, target.keys, array.nbytes, began
                )
                continue  # one way: it lands there without an answer
            try:
                host = await self._host_ref(target.host_id, target.address, target.host)
            except Exception as exc:  # its reader waits on its inbox: fail, and say why
                unreachable.append(exc)
                continue
            answer = self._offer(host, list(target.keys), array, owner)
            timeline.pushing(answer, self.host_id, self.device_id, target, array.nbytes)
            answers.append(_redirect_unless_landed(answer, host, target.keys, handle))
            sent.append(handle.id)

        def pushed(_: None) -> list[BufferHandle]:
            if held is not None:
                held.extend(i for a, i in zip(answers, sent, strict=True) if _declined(a))
            return self._pushed(answers, unreachable, outputs)

        return then(all_settled(answers), pushed)

    def _offer(
        self, host: ActorRef[Host], keys: list[str], array: np.ndarray, owner: str
    ) -> Promise[Any]:
        """``host.receive`` of a pushed output; True if it landed. An array
        big enough to be pulled by its reader goes only after the reader's
        host said it has room (``Host.hold``): a full store declines before
        any byte moves, not after the whole array was pulled."""
        if array.nbytes <= HOLD_ABOVE_BYTES:
            return host.receive(keys, array, owner, self.island)

        def send(hold_id: int | None) -> Promise[Any] | bool:
            if hold_id is None:
                return False  # no room there: its reader reads it here
            return host.receive(keys, array, owner, self.island, hold_id)

        return flatten(then(host.hold(int(array.nbytes)), send))

    async def _by_lane(self, target: PushTarget, array: np.ndarray, owner: str) -> bool:
        """Push a small value down the one-way lane to its reader's host process
        (``transports.lane``), when there is one; False: push it by call."""
        if not target.address or not LANES_ON or not lane.fits(array):
            return False
        found = _LANES.get(target.address)
        if found is None:
            found = _LANES[target.address] = await self._open_lane(target)
        if not found:
            return False
        address, host = found
        message = LaneMessage(target.host_id, target.keys, owner, self.island, array)
        fallback = functools.partial(_push_by_call, host)
        if lane.send(address, message, fallback):
            return True
        from ..transports.capnp.directory import local_token

        return await lane.connect(address, local_token()) and lane.send(address, message, fallback)

    async def _open_lane(self, target: PushTarget) -> tuple[str, ActorRef[Host]] | tuple[()]:
        """The lane to ``target``'s host process, opened once (empty: none)."""
        from ..transports.capnp.directory import local_token

        try:
            host = await self._host_ref(target.host_id, target.address, target.host)
            address = await host.lane()
        except Exception as exc:  # an older host, or none: pushes go by call
            _log.info("no lane to host %s: %s", target.host_id, exc)
            return ()
        if not address or not await lane.connect(address, local_token()):
            return ()
        return address, host

    def _pushed(
        self,
        answers: list[Promise[Any]],
        unreachable: list[Exception],
        outputs: list[BufferHandle],
    ) -> list[BufferHandle]:
        """The outputs, once every push landed or was redirected. A reader left
        with neither fails the producer (the controller then fails the reader's
        inbox): with ``HostLost`` when every failed push lost its host, else
        with ``DeviceError``; the outputs are dropped only now, after every
        redirect that points at them was answered."""
        errors = unreachable + [e for a in answers if (e := a.exception()) is not None]
        if errors:
            self._drop(outputs)
            lost = all(isinstance(e, HostLost) for e in errors)
            raise (HostLost if lost else DeviceError)(
                "; ".join(f"a push failed: {e}" for e in errors)
            )
        return outputs

    def _drop(self, outputs: list[BufferHandle]) -> None:
        for handle in outputs:
            with suppress(BufferMissing):
                self.store.decref(handle.id)

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
        return self._handle(self.store.put(array, owner, reserved=True), array)

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
        return [self._handle(self.store.put(out, owner, reserved=True), out) for out in outs]

    @endpoint
    def stats(self) -> DeviceStats:
        return DeviceStats(
            self.device_id,
            self.host_id,
            self.island,
            self.computations,
            self.busy_s,
            self.transfer_s,
            self.clock.now() - self.started_at,
        )

    async def _read(self, handle: BufferHandle, owner: str = "") -> Any:
        """The input's array: from this host's store, carried in its handle
        (small values), or fetched from its holder. A small array passed by
        value in the call (``cluster.run(c, d, [array])``) is used as it is.
        Session ``owner`` reads only its own buffers (``NotYours``)."""
        if isinstance(handle, np.ndarray):
            return handle
        if handle.host_id == self.host_id:
            self.store.check_owner(handle.id, owner)
            return self.store.get(handle.id)
        if handle.value is not None:
            await self._charge_transfer(
                self.cost.transfer_time(handle.nbytes, handle.island != self.island)
            )
            return handle.value
        holder = await self._host_ref(handle.host_id, handle.address, handle.host)
        began = timeline.start()
        array: np.ndarray = await holder.fetch(handle.id, owner)
        timeline.pulled(self.host_id, self.device_id, handle, began)
        await self._charge_transfer(
            self.cost.transfer_time(handle.nbytes, handle.island != self.island)
        )
        return array

    def _handle(self, buffer_id: str, array: np.ndarray) -> BufferHandle:
        return BufferHandle.of(
            buffer_id, array, self.host, self.host_id, self.device_id, self.island
        )

    async def _host_ref(
        self, host_id: int, address: str, known: ActorRef[Host] | None
    ) -> ActorRef[Host]:
        """Host ``host_id``'s actor, over a direct link when there can be one.

        (``known`` may be proxied by the controller; bytes must not take that
        path. See ``atoll.transports.capnp.directory``.)
        """
        if address:
            from ..transports.capnp.directory import direct_actor

            ref = await direct_actor(address, f"host{host_id}", self.ctx.system)
            if ref is not None:
                return ref
        if known is None:  # its process is gone, or cut off: as good as lost
            raise HostLost(f"host {host_id} at {address!r} cannot be reached directly")
        return known


@dataclass(frozen=True)
class Arrival:
    """A pushed input as its reader finds it in the store: the local copy's
    handle, and the modelled link time the transfer took (simulated devices
    spend it when they take the input). ``local`` is False for a redirect:
    the handle is the producer's own, read from where it is."""

    handle: BufferHandle
    transfer_s: float
    local: bool = True


def _log_unsent(notice: Promise[Any]) -> None:
    if notice.exception() is not None:
        _log.warning("could not fail a reader's inbox: %s", notice.exception())


def _push_by_call(host: ActorRef[Host], message: LaneMessage) -> None:
    """A lane closed before its receiver acknowledged ``message``: push it the
    ordinary way (a copy that did land is ignored there). If that push is
    declined, the readers take the value as it is, carried in a handle (the
    producer may have freed its own copy by now)."""
    keys = list(message.keys)
    answer = host.receive(keys, message.array, message.owner, message.island)

    def landed(done: Promise[Any]) -> None:
        if done.exception() is None and done.result():
            return
        if done.exception() is not None:
            _log.warning("a push sent again by call failed: %s", done.exception())
        value = BufferHandle.of("lane", message.array, host, -1, -1, message.island)
        host.redirect_inbox(keys, value).add_done_callback(_log_unsent)

    answer.add_done_callback(landed)


def _declined(answer: Promise[Any]) -> bool:
    """Whether a settled push was redirected (its reader reads in place)."""
    return answer.exception() is None and answer.result() is not True


def _redirect_unless_landed(
    answer: Promise[Any], host: ActorRef[Host], keys: tuple[str, ...], handle: BufferHandle
) -> Promise[Any]:
    """Settles once the push to ``host`` landed, or, when it was declined or
    failed, once the readers' inboxes there were pointed at ``handle``."""
    out: Promise[Any] = Promise("push settled")

    def done(pushed: Promise[Any]) -> None:
        if pushed.exception() is None and pushed.result():
            out.set_result(True)
            return
        if pushed.exception() is not None:
            _log.warning("a push failed; redirecting its reader: %s", pushed.exception())
        forward(as_promise(host.redirect_inbox(list(keys), handle)), out)

    answer.add_done_callback(done)
    return out


def _local_address() -> str:
    """The capnp address this process announced, if it is a host process."""
    directory = sys.modules.get("atoll.transports.capnp.directory")
    return directory.local_address() if directory is not None else ""


class Host(Actor):
    """One host: its object store and its device actors (as children).

    Its endpoints never block, so remote devices can always fetch from it.
    """

    def __init__(
        self,
        host_id: int,
        island: int,
        device_ids: Sequence[int],
        device_cls: type[Device],
        cost: CostModel,
        store_bytes: int | None = None,
    ) -> None:
        self.host_id = host_id
        self.island = island
        self.device_ids = list(device_ids)
        self.device_cls = device_cls
        self.cost = cost
        # in a host process (one that announced an address), large buffers
        # live in shared memory, for the other processes of this machine
        shared = bool(_local_address())
        self.store = ObjectStore(f"host{host_id}", store_bytes, shared=shared)
        self.device_refs: list[ActorRef[Device]] = []
        self.pushes_in = 0  # pushes that landed here
        self.pushes_declined = 0
        self.lane_address = ""  # where other host processes push small values

    async def on_start(self) -> None:
        await self._serve_lane()
        self.device_refs = [
            self.ctx.spawn(
                self.device_cls,
                device_id,
                self.host_id,
                self.island,
                self.store,
                self.ctx.ref,
                self.cost,
                name=f"device{device_id}",
            )
            for device_id in self.device_ids
        ]

    async def on_stop(self) -> None:
        if self.lane_address:
            lane.register(self.host_id, None)

    async def _serve_lane(self) -> None:
        """In a host process, take small pushes by lane (``transports.lane``)."""
        address = _local_address()
        if not address:
            return
        from ..transports.capnp.directory import local_token

        where = address.split("://", 1)[-1].rpartition(":")[0]
        try:
            self.lane_address = await lane.serve(where, local_token())
        except OSError as exc:  # lanes are an optimization: push by call instead
            _log.warning("host %s takes no pushes by lane: %s", self.host_id, exc)
            return
        lane.register(self.host_id, self._from_lane)

    @endpoint
    def lane(self) -> str:
        """Where this host takes pushes by lane ("" : it takes them by call only)."""
        return self.lane_address

    def _from_lane(self, message: LaneMessage) -> None:
        """A small value pushed down a lane. Its sender did not wait for an
        answer, so it cannot be declined: when the store has no room, the
        readers get it as it came, outside the store (a small value, read
        once; nothing here to free), instead of waiting for room that only
        their own progress would make."""
        keys, array = list(message.keys), message.array
        timeline.received(self.host_id, keys, array.nbytes, timeline.start())
        if self.store.fits(array.nbytes):
            try:
                self._land(keys, array, message.owner, message.island)
            except Exception as exc:  # its session ended, or is over its quota
                for key in keys:
                    self.store.fail(key, portable(exc, f"push to {key}"))
            return
        self.pushes_declined += 1
        value = BufferHandle.of("lane", array, self.ctx.ref, -1, -1, message.island)
        seconds = self.cost.transfer_time(value.nbytes, message.island != self.island)
        for key in keys:
            self.store.redirect(key, Arrival(value, seconds, local=False))

    @endpoint
    def devices(self) -> list[ActorRef[Device]]:
        return list(self.device_refs)

    @endpoint
    def fetch(self, buffer_id: str, owner: str = "") -> np.ndarray:
        """The bytes of a buffer held here (read-only). A session passes its
        ``owner`` label and gets ``NotYours`` for another session's buffer."""
        self.store.check_owner(buffer_id, owner)
        return np.asarray(self.store.get(buffer_id))

    @endpoint
    def timeline(self, record: bool) -> list[dict[str, Any]]:
        """Switch this process's timeline recorder on or off; what it held
        (``devices/timeline.py``; hosts sharing a process share one)."""
        return timeline.RECORDER.switch(record)

    @endpoint
    def address(self) -> str:
        """The capnp address of this host's process ('' in-process)."""
        return _local_address()

    @endpoint
    def hold(self, nbytes: int) -> int | None:
        """Room for a push of ``nbytes`` that is yet to be sent: a hold's id,
        or None if it does not fit now (the push is then declined before its
        bytes move). A hold not used within ``HOLD_TTL_S`` lapses."""
        hold_id = self.store.hold(nbytes)
        if hold_id is None:
            self.pushes_declined += 1
        return hold_id

    @endpoint(resolve_args=False)
    def receive(
        self, keys: list[str], array: Any, owner: str, island: int, hold: int | None = None
    ) -> bool | Promise[bool]:
        """A producer elsewhere pushes an output that devices here will read.

        Never blocks the host: bulk bytes still on their way arrive as a
        promise, and the answer follows it. The bytes are stored once, with
        one reference per inbox key in ``keys``, and delivered to each. With
        ``hold`` (from :meth:`hold`) they go into the room held for them;
        else, if they do not fit now, the push is declined (False): the
        readers then fetch the value when they run, under the store's
        back-pressure.
        """
        if isinstance(array, Promise):
            if hold is not None:  # a pull that fails gives its room back
                array.add_done_callback(lambda done: self._unhold(done, hold))
            return then(array, lambda value: self._accept(keys, value, owner, island, hold))
        return self._accept(keys, array, owner, island, hold)

    def _unhold(self, pulled: Promise[Any], hold: int) -> None:
        if pulled.exception() is not None:
            self.store.release_hold(hold)

    def _accept(
        self, keys: list[str], array: Any, owner: str, island: int, hold: int | None = None
    ) -> bool:
        array = np.asarray(array)
        timeline.received(self.host_id, keys, array.nbytes, timeline.start())
        if keys and hold is not None and self.store.take_hold(hold, array.nbytes):
            self._land(keys, array, owner, island, reserved=True)
            return True
        if hold is not None:
            self.store.release_hold(hold)
        if not keys or not self.store.fits(array.nbytes):
            self.pushes_declined += 1
            return False
        self._land(keys, array, owner, island)
        return True

    def _land(
        self, keys: list[str], array: Any, owner: str, island: int, reserved: bool = False
    ) -> None:
        """Store a pushed value once, with one reference per reader's key."""
        self.pushes_in += 1
        buffer_id = self.store.put(array, owner, reserved=reserved)
        for _ in keys[1:]:
            self.store.incref(buffer_id)
        handle = BufferHandle.of(buffer_id, array, self.ctx.ref, self.host_id, -1, self.island)
        seconds = self.cost.transfer_time(handle.nbytes, island != self.island)
        for key in keys:
            self.store.deliver(key, Arrival(handle, seconds), buffer_id)

    @endpoint
    def redirect_inbox(self, keys: list[str], handle: BufferHandle) -> None:
        """A push to ``keys`` did not land here: their readers read ``handle``
        (the producer's output, where it is) instead."""
        for key in keys:
            self.store.redirect(key, Arrival(handle, 0.0, local=False))

    @endpoint
    def fail_inbox(self, keys: list[str], error: BaseException) -> None:
        """Nothing will land under ``keys``: their producer failed with ``error``."""
        for key in keys:
            self.store.fail(key, error)

    @endpoint
    def free(self, buffer_id: str, owner: str = "") -> bool:
        """Drop one reference; True if the buffer was freed (``owner``: as in
        :meth:`fetch`, a session may free only its own)."""
        self.store.check_owner(buffer_id, owner)
        return self.store.decref(buffer_id)

    @endpoint
    def free_owner(self, owner: str) -> int:
        """Free everything ``owner`` holds here, and forget its quota and usage."""
        self.store.ledger.forget(owner)
        return self.store.free_owner(owner)

    @endpoint
    def set_quota(self, owner: str, max_bytes: int | None) -> None:
        """At most ``max_bytes`` in this store for ``owner`` (None: no limit)."""
        self.store.ledger.set_quota(owner, max_bytes)

    @endpoint
    def owner_usage(self) -> dict[str, dict[str, float]]:
        """Per owner: bytes and buffers held here, device seconds used here."""
        return self.store.ledger.usage()

    @endpoint
    def store_usage(self) -> dict[str, int]:
        """The store's buffers and bytes, and how large arrays moved.

        ``shm_buffers``/``shm_bytes``: buffers held in shared memory;
        ``shm_in``, ``stream_in``, ``chunks_in``: large arrays this process
        received by mapping, by bulk stream, by capnp chunks; ``lane_in``,
        ``lane_out``: small pushes it took and sent by lane; ``stream_out``:
        arrays it sent by bulk stream; ``tickets_refused``; ``maps_reused``,
        ``recycled``: shared-memory reuse (``transports.shm``); ``pid``. Those
        counters are the process's: hosts that share a process show the same.
        """
        shm_buffers, shm_bytes = self.store.shared_usage()
        moved = {key: bulk.counts[key] for key in _DATA_PLANE}
        moved.update({key: shm.counts[key] for key in _SHM_REUSE})
        moved.update({"lane_in": lane.stats["delivered"], "lane_out": lane.stats["sent"]})
        return {
            "buffers": len(self.store),
            "bytes": self.store.used_bytes,
            "capacity": self.store.capacity_bytes or 0,  # 0: unbounded
            "arrivals": self.store.pending_arrivals(),
            "pushes_in": self.pushes_in,
            "pushes_declined": self.pushes_declined,
            "shm_buffers": shm_buffers,
            "shm_bytes": shm_bytes,
            **moved,
            "pid": os.getpid(),
        }


_DATA_PLANE = ("shm_in", "stream_in", "chunks_in", "stream_out", "tickets_refused")
_SHM_REUSE = ("maps_reused", "recycled")  # see atoll.transports.shm
