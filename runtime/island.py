"""The island scheduler actor: runs one island's policy and dispatches its gangs.

The policy (:mod:`atoll.schedulers`) is a pure state machine that decides the
order; this actor owns the I/O. It forwards each gang's shards to their
devices with the inputs still as promises, so it never waits for data, and it
feeds shard completions back to the policy in batches.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..devices import BufferHandle, Device, GangTask, PushTarget, Rendezvous
from ..kernel import Actor, ActorRef, Promise, endpoint, forward
from ..schedulers import Completed, Dispatch, Submit, get_scheduler
from .latency import Wire

__all__ = ["IslandScheduler"]

_LED_KEPT = 4096  # gangs remembered as dispatched to their leader, for push_after


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
    ) -> None:
        self.island = island
        self.wire = wire
        self.policy_name = policy
        self.policy = get_scheduler(policy)
        self.devices = devices
        self._events = itertools.count()
        self._pending: dict[str, tuple[GangTask, Sequence[Any], str, Promise[Any], int]] = {}
        self.rendezvous: ActorRef[Rendezvous] | None = None
        self._completions: list[tuple[str, int]] = []
        self._after: dict[str, list[tuple[PushTarget, str, Promise[Any]]]] = {}
        self._led: dict[str, None] = {}  # gangs whose leader was sent them, newest last

    async def on_start(self) -> None:
        self.rendezvous = self.ctx.spawn(Rendezvous, name="rendezvous")

    @endpoint(resolve_args=False)
    def submit_gang(
        self, task: GangTask, inputs: Sequence[Any], owner: str = ""
    ) -> Promise[list[BufferHandle]]:
        """Order the gang; returns its leader's promise of the output handles."""
        if task.collective:  # only barriers need it: a capability costs on the wire
            task = replace(task, rendezvous=self.rendezvous)
        result: Promise[list[BufferHandle]] = Promise(task.gang_id)
        self._pending[task.gang_id] = (task, inputs, owner, result, 0)
        self._carry_out(
            self.policy.handle(Submit(next(self._events), task.gang_id, task.devices, owner))
        )
        return result

    def _carry_out(self, instructions: Sequence[Dispatch]) -> None:
        for instruction in instructions:
            gang_id, device = instruction.gang_id, instruction.device
            task, inputs, owner, result, sent = self._pending[gang_id]
            given = _unpushed(task, inputs) if device == task.leader else inputs
            promise = Wire.through(self.wire, self.devices[device], "run_gang", task, given, owner)
            promise.add_done_callback(functools.partial(self._report, gang_id, device))
            if device == task.leader:
                forward(promise, result)
                self._led[gang_id] = None
                while len(self._led) > _LED_KEPT:
                    del self._led[next(iter(self._led))]
                for target, by, answer in self._after.pop(gang_id, ()):
                    forward(self._push_output(device, gang_id, target, by), answer)
            sent += 1
            if sent == len(task.devices):
                del self._pending[gang_id]
            else:
                self._pending[gang_id] = (task, inputs, owner, result, sent)

    @endpoint
    def push_after(
        self, gang_id: str, leader: int, target: PushTarget, owner: str = ""
    ) -> Promise[Any]:
        """Have gang ``gang_id``'s leader push its output to ``target`` once
        the gang ran. Sent to its device right after the gang itself (now, if
        it was dispatched already), so the device handles it after the gang."""
        if gang_id in self._led or gang_id not in self._pending:  # its leader has it
            return self._push_output(leader, gang_id, target, owner)
        answer: Promise[Any] = Promise(f"push after {gang_id}")
        self._after.setdefault(gang_id, []).append((target, owner, answer))
        return answer

    def _push_output(
        self, device: int, gang_id: str, target: PushTarget, owner: str
    ) -> Promise[Any]:
        ref = self.devices[device]
        return Wire.through(self.wire, ref, "push_output", gang_id, target, owner)

    def _report(self, gang_id: str, device: int, _: Promise[Any]) -> None:
        """A shard finished: queue the event, and wake the actor once per batch.

        Completions arrive from outside the actor (promise callbacks); they
        are coalesced into one message so that a gang over thousands of
        devices costs one mailbox slot, not one per shard.
        """
        self._completions.append((gang_id, device))
        if len(self._completions) == 1:
            self.ctx.ref.completed()

    @endpoint
    def scheduler_name(self) -> str:
        """The name of this island's scheduling policy."""
        return self.policy_name

    @endpoint
    def completed(self) -> int:
        """Feed every queued completion to the policy; returns how many."""
        done, self._completions = self._completions, []
        for gang_id, device in done:
            self._carry_out(self.policy.handle(Completed(next(self._events), gang_id, device)))
        return len(done)


def _unpushed(task: GangTask, inputs: Sequence[Any]) -> Sequence[Any]:
    """The leader's inputs without those pushed to its inbox: it waits for
    the push, so their promises would only cost messages to resolve (a
    failed producer's inbox is failed by the controller instead)."""
    if not any(task.inbox):
        return inputs
    return [
        None if key is not None else value for value, key in zip(inputs, task.inbox, strict=True)
    ]
