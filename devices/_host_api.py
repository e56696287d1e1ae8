"""What the rest of ``devices/`` may ask of a host actor, without its module.

A device reads a buffer held on another host (``fetch``), a producer pushes
to a reader's host (``lane``, ``hold``, ``receive``, ``redirect_inbox``,
``fail_inbox``), and whoever holds a buffer's handle reads it, waits for
it or frees it at its host (``fetch``, ``ready``, ``free``, ``free_many``).
:class:`HostEndpoints` declares those endpoints; :class:`~atoll.devices.Host`
implements them. The modules that only talk to hosts (handles, the data
plane, pushes, run lanes, the device) name this class, so none of them
imports the host's module, which imports theirs.

Every endpoint answers at once or with a promise (a host never blocks);
calling one through an ``ActorRef`` returns a promise at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..kernel import Actor, Promise, endpoint

__all__ = ["HostEndpoints"]


class HostEndpoints(Actor):
    """The endpoints of a host that devices, pushes and handles call."""

    @endpoint
    def fetch(self, buffer_id: str, owner: str = "") -> np.ndarray | Promise[np.ndarray]:
        """The bytes of a buffer held here (``Host.fetch``)."""
        raise NotImplementedError

    @endpoint
    def ready(self, buffer_id: str, owner: str = "") -> Promise[None] | None:
        """Answered once a buffer held here exists (``Host.ready``)."""
        raise NotImplementedError

    @endpoint
    def lane(self) -> str:
        """Where this host takes pushes by lane ("": by call only)."""
        raise NotImplementedError

    @endpoint
    def hold(self, nbytes: int) -> int | None:
        """Room for a push yet to be sent: a hold's id, or None (``Host.hold``)."""
        raise NotImplementedError

    @endpoint(resolve_args=False)
    def receive(
        self, keys: list[str], array: Any, owner: str, island: int, hold: int | None = None
    ) -> bool | Promise[bool]:
        """A pushed output for the inbox keys ``keys``; True if it landed (``Host.receive``)."""
        raise NotImplementedError

    @endpoint
    def redirect_inbox(self, keys: list[str], handle: Any) -> None:
        """Readers of ``keys`` read ``handle`` (a ``BufferHandle``) where it is."""
        raise NotImplementedError

    @endpoint
    def fail_inbox(self, keys: list[str], error: BaseException) -> None:
        """Nothing will land under ``keys``: their producer failed with ``error``."""
        raise NotImplementedError

    @endpoint
    def free(self, buffer_id: str, owner: str = "") -> bool | Promise[bool]:
        """Drop one reference to a buffer held here (``Host.free``)."""
        raise NotImplementedError

    @endpoint
    def free_many(self, buffer_ids: list[str], owner: str = "") -> int:
        """Drop one reference to each of ``buffer_ids`` (``Host.free_many``)."""
        raise NotImplementedError
