"""A host process's leases: a session's runs of one device, sent by its client.

Every run used to go client → controller → island → host. A *lease* takes
the controller and the island off that path for the runs that need neither:
runs of one session on one device. The controller grants it
(``runtime/control/leases.py``), names which of its compiled plans the
client may run, and registers it here first (``Host.grant_lease``); the
client then sends each such run down its own lane to this host process
(``_runlane.LEASED``), which checks it against the lease and hands it to
the device as the island would have (``Device.run_plan``). The device's
report comes back down the same lane.

**Shared devices.** Under an island policy that says so
(``leases_shared``: the share policy), several sessions may hold leases on
one device at once, and this host orders their runs as the island would:
by stride over the sessions' weights, per device. While two or more leases
are busy on a device (runs on it, or waiting for it), at most ``DEPTH`` of
their runs are on it at a time; the others wait here, each lease's in the
order they came, and as each run ends the lease with the least device time
for its weight (its *pass*) has its next run handed over. A lease that
comes back from idle starts at the lowest pass of the busy ones, or at the
pass of the last run handed over (idling banks nothing). A lease alone
busy on its device hands every run over at once, as before. A lane's sync
(:func:`handed_over`) waits for the runs it sent that wait here.

A lease ends when the controller takes it back (``Host.revoke_lease``:
another session's gang wants the device, a slice moves, a host drains, the
session ends), or when the island drops one of its plans from the device
(the plan then leaves the lease here, in order with the drop). A run that
comes under a lease that ended, or that still waited here when it ended,
is refused with :class:`LeaseEnded` before it starts, so its client sends
it through the controller instead, with nothing run twice. A revocation is
answered once the runs the lease handed over have ended, so whoever took
it back (a move, the share policy) sees the device as the island does.

Everything here runs on the host process's event loop, called from the
lane's receiving end and the host actor's endpoints; nothing waits.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..kernel import ActorRef, AtollError, Promise, as_promise, forward, log_failure

__all__ = ["DEPTH", "LeaseEnded", "dropped", "grant", "handed_over", "revoke", "run"]

REPORT_S = 0.5  # a lease's runs are counted to the controller at most this often
DEPTH = 8  # a shared device's leased runs on it at a time (the rest wait here)

_log_failed = log_failure(logging.getLogger(__name__), "a lease's count to the controller")


class LeaseEnded(AtollError):
    """The lease a run came under ended (or was never granted here): the run
    did not start. Its client sends it through the controller instead."""


class _Waiting:
    """A run that waits for its turn on a shared device; ``report`` settles as
    its device's report does, once it is handed over (or fails if refused)."""

    __slots__ = ("epoch", "inputs", "plan_id", "report", "source", "watchers")

    def __init__(self, plan_id: int, epoch: int, inputs: Any, source: object) -> None:
        self.plan_id, self.epoch, self.inputs, self.source = plan_id, epoch, inputs, source
        self.report: Promise[Any] = Promise(f"leased run {epoch}")
        self.watchers: list[_Watch] | None = None  # syncs that wait for it to leave

    def left(self) -> None:
        """It was handed over or refused: the syncs that waited for it are told."""
        for watch in self.watchers or ():
            watch.left -= 1
            if watch.left == 0:
                watch.done.set_result(None)


@dataclass(eq=False)
class _Watch:
    """A lane's sync that waits for its runs waiting here to leave."""

    left: int
    done: Promise[None] = field(default_factory=lambda: Promise("leased runs handed over"))


@dataclass(eq=False)
class _Lease:
    """One lease as this host process keeps it."""

    device: int
    owner: str
    plans: dict[int, float]  # plan id -> its cost per run (gangs on the device)
    report_to: ActorRef[Any] | None  # where its counts go (the controller)
    weight: float = 1.0  # its session's share weight
    pass_: float = 0.0  # device time handed over, over its weight
    busy: bool = False  # it has runs on the device or waiting for it
    waiting: deque[_Waiting] = field(default_factory=deque)
    in_flight: int = 0  # runs handed to the device and not ended
    ran: int = 0  # runs ended, since the last count sent
    failed: int = 0  # ... of which failed
    ended: Promise[tuple[int, int]] | None = None  # revoked: settles once none is in flight
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


@dataclass(eq=False)
class _Queue:
    """One device's leases in this process, and its leased runs on it."""

    device: ActorRef[Any] | None = None  # (known from its first run)
    leases: dict[int, _Lease] = field(default_factory=dict)
    running: int = 0  # leased runs handed to the device and not ended
    waiting: int = 0  # leased runs that wait here for their turn
    busy: int = 0  # leases with runs on the device or waiting for it
    vtime: float = 0.0  # the pass of the last lease a run was handed over for
    handing: bool = False  # (handing runs over now: not again from a callback)


