"""The island scheduler actor: runs one island's policy and dispatches its gangs.

The policy (:mod:`atoll.schedulers`) is a pure state machine that decides the
order; this actor owns the I/O. It forwards each gang's shards to their
devices with the inputs still as promises, so it never waits for data, and it
feeds shard completions back to the policy in batches.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..devices import (
    BufferHandle,
    Device,
    DeviceProgram,
    GangTask,
    Host,
    PlannedGang,
    Rendezvous,
    RunReport,
    run_key,
    timeline,
)
from ..kernel import (
    Actor,
    ActorRef,
    ActorStopped,
    HostLost,
    Promise,
    all_settled,
    endpoint,
    forward,
    log_failure,
    then,
)
from ..schedulers import Completed, Dispatch, PolicyError, Submit, get_scheduler
from .latency import Wire, over
from .planner import CompiledPlan

__all__ = ["IslandScheduler"]

_log = logging.getLogger(__name__)
_log_failed = log_failure(_log, "a notice to a device or host")


class IslandScheduler(Actor):
    """Runs one island's scheduling policy (a pure state machine) as an actor.

    ``submit_gang`` takes the gang's inputs as promises and forwards them to
    the devices unresolved, in the order the policy says: the scheduler never
    waits for data. A child :class:`Rendezvous` serves the gangs' barriers.
    """

    def __init__(
        self,
        island: int,
        policy: str,
        devices: dict[int, ActorRef[Device]],
        wire: Wire | None = None,
        hosts: Mapping[int, ActorRef[Host]] | None = None,
    ) -> None:
        self.island = island
        self.hosts = dict(hosts or {})  # every host, by id: to fail readers' inboxes
        self.gang_by_gang = 0  # compiled runs this island's policy made go gang by gang
        self.wire = wire
        self.policy_name = policy
        self.policy = get_scheduler(policy)
        self.devices = devices
        self._events = itertools.count()
        self._pending: dict[str, tuple[GangTask, Sequence[Any], str, Promise[Any], int]] = {}
        self.rendezvous: ActorRef[Rendezvous] | None = None
        self._completions: list[tuple[str, int]] = []
        self._positions = 0  # gangs dispatched: each gang's place in the island's order
        self._running: dict[str, int] = {}  # gang -> its shards sent and not done (status)
        self._installed: dict[int, tuple[ActorRef[Device], set[int]]] = {}  # device -> plans

    async def on_start(self) -> None:
        self.rendezvous = self.ctx.spawn(Rendezvous, name="rendezvous")

    @endpoint(resolve_args=False)
    def submit_gang(
        self, task: GangTask, inputs: Sequence[Any], owner: str = "", weight: float = 1.0
    ) -> Promise[list[BufferHandle]]:
        """Order the gang; returns its leader's promise of the output handles.

        ``owner`` is the sending session's label and ``weight`` its share
        (for policies that keep shares, see ``schedulers/_share.py``)."""
        if task.collective:  # only barriers need it: a capability costs on the wire
            task = replace(task, rendezvous=self.rendezvous)
        result: Promise[list[BufferHandle]] = Promise(task.gang_id)
        self._pending[task.gang_id] = (task, inputs, owner, result, 0)
        self._carry_out(
            self.policy.handle(
                Submit(next(self._events), task.gang_id, task.devices, owner, weight)
            )
        )
        return result

    def _carry_out(self, instructions: Sequence[Dispatch]) -> None:
        for instruction in instructions:
            gang_id, device = instruction.gang_id, instruction.device
            task, inputs, owner, result, sent = self._pending[gang_id]
            given = _unpushed(task, inputs) if device == task.leader else inputs
            promise = over(self.wire, self.devices[device]).run_gang(task, given, owner)
            promise.add_done_callback(functools.partial(self._report, gang_id, device))
            self._running[gang_id] = self._running.get(gang_id, 0) + 1
            if device == task.leader:
                self._record_dispatch(gang_id, task.leader, owner)
                forward(promise, result)
            sent += 1
            if sent == len(task.devices):
                del self._pending[gang_id]
            else:
                self._pending[gang_id] = (task, inputs, owner, result, sent)

    @endpoint(resolve_args=False)
    def run_plan(
        self,
        compiled: CompiledPlan,
        epoch: int,
        inputs: Mapping[int, Sequence[Any]],
        owner: str = "",
        weight: float = 1.0,
    ) -> dict[int, Promise[RunReport]]:
        """Run a compiled plan as run ``epoch``: one message per device.

        The policy sees the whole run as one gang over all its devices (a
        ``Submit`` whose ``cost`` is the run's gangs per device, and a
        ``Completed`` per device once it reported): the run's gangs take
        consecutive places in the island's order, and a policy that keeps
        shares charges the run's client for all of them, at a cost per run
        that does not grow with its length. That needs a policy that
        dispatches a gang as it is submitted (``dispatches_on_submit``: gang
        FIFO, or the share policy while one client is alone); with any other,
        or when the policy does not now, the run goes through the policy gang
        by gang (:meth:`_gang_by_gang`), in this same handler, so that nothing
        sent later can overtake it. Devices get their part in one
        island-wide order, since this actor is the only sender to them.

        Each device is sent its part (installed first, once, on the same
        link); returns each device's promise of its
        :class:`~atoll.devices.RunReport`. Inputs stay promises.
        """
        if not getattr(self.policy, "dispatches_on_submit", False):
            return self._gang_by_gang(compiled, epoch, inputs, owner, weight)
        run, devices = run_key(epoch), tuple(compiled.programs)
        shards = sum(len(gang_devices) for _, gang_devices in compiled.gangs)
        submit = Submit(next(self._events), run, devices, owner, weight, shards / len(devices))
        sent = self.policy.handle(submit)
        if sorted(d.device for d in sent) != sorted(devices):
            raise PolicyError(f"{self.policy_name} did not dispatch run {run} as submitted")
        self._running[run] = len(devices)
        if timeline.RECORDER.on:  # the run's gangs: consecutive places in the order
            for node, gang_devices in compiled.gangs:
                self._record_dispatch(f"{run}/{node}", gang_devices[0], owner)
        else:
            self._positions += len(compiled.gangs)
        reports = {}
        for device, program in compiled.programs.items():
            ref = self.devices[device]
            installed = self._install(device, ref, program)
            given = inputs.get(device, ())
            report = over(self.wire, ref).run_plan(compiled.plan_id, epoch, given, owner)
            if installed is not None:  # a plan that could not be installed says why
                report = _unless_not_installed(report, installed)
            report.add_done_callback(functools.partial(self._report, run, device))
            reports[device] = report
        return reports

    def _gang_by_gang(
        self,
        compiled: CompiledPlan,
        epoch: int,
        inputs: Mapping[int, Sequence[Any]],
        owner: str,
        weight: float,
    ) -> dict[int, Promise[RunReport]]:
        """A compiled run submitted gang by gang, in the plan's order, with a
        report per leader device made here: kept outputs, errors, and the
        other outputs as ``held`` (the controller frees them once the whole
        run is over). A gang that fails fails its readers' inboxes at once."""
        self.gang_by_gang += 1
        values: dict[int, dict[int, Any]] = {}  # per device: an Earlier is its own
        planned: dict[int, PlannedGang] = {}
        for device, program in compiled.programs.items():
            values[device] = dict(zip(program.inputs, inputs.get(device, ()), strict=True))
            planned.update((gang.node, gang) for gang in program.gangs)
        reports: dict[int, RunReport] = {}
        ran: dict[int, list[Promise[Any]]] = {}
        made: dict[tuple[int, int] | None, Promise[Any]] = {}  # outputs read by their leader
        for node, devices in compiled.gangs:
            gang, leader = planned[node], devices[0]
            task = gang.task(epoch, gang.host, leader)
            result = self.submit_gang(task, gang.given(values[leader], made), owner, weight)
            made.update(
                ((node, o), then(result, operator.itemgetter(o))) for o in range(len(gang.outputs))
            )
            report = reports.setdefault(leader, RunReport())
            result.add_done_callback(functools.partial(self._gang_ran, gang, task, report))
            ran.setdefault(leader, []).append(result)
        return {
            leader: then(all_settled(ran[leader]), functools.partial(_given, report))
            for leader, report in reports.items()
        }

    def _gang_ran(
        self, gang: PlannedGang, task: GangTask, report: RunReport, result: Promise[Any]
    ) -> None:
        """A gang of a run gone gang by gang settled: its outputs no one keeps
        are held until the whole run is over; if it failed, so do the inboxes
        its readers wait on, now."""
        report.held.extend(report.record(gang, task.gang_id, result))
        error = report.errors.get(gang.node)
        if error is None:
            return
        for target in task.push:
            host = self.hosts.get(target.host_id)
            if host is not None:
                host.fail_inbox(list(target.keys), error).add_done_callback(_log_failed)

    def _install(
        self, device: int, ref: ActorRef[Device], program: DeviceProgram
    ) -> Promise[None] | None:
        """Send a device its part of a plan, unless it has it (a device that
        was replaced, as after a host rejoined, starts with none); the
        answer, when it was sent now. One that fails (a kernel the host
        cannot import) is sent again with the next run."""
        known, plans = self._installed.get(device, (None, set()))
        if known is not ref:
            plans = set()
            self._installed[device] = (ref, plans)
        if program.plan_id in plans:
            return None
        plans.add(program.plan_id)
        timeline.control("install plan", self._lane, plan=program.plan_id, device=device)
        sent: Promise[None] = over(self.wire, ref).install_plan(program)
        sent.add_done_callback(functools.partial(_forget_failed, plans, program.plan_id))
        return sent

    @endpoint
    def replace_host(
        self, host_id: int, host: ActorRef[Host], devices: Mapping[int, ActorRef[Device]]
    ) -> None:
        """A new host process took the place of lost host ``host_id``: send to
        its references from now on (``devices``: by device id; those of
        other islands are ignored). Its devices get plans installed afresh."""
        self.hosts[host_id] = host
        for device_id, ref in devices.items():
            if device_id in self.devices:
                self.devices[device_id] = ref
                self._installed.pop(device_id, None)

    @endpoint
    def drop_plans(self, plan_ids: list[int]) -> None:
        """Forget compiled plans on every device that has them."""
        doomed = set(plan_ids)
        for ref, plans in self._installed.values():
            mine = sorted(plans & doomed)
            if mine:
                plans.difference_update(mine)
                over(self.wire, ref).drop_plans(mine).add_done_callback(_log_failed)

    def _report(self, gang_id: str, device: int, shard: Promise[Any]) -> None:
        """A shard finished: queue the event, and wake the actor once per batch.

        Completions arrive from outside the actor (promise callbacks); they
        are coalesced into one message so that a gang over thousands of
        devices costs one mailbox slot, not one per shard. A shard whose
        device is gone (its host lost) abandons its gang's barriers, so that
        the gang's other shards fail instead of waiting there forever.
        """
        self._completions.append((gang_id, device))
        if len(self._completions) == 1:
            self.ctx.ref.completed()
        error = shard.exception()
        if self.rendezvous is not None and isinstance(error, (HostLost, ActorStopped)):
            self.rendezvous.abandon(gang_id, error).add_done_callback(_log_failed)

    @property
    def _lane(self) -> str:
        return f"island{self.island}"

    def _record_dispatch(self, gang_id: str, leader: int, owner: str) -> None:
        """Record a gang's dispatch, with its place in the island's order (timelines)."""
        if timeline.RECORDER.on:
            timeline.control(
                "dispatch",
                self._lane,
                gang=gang_id,
                device=leader,
                position=self._positions,
                island=self.island,
                client=owner,
            )
        self._positions += 1

    @endpoint
    def scheduler_name(self) -> str:
        """The name of this island's scheduling policy."""
        return self.policy_name

    @endpoint
    def load(self) -> dict[str, Any]:
        """For ``atoll status``: gangs the policy holds back (queued, none of
        their shards sent yet), gangs sent to devices and not finished, and
        compiled runs the policy made go gang by gang."""
        queued = sum(1 for entry in self._pending.values() if entry[4] == 0)
        return {
            "island": self.island,
            "scheduler": self.policy_name,
            "queued": queued,
            "running": len(self._running),
            "compiled_gang_by_gang": self.gang_by_gang,
        }

    @endpoint
    def tenants(self) -> dict[str, dict[str, float]]:
        """Per client, what the policy tracks (weight, queued and running
        gangs...); empty for a policy that keeps no clients (FIFO)."""
        clients = getattr(self.policy, "clients", None)
        return clients() if callable(clients) else {}

    @endpoint
    def completed(self) -> int:
        """Feed every queued completion to the policy; returns how many."""
        done, self._completions = self._completions, []
        for gang_id, device in done:
            left = self._running.pop(gang_id, 1) - 1
            if left > 0:
                self._running[gang_id] = left
            self._carry_out(self.policy.handle(Completed(next(self._events), gang_id, device)))
        return len(done)


def _given(report: RunReport, _: Promise[None]) -> RunReport:
    return report


def _unpushed(task: GangTask, inputs: Sequence[Any]) -> Sequence[Any]:
    """The leader's inputs without those pushed to its inbox: it waits for
    the push, so their promises would only cost messages to resolve (a
    failed producer's inbox is failed by the controller instead)."""
    if not any(task.inbox):
        return inputs
    return [
        None if key is not None else value for value, key in zip(inputs, task.inbox, strict=True)
    ]


def _unless_not_installed(
    report: Promise[RunReport], installed: Promise[None]
) -> Promise[RunReport]:
    """``report``, except that a run whose plan failed to install fails with
    why it did (not with the device's "not installed")."""
    out: Promise[RunReport] = Promise(f"report of {report!r}")

    def settled(_: Promise[None]) -> None:
        error = installed.exception()
        if report.exception() is not None and error is not None:
            out.set_exception(error)
        else:
            forward(report, out)

    all_settled([report, installed]).add_done_callback(settled)
    return out


def _forget_failed(plans: set[int], plan_id: int, sent: Promise[None]) -> None:
    """An install that failed: the next run of the plan sends it again."""
    if sent.exception() is not None:
        plans.discard(plan_id)
        _log_failed(sent)
