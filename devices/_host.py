"""The host actor: one machine's object store, its devices, and pushes landing.

A :class:`Host` owns its host's :class:`~atoll.devices.ObjectStore` and
spawns its device actors as children. Readers elsewhere fetch buffers from
it; producers elsewhere push outputs to it (``receive``, or a lane for small
values), and it delivers them to the inbox keys its devices wait on. Its
endpoints never block, so a device waiting for data cannot deadlock with a
device whose data it needs; what cannot be answered yet is answered with a
promise.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from ..kernel import (
    Actor,
    ActorRef,
    ActorStopped,
    AtollError,
    Directive,
    Promise,
    UsageError,
    config,
    endpoint,
    log_failure,
    process_counters,
    then,
    value_of,
)
from ..transports.dataplane import bulk, lane, shm
from ..transports.dataplane.lane import LaneMessage
from . import _checkpoint as checkpoint
from . import _lease as leases
from . import _runlane as runlane
from . import timeline
from ._colocated import ColocatedCall, run_on_host
from ._device import live_stats
from ._host_api import HostEndpoints
from ._plan import portable
from ._plane import DataPlane, process_plane
from ._store import BufferMissing, ObjectStore, StoredBuffer
from ._values import Arrival, BufferHandle, CostModel, DeviceStats

if TYPE_CHECKING:
    from ._device import Device

__all__ = ["Host"]

_log = logging.getLogger(__name__)


class Host(HostEndpoints):
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
        plane: DataPlane | None = None,
        *,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        if settings is not None:  # its controller's: this process runs the path as it does
            config.use(config.settings().with_cluster(settings))
        self.plane = plane if plane is not None else process_plane()
        self.host_id = host_id
        self.island = island
        self.device_ids = list(device_ids)
        self.device_cls = device_cls
        self.cost = cost
        # in a host process (one that serves at an address), large buffers
        # live in shared memory, for the other processes of this machine
        shared = bool(self.plane.address)
        # a host process's buffer ids carry a token of its own: one that takes
        # the place of a lost host (same host id) never reuses an id of the
        # old one, which may have moved elsewhere (runtime/control/elastic.py)
        name = f"host{host_id}.{secrets.token_hex(3)}" if shared else f"host{host_id}"
        self.store = ObjectStore(name, store_bytes, shared=shared)
        self.device_refs: list[ActorRef[Device]] = []
        self.pushes_in = 0  # pushes that landed here
        self.pushes_declined = 0
        self.lane_address = ""  # where other host processes push small values
        self.run_lane_address = ""  # where islands send runs (devices/_runlane.py)
        self.moving: dict[str, int] = {}  # being copied away: frees that wait
        # users' actors here (Cluster.spawn), by session: stopped when it ends
        self.user_actors: dict[str, list[ActorRef[Any]]] = {}
        self._on_failure: dict[ActorRef[Any], Directive] = {}  # a user actor's supervision
        self._restarts_left: dict[ActorRef[Any], int] = {}  # before a failure stops it
        self._user_names = itertools.count()

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
                plane=self.plane,
                name=f"device{device_id}",
            )
            for device_id in self.device_ids
        ]
        await self._serve_run_lane()

    async def on_stop(self) -> None:
        if self.lane_address:
            lane.register(self.host_id, None)
        if self.run_lane_address:
            runlane.unregister(self.host_id, self.device_ids)

    async def _serve_run_lane(self) -> None:
        """In a host process, take islands' runs by lane (``devices/_runlane.py``)."""
        if not self.plane.address:
            return
        where = self.plane.address.split("://", 1)[-1].rpartition(":")[0]
        try:
            self.run_lane_address = await runlane.serve_runs(where, self.plane.token())
        except OSError as exc:  # an optimization: runs come by call instead
            _log.warning("host %s takes no runs by lane: %s", self.host_id, exc)
            return
        runlane.register(
            self.host_id, self.ctx.ref, dict(zip(self.device_ids, self.device_refs, strict=True))
        )

    @endpoint
    def run_lane(self) -> str:
        """Where islands send this host's devices their runs ("" : by call only)."""
        return self.run_lane_address

    @endpoint(resolve_args=False)
    def stash(self, ticket: str, args: tuple[Any, ...]) -> None:
        """The arguments of a run lane's call that needed Cap'n Proto (a
        reference, a promise...), sent with ``ticket``; the call waits for
        them on its lane (``devices/_runlane.py``)."""
        runlane.stash(ticket, tuple(args))

    @endpoint
    def grant_lease(
        self,
        lease_id: int,
        device: int,
        owner: str,
        plan_ids: list[int],
        report_to: ActorRef[Any] | None = None,
        weight: float = 1.0,
        costs: dict[int, float] | None = None,
    ) -> None:
        """Let session ``owner``'s client send runs of these installed plans
        on ``device`` straight here, under lease ``lease_id`` (or add the
        plans to it); ``report_to`` (the controller) hears their counts;
        ``weight`` and each plan's ``costs`` order its runs on a device that
        leases share (``devices/_lease.py``)."""
        if device not in self.device_ids:
            raise AtollError(f"device {device} is not on host {self.host_id}")
        leases.grant(lease_id, device, owner, plan_ids, report_to, weight, costs)

    @endpoint
    def revoke_lease(self, lease_id: int) -> Promise[tuple[int, int]]:
        """End a lease: later runs under it are refused (their client sends
        them through the controller). Answered once the runs it let through
        ended, with those not counted yet (runs, failed)."""
        return leases.revoke(lease_id)

    async def _serve_lane(self) -> None:
        """In a host process, take small pushes by lane (``transports.dataplane.lane``)."""
        if not self.plane.address:
            return
        try:
            self.lane_address = await self.plane.serve_lanes()
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
    def fetch(self, buffer_id: str, owner: str = "") -> np.ndarray | Promise[np.ndarray]:
        """The bytes of a buffer held here (read-only). A session passes its
        ``owner`` label and gets ``NotYours`` for another session's buffer.
        A buffer an accelerator is still computing is answered once it
        exists (or with the error its computation failed with); the host
        meanwhile answers other calls."""
        moved = self._moved(buffer_id)
        if moved is not None:
            promise: Promise[np.ndarray] = moved.fetch(buffer_id, owner)
            return promise
        self.store.check_owner(buffer_id, owner)
        array = self.store.get(buffer_id)  # held from now: a free meanwhile cannot lose it
        pending = self.store.pending(buffer_id)
        if pending is None:
            return np.asarray(array)
        return then(pending, lambda _: np.asarray(array))

    @endpoint
    async def save_arrays(self, directory: str, buffers: dict[str, str], owner: str = "") -> None:
        """Write the buffers held here (``name -> buffer id``, all ``owner``'s)
        into the checkpoint directory ``directory`` (orbax), from this host:
        their bytes go to disk without leaving this process. Asynchronous:
        waits for buffers still being computed, and writes on a thread."""
        arrays = {name: await value_of(self.fetch(bid, owner)) for name, bid in buffers.items()}
        await anyio.to_thread.run_sync(checkpoint.save, directory, arrays)

    @endpoint
    def ready(self, buffer_id: str, owner: str = "") -> Promise[None] | None:
        """Answered once a buffer held here exists: at once, unless an
        accelerator is still computing it (then with its error, if it fails)."""
        moved = self._moved(buffer_id)
        if moved is not None:
            return moved.ready(buffer_id, owner)
        self.store.check_owner(buffer_id, owner)
        return self.store.pending(buffer_id)

    @endpoint
    def timeline(self, record: bool) -> list[dict[str, Any]]:
        """Switch this process's timeline recorder on or off; what it held
        (``devices/timeline.py``; hosts sharing a process share one)."""
        return timeline.RECORDER.switch(record)

    @endpoint
    def process_counters(self) -> dict[str, float]:
        """This host's process: its pid, CPU seconds and message counters
        (``atoll bench controlplane``; hosts sharing a process share them)."""
        return process_counters()

    @endpoint
    def address(self) -> str:
        """The capnp address of this host's process ('' in-process)."""
        return self.plane.address

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
        handle = BufferHandle.of(
            buffer_id, array, self.ctx.ref, self.host_id, -1, self.island, self.plane.address
        )
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
    def free(self, buffer_id: str, owner: str = "") -> bool | Promise[bool]:
        """Drop one reference; True if the buffer was freed (``owner``: as in
        :meth:`fetch`, a session may free only its own)."""
        if buffer_id in self.moving:  # being copied: the copy takes the free
            self.store.check_owner(buffer_id, owner)
            self.moving[buffer_id] += 1
            return False
        moved = self.store.moved_out.get(buffer_id) if self.store.moved_out else None
        if moved is not None:
            forwarded: Promise[bool] = moved.free(buffer_id, owner)
            return forwarded
        self.store.check_owner(buffer_id, owner)
        return self.store.decref(buffer_id)

    @endpoint(share_args=False, inline=True)
    def free_many(self, buffer_ids: list[str], owner: str = "") -> int:
        """Drop one reference to each buffer (a client's references to them
        went); how many were freed. One that is gone already is skipped: its
        session ended, or it was freed by hand meanwhile. One that moved to
        another host is freed there."""
        freed = 0
        for buffer_id in buffer_ids:
            if buffer_id in self.moving or buffer_id in self.store.moved_out:
                with suppress(BufferMissing):
                    freed += self.free(buffer_id, owner) is True  # sent on, or kept for later
                continue
            with suppress(BufferMissing):
                self.store.check_owner(buffer_id, owner)
                freed += self.store.decref(buffer_id)
        return freed

    # -- elastic slices (runtime/control/elastic.py) ----------------------------------
    @endpoint
    def buffers(
        self, places: list[int | str] | None = None, copy: bool = False
    ) -> list[StoredBuffer]:
        """The buffers held here that belong to ``places`` (devices, or a
        suspended slice's labels; None: all), as a move needs them. With
        ``copy``, they are about to be copied elsewhere: frees of them wait
        for :meth:`hand_over` (which sends them on) or :meth:`keep`."""
        stored = self.store.placed_at(None if places is None else set(places))
        if copy:  # (one another change is copying already is its to move)
            stored = [s for s in stored if s.id not in self.moving]
            self.moving.update((s.id, 0) for s in stored)
        return stored

    @endpoint
    async def retag(self, buffer_ids: list[str], place: int | str) -> None:
        """These buffers, held here, belong to ``place`` from now on: another
        device of this host, or host memory (a suspended slice's label).
        Asynchronous: a buffer still being computed is waited for first."""
        for buffer_id in buffer_ids:
            pending = self.store.pending(buffer_id) if buffer_id in self.store else None
            if pending is not None:
                with suppress(Exception):  # a failed one moves as it is
                    await pending
            if buffer_id in self.store:
                self.store.retag(buffer_id, place, self.placed(buffer_id, place))

    def placed(self, buffer_id: str, place: int | str) -> Any:
        """Buffer ``buffer_id``'s array as ``place`` holds it (None: as it is)."""
        return None

    @endpoint
    def hand_over(self, buffer_ids: list[str], to: ActorRef[Host]) -> None:
        """These buffers were copied to host ``to``, which holds them from
        now on: frees of them go there (the ones that waited too); reads
        still find the old copies until :meth:`drop_moved`."""
        for buffer_id in buffer_ids:
            waited = self.moving.pop(buffer_id, 0)
            self.store.moved_out.pop(buffer_id, None)
            self.store.moved_out[buffer_id] = to
            if waited:
                to.free_many([buffer_id] * waited, "").add_done_callback(_log_unfreed)
        while len(self.store.moved_out) > MOVED_KEPT:
            del self.store.moved_out[next(iter(self.store.moved_out))]

    @endpoint
    def keep(self, buffer_ids: list[str]) -> None:
        """A copy failed: these buffers stay here; the frees that waited apply."""
        for buffer_id in buffer_ids:
            for _ in range(self.moving.pop(buffer_id, 0)):
                with suppress(BufferMissing):
                    self.store.decref(buffer_id)

    @endpoint
    def drop_moved(self, buffer_ids: list[str]) -> int:
        """Drop the old copies of buffers handed over (no run reads them
        here any more); how many were still here."""
        dropped = 0
        for buffer_id in buffer_ids:
            if buffer_id in self.store and buffer_id in self.store.moved_out:
                self.store.remove(buffer_id)
                dropped += 1
        return dropped

    @endpoint
    def leave(self) -> bool:
        """This host was drained: a host process leaves the cluster (shortly,
        once this answer is out); True if it will. One in the controller's
        process, or in a JAX runtime (whose process count is fixed), stays,
        holding nothing."""
        if not _LEAVING or _jax_runtime_configured():
            return False
        loop = asyncio.get_running_loop()
        for callback in _LEAVING:
            loop.call_later(_LEAVE_AFTER_S, callback)
        return True

    def _moved(self, buffer_id: str) -> ActorRef[Host] | None:
        """The host buffer ``buffer_id`` moved to, if it is no longer here."""
        if not self.store.moved_out or buffer_id in self.store:
            return None
        return self.store.moved_out.get(buffer_id)

    @endpoint
    def free_owner(self, owner: str) -> int:
        """Free everything ``owner`` holds here, forget its quota and usage,
        and stop its actors (a session that ended)."""
        self.store.ledger.forget(owner)
        for actor in self.user_actors.pop(owner, []):
            self._on_failure.pop(actor, None)
            self._restarts_left.pop(actor, None)
            self.ctx.start_soon(_stop_quietly, actor)
        return self.store.free_owner(owner)

    @endpoint
    def spawn_user(
        self,
        cls: type[Actor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        owner: str,
        on_failure: str = "restart",
    ) -> ActorRef[Any]:
        """Start an actor of the user's class ``cls`` in this host's process,
        beside its devices, for session ``owner`` (``Cluster.spawn``); its
        reference, which only the caller holds. When it fails (its
        ``on_start`` raises, or an endpoint of a class with ``fail_on_error``),
        it is restarted or stopped, as ``on_failure`` says; the host goes on."""
        if not (isinstance(cls, type) and issubclass(cls, Actor)):
            raise UsageError(f"spawn takes an Actor class, not {cls!r}")
        directive = {"restart": Directive.RESTART, "stop": Directive.STOP}.get(on_failure)
        if directive is None:
            raise UsageError(
                f"on_failure must be 'restart' or 'stop', not {on_failure!r}: an actor of a "
                "session never fails its host"
            )
        name = f"user{next(self._user_names)}.{cls.__name__}"
        actor: ActorRef[Any] = self.ctx.spawn(cls, *args, name=name, **kwargs)
        self.user_actors.setdefault(owner, []).append(actor)
        self._on_failure[actor] = directive
        self._restarts_left[actor] = cls.max_restarts
        return actor

    def on_child_failed(self, child: ActorRef[Any], error: BaseException) -> Directive:
        """A user's actor: as its session asked, and stopped once it used up
        its class's ``max_restarts`` (the kernel would escalate then: a
        session's actor never fails its host); a device: escalate."""
        directive = self._on_failure.get(child)
        if directive is None:
            return super().on_child_failed(child, error)
        if directive is Directive.RESTART:
            left = self._restarts_left[child] = self._restarts_left.get(child, 0) - 1
            if left < 0:
                directive = Directive.STOP
        if directive is Directive.STOP:
            self._forget_user(child)
        _log.warning("%s failed (%s): %s", child.name, error, directive.value)
        return directive

    def _forget_user(self, actor: ActorRef[Any]) -> None:
        self._on_failure.pop(actor, None)
        self._restarts_left.pop(actor, None)
        for actors in self.user_actors.values():
            if actor in actors:
                actors.remove(actor)

    @endpoint(resolve_args=False)
    def run_colocated(
        self, call: ColocatedCall, args: list[Any], owner: str
    ) -> Promise[list[list[tuple[int, BufferHandle]]]]:
        """This host's part of a colocated function over a slice
        (``devices/_colocated.py``): per output, the handles of its shards on
        this host's devices, by their place in the slice. Answered once
        they are stored; this host answers other calls meanwhile (the inputs
        are awaited, and the function runs, beside its message loop)."""
        answer: Promise[list[list[tuple[int, BufferHandle]]]] = Promise(call.name)
        self.ctx.start_soon(self._colocated, call, args, owner, answer)
        return answer

    async def _colocated(
        self,
        call: ColocatedCall,
        args: list[Any],
        owner: str,
        answer: Promise[list[list[tuple[int, BufferHandle]]]],
    ) -> None:
        try:
            values = [await value_of(arg) for arg in args]
            answer.set_result(await run_on_host(self, call, values, owner))
        except Exception as exc:
            answer.set_exception(portable(exc, f"{call.name} on host {self.host_id}"))
        except BaseException:  # cancelled: the host stops
            answer.set_exception(ActorStopped(f"{call.name}: host {self.host_id} stopped"))
            raise

    async def bytes_of(self, handle: BufferHandle, owner: str) -> np.ndarray:
        """A buffer's bytes, once it exists: from this store, or from its holder."""
        if handle.host_id == self.host_id:
            return np.asarray(await value_of(self.fetch(handle.id, owner)))
        if handle.value is not None:
            return handle.value
        holder = await self.plane.host_ref(
            handle.host_id, handle.address, handle.host, self.ctx.system
        )
        array: np.ndarray = await holder.fetch(handle.id, owner)
        return array

    async def store_shard(self, array: np.ndarray, owner: str, device: int) -> BufferHandle:
        """Keep ``array`` as a buffer of ``device`` here, for ``owner`` (once
        there is room; a session over its quota fails at once)."""
        self.store.ledger.check(owner, array.nbytes)
        await self.store.reserve(array.nbytes)
        try:  # the session may have ended while this waited
            self.store.ledger.check_open(owner)
        except BaseException:
            self.store.unreserve(array.nbytes)
            raise
        buffer_id = self.store.put(array, owner, reserved=True, place=device)
        # no value inside, however small: a shard is read where it is, and a
        # handle goes with every run that reads it, to each of its devices
        where = (self.ctx.ref, self.host_id, device, tuple(array.shape), str(array.dtype))
        return BufferHandle(buffer_id, *where, array.nbytes, self.island, self.plane.address)

    def drop_shard(self, handle: BufferHandle) -> None:
        """Free a shard :meth:`store_shard` kept, whose call failed after."""
        with suppress(BufferMissing):
            self.store.decref(handle.id)

    @endpoint
    def set_quota(self, owner: str, max_bytes: int | None) -> None:
        """At most ``max_bytes`` in this store for ``owner`` (None: no limit)."""
        self.store.ledger.set_quota(owner, max_bytes)

    @endpoint
    def device_stats(self) -> list[DeviceStats]:
        """This host's devices' stats, read at once (``Device.stats`` waits
        behind the runs in a device's mailbox; a monitor must not)."""
        return live_stats(self.store, self.device_ids)

    @endpoint
    def owner_usage(self) -> dict[str, dict[str, float]]:
        """Per owner: bytes and buffers held here, device seconds used here."""
        return self.store.ledger.usage()

    @endpoint
    def settings_in_force(self) -> dict[str, Any]:
        """This host process's cluster-scoped settings (its controller's
        since it joined; ``atoll.kernel.config``)."""
        return config.settings().cluster()

    @endpoint
    def store_usage(self, reset_peak: bool = False) -> dict[str, int]:
        """The store's buffers and bytes, and how large arrays moved.

        ``peak_bytes``: the most bytes held at once since the store began, or
        since the last call with ``reset_peak`` (which starts a new window).
        ``waiting_for_room``: puts and computations waiting for room now.

        ``shm_buffers``/``shm_bytes``: buffers held in shared memory;
        ``shm_in``, ``stream_in``, ``chunks_in``: large arrays this process
        received by mapping, by bulk stream, by capnp chunks; ``lane_in``,
        ``lane_out``: small pushes it took and sent by lane; ``stream_out``:
        arrays it sent by bulk stream; ``tickets_refused``; the same with
        ``_bytes`` (and ``inline_in_bytes``, ``inline_out_bytes``: arrays
        carried inside Cap'n Proto messages) count bytes; ``maps_reused``,
        ``recycled``: shared-memory reuse (``transports.dataplane.shm``);
        ``taken_over``: segments of buffers that moved here, taken over
        from the host they left (no copy); ``pid``. Those
        counters are the process's: hosts that share a process show the same.
        """
        shm_buffers, shm_bytes = self.store.shared_usage()
        moved = {key: bulk.counts[key] for key in _DATA_PLANE}
        moved.update({key: shm.counts[key] for key in _SHM_REUSE})
        moved.update({"lane_in": lane.stats["delivered"], "lane_out": lane.stats["sent"]})
        moved.update(
            {
                "lane_in_bytes": lane.stats["delivered_bytes"],
                "lane_out_bytes": lane.stats["sent_bytes"],
            }
        )
        return {
            "buffers": len(self.store),
            "bytes": self.store.used_bytes,
            "peak_bytes": self.store.reset_peak() if reset_peak else self.store.peak_bytes,
            "capacity": self.store.capacity_bytes or 0,  # 0: unbounded
            "waiting_for_room": self.store.waiting(),
            "arrivals": self.store.pending_arrivals(),
            "pushes_in": self.pushes_in,
            "pushes_declined": self.pushes_declined,
            "shm_buffers": shm_buffers,
            "shm_bytes": shm_bytes,
            **moved,
            "pid": os.getpid(),
        }


def on_leave(callback: Callable[[], None]) -> None:
    """Call ``callback`` (on the loop) when a host of this process is told
    to leave the cluster: ``atoll host`` stops then."""
    _LEAVING.append(callback)


def _jax_runtime_configured() -> bool:
    """Whether this process joined a multi-process JAX runtime."""
    import sys

    if "jax" not in sys.modules:
        return False
    import jax

    return bool(jax.distributed.is_initialized())


_LEAVING: list[Callable[[], None]] = []
_LEAVE_AFTER_S = 0.2  # time for the answer to leave before the process does
MOVED_KEPT = 1 << 20  # buffers that moved away whose readers are sent on
_log_unfreed = log_failure(_log, "a free sent on to where a buffer moved", logging.DEBUG)
_DATA_PLANE = (
    *("shm_in", "stream_in", "chunks_in", "stream_out", "tickets_refused"),
    *("shm_in_bytes", "stream_in_bytes", "chunks_in_bytes", "stream_out_bytes"),
    *("inline_in_bytes", "inline_out_bytes"),
)
_SHM_REUSE = ("maps_reused", "recycled", "taken_over")  # see atoll.transports.dataplane.shm


async def _stop_quietly(actor: ActorRef[Any]) -> None:
    """Stop a session's actor; one that is gone already is left alone."""
    with contextlib.suppress(AtollError):
        await actor.stop()
