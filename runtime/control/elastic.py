"""Elastic slices: move, suspend and resume a slice; drain a host; re-place onto spares.

A client holds virtual slices and buffer handles, never physical devices,
so the controller may change what stands behind them. The controller owns
one :class:`Elastic`, which does that in four steps for every change:

1. **Gate.** The slice gets a gate: runs submitted for it from now on are
   held, in order, at the controller (``hold``), and other slices' work
   goes on. A suspended slice keeps its gate until it is resumed.
2. **Quiet.** It waits for the runs already dispatched on the slice to
   settle (their gangs took their inputs and made their outputs).
3. **Relocate.** Each device's buffers go to the device in the same mesh
   position (``relocate``): a buffer that stays on its host is only
   retagged (a JAX host puts it on the new device, or in host memory for a
   suspended slice); one that changes host is copied over the data plane by
   the new device (``Device.adopt``), keeping its id, owner and references.
   The controller notes where each one went (``located``): the handles of
   later runs' inputs are made fresh, and a client whose handle names a
   host that left asks it (``locate``). The old copy is handed over
   (``Host.hand_over``): frees of it go to the new host from then on (and
   the ones made while it was copied, which waited), and it is dropped once
   every run dispatched before is over; reads of it are then sent on.
4. **Open.** The slice's allocation changes, its plans are dropped (the
   next run compiles for the new devices), and the held runs go, in the
   order they came.

A host is drained by moving every slice off it (onto free devices, else
spares), then every other buffer it holds; it then leaves. A lost host's
slices are re-placed the same way, without their buffers, which were lost
with it: reading one raises ``HostLost``.

What is asynchronous: every operation here awaits hosts and devices; the
controller keeps answering meanwhile, and holds only the gated slices' runs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ...devices import BufferHandle
from ...devices._shards import ShardedHandle
from ...devices._store import StoredBuffer
from ...kernel import AtollError, Promise, all_settled, forward, log_failure, then
from .tenancy import check_slice

if TYPE_CHECKING:
    from ...devices import Device, Host
    from ...kernel import ActorRef
    from ..topology import Topology
    from .planner import PlanCache
    from .resources import ResourceManager


class ControlView(Protocol):
    """What :class:`Elastic` reads of its controller, and all it reads: the
    slices and hosts it re-places (``resources``), the cluster's shape, the
    plan cache it invalidates, and the hosts and devices it moves buffers
    between (their references and addresses). The
    controller is one; the controller, in turn, only calls Elastic's methods."""

    @property
    def resources(self) -> ResourceManager: ...

    @property
    def cluster_topology(self) -> Topology: ...

    @property
    def plans(self) -> PlanCache: ...

    @property
    def host_refs(self) -> Sequence[ActorRef[Host]]: ...

    @property
    def device_refs(self) -> Sequence[ActorRef[Device]]: ...

    @property
    def host_addresses(self) -> Sequence[str]: ...


__all__ = ["Elastic", "SliceSuspended"]

_log = logging.getLogger(__name__)
LOCATED_KEPT = 1 << 20  # moved buffers whose new place the controller remembers
_log_hand_over = log_failure(_log, "a hand-over of moved buffers")


class SliceSuspended(AtollError):
    """The slice is suspended: resume it first."""


@dataclass
class _Gate:
    """Runs held for a slice while it moves or is suspended."""

    reason: str  # "moving", "suspended"
    held: deque[Callable[[], None]] = field(default_factory=deque)


@dataclass(frozen=True)
class _Copy:
    """Buffers to take from ``place`` on host ``src`` to ``to_place`` on
    ``dst`` (by its device ``device``)."""

    src: int
    place: int | str
    dst: int
    device: int
    to_place: int | str


