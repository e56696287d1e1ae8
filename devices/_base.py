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
    Promise,
    all_settled,
    as_promise,
    endpoint,
    failed,
    first_settled,
    forward,
    then,
    value_of,
)
from ..transports import bulk, shm
from ..transports.inproc import read_only
from ._errors import DeviceError, UnsupportedKernel
from ._gang import GangTask, PushTarget
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


_RECENT_GANGS = 64  # finished gangs whose outputs a late push_output can still find
INLINE_VALUE_BYTES = 1 << 14  # outputs up to this size ride along in their handle


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
            outputs = await self.run_shard(task, handles, owner)
        finally:
            for buffer_id in taken:
                with suppress(BufferMissing):  # its owner's session may have ended
                    self.store.decref(buffer_id)
        self.computations += 1
        if leader:
            self._remember(task.gang_id, outputs)
        if leader and task.push:
            return await self._push(task.push, outputs, owner)
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
        self, targets: Sequence[PushTarget], outputs: list[BufferHandle], owner: str
    ) -> Promise[list[BufferHandle]]:
        """Send outputs to the hosts that read them; the promise of ``outputs``
        settles when every push was answered (landed, declined or failed)."""
        answers: list[Promise[Any]] = []
        unreachable: list[str] = []
        for target in targets:
            handle = outputs[target.output]
            if target.host_id == self.host_id:
                for key in target.keys:
                    self.store.incref(handle.id)
                    self.store.deliver(key, Arrival(handle, 0.0), handle.id)
                continue
            try:
                host = await self._host_ref(target.host_id, target.address, target.host)
            except Exception as exc:  # its reader waits on its inbox: fail, and say why
                unreachable.append(f"cannot reach host {target.host_id} to push: {exc}")
                continue
            array = np.asarray(self.store.get(handle.id))
            answer = host.receive(list(target.keys), array, owner, self.island)
            answers.append(_redirect_unless_landed(answer, host, target.keys, handle))
        return then(all_settled(answers), lambda _: self._pushed(answers, unreachable, outputs))

    def _pushed(
        self, answers: list[Promise[Any]], unreachable: list[str], outputs: list[BufferHandle]
    ) -> list[BufferHandle]:
        """The outputs, once every push landed or was redirected. A reader left
        with neither fails the producer (the controller then fails the reader's
        inbox); the outputs are dropped only now, after every redirect that
        points at them was answered."""
        problems = unreachable + [str(a.exception()) for a in answers if a.exception()]
        if problems:
            self._drop(outputs)
            raise DeviceError("; ".join(problems))
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
        arrays = [await self._read(handle) for handle in inputs]
        return await self._stored(np.asarray(await self.execute(computation, arrays)), owner)

    async def _stored(self, array: Any, owner: str) -> BufferHandle:
        """Store ``array`` once there is room (back-pressure); its handle."""
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

    async def _read(self, handle: BufferHandle) -> Any:
        """The input's array: from this host's store, carried in its handle
        (small values), or fetched from its holder. A small array passed by
        value in the call (``cluster.run(c, d, [array])``) is used as it is."""
        if isinstance(handle, np.ndarray):
            return handle
        if handle.host_id == self.host_id:
            return self.store.get(handle.id)
        if handle.value is not None:
            await self._charge_transfer(
                self.cost.transfer_time(handle.nbytes, handle.island != self.island)
            )
            return handle.value
        holder = await self._host_ref(handle.host_id, handle.address, handle.host)
        array: np.ndarray = await holder.fetch(handle.id)
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
        if known is None:
            raise AtollError(f"host {host_id} at {address!r} cannot be reached directly")
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

    async def on_start(self) -> None:
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

    @endpoint
    def devices(self) -> list[ActorRef[Device]]:
        return list(self.device_refs)

    @endpoint
    def fetch(self, buffer_id: str) -> np.ndarray:
        """The bytes of a buffer held here (read-only)."""
        return np.asarray(self.store.get(buffer_id))

    @endpoint
    def address(self) -> str:
        """The capnp address of this host's process ('' in-process)."""
        return _local_address()

    @endpoint(resolve_args=False)
    def receive(self, keys: list[str], array: Any, owner: str, island: int) -> bool | Promise[bool]:
        """A producer elsewhere pushes an output that devices here will read.

        Never blocks the host: bulk bytes still on their way arrive as a
        promise, and the answer follows it. The bytes are stored once, with
        one reference per inbox key in ``keys``, and delivered to each. If
        they do not fit now, the push is declined (False): the readers then
        fetch the value when they run, under the store's back-pressure.
        """
        if isinstance(array, Promise):
            return then(array, lambda value: self._accept(keys, value, owner, island))
        return self._accept(keys, array, owner, island)

    def _accept(self, keys: list[str], array: Any, owner: str, island: int) -> bool:
        array = np.asarray(array)
        if not keys or not self.store.fits(array.nbytes):
            self.pushes_declined += 1
            return False
        self.pushes_in += 1
        buffer_id = self.store.put(array, owner)
        for _ in keys[1:]:
            self.store.incref(buffer_id)
        handle = BufferHandle.of(buffer_id, array, self.ctx.ref, self.host_id, -1, self.island)
        seconds = self.cost.transfer_time(handle.nbytes, island != self.island)
        for key in keys:
            self.store.deliver(key, Arrival(handle, seconds), buffer_id)
        return True

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
    def free(self, buffer_id: str) -> bool:
        """Drop one reference; True if the buffer was freed."""
        return self.store.decref(buffer_id)

    @endpoint
    def free_owner(self, owner: str) -> int:
        return self.store.free_owner(owner)

    @endpoint
    def store_usage(self) -> dict[str, int]:
        """The store's buffers and bytes, and how large arrays moved.

        ``shm_buffers``/``shm_bytes``: buffers held in shared memory;
        ``shm_in``, ``stream_in``, ``chunks_in``: large arrays this process
        received by mapping, by bulk stream, by capnp chunks; ``stream_out``:
        arrays it sent by bulk stream; ``tickets_refused``; ``maps_reused``,
        ``recycled``: shared-memory reuse (``transports.shm``); ``pid``. Those
        counters are the process's: hosts that share a process show the same.
        """
        shm_buffers, shm_bytes = self.store.shared_usage()
        moved = {key: bulk.counts[key] for key in _DATA_PLANE}
        moved.update({key: shm.counts[key] for key in _SHM_REUSE})
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
