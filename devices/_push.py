"""The sending half of a push: a producer's outputs to the hosts that read them.

Parallel dispatch tells a gang's leader where its outputs go (its
:class:`~atoll.devices._gang.PushTarget` list). A :class:`Pusher` makes those
pushes for one device: a reader on the same host gets the buffer itself
(one more reference, delivered to its inbox key); a reader's host in
another process gets the bytes, by lane when small (one way, no answer),
else by a ``Host.receive`` call, after asking that host for room when the
array is large. A push that is declined, or fails, points the reader's inbox
at the producer's own handle instead, so the reader reads it in place.

What is asynchronous about it: :meth:`Pusher.push` returns a promise that
settles once every push was answered (landed, declined or failed); lanes
count as answered when sent. The receiving half is ``Host.receive``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

import numpy as np

from ..kernel import (
    ActorRef,
    ActorStopped,
    ActorSystem,
    HostLost,
    Promise,
    as_promise,
    flatten,
    forward,
    log_failure,
    then,
    when_settled,
)
from ..transports.dataplane.lane import LaneMessage
from ..transports.dataplane.lane import fits as lane_fits
from . import timeline
from ._errors import DeviceError
from ._gang import PushTarget
from ._host_api import HostEndpoints
from ._plane import DataPlane
from ._store import BufferMissing, ObjectStore
from ._values import Arrival, BufferHandle

__all__ = ["HOLD_ABOVE_BYTES", "Pusher"]

_log = logging.getLogger(__name__)
_log_unsent = log_failure(_log, "a notice to a reader's inbox")

# pushes above this size (what Cap'n Proto sends as a pulled buffer, not
# inline) ask the reader's host for room first (Host.hold)
HOLD_ABOVE_BYTES = 1 << 20


class Pusher:
    """Pushes one device's outputs (see the module docstring).

    ``host_ref`` finds a reader's host actor over a direct link when there
    can be one (the device's own, which knows its actor system).
    """

    def __init__(
        self,
        store: ObjectStore,
        host_id: int,
        device_id: int,
        island: int,
        plane: DataPlane,
        system: Callable[[], ActorSystem],
    ) -> None:
        self.store = store
        self.host_id = host_id
        self.device_id = device_id
        self.island = island
        self.plane = plane
        self._system = system

    async def host_ref(
        self, host_id: int, address: str, known: ActorRef[HostEndpoints] | None
    ) -> ActorRef[HostEndpoints]:
        """Host ``host_id``'s actor, over a direct link when there can be one
        (``known`` may be proxied by the controller; bytes must not take that
        path; see ``atoll.transports.capnp.directory``)."""
        return await self.plane.host_ref(host_id, address, known, self._system())

    async def push(
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
                self.deliver_here(target, handle)
                continue
            array = np.asarray(self.store.get(handle.id))
            began = timeline.start()
            if await self._by_lane(target, array, owner):
                self._lane_pushed(target, array, began)
                continue  # one way: it lands there without an answer
            try:
                host = await self.host_ref(target.host_id, target.address, target.host)
            except Exception as exc:  # its reader waits on its inbox: fail, and say why
                unreachable.append(exc)
                continue
            answer = self._offer(host, list(target.keys), array, owner)
            timeline.pushing(answer, self.host_id, self.device_id, target, array.nbytes)
            answers.append(_redirect_unless_landed(answer, host, target.keys, handle))
            sent.append(handle.id)

        def pushed() -> list[BufferHandle]:
            if held is not None:
                held.extend(i for a, i in zip(answers, sent, strict=True) if _declined(a))
            return self._pushed(answers, unreachable, outputs)

        return when_settled(answers, pushed, "pushed")

    def push_now(
        self, targets: Sequence[PushTarget], outputs: list[BufferHandle], owner: str
    ) -> bool:
        """:meth:`push` without waiting, when every push to another host goes
        down a lane open now; False, and nothing sent, when one would not (no
        lane open to its host yet, a value too large for one)."""
        frames: list[tuple[PushTarget, np.ndarray]] = []
        for target in targets:
            if target.host_id != self.host_id:
                array = self._lane_array(target, outputs)
                if array is None:
                    return False
                frames.append((target, array))
        for target in targets:
            if target.host_id == self.host_id:
                self.deliver_here(target, outputs[target.output])
        for target, array in frames:
            message = LaneMessage(target.host_id, target.keys, owner, self.island, array)
            began = timeline.start()
            if not self.plane.send_now(target, message, _push_by_call):  # (open: checked)
                raise DeviceError(f"the lane to host {target.host_id} took no push")
            self._lane_pushed(target, array, began)
        return True

    def _lane_array(self, target: PushTarget, outputs: list[BufferHandle]) -> np.ndarray | None:
        """The array to push to ``target`` down a lane open now (None: no
        lane is open to its host, it does not fit one, or it is gone: then
        :meth:`push` says what is wrong)."""
        if not self.plane.lane_open(target.address):
            return None
        try:
            array = np.asarray(self.store.get(outputs[target.output].id))
        except BufferMissing:
            return None
        return array if lane_fits(array) else None

    def _lane_pushed(self, target: PushTarget, array: np.ndarray, began: float) -> None:
        timeline.push(
            self.host_id, self.device_id, target.host_id, target.keys, array.nbytes, began
        )

    def deliver_here(self, target: PushTarget, handle: BufferHandle) -> None:
        """A reader on this host: one more reference per inbox key, delivered."""
        for key in target.keys:
            self.store.incref(handle.id)
            self.store.deliver(key, Arrival(handle, 0.0), handle.id)

    async def fail(self, targets: Sequence[PushTarget], error: BaseException) -> None:
        """Fail the inboxes a failed gang's outputs were due in (no reply awaited)."""
        for target in targets:
            if target.host_id == self.host_id:
                for key in target.keys:
                    self.store.fail(key, error)
                continue
            try:
                host = await self.host_ref(target.host_id, target.address, target.host)
            except Exception as exc:  # unreachable: its readers fail with the host
                # (info, not warning: the loss of that host is reported where it is
                # seen; a cluster that stops with runs in flight says this per push)
                _log.info("cannot fail inboxes on host %s: %s", target.host_id, exc)
                continue
            host.fail_inbox(list(target.keys), error).add_done_callback(_log_unsent)

    def _offer(
        self, host: ActorRef[HostEndpoints], keys: list[str], array: np.ndarray, owner: str
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
        (``transports.dataplane.lane``), when there is one; False: push it by call."""
        if not target.address:
            return False
        message = LaneMessage(target.host_id, target.keys, owner, self.island, array)
        return await self.plane.send_by_lane(target, message, _push_by_call, self._system())

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
            self.drop(outputs)
            lost = all(isinstance(e, HostLost) for e in errors)
            raise (HostLost if lost else DeviceError)(
                "; ".join(f"a push failed: {e}" for e in errors)
            )
        return outputs

    def drop(self, outputs: list[BufferHandle]) -> None:
        """Drop this device's reference to each of ``outputs``."""
        for handle in outputs:
            with suppress(BufferMissing):
                self.store.decref(handle.id)


def _push_by_call(host: ActorRef[HostEndpoints], message: LaneMessage) -> None:
    """A lane closed before its receiver acknowledged ``message``: push it the
    ordinary way (a copy that did land is ignored there). If that push is
    declined, the readers take the value as it is, carried in a handle (the
    producer may have freed its own copy by now)."""
    keys = list(message.keys)
    answer = host.receive(keys, message.array, message.owner, message.island)

    def landed(done: Promise[Any]) -> None:
        if done.exception() is None and done.result():
            return
        if done.exception() is not None:  # handled: the reader reads it in place
            _log.info("a push sent again by call failed: %s", done.exception())
        value = BufferHandle.of("lane", message.array, host, -1, -1, message.island)
        host.redirect_inbox(keys, value).add_done_callback(_log_unsent)

    answer.add_done_callback(landed)


def _declined(answer: Promise[Any]) -> bool:
    """Whether a settled push was redirected (its reader reads in place)."""
    return answer.exception() is None and answer.result() is not True


def _redirect_unless_landed(
    answer: Promise[Any], host: ActorRef[HostEndpoints], keys: tuple[str, ...], handle: BufferHandle
) -> Promise[Any]:
    """Settles once the push to ``host`` landed, or, when it was declined or
    failed, once the readers' inboxes there were pointed at ``handle``."""
    out: Promise[Any] = Promise("push settled")

    def done(pushed: Promise[Any]) -> None:
        if pushed.exception() is None and pushed.result():
            out.set_result(True)
            return
        error = pushed.exception()
        if error is not None:  # a reader's host that is gone, or stopping: no news
            gone = isinstance(error, (HostLost, ActorStopped))
            (_log.info if gone else _log.warning)(
                "a push failed; redirecting its reader: %s", error
            )
        forward(as_promise(host.redirect_inbox(list(keys), handle)), out)

    answer.add_done_callback(done)
    return out