class Elastic:
    """The controller's elastic slices (see the module docstring)."""

    def __init__(self, controller: ControlView) -> None:
        self.c = controller
        self.gates: dict[int, _Gate] = {}
        self.located: dict[str, BufferHandle] = {}  # buffer id -> where it is now
        self.running: dict[int, set[Promise[Any]]] = {}  # slice id -> runs under way
        self.parked: dict[int, dict[int, int]] = {}  # suspended slice -> position -> host
        self.busy: dict[int, Promise[None]] = {}  # slice id -> the change under way
        self.draining: set[int] = set()
        self.drained: set[int] = set()
        self.lost: set[int] = set()
        self.log: deque[dict[str, Any]] = deque(maxlen=256)  # what changed, newest last

    def change_under_way(self, slice_id: int) -> Promise[None] | None:
        """The move, suspend or resume of ``slice_id`` under way, if any."""
        return self.busy.get(slice_id)

    def host_back(self, host_id: int) -> None:
        """Host ``host_id`` took its place again (a new process joined)."""
        self.lost.discard(host_id)

    # -- the dispatch path ---------------------------------------------------
    def hold(self, slices: Iterable[int], call: Callable[[], Promise[Any]]) -> Promise[Any] | None:
        """If one of ``slices`` is gated, the promise of ``call()``, made when
        the gate opens (runs go in the order they came); else None."""
        gate = next((self.gates[s] for s in slices if s in self.gates), None)
        if gate is None:
            return None
        answer: Promise[Any] = Promise("held run")
        gate.held.append(functools.partial(_release_held, call, answer))
        return answer

    def track(self, slices: Iterable[int], run: Promise[Any]) -> None:
        """``run`` (its answer, settled once it is over) runs on ``slices``."""
        for slice_id in slices:
            runs = self.running.setdefault(slice_id, set())
            runs.add(run)
            run.add_done_callback(runs.discard)

    def fresh(self, inputs: Sequence[Any]) -> list[Any]:
        """``inputs`` with every handle of a buffer that moved made to name
        where it is now (a promise's, once it settles)."""
        return [self._fresh_one(x) for x in inputs]

    def _fresh_one(self, value: Any) -> Any:
        if isinstance(value, BufferHandle):  # (a small value rides in its handle: as it is)
            return value if value.value is not None else self.located.get(value.id, value)
        if isinstance(value, ShardedHandle):  # its shards moved with their slice
            parts = tuple(self._fresh_one(part) for part in value.parts)
            if parts == value.parts:
                return value
            devices = tuple(part.device_id for part in parts)
            return dataclasses.replace(
                value, parts=parts, layout=dataclasses.replace(value.layout, devices=devices)
            )
        if isinstance(value, Promise):
            if value.done() and value.exception() is None:
                return self._fresh_one(value.result())
            return then(value, self._fresh_one) if not value.done() else value
        return value

    def locate(self, buffer_ids: Sequence[str]) -> dict[str, BufferHandle]:
        """Where the buffers that moved are now (those that did not: absent)."""
        return {b: self.located[b] for b in buffer_ids if b in self.located}

    def forget(self, slice_id: int) -> None:
        """The slice was released: its held runs go (and fail: no such slice)."""
        self.parked.pop(slice_id, None)
        self.running.pop(slice_id, None)
        self._open(slice_id)

    # -- operations ------------------------------------------------------------
    async def move(
        self,
        slice_id: int,
        devices: Sequence[int] | None = None,
        host: int | None = None,
        owner: str = "",
        avoid: Sequence[int] = (),
        spares: bool = False,
    ) -> dict[str, Any]:
        """Move a slice to ``devices``, or free devices on ``host``, or any
        free devices off the hosts in ``avoid`` (spares too, with ``spares``:
        a slice that must leave a host). See the module docstring."""
        async with self._turn(slice_id, owner) as alloc:
            if slice_id in self.parked:
                raise SliceSuspended(f"slice {slice_id} is suspended: resume it to move it")
            resources = self.c.resources
            if devices is None:
                devices = resources.targets(slice_id, host=host, avoid=avoid, spares=spares)
            if set(devices) & set(alloc.devices):
                raise AtollError(
                    f"slice {slice_id} holds devices {sorted(set(devices) & set(alloc.devices))}"
                    " already: move it to devices it does not hold"
                )
            return await self._relocate_slice(slice_id, alloc.devices, list(devices), "move")

    async def suspend(self, slice_id: int, owner: str = "") -> dict[str, Any]:
        """Park a slice's buffers in its hosts' memory and give its devices
        back; its runs are held until :meth:`resume`."""
        async with self._turn(slice_id, owner) as alloc:
            if slice_id in self.parked:
                return {"slice": slice_id, "suspended": True, "buffers": 0, "bytes": 0}
            began = time.perf_counter()
            self.gates[slice_id] = _Gate("suspended")
            await self._quiet(slice_id)
            topology = self.c.cluster_topology
            copies = [
                _Copy(topology.device(d).host, d, topology.device(d).host, d, _label(slice_id, i))
                for i, d in enumerate(alloc.devices)
            ]
            try:
                count, nbytes = await self._copy(copies)
            except BaseException:
                await self._undo(copies)
                self._open(slice_id)
                raise
            self.parked[slice_id] = {i: c.dst for i, c in enumerate(copies)}
            self.c.resources.suspend(slice_id)
            self.c.plans.invalidate_slice(slice_id)
            return self._note("suspend", slice_id, count, nbytes, began)

    async def resume(self, slice_id: int, owner: str = "") -> dict[str, Any]:
        """Give a suspended slice devices again (others, if its own were
        taken) and its buffers back; its held runs go."""
        async with self._turn(slice_id, owner):
            parked = self.parked.get(slice_id)
            if parked is None:
                return {"slice": slice_id, "resumed": False, "buffers": 0, "bytes": 0}
            began = time.perf_counter()
            resources = self.c.resources
            hosts = set(parked.values())
            try:  # where it was parked, if that host has room: nothing to copy
                devices = resources.targets(slice_id, host=hosts.pop()) if len(hosts) == 1 else []
            except AtollError:
                devices = []
            devices = devices or resources.targets(slice_id)  # (not spares)
            resources.reassign(slice_id, devices)
            topology = self.c.cluster_topology
            copies = [
                _Copy(parked[i], _label(slice_id, i), topology.device(d).host, d, d)
                for i, d in enumerate(devices)
            ]
            try:
                count, nbytes = await self._copy(copies)
            except BaseException:
                await self._undo(copies)
                resources.suspend(slice_id)  # still suspended, as it was
                raise
            del self.parked[slice_id]
            self._open(slice_id)
            return self._note("resume", slice_id, count, nbytes, began)

    async def drain(self, host_id: int) -> dict[str, Any]:
        """Move every slice and buffer off host ``host_id``; it then holds
        nothing and takes no new slices. What moved."""
        began = time.perf_counter()
        self.draining.add(host_id)
        moved = [0, 0]  # buffers, bytes
        try:
            doomed = self.c.resources.retire_host(host_id)
            for slice_id in doomed:
                if slice_id in self.parked or slice_id not in self.c.resources:
                    continue  # suspended meanwhile (its buffers follow), or released
                try:
                    report = await self.move(slice_id, avoid=[host_id], spares=True)
                except SliceSuspended:
                    continue  # suspended meanwhile: its parked buffers follow
                moved = [moved[0] + report["buffers"], moved[1] + report["bytes"]]
            for count in (await self._unpark(host_id), await self._leftovers(host_id)):
                moved = [moved[0] + count[0], moved[1] + count[1]]
            runs = [r for runs in self.running.values() for r in runs]
            if runs:  # a run of another slice may still read what was there
                await all_settled(runs)
        except BaseException:
            self.c.resources.restore_host(host_id)  # not drained: it takes slices again
            raise
        finally:
            self.draining.discard(host_id)
        self.drained.add(host_id)
        return self._note("drain", -1, moved[0], moved[1], began, host=host_id)

    async def host_lost(self, host_id: int) -> list[int]:
        """Host ``host_id`` is gone with its buffers: its slices get other
        devices (free, else spare); their buffers elsewhere stay. The slices
        re-placed."""
        if host_id in self.lost or host_id in self.drained or not self.c.resources.spare_hosts:
            return []  # no spares: its slices wait for a host to take its place
        self.lost.add(host_id)
        doomed = self.c.resources.retire_host(host_id)
        placed = []
        for slice_id in doomed:
            if slice_id in self.parked:
                continue  # parked in host memory: what was on that host is lost
            try:
                await self.move(slice_id, avoid=[host_id], spares=True)
                placed.append(slice_id)
            except AtollError as exc:
                _log.warning(
                    "slice %s lost host %s and found no devices: %s", slice_id, host_id, exc
                )
        self.log.append({"op": "lost", "host": host_id, "slices": placed, "at": time.time()})
        return placed

    # -- the steps -------------------------------------------------------------
    def _turn(self, slice_id: int, owner: str) -> _Turn:
        return _Turn(self, slice_id, owner)

    async def _relocate_slice(
        self, slice_id: int, old: Sequence[int], new: Sequence[int], op: str
    ) -> dict[str, Any]:
        began = time.perf_counter()
        resources, topology = self.c.resources, self.c.cluster_topology
        before = resources.get(slice_id)
        resources.reassign(slice_id, new, give_back=False)  # reserved from now on
        self.gates[slice_id] = _Gate("moving")
        try:
            await self._quiet(slice_id)
            copies = [
                _Copy(topology.device(o).host, o, topology.device(n).host, n, n)
                for o, n in zip(old, new, strict=True)
                if topology.device(o).host not in self.lost
            ]
            count, nbytes = await self._copy(copies)
        except BaseException:
            await self._undo(copies)
            resources.undo(before, new)
            self._open(slice_id)
            raise
        resources.give_back([d for d in old if d not in new])
        self.c.plans.invalidate_slice(slice_id)
        self._open(slice_id)
        return self._note(op, slice_id, count, nbytes, began)

    async def _quiet(self, slice_id: int) -> None:
        """Wait for the runs dispatched on the slice so far to be over."""
        runs = list(self.running.get(slice_id, ()))
        if runs:
            await all_settled(runs)

    async def _copy(self, copies: Sequence[_Copy]) -> tuple[int, int]:
        """Carry out ``copies``; how many buffers, and bytes, moved."""
        count = nbytes = 0
        for copy in copies:
            n, b = await self._copy_one(copy)
            count, nbytes = count + n, nbytes + b
        return count, nbytes

    async def _undo(self, copies: Sequence[_Copy]) -> None:
        """A change failed midway: take what went back where it was (as far
        as the hosts involved still answer)."""
        for copy in copies:
            on_device = isinstance(copy.place, int) and copy.place >= 0
            # a parked buffer's copy is done by any device of the host it was on
            device = copy.place if on_device else self.c.cluster_topology.on_host(copy.src)[0]
            back = _Copy(copy.dst, copy.to_place, copy.src, int(device), copy.place)
            try:
                await self._copy_one(back)
            except Exception as exc:  # a host gone: what it held is lost with it
                _log.warning("taking back %s after a failed change: %s", copy, exc)

    async def _copy_one(self, copy: _Copy) -> tuple[int, int]:
        c = self.c
        if copy.src in self.lost:
            return 0, 0  # what it held was lost with it
        src, here = c.host_refs[copy.src], copy.src == copy.dst
        stored: list[StoredBuffer] = await src.buffers([copy.place], not here)
        if not stored:
            return 0, 0
        ids = [s.id for s in stored]
        if here:
            await src.retag(ids, copy.to_place)
        else:
            wanted = [(self._handle(s, copy.src, copy.place), s, copy.to_place) for s in stored]
            try:
                await c.device_refs[copy.device].adopt(wanted)
            except BaseException:
                src.keep(ids).add_done_callback(_log_hand_over)
                raise
            await src.hand_over(ids, c.host_refs[copy.dst])
            self._drop_later(copy.src, ids)
        device = copy.to_place if isinstance(copy.to_place, int) else -1
        for s in stored:
            self.located.pop(s.id, None)  # the newest last: the oldest go first
            self.located[s.id] = self._handle(s, copy.dst, device)
        while len(self.located) > LOCATED_KEPT:
            del self.located[next(iter(self.located))]
        return len(stored), sum(s.nbytes for s in stored)

    def _handle(self, stored: StoredBuffer, host_id: int, place: int | str) -> BufferHandle:
        c = self.c
        device = place if isinstance(place, int) else -1
        return BufferHandle(
            stored.id,
            c.host_refs[host_id],
            host_id,
            device,
            stored.shape,
            stored.dtype,
            stored.nbytes,
            c.cluster_topology.island_of_host(host_id),
            c.host_addresses[host_id],
        )

    def _drop_later(self, src: int, ids: list[str]) -> None:
        """Drop the old copies once every run dispatched so far is over (one
        may still read them where they were)."""
        runs = [r for runs in self.running.values() for r in runs]

        def drop(_: Promise[None]) -> None:
            self.c.host_refs[src].drop_moved(ids).add_done_callback(_log_hand_over)

        all_settled(runs).add_done_callback(drop)

    async def _unpark(self, host_id: int) -> tuple[int, int]:
        """Suspended slices' buffers parked on a draining host go elsewhere."""
        count = nbytes = 0
        for slice_id in list(self.parked):
            async with self._turn(slice_id, ""):
                parked = self.parked.get(slice_id, {})  # resumed meanwhile: none
                for position, host in list(parked.items()):
                    if host != host_id:
                        continue
                    dst, device = self._landing(host_id)
                    label = _label(slice_id, position)
                    n, b = await self._copy_one(_Copy(host, label, dst, device, label))
                    count, nbytes = count + n, nbytes + b
                    parked[position] = dst
        return count, nbytes

    async def _leftovers(self, host_id: int) -> tuple[int, int]:
        """What a draining host still holds once its slices moved (buffers on
        devices no slice holds, pushes that landed): to another host."""
        stored: list[StoredBuffer] = await self.c.host_refs[host_id].buffers(None)
        count = nbytes = 0
        for place in dict.fromkeys(s.place for s in stored):
            dst, device = self._landing(host_id)
            to_place = device if isinstance(place, int) and place >= 0 else place
            n, b = await self._copy_one(_Copy(host_id, place, dst, device, to_place))
            count, nbytes = count + n, nbytes + b
        return count, nbytes

    def _landing(self, leaving: int) -> tuple[int, int]:
        """A host (and one of its devices) to take a leaving host's buffers."""
        topology, resources = self.c.cluster_topology, self.c.resources
        island = topology.island_of_host(leaving)
        gone = set(resources.gone_hosts) | self.lost | self.drained | {leaving}
        for device in topology.devices:
            if device.island == island and device.host not in gone:
                return device.host, device.id
        raise AtollError(f"no host left on island {island} to take host {leaving}'s buffers")

    def _open(self, slice_id: int) -> None:
        """The slice's gate opens: its held runs go, in order."""
        gate = self.gates.pop(slice_id, None)
        while gate is not None and gate.held:
            gate.held.popleft()()

    def _note(
        self, op: str, slice_id: int, count: int, nbytes: int, began: float, **more: Any
    ) -> dict[str, Any]:
        """What a change did, kept for ``atoll status`` too."""
        seconds = time.perf_counter() - began
        note = {"op": op, "slice": slice_id, "buffers": count, "bytes": nbytes, "seconds": seconds}
        note.update(more)
        self.log.append({**note, "at": time.time()})
        return note

    def status(self) -> dict[str, Any]:
        """Spares, suspended slices, drains and the latest changes (``atoll status``)."""
        resources = self.c.resources
        return {
            "spares": resources.spares,
            "suspended": sorted(self.parked),
            "moving": sorted(s for s, g in self.gates.items() if g.reason == "moving"),
            "draining": sorted(self.draining),
            "drained": sorted(self.drained),
            "lost": sorted(self.lost),
            "changes": list(self.log)[-16:],
        }


class _Turn:
    """One change of a slice at a time: waits for the one under way, checks
    that ``owner`` may change it, and marks the slice busy until it ends."""

    def __init__(self, elastic: Elastic, slice_id: int, owner: str) -> None:
        self.elastic, self.slice_id, self.owner = elastic, slice_id, owner
        self.done: Promise[None] = Promise(f"slice {slice_id} changed")

    async def __aenter__(self) -> Any:
        busy = self.elastic.busy
        while self.slice_id in busy:
            await busy[self.slice_id]
        alloc = check_slice(self.elastic.c.resources.get(self.slice_id), self.owner)
        busy[self.slice_id] = self.done
        return alloc

    async def __aexit__(self, *exc: object) -> None:
        del self.elastic.busy[self.slice_id]
        self.done.set_result(None)


def _release_held(call: Callable[[], Promise[Any]], answer: Promise[Any]) -> None:
    """A held run goes now (or fails, if its slice went meanwhile)."""
    try:
        forward(call(), answer)
    except Exception as exc:
        answer.set_exception(exc)


def _label(slice_id: int, position: int) -> str:
    """Where a suspended slice's buffer of mesh position ``position`` is parked."""
    return f"slice{slice_id}/{position}"
