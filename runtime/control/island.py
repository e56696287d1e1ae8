"""The island scheduler actor: runs one island's policy and dispatches its runs.

The policy (:mod:`atoll.schedulers`) is a pure state machine that decides the
order; this actor owns the I/O. Work reaches it only as compiled runs (a
program's part on this island, ``run_plan``), which the policy sees as one
gang over the run's devices. It sends each device its part with the inputs
still as promises, so it never waits for data, and it feeds completions
back to the policy in batches.

It checks every answer of the policy before it carries any of it out
(``docs/schedulers.md`` has the rules): instructions are ``Dispatch``es
caused by the event being handled, of gangs the island holds, to their own
devices, every device of a gang in the same answer, with one ``seq`` per
gang that grows from gang to gang. An answer that breaks a rule, or a policy
that raises, breaks the island: every gang and run it holds fails with a
:class:`~atoll.schedulers.PolicyError` that names the policy and the rule,
and so does every later one, rather than wait for a dispatch that will not
come.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ...devices import Device, Host, RunReport, timeline
from ...devices import _runlane as runlane
from ...devices._device import Reply
from ...devices._gang import Rendezvous
from ...devices._plan import DeviceProgram, run_key
from ...kernel import (
    Actor,
    ActorRef,
    Promise,
    all_settled,
    endpoint,
    failed,
    forward,
    log_failure,
    when_settled,
)
from ...schedulers import Completed, Dispatch, Event, PolicyError, Submit, get_scheduler
from ..latency import Wire, over
from ..runlanes import RunLanes
from .planner import CompiledPlan

__all__ = ["IslandScheduler", "RunArgs"]

# one run as the controller sends it: its part of a plan, its epoch, each
# device's inputs, its owner, the owner's weight, a client's call to answer
RunArgs = tuple[CompiledPlan, int, Mapping[int, Sequence[Any]], str, float, "Reply | None"]

_log = logging.getLogger(__name__)
_log_failed = log_failure(_log, "a notice to a device or host")


# a run the island took (its devices' reports), or the failed promise of one it refused
Taken = dict[int, Promise[RunReport]] | Promise[dict[int, Promise[RunReport]]]


class IslandScheduler(Actor):
    """Runs one island's scheduling policy (a pure state machine) as an actor.

    ``run_plan`` takes a run's inputs as promises and forwards them to the
    devices unresolved, in the order the policy says: the scheduler never
    waits for data. A child :class:`Rendezvous` serves the barriers of
    collective gangs (installed plans name it).
    """

    def __init__(
        self,
        island: int,
        policy: str,
        devices: dict[int, ActorRef[Device]],
        wire: Wire | None = None,
        hosts: Mapping[int, ActorRef[Host]] | None = None,
        lanes: tuple[bytes, Mapping[int, int]] | None = None,
    ) -> None:
        self.island = island
        self.hosts = dict(hosts or {})  # every host, by id: to fail readers' inboxes
        # run lanes to host processes (``lanes``: the cluster token, each
        # device's host), for runs, plans and drops; None: all by call
        self.lanes = RunLanes(lanes[0], self.hosts, lanes[1]) if lanes else None
        self.held_back = 0  # compiled runs the policy did not dispatch at once on every device
        self._runs: dict[str, _HeldRun] = {}  # compiled runs not yet sent to every device
        self.wire = wire
        self.policy_name = policy
        self.policy = get_scheduler(policy)
        self.devices = devices
        self._events = itertools.count()
        self.rendezvous: ActorRef[Rendezvous] | None = None
        self._completions: list[tuple[str, int, bool]] = []  # gang, device, idle
        self._positions = 0  # gangs dispatched: each gang's place in the island's order
        self._running: dict[str, int] = {}  # gang -> its shards sent and not done (status)
        self._installed: dict[int, tuple[ActorRef[Device], set[int]]] = {}  # device -> plans
        self._installing: dict[tuple[int, int], Promise[None]] = {}  # (device, plan): sent
        self._last_seq: int | None = None  # the last gang's place, as the policy numbered it
        self.broken: PolicyError | None = None  # the policy broke its contract: all runs fail
        self._completed: Callable[[], Promise[int]] | None = None  # its own ``completed``

    async def on_start(self) -> None:
        self.rendezvous = self.ctx.spawn(Rendezvous, name="rendezvous")
        if self.lanes is not None:
            self.lanes.start()

    async def on_stop(self) -> None:
        if self.lanes is not None:
            await self.lanes.aclose()

    def _call(self, device: int, kind: int, *args: Any) -> Promise[Any]:
        """``device``'s endpoint ``kind`` (``_runlane.RUN``...) with ``args``:
        by its host's run lane when there is one, else by call. The island
        sends everything for a device the same way, so it comes in order."""
        ref = self.devices[device]  # (the device as it is now, if the call waits)
        by_call: Callable[[], Promise[Any]] = functools.partial(self._by_call, ref, kind, args)
        if self.lanes is None:
            return by_call()
        return self.lanes.call(device, kind, args, by_call)

    def _by_call(self, ref: ActorRef[Device], kind: int, args: tuple[Any, ...]) -> Promise[Any]:
        """A device's endpoint ``kind`` with ``args`` by call (no lane, or it cannot)."""
        answer: Promise[Any] = getattr(over(self.wire, ref), runlane.ENDPOINTS[kind])(*args)
        return answer

    def _handled(self, event: Event) -> list[Dispatch]:
        """The policy's answer to ``event``, checked (see the module
        docstring); a broken answer breaks the island, and raises why."""
        try:
            instructions = self.policy.handle(event)
        except PolicyError as exc:  # an event it may refuse: that gang fails, not the island
            if isinstance(event, Submit):
                self._runs.pop(event.gang_id, None)
                raise
            self._break(f"it refused {event}: {exc}")
        except Exception as exc:
            self._break(f"it raised {type(exc).__name__}: {exc} on {event}")
        problem = self._check(event, instructions)
        if problem is not None:
            self._break(problem)
        return instructions

    def _check(self, event: Event, instructions: Any) -> str | None:
        """What is wrong with ``instructions`` as an answer to ``event``, or None."""
        if not isinstance(instructions, list):
            return f"handle() returned {type(instructions).__name__}, not a list of Dispatch"
        gangs: dict[str, tuple[set[int], set[int]]] = {}  # gang -> (its devices, sent)
        for ins in instructions:
            if not isinstance(ins, Dispatch):
                return f"it returned {ins!r}, which is not a Dispatch"
            if ins.cause != event.event_id:
                return f"{ins} names cause {ins.cause}, not the event handled ({event.event_id})"
            devices = self._devices_of(ins.gang_id)
            if devices is None:
                return f"{ins} dispatches a gang the island does not hold (unknown, or sent)"
            wanted, sent = gangs.setdefault(ins.gang_id, (devices, set()))
            if ins.device not in wanted or ins.device in sent:
                return f"{ins} sends gang {ins.gang_id!r} to device {ins.device}, " + (
                    "twice" if ins.device in sent else f"not one of its devices {sorted(wanted)}"
                )
            sent.add(ins.device)
        for gang_id, (wanted, sent) in gangs.items():
            if sent != wanted:
                return (
                    f"it dispatched gang {gang_id!r} to devices {sorted(sent)} of "
                    f"{sorted(wanted)}: a gang's devices are all dispatched in one answer"
                )
        return self._check_seqs(instructions)

    def _check_seqs(self, instructions: list[Dispatch]) -> str | None:
        """One ``seq`` per gang, growing from gang to gang; None if so."""
        by_gang: dict[str, int] = {}
        for ins in instructions:
            if by_gang.setdefault(ins.gang_id, ins.seq) != ins.seq:
                return f"gang {ins.gang_id!r} has two seqs ({by_gang[ins.gang_id]}, {ins.seq})"
        last = self._last_seq
        for gang_id, seq in by_gang.items():
            if last is not None and seq <= last:
                return f"gang {gang_id!r} has seq {seq}, not above the last gang's ({last})"
            last = seq
        self._last_seq = last
        return None

    def _devices_of(self, gang_id: str) -> set[int] | None:
        """The devices of a gang or run the island holds, none of them sent yet."""
        held = self._runs.get(gang_id)
        if held is None:
            return None
        return set(held.reports) if held.left == len(held.reports) else None

    def _break(self, rule: str) -> None:
        """The policy broke its contract: fail everything held, and refuse
        what comes (see the module docstring); raises the error."""
        error = PolicyError(
            f"island {self.island}: scheduler {self.policy_name!r} broke its contract: {rule} "
            "(docs/schedulers.md); the island runs nothing more"
        )
        if self.broken is None:
            _log.error("%s", error)
            self.broken = error
        for held in self._runs.values():
            for report in held.reports.values():
                if not report.done():
                    report.set_exception(error)
        self._runs.clear()
        raise error

    def _refuse_if_broken(self) -> None:
        if self.broken is not None:
            raise self.broken

    def _carry_out(self, instructions: Sequence[Dispatch]) -> None:
        for instruction in instructions:
            held = self._runs[instruction.gang_id]
            held.left -= 1
            if held.left == 0:
                del self._runs[instruction.gang_id]
            self._send_part(held, instruction.device)

    @endpoint(resolve_args=False, share_args=False, inline=True)
    def run_plan(
        self,
        compiled: CompiledPlan,
        epoch: int,
        inputs: Mapping[int, Sequence[Any]],
        owner: str = "",
        weight: float = 1.0,
        reply: Reply | None = None,
    ) -> dict[int, Promise[RunReport]]:
        """Run a compiled plan as run ``epoch``: one message per device.

        The policy sees the whole run as one gang over all its devices (a
        ``Submit`` whose ``cost`` is the run's gangs per device, and a
        ``Completed`` per device once it reported): the run's gangs take
        consecutive places in the island's order, and a policy that keeps
        shares charges the run's client for all of them, at a cost per run
        that does not grow with its length. Each device is sent its part
        (installed first, once, on the same link) when the policy dispatches
        the run there: at once for gang FIFO, or later, in the policy's
        order, when it holds runs back (the share policy while clients share
        the island). Devices get their parts in one island-wide order, since
        this actor is the only sender to them and the policy dispatches all
        of a gang's devices together.

        Returns each device's promise of its
        :class:`~atoll.devices.RunReport` at once. Inputs stay promises.
        ``reply``: a client's call that the run's one device answers itself.
        """
        self._refuse_if_broken()
        run = run_key(epoch)
        reports: dict[int, Promise[RunReport]] = {d: Promise(run) for d in compiled.programs}
        held = self._runs[run] = _HeldRun(compiled, epoch, inputs, owner, reports, reply)
        shards = sum(len(gang_devices) for _, gang_devices in compiled.gangs)
        devices = tuple(compiled.programs)
        submit = Submit(next(self._events), run, devices, owner, weight, shards / len(devices))
        instructions = self._handled(submit)
        if sum(i.gang_id == run for i in instructions) < len(devices):
            self.held_back += 1  # (for status and tests: the policy queued it)
        held.unseen = True
        try:
            self._carry_out(instructions)
        finally:
            held.unseen = False
        return reports

    @endpoint(resolve_args=False, share_args=False, inline=True)
    def run_plans(self, runs: Sequence[RunArgs]) -> list[Taken]:
        """Several runs, in order, each as :meth:`run_plan` takes it: what one
        turn of the controller's loop sent this island, in one message. Per
        run, its reports (a failed promise, for a run refused)."""
        answers: list[Taken] = []
        for args in runs:
            try:
                answers.append(self.run_plan(*args))
            except Exception as exc:
                answers.append(failed(exc))
        return answers

    def _send_part(self, held: _HeldRun, device: int) -> None:
        """The policy dispatched run ``held`` on ``device``: send it its part."""
        run = run_key(held.epoch)
        compiled = held.compiled
        if held.left == len(held.reports) - 1:  # its first part: the run takes its places
            if timeline.RECORDER.on:  # its gangs: consecutive places in the order
                for node, gang_devices in compiled.gangs:
                    self._record_dispatch(f"{run}/{node}", gang_devices[0], held.owner)
            else:
                self._positions += len(compiled.gangs)
        self._running[run] = self._running.get(run, 0) + 1
        ref = self.devices[device]
        installed = self._install(device, ref, compiled.programs[device])
        given = held.inputs.get(device, ())
        args = (compiled.plan_id, held.epoch, given, held.owner)
        report = self._call(device, runlane.RUN, *args, *([held.reply] if held.reply else []))
        if installed is not None:  # a plan that could not be installed says why
            report = _unless_not_installed(report, installed)
        report.add_done_callback(functools.partial(self._report, run, device))
        if held.unseen:  # sent as the run came: its own promise is the run's report
            held.reports[device] = report
        else:
            forward(report, held.reports[device])

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
        if any(gang.collective for gang in program.gangs):  # its barriers are here
            gangs = tuple(
                replace(g, rendezvous=self.rendezvous) if g.collective else g for g in program.gangs
            )
            program = replace(program, gangs=gangs)
        timeline.control("install plan", self._lane, plan=program.plan_id, device=device)
        sent: Promise[None] = self._call(device, runlane.INSTALL, program)
        sent.add_done_callback(functools.partial(_forget_failed, plans, program.plan_id))
        key = (device, program.plan_id)
        self._installing[key] = sent  # (until answered: install() waits for it too)
        sent.add_done_callback(functools.partial(_answered, self._installing, key))
        return sent

    @endpoint(inline=True)
    def install(self, compiled: CompiledPlan) -> Promise[None]:
        """Install a compiled plan's parts on their devices now, ahead of its
        runs (a lease's: ``runtime/control/leases.py``); answered once every
        device has it. A part a device has already costs nothing."""
        self._refuse_if_broken()
        sent: list[Promise[None]] = []
        for device, program in compiled.programs.items():
            installed = self._install(device, self.devices[device], program)
            installed = installed or self._installing.get((device, program.plan_id))
            if installed is not None:  # (sent now, or before and not answered yet)
                sent.append(installed)
        return when_settled(sent, functools.partial(_raise_first, sent), "installed")

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
        if self.lanes is not None:
            self.lanes.replaced(host_id)

    @endpoint
    def host_lost(self, host_id: int) -> None:
        """Host ``host_id``'s link is gone (it died, or stopped answering):
        close its run lane, so that calls on it fail rather than wait."""
        if self.lanes is not None:
            self.lanes.lost(host_id)

    @endpoint
    def drop_plans(self, plan_ids: list[int]) -> None:
        """Forget compiled plans on every device that has them."""
        doomed = set(plan_ids)
        for device, (_, plans) in self._installed.items():
            mine = sorted(plans & doomed)
            if mine:
                plans.difference_update(mine)
                self._call(device, runlane.DROP, mine).add_done_callback(_log_failed)

    def _report(self, gang_id: str, device: int, shard: Promise[Any]) -> None:
        """A shard finished: queue the event, and wake the actor once per batch.

        Completions arrive from outside the actor (promise callbacks); they
        are coalesced into one message so that a gang over thousands of
        devices costs one mailbox slot, not one per shard. A shard whose
        device is gone (its host lost) abandons its gang's barriers, so that
        the gang's other shards fail instead of waiting there forever.
        """
        idle = shard.exception() is None and getattr(shard.result(), "idle", False)
        self._completions.append((gang_id, device, idle))
        if len(self._completions) == 1:
            if self._completed is None:
                self._completed = self.ctx.ref.completed
            self._completed()
        error = shard.exception()
        if self.rendezvous is not None and error is not None:  # it never ran its gangs
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
        """For ``atoll status``: gangs and compiled runs the policy holds back
        (queued, none of their shards sent yet), those sent to devices and
        not finished, and how many compiled runs the policy held back."""
        queued = sum(1 for held in self._runs.values() if held.left == len(held.reports))
        return {
            "island": self.island,
            "scheduler": self.policy_name,
            "queued": queued,
            "running": len(self._running),
            "compiled_held_back": self.held_back,
        }

    @endpoint
    def tenants(self) -> dict[str, dict[str, float]]:
        """Per client, what the policy tracks (weight, queued and running
        gangs...); empty for a policy that keeps no clients (FIFO)."""
        clients = getattr(self.policy, "clients", None)  # a plugin may predate it
        return clients() if callable(clients) else {}

    @endpoint(inline=True)
    def completed(self) -> int:
        """Feed every queued completion to the policy; returns how many."""
        done, self._completions = self._completions, []
        for gang_id, device, idle in done:
            left = self._running.pop(gang_id, 1) - 1
            if left > 0:
                self._running[gang_id] = left
            if self.broken is None:
                event = Completed(next(self._events), gang_id, device, idle)
                self._carry_out(self._handled(event))
        return len(done)


