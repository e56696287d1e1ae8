"""The client's half of a session (``runtime/control/sessions.py`` has the
controller's): a small actor whose reference the client passes when it
opens its session; the controller binds it to the connection that carried
it, so the session ends when that connection does. Nothing asynchronous."""

from __future__ import annotations

from ...kernel import Actor

__all__ = ["SessionAnchor"]


class SessionAnchor(Actor):
    """A client's stand-in, passed to :meth:`SessionWatcher.open`.

    It has no endpoints: only its reference matters, since on the controller's
    side it is bound to the connection that carried it.
    """