_leases: dict[int, _Lease] = {}  # this process's, by lease id
_queues: dict[int, _Queue] = {}  # by device
_ending: dict[int, _Lease] = {}  # ended here (a plan dropped) and not yet revoked
_ended_ids: dict[int, None] = {}  # leases ended here, the newest last: never granted again
ENDED_KEPT = 4096


def grant(
    lease_id: int,
    device: int,
    owner: str,
    plans: Iterable[int],
    report_to: ActorRef[Any] | None,
    weight: float = 1.0,
    costs: Mapping[int, float] | None = None,
) -> None:
    """Register lease ``lease_id`` (or add ``plans`` to it): ``owner``'s runs
    of those installed plans on ``device`` may come straight from its client;
    ``weight`` is its session's share, ``costs`` each plan's device time per
    run (1.0 if not given), both for a device that leases share."""
    lease = _leases.get(lease_id)
    if lease is None and lease_id in _ended_ids:  # (a grant that crossed its end)
        raise LeaseEnded(f"lease {lease_id} ended here already")
    if lease is not None and (lease.device != device or lease.owner != owner):
        raise AtollError(f"lease {lease_id} is another session's or device's")
    if lease is None:
        lease = _leases[lease_id] = _Lease(device, owner, {}, report_to, weight)
        _queues.setdefault(device, _Queue()).leases[lease_id] = lease
    lease.weight = weight
    lease.plans.update((plan, (costs or {}).get(plan, 1.0)) for plan in plans)


def revoke(lease_id: int) -> Promise[tuple[int, int]]:
    """End lease ``lease_id`` now: later runs under it, and those that wait
    here, are refused. Settles, once the runs it handed over have ended,
    with the runs (and failures) not counted to the controller yet;
    ``(0, 0)`` for a lease not held here."""
    lease = _end(lease_id) or _ending.pop(lease_id, None)
    return as_promise((0, 0)) if lease is None or lease.ended is None else lease.ended


def _end(lease_id: int) -> _Lease | None:
    """Take lease ``lease_id`` out of force (later runs under it are refused,
    and so are those that wait here)."""
    lease = _leases.pop(lease_id, None)
    if lease is None:
        return None
    _ended_ids[lease_id] = None
    while len(_ended_ids) > ENDED_KEPT:
        del _ended_ids[next(iter(_ended_ids))]
    if lease.timer is not None:
        lease.timer.cancel()
        lease.timer = None
    lease.ended = Promise(f"lease {lease_id} ended")
    queue = _queues[lease.device]
    del queue.leases[lease_id]
    refused, lease.waiting = lease.waiting, deque()
    queue.waiting -= len(refused)
    for waiting in refused:
        waiting.left()
        waiting.report.set_exception(LeaseEnded(f"lease {lease_id} ended before this run's turn"))
    if lease.busy:  # (its runs on the device end in their time; it asks for no more)
        lease.busy = False
        queue.busy -= 1
    if not queue.leases and not queue.running:
        del _queues[lease.device]
    else:
        _next(queue)  # (one lease fewer: more may go now)
    if lease.in_flight == 0:
        lease.ended.set_result(_take_counts(lease))
    return lease


def dropped(device: int, plan_ids: Iterable[int]) -> None:
    """The island dropped these plans from ``device``: a lease that covers
    one ends here (the controller takes it back too), so that no later run
    under it reads the outputs of one that was refused."""
    doomed = set(plan_ids)
    for lease_id, lease in list(_leases.items()):
        if lease.device == device and not doomed.isdisjoint(lease.plans):
            _ending[lease_id] = lease
            _end(lease_id)


def run(device: ActorRef[Any], target: int, args: Any, source: object = None) -> Promise[Any]:
    """A run that came under a lease, ``(lease_id, plan_id, epoch, inputs)``
    (from lane ``source``), handed to ``device`` (device id ``target``) if
    the lease allows it, now or at its turn; the promise of its report.
    Raises :class:`LeaseEnded` if not."""
    lease_id, plan_id, epoch, inputs = args
    lease = _leases.get(lease_id)
    if lease is None:
        raise LeaseEnded(f"lease {lease_id} ended (or was never granted here)")
    if lease.device != target or plan_id not in lease.plans:
        raise AtollError(f"lease {lease_id} does not cover plan {plan_id} on device {target}")
    queue = _queues[target]
    queue.device = device
    if not lease.busy:  # back from idle: it banked nothing
        floor = min((other.pass_ for other in queue.leases.values() if other.busy), default=None)
        lease.pass_ = max(lease.pass_, queue.vtime if floor is None else floor)
        lease.busy = True
        queue.busy += 1
    if queue.waiting or (queue.busy > 1 and queue.running >= DEPTH):
        waiting = _Waiting(plan_id, epoch, inputs, source)
        lease.waiting.append(waiting)
        queue.waiting += 1
        return waiting.report
    try:  # alone on the device (or room on it): straight on
        return _start(queue, lease_id, lease, plan_id, epoch, inputs)
    except BaseException:
        _idle(queue, lease)
        raise


