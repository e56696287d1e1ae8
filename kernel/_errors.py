"""The one error hierarchy of atoll.

Every error atoll raises on purpose derives from :class:`AtollError`, so an
application can catch "anything atoll said" in one ``except`` clause. Errors
that cross an actor boundary are *boxed*: the caller never sees the remote
exception object itself (it may not even be importable on the caller's side),
but a :class:`RemoteActorError` naming the actor, the endpoint, the remote
exception type and its traceback as text. Where the caller has that type
(its module is imported here), the box is an instance of it as well, so
``except ValueError`` catches a ``ValueError`` raised on a host.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = [
    "ActorCancelled",
    "ActorFailed",
    "ActorStopped",
    "AtollError",
    "BadCall",
    "BadMailbox",
    "CallCancelled",
    "HostLost",
    "MailboxFull",
    "NoSuchEndpoint",
    "NotAnActor",
    "NotRunning",
    "RemoteActorError",
    "TransportError",
    "UsageError",
]


class AtollError(Exception):
    """Base class of every error atoll raises on purpose.

    Every one pickles faithfully, whatever its ``__init__`` takes: it is
    rebuilt from its ``args`` and attributes, not by calling ``__init__``
    again, so errors cross process boundaries intact.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(cls: type[AtollError], args: tuple[Any, ...], state: dict[str, Any]) -> AtollError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class UsageError(AtollError, ValueError):
    """The caller's mistake (asking for more devices than exist, a slice it
    does not hold, a broken scheduler): raised in an actor, it reaches the
    caller as itself, not boxed in a :class:`RemoteActorError` with atoll's
    own traceback; its message says what to do instead."""