def _unless_not_installed(
    report: Promise[RunReport], installed: Promise[None]
) -> Promise[RunReport]:
    """``report``, except that a run whose plan failed to install fails with
    why it did (not with the device's "not installed")."""
    out: Promise[RunReport] = Promise("report")

    def settled(_: Promise[None]) -> None:
        error = installed.exception()
        if report.exception() is not None and error is not None:
            out.set_exception(error)
        else:
            forward(report, out)

    all_settled([report, installed]).add_done_callback(settled)
    return out


def _answered(
    installing: dict[tuple[int, int], Promise[None]], key: tuple[int, int], _: Any
) -> None:
    """An install was answered: ``install()`` need not wait for it any more."""
    installing.pop(key, None)


def _raise_first(answers: Sequence[Promise[None]]) -> None:
    """Raise the first failure among settled ``answers``, if any."""
    for answer in answers:
        error = answer.exception()
        if error is not None:
            raise error


def _forget_failed(plans: set[int], plan_id: int, sent: Promise[None]) -> None:
    """An install that failed: the next run of the plan sends it again."""
    if sent.exception() is not None:
        plans.discard(plan_id)
        _log_failed(sent)


@dataclass(slots=True)
class _HeldRun:
    """A compiled run the island took, until every device was sent its part."""

    compiled: CompiledPlan
    epoch: int
    inputs: Mapping[int, Sequence[Any]]
    owner: str
    reports: dict[int, Promise[RunReport]]  # by device, settled from its report
    reply: Reply | None  # a client's call its one device answers (Device.run_plan)
    left: int = field(init=False)  # devices not sent their part yet
    unseen: bool = field(default=False, init=False)  # its reports not handed out yet

    def __post_init__(self) -> None:
        self.left = len(self.reports)