def handed_over(source: object) -> Promise[None] | None:
    """A promise that settles once the runs from lane ``source`` that wait
    here now were handed to their devices (or refused); None if none waits.
    The lane's sync answers with it: what a client sends after (a slice's
    release) must come after those runs, as after any other."""
    watch: _Watch | None = None
    for queue in _queues.values():
        if not queue.waiting:
            continue
        for lease in queue.leases.values():
            for waiting in lease.waiting:
                if waiting.source is source:
                    watch = watch or _Watch(0)
                    watch.left += 1
                    waiting.watchers = [*(waiting.watchers or ()), watch]
    return None if watch is None else watch.done


def _start(
    queue: _Queue, lease_id: int, lease: _Lease, plan_id: int, epoch: int, inputs: Any
) -> Promise[Any]:
    """Hand a run to the device, charged to its lease's pass."""
    assert queue.device is not None
    report: Promise[Any] = queue.device.run_plan(plan_id, epoch, inputs, lease.owner)
    queue.vtime = lease.pass_
    lease.pass_ += lease.plans[plan_id] / lease.weight
    lease.in_flight += 1
    queue.running += 1
    report.add_done_callback(functools.partial(_ended, lease_id, lease, queue))
    return report


def _next(queue: _Queue) -> None:
    """Hand the device the waiting runs it has room for, lowest pass first
    (at most ``DEPTH`` on it while two leases or more are busy)."""
    if queue.handing:  # (a run that ended at once, in the loop below)
        return
    queue.handing = True
    try:
        while queue.waiting and (queue.busy <= 1 or queue.running < DEPTH):
            lease_id, lease = _lowest(queue)
            waiting = lease.waiting.popleft()
            queue.waiting -= 1
            waiting.left()
            try:
                report = _start(
                    queue, lease_id, lease, waiting.plan_id, waiting.epoch, waiting.inputs
                )
            except Exception as exc:  # (the device would not take it: it fails alone)
                waiting.report.set_exception(exc)
                _idle(queue, lease)
                continue
            forward(report, waiting.report)
    finally:
        queue.handing = False


def _lowest(queue: _Queue) -> tuple[int, _Lease]:
    """The lease with a run waiting whose pass is lowest (of equal passes,
    the oldest lease's); one must wait. (A loop: no key function to call per
    lease, as ``min`` would, a few times per run.)"""
    chosen_id, chosen = -1, None
    for lease_id, lease in queue.leases.items():
        if lease.waiting and (chosen is None or lease.pass_ < chosen.pass_):
            chosen_id, chosen = lease_id, lease
    assert chosen is not None
    return chosen_id, chosen


def _idle(queue: _Queue, lease: _Lease) -> None:
    """``lease`` no longer busy, if it has nothing on the device or waiting."""
    if lease.busy and not lease.in_flight and not lease.waiting:
        lease.busy = False
        queue.busy -= 1


def _ended(lease_id: int, lease: _Lease, queue: _Queue, report: Promise[Any]) -> None:
    """A run under ``lease`` ended: counted, the device's next waiting run
    handed over, and a revocation waiting for it told."""
    lease.in_flight -= 1
    queue.running -= 1
    lease.ran += 1
    if report.exception() is not None or getattr(report.result(), "errors", None):
        lease.failed += 1
    _idle(queue, lease)
    if queue.waiting:
        _next(queue)
    elif not queue.leases and not queue.running and _queues.get(lease.device) is queue:
        del _queues[lease.device]
    if lease.ended is not None:
        if lease.in_flight == 0 and not lease.ended.done():
            lease.ended.set_result(_take_counts(lease))
    elif lease.timer is None and lease.report_to is not None:
        loop = asyncio.get_running_loop()
        lease.timer = loop.call_later(REPORT_S, _count, lease_id, lease)


def _count(lease_id: int, lease: _Lease) -> None:
    """Tell the controller how many runs the lease let through since the last count."""
    lease.timer = None
    if lease.report_to is None or lease.ended is not None:
        return
    ran, failed = _take_counts(lease)
    lease.report_to.leased(lease_id, ran, failed).add_done_callback(_log_failed)


def _take_counts(lease: _Lease) -> tuple[int, int]:
    counts = lease.ran, lease.failed
    lease.ran = lease.failed = 0
    return counts


def held() -> dict[int, tuple[int, str, int]]:
    """For tests and status: each lease held here, ``(device, owner, runs in flight)``."""
    return {i: (lease.device, lease.owner, lease.in_flight) for i, lease in _leases.items()}
