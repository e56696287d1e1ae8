"""The data plane as hosts and devices reach it: one object per process.

A host process serves at a Cap'n Proto address. Its hosts and devices move
bytes to and from other host processes over links of their own: a direct
link to the holder of a buffer (not through the controller, which would
proxy every byte), and one-way lanes for small pushes. A :class:`DataPlane`
is what a :class:`~atoll.devices.Host` is given to do that; its devices use
their host's. In one process (:data:`IN_PROCESS`) there is nothing to reach:
the address is empty and every reference stays the one the caller holds.

The process that serves (``atoll host``, see ``runtime/deploy/process.py``) makes
its plane with :class:`ProcessPlane` and hands it to :func:`use_plane`,
once, before it spawns hosts; a host built without a plane takes that one.
Everything runs on the event loop's thread (Cap'n Proto's rule).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..kernel import ActorRef, ActorSystem, HostLost
from ..kernel.config import settings
from ..transports.dataplane import lane
from ..transports.dataplane.lane import LaneMessage
from ._host_api import HostEndpoints

if TYPE_CHECKING:
    from ._gang import PushTarget

__all__ = ["IN_PROCESS", "DataPlane", "ProcessPlane", "Resend", "process_plane", "use_plane"]

_log = logging.getLogger(__name__)
# what a lane hands back a message it could not deliver to: (its host, the message)
Resend = Callable[["ActorRef[HostEndpoints]", LaneMessage], None]


class DataPlane:
    """The data plane of a process with no address: every cluster in one process."""

    address = ""  # the capnp address this process serves at ('' : none)

    def token(self) -> bytes:
        """The cluster token links are opened with (empty: none)."""
        return b""

    async def host_ref(
        self, host_id: int, address: str, known: ActorRef[HostEndpoints] | None, system: ActorSystem
    ) -> ActorRef[HostEndpoints]:
        """Host ``host_id``'s actor, over a direct link when there can be one;
        else ``known`` (``HostLost`` when there is none)."""
        if known is None:  # its process is gone, or cut off: as good as lost
            raise HostLost(f"host {host_id} at {address!r} cannot be reached directly")
        return known

    async def send_by_lane(
        self, target: PushTarget, message: LaneMessage, resend: Resend, system: ActorSystem
    ) -> bool:
        """Push ``message`` down the one-way lane to ``target``'s host process;
        False: there is none, push it by call. A message the lane could not
        deliver goes to ``resend`` with the host it was for."""
        return False

    def lane_open(self, address: str) -> bool:
        """Whether a push to the host process at ``address`` goes down a lane
        that is open already (no host to dial first)."""
        return False

    def send_now(self, target: PushTarget, message: LaneMessage, resend: Resend) -> bool:
        """:meth:`send_by_lane` without waiting: down a lane that is open now
        (:meth:`lane_open`) and fits ``message``, else False and nothing sent
        (``resend`` gets it back if the lane closes before it is acknowledged)."""
        return False

    async def serve_lanes(self) -> str:
        """Start taking pushes by lane; where ('' : this process takes none)."""
        return ""


IN_PROCESS = DataPlane()


class ProcessPlane(DataPlane):
    """The data plane of a host process serving at ``address`` (see the module)."""

    def __init__(self, address: str, token: bytes) -> None:
        self.address = address
        self._token = token
        # lanes to other host processes, by capnp address (empty: none there)
        self._lanes: dict[str, tuple[str, ActorRef[HostEndpoints]] | tuple[()]] = {}

    def token(self) -> bytes:
        return self._token

    async def host_ref(
        self, host_id: int, address: str, known: ActorRef[HostEndpoints] | None, system: ActorSystem
    ) -> ActorRef[HostEndpoints]:
        if address:
            from ..transports.capnp.directory import direct_actor

            ref = await direct_actor(address, f"host{host_id}", system)
            if ref is not None:
                return ref
        return await super().host_ref(host_id, address, known, system)

    def lane_open(self, address: str) -> bool:
        return self._open_lane_now(address) is not None

    def _open_lane_now(self, address: str) -> tuple[str, ActorRef[HostEndpoints]] | None:
        """The lane to the host process at ``address`` if it is open now."""
        found = self._lanes.get(address) if address and settings().push_lanes else None
        if not found or not lane.is_open(found[0]):
            return None
        return found

    def send_now(self, target: PushTarget, message: LaneMessage, resend: Resend) -> bool:
        found = self._open_lane_now(target.address)
        if found is None:
            return False
        address, host = found  # (lane.send checks the fit: False, nothing sent)
        return lane.send(address, message, functools.partial(resend, host))

    async def send_by_lane(
        self, target: PushTarget, message: LaneMessage, resend: Resend, system: ActorSystem
    ) -> bool:
        if not target.address or not settings().push_lanes or not lane.fits(message.array):
            return False
        found = self._lanes.get(target.address)
        if found is None:
            found = self._lanes[target.address] = await self._open_lane(target, system)
        if not found:
            return False
        address, host = found
        fallback = functools.partial(resend, host)
        if lane.send(address, message, fallback):
            return True
        return await lane.connect(address, self._token) and lane.send(address, message, fallback)

    async def _open_lane(
        self, target: PushTarget, system: ActorSystem
    ) -> tuple[str, ActorRef[HostEndpoints]] | tuple[()]:
        """The lane to ``target``'s host process, opened once (empty: none)."""
        try:
            host = await self.host_ref(target.host_id, target.address, target.host, system)
            address: str = await host.lane()
        except Exception as exc:  # an older host, or none: pushes go by call
            _log.info("no lane to host %s: %s", target.host_id, exc)
            return ()
        if not address or not await lane.connect(address, self._token):
            return ()
        return address, host

    async def serve_lanes(self) -> str:
        where = self.address.split("://", 1)[-1].rpartition(":")[0]
        return await lane.serve(where, self._token)


_process: list[DataPlane] = [IN_PROCESS]


def use_plane(plane: DataPlane) -> None:
    """Make ``plane`` this process's data plane, for hosts built from now on."""
    _process[0] = plane


def process_plane() -> DataPlane:
    """This process's data plane (:data:`IN_PROCESS` unless :func:`use_plane` set one)."""
    return _process[0]
