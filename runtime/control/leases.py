"""The controller's leases: which session's client may send a device its runs itself.

A run of one session on one device needs the controller only to admit it
(the session's gang quota), to place and plan it (the same every time for
a call of one shape), and to order it among other sessions' runs (the
island's share policy). While no other session wants the device there is
nothing to order, so the controller hands that device's runs of a call
shape to the session's client for a while: a **lease**, as Ray's scheduler
leases a worker to an owner, which then submits to it directly.

* **Granting** (:meth:`Leases.grant`, the client asks by ``Controller.lease``
  after a few calls of one shape): only over run lanes to a host process,
  with whole-plan compiling on, when the call compiles to one program on
  that one device, when no other session ran on the device in the last
  ``QUIET_S`` and none holds a lease on it, and while no slice is changing
  or has moved (a moved buffer's handle is made fresh by the controller,
  on its path). The plan is installed first (through the island, in its
  order), then the lease is registered at the device's host
  (``devices/_lease.py``), then the client hears of it. A session's lease
  gathers every call shape it asks for on that device.
* **Shared devices.** Under an island policy that allows it
  (``schedulers.leases_shared``: the share policy, the default), several
  sessions may hold leases on one device at once, and the device's host
  orders their runs by stride over their weights, as the policy would on
  that device. Then only another session's gang over several devices (in
  the last ``QUIET_S``), or another session that keeps running there
  through the controller with no lease of its own (for ``GRACE_S`` and
  ``GRACE_RUNS`` runs: one refused a lease, say), keeps a lease from being
  granted, or takes one back: the island must order those runs among what
  the device runs. Its first calls there, before its own lease, run beside
  the leases' runs. Under other policies a device is leased to one session
  at a time.
* **Quota.** A lease holds ``window`` of the session's gang quota (at most
  ``LEASE_WINDOW``, at most half of the room left) for as long as it lives;
  the client keeps at most that many of its runs in flight and sends any
  more through the controller, so the quota holds as before.
* **Taking back** (:meth:`Leases.take_back`): when a run of another session
  comes for the device (on a shared device, only as above; the lease ends,
  and its runs from then on go through the island, in its order); when its
  session's weight changes; before an elastic change (a move, suspend,
  drain, lost host: the change waits for the lease's runs, as for any
  run); when its session ends; when the host is replaced. The host refuses
  later runs under it with ``LeaseEnded``, and its client sends them
  through the controller: nothing runs twice, nothing is lost. Its quota
  comes back once its runs ended.
* **Counting.** The host tells the controller how many runs each lease let
  through, every half second at most (``Controller.leased``), for
  ``/metrics`` and ``atoll top``.

A lease's runs are numbered apart from the controller's (``EPOCH_SHIFT``),
so that their gang ids and the outputs a device keeps for later runs
(``PriorOutput``) never meet the island's. What is asynchronous: granting
waits for the plan's install and the host's answer; taking back answers
once the host did (its runs ended). Everything else is plain bookkeeping
on the controller's loop.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ...kernel import Promise, all_settled, as_promise, log_failure
from ...kernel.config import settings
from .planner import CompiledPlan

if TYPE_CHECKING:
    from ...devices import Host
    from ...kernel import ActorRef
    from .elastic import Elastic
    from .island import IslandScheduler
    from .metrics import RunCounters
    from .tenancy import Tenants

__all__ = [
    "EPOCH_SHIFT",
    "GRACE_RUNS",
    "GRACE_S",
    "LEASE_WINDOW",
    "QUIET_S",
    "LeaseGrant",
    "Leases",
]

LEASE_WINDOW = 64  # runs a lease lets its client have in flight (out of its gang quota)
QUIET_S = 1.0  # a device another session ran on this recently is not leased
GRACE_S = 1.0  # ... a shared device: a gang over several, or runs with no lease for this long
GRACE_RUNS = 64  # ... and this many of them (a session on its way to a lease makes a few)
EPOCH_SHIFT = 40  # a lease's runs are numbered (lease id << EPOCH_SHIFT) + n

_log = logging.getLogger(__name__)
_log_failed = log_failure(_log, "a lease taken back")
_log_gone = log_failure(_log, "a lease taken back from a host given up for lost", logging.DEBUG)
ENDED_KEPT = 4096  # ended sessions remembered (a grant under way for one is refused)


@dataclass(frozen=True)
class LeaseGrant:
    """What a client is told of its lease, for one call shape: send runs of
    plan ``plan_id`` to ``device`` (on host ``host``) down its lane there,
    each with the call's inputs at ``inputs`` (indices, in the order the
    device's program reads them), numbered from ``first_epoch`` on (the
    same numbers for every shape of one lease: the client counts them);
    the run's outputs are the report's ``outputs`` (``(node, index)``);
    at most ``window`` runs in flight."""

    lease_id: int
    device: int
    host: int
    plan_id: int
    inputs: tuple[int, ...]
    outputs: tuple[tuple[int, int], ...]
    window: int
    first_epoch: int


class LeaseView(Protocol):
    """What of the controller :class:`Leases` reads and calls."""

    @property
    def tenants(self) -> Tenants: ...
    @property
    def runs(self) -> RunCounters: ...
    @property
    def elastic(self) -> Elastic: ...
    @property
    def host_refs(self) -> Sequence[ActorRef[Host]]: ...
    @property
    def host_addresses(self) -> Sequence[str]: ...
    @property
    def schedulers(self) -> dict[int, ActorRef[IslandScheduler]]: ...
    @property
    def compile(self) -> bool | None: ...
    @property
    def report_to(self) -> ActorRef[Any]: ...

    def host_of_device(self, device: int) -> int: ...
    def plan_live(self, compiled: CompiledPlan) -> bool: ...


@dataclass(eq=False)
class _Held:
    """A lease the controller granted and has not taken back."""

    lease_id: int
    device: int
    host: int
    owner: str
    window: int  # of its session's gang quota
    plans: set[int]
    taken: bool = False  # taken back (once: its quota is given back once)


class Leases:
    """The controller's leases and what it saw of who runs where (see the
    module docstring)."""

    def __init__(self, controller: LeaseView) -> None:
        self._controller = controller
        self.by_device: dict[int, dict[str, _Held]] = {}  # device -> owner -> its lease
        self.shared_devices: set[int] = set()  # whose island's policy lets leases share them
        self._ids = itertools.count(1)
        self._seen: dict[int, dict[str, float]] = {}  # device -> owner -> its last run there
        self._wide_seen: dict[int, dict[str, float]] = {}  # ... its last gang over several
        # shared device -> owner with no lease there -> [since, last, runs] it ran there
        self._unleased: dict[int, dict[str, list[float]]] = {}
        self.hold_off = 0  # elastic changes under way: none is granted meanwhile
        self._ended_owners: dict[str, None] = {}  # sessions that ended (the newest last)
        self.granted = 0
        self.taken_back = 0

    def seen(self, devices: Collection[int], owner: str) -> Promise[None] | None:
        """A run of ``owner`` goes to ``devices`` (through the controller):
        remembered; a lease another session holds on one of them ends, and
        the promise that it did (its runs ended) is returned; else None."""
        now = time.monotonic()
        wide = len(devices) > 1
        taken: list[Promise[None]] = []
        for device in devices:
            for seen in (self._seen, self._wide_seen) if wide else (self._seen,):
                if device not in seen:
                    seen[device] = {}
                seen[device][owner] = now
            held = self.by_device.get(device) if self.by_device else None
            if not wide and self._beside(device, owner, held, now):
                continue
            for other in list(held.values()) if held else ():
                if other.owner != owner:
                    taken.append(self.take_back(other))
        return all_settled(taken) if taken else None

    def _beside(self, device: int, owner: str, held: dict[str, _Held] | None, now: float) -> bool:
        """Whether ``owner``'s run of ``device`` alone (through the controller)
        runs beside the device's leases: on a shared device, if it holds one
        there, or has not kept running there without one (``GRACE_S``)."""
        if device not in self.shared_devices:
            return False
        return owner in (held or ()) or not self._unleased_long(device, owner, now)

    def _unleased_long(self, device: int, owner: str, now: float) -> bool:
        """``owner`` runs on shared ``device`` through the controller, with no
        lease there: whether it has for ``GRACE_S`` and ``GRACE_RUNS`` runs
        (its runs then need the island's order, and the device's leases end)."""
        runs = self._unleased.get(device)
        if runs is None:
            runs = self._unleased[device] = {}
        since = runs.get(owner)
        if since is None or now - since[1] > QUIET_S:
            since = runs[owner] = [now, now, 0]
        since[1] = now
        since[2] += 1
        return now - since[0] >= GRACE_S and since[2] >= GRACE_RUNS

    def refusal(self, device: int, owner: str) -> str | None:
        """Why ``owner`` may not have a lease on ``device`` now, or None."""
        c = self._controller
        if not settings().leases:
            return "leases are off (ATOLL_LEASES=0)"
        if not c.compile or not c.host_addresses[c.host_of_device(device)]:
            return "the device's host is in the controller's process, or plans run gang by gang"
        if self.hold_off or c.elastic.gates or c.elastic.located:
            return "slices are changing, or buffers moved"
        if owner in self._ended_owners:
            return "the session ended"
        shared = device in self.shared_devices
        if not shared and any(other != owner for other in self.by_device.get(device, ())):
            return "another session holds the device's lease"
        now = time.monotonic()
        for other, when in (self._wide_seen if shared else self._seen).get(device, {}).items():
            if other != owner and now - when < QUIET_S:
                return "another session ran on the device just now (a gang over several, if shared)"
        for other, (since, last, n) in self._unleased.get(device, {}).items() if shared else ():
            long = last - since >= GRACE_S and n >= GRACE_RUNS
            if other != owner and now - last < QUIET_S and long:
                return "another session runs on the device without a lease"
        return None

    async def grant(self, compiled: CompiledPlan, device: int, owner: str) -> LeaseGrant | None:
        """A lease on ``device`` for ``owner``'s runs of ``compiled`` (a call
        of one shape), or None when it cannot have one (see :meth:`refusal`).
        Waits for the plan's install and the host's answer."""
        program = compiled.programs.get(device)
        if len(compiled.programs) != 1 or program is None or compiled.island < 0:
            return None
        if any(node < 0 for node, _, _ in compiled.outputs) or self.refusal(device, owner):
            return None
        c = self._controller
        await c.schedulers[compiled.island].install(compiled)
        if self.refusal(device, owner) or not c.plan_live(compiled):  # (changed meanwhile)
            return None
        held = self.by_device.get(device, {}).get(owner) or self._new(device, owner)
        if held is None:
            return None
        new = compiled.plan_id not in held.plans
        held.plans.add(compiled.plan_id)
        if new:
            host = c.host_refs[held.host]
            weight = c.tenants.weight(owner)
            cost = {compiled.plan_id: float(sum(len(d) for _, d in compiled.gangs))}
            try:
                await host.grant_lease(
                    held.lease_id, device, owner, [compiled.plan_id], c.report_to, weight, cost
                )
            except Exception:  # (its host is gone, say): no lease
                self.take_back(held).add_done_callback(_log_failed)
                raise
            if held.taken or not c.plan_live(compiled):  # (taken back, or let go, meanwhile)
                return None
        return LeaseGrant(
            held.lease_id,
            device,
            held.host,
            compiled.plan_id,
            program.inputs,
            tuple((node, index) for node, index, _ in compiled.outputs),
            held.window,
            held.lease_id << EPOCH_SHIFT,
        )

    def _new(self, device: int, owner: str) -> _Held | None:
        """A new lease on ``device`` for ``owner``, its quota held; None if
        the session has no room for one."""
        c = self._controller
        window = c.tenants.reserve(owner, LEASE_WINDOW)
        if window < 1:
            return None
        host = c.host_of_device(device)
        held = _Held(next(self._ids), device, host, owner, window, set())
        self._unleased.get(device, {}).pop(owner, None)
        self.by_device.setdefault(device, {})[owner] = held
        self.granted += 1
        return held

    def _unlist(self, held: _Held) -> None:
        """``held`` is no longer in force (if it was)."""
        owners = self.by_device.get(held.device)
        if owners is not None and owners.get(held.owner) is held:
            del owners[held.owner]
            if not owners:
                del self.by_device[held.device]

    def _all(self) -> list[_Held]:
        return [held for owners in self.by_device.values() for held in owners.values()]

    def take_back(self, held: _Held) -> Promise[None]:
        """End ``held``: its host refuses later runs under it; settles once the
        runs it let through ended (or its host is gone), its quota given back."""
        self._unlist(held)
        if held.taken:
            return as_promise(None)
        held.taken = True
        self.taken_back += 1
        c = self._controller
        if not held.plans:  # its host never heard of it
            c.tenants.unreserve(held.owner, held.window)
            return as_promise(None)
        ended: Promise[tuple[int, int]] = c.host_refs[held.host].revoke_lease(held.lease_id)
        done: Promise[None] = Promise(f"lease {held.lease_id} taken back")
        ended.add_done_callback(functools.partial(self._ended, held, done))
        return done

    def _ended(self, held: _Held, done: Promise[None], ended: Promise[tuple[int, int]]) -> None:
        c = self._controller
        if ended.exception() is None:
            c.runs.leased(*ended.result())
        c.tenants.unreserve(held.owner, held.window)
        done.set_result(None)

    def take_back_all(self, owner: str | None = None, host: int | None = None) -> Promise[None]:
        """End every lease (of ``owner``, or on ``host``, if given); settles
        once all of them did."""
        doomed = [
            held
            for held in self._all()
            if (owner is None or held.owner == owner) and (host is None or held.host == host)
        ]
        return all_settled([self.take_back(held) for held in doomed])

    def plans_dropped(self, plan_ids: Iterable[int]) -> None:
        """The controller let these plans go: a lease that covers one ends
        (its host ends it too, as the drop reaches the device)."""
        doomed = set(plan_ids)
        for held in [h for h in self._all() if h.plans & doomed]:
            self.take_back(held).add_done_callback(_log_failed)

    def host_gone(self, host: int) -> None:
        """Host ``host`` was lost or replaced: its leases went with it."""
        for held in [h for h in self._all() if h.host == host]:
            self._unlist(held)
            held.taken = True
            self.taken_back += 1
            self._controller.tenants.unreserve(held.owner, held.window)
            # (a host given up for lost may still be there: tell it, if it hears)
            revoked = self._controller.host_refs[host].revoke_lease(held.lease_id)
            revoked.add_done_callback(_log_gone)

    def forget(self, owner: str) -> None:
        """Session ``owner`` ended (its leases were taken back): no lease is
        granted to it again, and what was seen of it goes."""
        self._ended_owners[owner] = None
        while len(self._ended_owners) > ENDED_KEPT:
            del self._ended_owners[next(iter(self._ended_owners))]
        for seen in (*self._seen.values(), *self._wide_seen.values()):
            seen.pop(owner, None)
        for runs in self._unleased.values():
            runs.pop(owner, None)

    def status(self) -> dict[str, Any]:
        """For tests and ``atoll status``: the leases held, granted, taken back."""
        return {
            "held": {
                d: [(h.owner, h.lease_id, sorted(h.plans)) for h in owners.values()]
                for d, owners in self.by_device.items()
            },
            "granted": self.granted,
            "taken_back": self.taken_back,
        }
