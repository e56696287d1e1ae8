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
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..kernel import Actor, ActorRef, Promise, endpoint
from ..transports.capnp import peer_of

if TYPE_CHECKING:
    from .controller import Controller

__all__ = ["SessionAnchor", "SessionWatcher"]

_log = logging.getLogger("atoll.sessions")


class SessionAnchor(Actor):
    """A client's stand-in, passed to :meth:`SessionWatcher.open`.

    It has no endpoints: only its reference matters, since on the controller's
    side it is bound to the connection that carried it.
    """


@dataclass
class _Session:
    owner: str
    unwatch: Callable[[], None]


class SessionWatcher(Actor):
    """Hands out owner labels and frees each one when its connection closes.

    Lives in the controller process (a child of the ``ClusterBuilder``). Its
    state changes only in its own endpoints: a close callback, which runs
    synchronously inside the transport, merely sends :meth:`end` to itself.
    """

    def __init__(self, controller: ActorRef[Controller]) -> None:
        self.controller = controller
        self._sessions: dict[int, _Session] = {}
        self._ids = itertools.count(1)

    @endpoint
    def open(self, anchor: ActorRef[Any], owner: str = "client") -> str:
        """Open a session for the client that sent ``anchor``; its owner label.

        The label is ``owner`` made unique (``"client#3"``). Everything the
        client labels with it is freed once the connection ``anchor`` came
        over closes.
        """
        session_id = next(self._ids)
        session = _Session(f"{owner}#{session_id}", _noop)
        self._sessions[session_id] = session
        peer = peer_of(anchor)
        if peer is not None:  # after registering: a closed peer calls back at once
            session.unwatch = peer.on_close(functools.partial(_send_end, self.ctx.ref, session_id))
        return session.owner

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
        released.add_done_callback(functools.partial(_report, session.owner, reason))
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
