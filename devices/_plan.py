"""Compiled plans as a device keeps them: its gangs of a program, installed once.

Parallel dispatch of a program plans everything before anything runs (see
``atoll.runtime.control.planner``). When hosts are processes of their own, the
control plane *installs* each device's part of a plan on that device once: a
:class:`DeviceProgram`, the device's gangs in the island's order, each with
where its inputs come from and where its outputs go. From then on a run of
the program costs one ``run_plan(plan, epoch, inputs)`` message per device,
not one message per gang, and the device answers once, with a
:class:`RunReport`.

Everything that differs between runs derives from the run's ``epoch``: gang
ids and inbox keys are ``"c<epoch>/<node>"`` and ``"c<epoch>/<node>/<input>"``,
so no ids travel with a run. This module is plain data; the device actor
carries it out (``Device.run_plan``).
"""

from __future__ import annotations

import traceback
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..kernel import AtollError, RemoteActorError
from ._aval import Aval
from ._gang import GangTask, PushTarget, meets

__all__ = ["DeviceProgram", "PlannedGang", "PriorOutput", "RunReport", "portable", "run_key"]


PUSHED_IN = -1  # PlannedGang.inputs: the producer pushes it to the leader's inbox
MADE_HERE = -2  # ... the producer is an earlier gang of the run, led by this device


def run_key(epoch: int) -> str:
    """The prefix of every gang id and inbox key of run ``epoch``."""
    return f"c{epoch}"


@dataclass(frozen=True)
class PriorOutput:
    """An input that an earlier run made on the device that reads it: output
    ``index`` of node ``node`` in run ``run``, still on its way back to the
    controller when this run was sent. The device takes it from what it
    keeps of its recent runs, with no round trip: the island sends a
    device its runs in order, so that run went first. ``value``, its
    promise, is what a device in the controller's process waits for when
    it does not have it; one in a process of its own is sent none (a
    promise would cost it a call back for the value), and fails instead,
    with the error of that run if it failed to get there."""

    run: int
    node: int
    index: int
    value: Any = None

    @property
    def key(self) -> tuple[int, int, int]:
        return self.run, self.node, self.index


@dataclass(frozen=True)
class PlannedGang:
    """One gang as each of its devices runs it in every run of a plan.

    ``devices``: the gang's devices, the leader first; every device of the
    gang keeps the same entry and plays its part (only the leader reads
    data, computes the outputs and pushes them). ``inputs[i]``: which program
    input input ``i`` is, by index, or ``PUSHED_IN`` when its producer pushes
    it to the leader (under the inbox key of ``(node, i)``), or ``MADE_HERE``
    when its producer is an earlier gang of the same run led by this same
    device: ``local[i]`` then names it, ``(node, output)``, and the leader
    takes it as that gang left it, with no push and no wait. A made input
    is ``resident`` on the other shards (made by a gang over the same
    devices), so they need not wait for it. ``push``: where the outputs go,
    with inbox keys written as ``"<node>/<input>"`` (the run's prefix is
    added per run). ``keep[o]``: output ``o`` is an output of the program,
    reported and kept; the others are freed once their pushes were answered.
    ``host``: the leader's host, where the inbox keys are. ``rendezvous``:
    the island's barriers, for a collective gang (the island sets it when
    it installs the plan).
    """

    node: int
    kernel: Any
    devices: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    outputs: tuple[Aval, ...]
    inputs: tuple[int, ...]
    resident: tuple[bool, ...]
    push: tuple[PushTarget, ...]
    keep: tuple[bool, ...]
    host: int = -1  # the leader's host
    local: tuple[tuple[int, int] | None, ...] = ()  # per input: (node, output) made here
    rendezvous: Any = None  # ActorRef[Rendezvous]: Any keeps this module plain data

    @property
    def collective(self) -> bool:
        """Whether the gang's shards meet at a barrier (as ``GangTask.collective``)."""
        return meets(self.kernel, self.devices)

    def task(self, epoch: int, host: int, device: int) -> GangTask:
        """The gang's task in run ``epoch`` on ``device`` of host ``host``
        (inbox keys and push targets matter on the leader only)."""
        run = run_key(epoch)
        gang_id = f"{run}/{self.node}"
        shape = (self.kernel, self.devices, self.mesh_shape, self.axis_names, self.outputs)
        if device != self.devices[0]:
            return GangTask(gang_id, *shape, self.rendezvous, resident=self.resident)
        inbox = tuple(
            f"{gang_id}/{i}" if src == PUSHED_IN else None for i, src in enumerate(self.inputs)
        )
        targets = tuple(target.under(run) for target in self.push)
        return GangTask(
            gang_id,
            *shape,
            self.rendezvous,
            inbox=inbox,
            inbox_host=host if PUSHED_IN in self.inputs else -1,
            resident=self.resident,
            push=targets,
        )

    def given(
        self, inputs: Mapping[int, Any], made: Mapping[tuple[int, int] | None, Any]
    ) -> list[Any]:
        """This gang's inputs, out of the program inputs the run sent its
        device, by index, and the outputs its earlier gangs ``made`` here
        (None where a push brings one)."""
        return [
            inputs[src] if src >= 0 else made.get(self.local[i]) if src == MADE_HERE else None
            for i, src in enumerate(self.inputs)
        ]


