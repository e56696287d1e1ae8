"""Client sessions: what a remote client owns is freed when its connection ends.

A client that reaches a cluster over Cap'n Proto (``atoll.connect``) opens a
*session* with the :class:`SessionWatcher` of the controller process. It passes
a :class:`SessionAnchor`, a small actor of its own: on the controller's side
that reference arrived over the client's connection, so the watcher knows
which connection the session belongs to (``peer_of``) and registers a
close callback on it. The owner label the watcher hands back is unique to the
session, so two clients, or a client and its own later reconnection, never
share one.

When the connection closes, for whatever reason (a clean close, a crash, a
``kill -9``, a dropped TCP link that the socket reports), the transport runs
the callback; the watcher then asks the controller to ``release_owner`` the
label, which frees the session's slices and every buffer labelled with it.
Nothing polls: the drop is learnt from the transport. A reference that did
not come over a connection (an in-process client) opens a session that only
:meth:`SessionWatcher.end` closes.

Sessions are the cluster's tenants (``runtime/control/tenancy.py``). Each has a
*weight*, its proportional share of device time on every island whose policy
keeps shares (the default, ``"share"``), given at ``open`` and changed later
by :meth:`SessionWatcher.set_weight`; and quotas of queued gangs and of
object-store bytes (:meth:`SessionWatcher.set_quota`). The owner label ends
in a random part (``"alice#3.5f0c..."``) and works as a capability: a buffer
or slice is served only to the session whose label it carries, so the label
is never shown to others; status rows show the public name (``"alice#3"``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...kernel import Actor, ActorRef, AtollError, Promise, endpoint
from ...transports.capnp import peer_of
from .tenancy import DEFAULT_MAX_GANGS, public_name

if TYPE_CHECKING:
    from .controller import Controller

__all__ = ["SessionWatcher"]

_log = logging.getLogger("atoll.sessions")


@dataclass
class _Session:
    owner: str
    unwatch: Callable[[], None]
    weight: float = 1.0


class SessionWatcher(Actor):
    """Hands out owner labels and frees each one when its connection closes.

    Lives in the controller process (a child of the ``ClusterBuilder``). Its
    state changes only in its own endpoints: a close callback, which runs
    synchronously inside the transport, merely sends :meth:`end` to itself.
    """

    def __init__(
        self,
        controller: ActorRef[Controller],
        max_gangs: int | None = DEFAULT_MAX_GANGS,
        max_bytes: int | None = None,
    ) -> None:
        self.controller = controller
        self.max_gangs = max_gangs  # every new session's quotas (set_quota changes one)
        self.max_bytes = max_bytes
        self._sessions: dict[int, _Session] = {}
        self._ids = itertools.count(1)

    @endpoint
    async def open(self, anchor: ActorRef[Any], owner: str = "client", weight: float = 1.0) -> str:
        """Open a session for the client that sent ``anchor``; its owner label.

        The label is ``owner`` made unique and unguessable
        (``"client#3.<random>"``). Everything the client labels with it is
        freed once the connection ``anchor`` came over closes. ``weight`` is
        its share of device time (see the module docstring).
        """
        session_id = next(self._ids)
        label = f"{owner.replace('.', '_')}#{session_id}.{secrets.token_hex(8)}"
        await self.controller.set_tenant(label, weight, self.max_gangs, self.max_bytes)
        session = _Session(label, _noop, float(weight))
        self._sessions[session_id] = session
        peer = peer_of(anchor)
        if peer is not None:  # after registering: a closed peer calls back at once
            session.unwatch = peer.on_close(functools.partial(_send_end, self.ctx.ref, session_id))
        return session.owner

    @endpoint
    async def set_weight(self, session: int | str, weight: float) -> float:
        """An administrator changes a session's weight (by id or public
        name, ``"alice#3"``); its next gangs carry it. Returns the weight."""
        session_id = self._find(session)
        await self.controller.set_tenant(self._sessions[session_id].owner, weight, quotas=False)
        self._sessions[session_id].weight = float(weight)
        return float(weight)

    @endpoint
    async def set_quota(
        self, session: int | str, max_gangs: int | None, max_bytes: int | None
    ) -> None:
        """An administrator sets a session's quotas: gangs queued or running
        at once, and bytes held in each host's store (None: no limit)."""
        owner = self._sessions[self._find(session)].owner
        await self.controller.set_tenant(owner, None, max_gangs, max_bytes)

    @endpoint
    def set_default_quota(self, max_gangs: int | None, max_bytes: int | None) -> None:
        """An administrator sets the quotas every session opened from now on
        gets (sessions already open keep theirs; ``set_quota`` changes one)."""
        for name, value in (("max_gangs", max_gangs), ("max_bytes", max_bytes)):
            if value is not None and value < 1:
                raise AtollError(f"{name} must be positive or None, got {value}")
        self.max_gangs, self.max_bytes = max_gangs, max_bytes

    def _find(self, session: int | str) -> int:
        """A session's id, from its id or its public name."""
        for session_id, s in self._sessions.items():
            if session in (session_id, public_name(s.owner)):
                return session_id
        raise AtollError(f"no open session {session!r}")

    @endpoint
    async def usage(self) -> dict[int, dict[str, Any]]:
        """Per open session: its public name, weight, quotas, gangs queued
        (held by a policy) and running, device seconds used, bytes and
        buffers held (what ``client.status()`` shows; no owner labels).
        Session 0, if present, sums the buffers held under no open session."""
        rows = await self.controller.tenant_usage()
        report: dict[int, dict[str, Any]] = {
            session_id: {"name": public_name(s.owner), **rows.pop(s.owner, {"weight": s.weight})}
            for session_id, s in self._sessions.items()
        }
        held = [row for row in rows.values() if row["buffers"]]
        if held:  # buffers of no open session: the runtime's own, or a leak
            report[0] = {
                "name": "(no open session)",
                "bytes": sum(row["bytes"] for row in held),
                "buffers": sum(row["buffers"] for row in held),
            }
        return report

    @endpoint
    def end(self, session_id: int, reason: str = "closed by the client") -> Promise[int] | int:
        """Close a session and free what its owner holds; how many buffers went.

        Called by the watcher itself when the session's connection closes, and
        by anyone who ends a session explicitly. Ending it twice frees nothing
        the second time. The answer follows the controller's ``release_owner``
        without the watcher waiting for it, so a slow host never holds up
        other sessions.
        """
        session = self._sessions.pop(session_id, None)
        if session is None:
            return 0
        session.unwatch()
        released: Promise[int] = self.controller.release_owner(session.owner)
        released.add_done_callback(functools.partial(_report, public_name(session.owner), reason))
        return released

    @endpoint
    def sessions(self) -> dict[int, str]:
        """The open sessions: id to owner label (for tools and tests)."""
        return {session_id: s.owner for session_id, s in self._sessions.items()}


def _send_end(watcher: ActorRef[SessionWatcher], session_id: int, reason: str) -> None:
    """A close callback: queue ``end`` on the watcher (no one awaits its answer)."""
    watcher.end(session_id, f"connection closed: {reason}")


def _report(owner: str, reason: str, released: Promise[int]) -> None:
    error = released.exception()
    if error is not None:  # e.g. a host already gone: the others were freed anyway
        _log.warning("session %s (%s): release failed: %s", owner, reason, error)
    else:
        _log.info("session %s ended (%s): %d buffers freed", owner, reason, released.result())


def _noop() -> None:
    """Unwatching a session that nothing watches."""