class BadCall(UsageError, TypeError):
    """A call did not match the endpoint's signature, or a value could not
    cross the wire (it could not be pickled, or not unpickled where it arrived).
    A usage error: it reaches the caller as itself, from any actor.

    Attributes:
        message: what was wrong.
        exc_type: when the far side failed (decoding the arguments, encoding a
            result), the qualified name of the exception it raised; else "".
        remote_traceback: that exception's formatted traceback, or "".
    """

    def __init__(self, message: str, exc_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        if not self.remote_traceback:
            return self.message
        return f"{self.message}\n--- remote traceback ---\n{self.remote_traceback.rstrip()}"

    def __reduce__(self) -> tuple[type[BadCall], tuple[str, str, str]]:
        return (BadCall, (self.message, self.exc_type, self.remote_traceback))


class NotAnActor(AtollError, TypeError):
    """``spawn`` was given something that is not an :class:`Actor` subclass."""


class NotRunning(AtollError, RuntimeError):
    """An actor or actor system was used outside a running :class:`ActorSystem`."""


class BadMailbox(AtollError, ValueError):
    """Mailbox bounds that make no sense (a capacity below 1 or a negative slack)."""


class NoSuchEndpoint(AtollError, AttributeError):
    """The target actor has no endpoint of that name."""

    def __init__(self, actor: str, endpoint: str) -> None:
        super().__init__(f"actor {actor!r} has no endpoint {endpoint!r}")
        self.actor = actor
        self.endpoint = endpoint


class MailboxFull(AtollError):
    """A synchronous call found the target's mailbox and its slack full.

    Nothing was enqueued. Use ``await ref.endpoint.send(...)`` to wait for room
    instead of failing.
    """

    def __init__(self, actor: str, capacity: int) -> None:
        super().__init__(
            f"mailbox of {actor!r} is full ({capacity} messages); "
            "use `await ref.<endpoint>.send(...)` to wait for room"
        )
        self.actor = actor
        self.capacity = capacity


class ActorStopped(AtollError):
    """The actor stopped before (or while) handling this call."""

    def __init__(self, actor: str, reason: str = "stopped") -> None:
        super().__init__(f"actor {actor!r} is no longer running: {reason}")
        self.actor = actor
        self.reason = reason


class ActorCancelled(ActorStopped):
    """The actor was cancelled while handling this call."""


class CallCancelled(AtollError):
    """The caller cancelled this call with :meth:`Promise.cancel`."""

    def __init__(self, actor: str, endpoint: str, reason: str) -> None:
        super().__init__(f"call {actor}.{endpoint} cancelled: {reason}")
        self.actor = actor
        self.endpoint = endpoint
        self.reason = reason


class RemoteActorError(AtollError):
    """An endpoint raised; this box carries what happened, as text.

    Attributes:
        actor: the name of the actor that raised.
        endpoint: the endpoint that was running.
        exc_type: the qualified name of the original exception type.
        message: ``str()`` of the original exception.
        remote_traceback: the formatted traceback, taken where it was raised.
    """

    def __new__(
        cls,
        actor: str = "",
        endpoint: str = "",
        exc_type: str = "",
        message: str = "",
        remote_traceback: str = "",
    ) -> RemoteActorError:
        """A box of the remote type's own kind too, where this process has
        that type (``RemoteActorError[ValueError]`` is both)."""
        typed = _typed_box(exc_type) if cls is RemoteActorError else None
        return super().__new__(typed or cls)  # a typed box was tried once: it builds

    def __init__(
        self,
        actor: str,
        endpoint: str,
        exc_type: str,
        message: str,
        remote_traceback: str,
    ) -> None:
        # the remote type's own __init__ is not run: its arguments are not known
        Exception.__init__(self, f"{actor}.{endpoint} raised {exc_type}: {message}")
        self.actor = actor
        self.endpoint = endpoint
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        head = Exception.__str__(self)
        return f"{head}\n--- remote traceback ---\n{self.remote_traceback.rstrip()}"

    def __reduce__(self) -> tuple[type[RemoteActorError], tuple[str, str, str, str, str]]:
        return (
            RemoteActorError,
            (self.actor, self.endpoint, self.exc_type, self.message, self.remote_traceback),
        )


_BOXES: dict[type[Exception], type[RemoteActorError] | None] = {}


def _typed_box(exc_type: str) -> type[RemoteActorError] | None:
    """The box class for remote type ``exc_type`` ("module.QualName"), made
    once per type: a subclass of both :class:`RemoteActorError` and that type;
    None where this process does not have the type (its module is not
    imported here: nothing is imported for it), or it cannot be mixed in."""
    original = _known_exception(exc_type)
    if original is None:
        return None
    if original not in _BOXES:
        _BOXES[original] = _mixed(original)
    return _BOXES[original]


_OWN = ("actor", "endpoint", "exc_type", "message", "remote_traceback")


def _mixed(original: type[Exception]) -> type[RemoteActorError] | None:
    """The box class for ``original``, tried once with a whole instance;
    None for a type that cannot be mixed in: a layout that cannot be
    combined, a ``__new__`` of its own (``ExceptionGroup``'s), an attribute
    of the box's own that it makes read-only, or anything else that fails."""
    if any(isinstance(getattr(original, name, None), property) for name in _OWN):
        return None
    try:
        namespace = {"__hash__": BaseException.__hash__}  # a type with __eq__ has none
        box = type(
            f"RemoteActorError[{original.__name__}]", (RemoteActorError, original), namespace
        )
        trial: RemoteActorError = super(RemoteActorError, box).__new__(box)  # type: ignore[misc]
        RemoteActorError.__init__(trial, "a", "b", "c", "d", "e")
        str(trial)
    except Exception:
        return None
    return box


def _known_exception(exc_type: str) -> type[Exception] | None:
    """The exception class ``exc_type`` names, from a module already imported
    here. Not ``OSError``'s (their constructor reads the arguments as errno
    and path), nor the errors of an actor's or a link's life (``HostLost``,
    ``ActorStopped``...), which say what happened to the callee itself and
    which callers test for: one raised further away stays a plain box."""
    parts = exc_type.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        found: Any = module
        for name in parts[cut:]:
            found = getattr(found, name, None)
        if not isinstance(found, type) or not issubclass(found, Exception):
            return None
        life = _LIFE[1:]  # the errors of a life or a link, and theirs
        if found is AtollError or issubclass(found, (OSError, *life)):
            return None
        plain: type[Exception] = found
        return plain
    return None


class ActorFailed(AtollError):
    """An actor failed as a whole (not just one call), and supervision saw it.

    ``__cause__`` holds what made it fail; a parent's
    :meth:`Actor.on_child_failed` receives one of these.
    """

    def __init__(self, actor: str, error: BaseException) -> None:
        super().__init__(f"actor {actor!r} failed: {type(error).__name__}: {error}")
        self.actor = actor
        self.error = error
        self.__cause__ = error


class TransportError(AtollError):
    """A transport could not deliver a message or reach an address."""


class HostLost(TransportError):
    """The connection to a peer broke (or its process died) while calls were
    pending on it. Any network transport raises it; it is not Cap'n Proto's own."""


# errors about the callee's own life or its link: never mixed into a box
_LIFE: tuple[type[AtollError], ...] = (
    AtollError,  # the base itself: a box is one already (its subclasses mix in)
    RemoteActorError,
    ActorFailed,
    ActorStopped,
    ActorCancelled,
    CallCancelled,
    HostLost,
    MailboxFull,
    NotRunning,
    TransportError,
)