@dataclass(frozen=True)
class DeviceProgram:
    """A device's part of a compiled plan: its gangs, in the island's order."""

    plan_id: int
    device: int
    gangs: tuple[PlannedGang, ...]
    inputs: tuple[int, ...] = ()  # the program inputs a run sends this device, in order


@dataclass
class RunReport:
    """What a device answers once per run: the program outputs it made (by
    ``(node, output)``), the error of each gang that failed (by node), and
    buffers it could not free yet because a reader elsewhere reads them in
    place (a push there was declined); the controller frees those once the
    whole run is over."""

    outputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    errors: dict[int, BaseException] = field(default_factory=dict)
    held: list[str] = field(default_factory=list)
    answered: bool = False  # the device sent its outputs to the client itself
    idle: bool = False  # the device had nothing left in flight when the run ended there

    def record(
        self, gang: PlannedGang, gang_id: str, out: Any, held: Container[str] = ()
    ) -> list[str]:
        """Take in a leader's settled gang (``out``, a promise of its output
        handles): its error, or its kept outputs; the other outputs go to
        ``held`` when a reader elsewhere reads them in place (ids in ``held``),
        and are returned otherwise, for the caller to free or hold."""
        error = out.exception()
        if error is not None:
            self.errors[gang.node] = portable(error, gang_id)
            return []
        unkept = []
        for index, (handle, keep) in enumerate(zip(out.result(), gang.keep, strict=True)):
            if keep:
                self.outputs[gang.node, index] = handle
            elif handle.id not in held:
                unkept.append(handle.id)
            elif handle.id not in self.held:  # declined by two hosts: freed once
                self.held.append(handle.id)
        return unkept

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its fields in order (a report crosses a lane on every
        run; the default is a state dictionary); without its outputs once
        the device sent them to the client (``answered``): nobody else
        reads them."""
        outputs = {} if self.answered else self.outputs
        return RunReport, (outputs, self.errors, self.held, self.answered, self.idle)

    def output(self, node: int, index: int) -> Any:
        """Output ``index`` of ``node``, or the error its gang failed with."""
        if node in self.errors:
            raise self.errors[node]
        return self.outputs[node, index]


def portable(error: BaseException, gang_id: str) -> AtollError:
    """``error`` as an atoll error, which travels to any host intact: atoll's
    own as they are, any other boxed with its type, message and traceback."""
    if isinstance(error, AtollError):
        return error
    kind = f"{type(error).__module__}.{type(error).__qualname__}"
    text = "".join(traceback.format_exception(error))
    return RemoteActorError(gang_id, "run_plan", kind, str(error), text)
