"""Gangs: the shards of one sharded computation, and the barrier they meet at.

A :class:`GangTask` is what every device of a gang receives: the kernel, the
gang's devices in mesh order (the first is the *leader*, which holds the
outputs) and the mesh. Shards of a collective gang meet at a
:class:`Rendezvous` before running, as the participants of a collective do:
a device that reached the barrier is blocked until every other shard of its
gang has too. That is exactly why all devices must run gangs in one order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..kernel import Actor, ActorRef, Promise, endpoint
from ._aval import Aval

__all__ = ["GangTask", "PushTarget", "Rendezvous", "meets"]


def meets(kernel: Any, devices: tuple[int, ...]) -> bool:
    """Whether a gang of ``kernel`` over ``devices`` is collective: its shards
    meet at a barrier before any of them runs."""
    return len(devices) > 1 and bool(getattr(kernel, "collective", False))


@dataclass(frozen=True)
class PushTarget:
    """Where the leader sends output ``output`` as soon as it exists.

    The host ``host_id`` (dialled at capnp ``address`` when it is a process
    of its own, else through ``host``) gets the bytes once and delivers them
    to each of ``keys``, the inbox keys its readers wait on. A push the
    reader's host declines (no room) redirects them: they read the output
    where it is. If the producer fails, or the reader's host cannot be
    reached, the inboxes fail with why (``devices/_push.py``).
    """

    output: int
    host_id: int
    host: Any  # ActorRef[Host] or None; Any keeps devices/_gang free of devices/_host
    address: str
    keys: tuple[str, ...]

    def under(self, run: str) -> PushTarget:
        """This target with its inbox keys under run prefix ``run`` (one
        target per gang and run: built directly, not by ``dataclasses.replace``;
        a new field goes here too, and ``tests/devices`` checks it does)."""
        keys = tuple(f"{run}/{key}" for key in self.keys)
        return PushTarget(self.output, self.host_id, self.host, self.address, keys)


@dataclass(frozen=True)
class GangTask:
    """One gang's shard instructions (the same for every device of the gang).

    Set by parallel dispatch (all empty otherwise):

    * ``inbox``: per input, the key its producer pushes it under on host
      ``inbox_host`` (the leader's), or None to wait for the input's promise;
    * ``resident``: per input, True when the producer was a gang over these
      same devices, so every shard's part of it is already in place (the
      device ran the producer first) and only the leader waits for it;
    * ``push``: where the leader sends its outputs.
    """

    gang_id: str
    kernel: Any
    devices: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    outputs: tuple[Aval, ...] = ()
    rendezvous: ActorRef[Rendezvous] | None = None
    inbox: tuple[str | None, ...] = ()
    inbox_host: int = -1
    resident: tuple[bool, ...] = ()
    push: tuple[PushTarget, ...] = ()

    @property
    def output_bytes(self) -> int:
        """The bytes of all the gang's outputs (known before it runs)."""
        return sum(aval.nbytes for aval in self.outputs)

    @property
    def leader(self) -> int:
        return self.devices[0]

    @property
    def collective(self) -> bool:
        """Whether the shards must all be present before any of them runs."""
        return meets(self.kernel, self.devices)


_ABANDONED_KEPT = 4096  # gangs remembered as abandoned, for shards that arrive late


class Rendezvous(Actor):
    """Barriers for gangs. Never blocks: each arrival gets a promise that settles
    when the last of ``parties`` arrivals for the same key comes in.

    Keys are ``"<gang id>/<stage>"``. A gang whose shard can never arrive
    (its device's host was lost) is :meth:`abandon` ed: its barriers fail
    the shards that wait there, and those that come later, instead of
    holding their devices forever.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, list[Promise[None]]] = {}
        self._abandoned: dict[str, BaseException] = {}  # gang id -> why, oldest first

    @endpoint
    def arrive(self, key: str, parties: int) -> Promise[None]:
        """Returns at once; the promise settles when all ``parties`` arrived
        (or fails, if the gang was abandoned)."""
        promise: Promise[None] = Promise(f"barrier {key}")
        error = self._abandoned_for(key)
        if error is not None:
            promise.set_exception(error)
            return promise
        waiting = self._waiting.setdefault(key, [])
        waiting.append(promise)
        if len(waiting) >= parties:
            del self._waiting[key]
            for each in waiting:
                each.set_result(None)
        return promise

    def _abandoned_for(self, key: str) -> BaseException | None:
        """Why barrier ``key`` fails at once: its gang, or the run it is a
        gang of (``"<run>/<node>"``), was abandoned; None if not."""
        head = key
        while "/" in head:
            head = head.rpartition("/")[0]
            error = self._abandoned.get(head)
            if error is not None:
                return error
        return None

    @endpoint
    def abandon(self, gang_id: str, error: BaseException) -> int:
        """A shard of gang ``gang_id`` will never arrive: fail the gang's
        barriers with ``error``, for the shards waiting there now (returns
        how many) and for those still to come. A compiled run's id abandons
        every gang of the run."""
        self._abandoned[gang_id] = error
        while len(self._abandoned) > _ABANDONED_KEPT:
            del self._abandoned[next(iter(self._abandoned))]
        failed = 0
        inside = f"{gang_id}/"
        for key in [key for key in self._waiting if key.startswith(inside)]:
            for promise in self._waiting.pop(key):
                promise.set_exception(error)
                failed += 1
        return failed

    @endpoint
    def waiting(self) -> dict[str, int]:
        """How many shards wait at each barrier that is not complete (for tests)."""
        return {key: len(ps) for key, ps in self._waiting.items()}
