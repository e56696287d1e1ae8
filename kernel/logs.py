"""Logging: every record names the actor it was logged from; ``ATOLL_LOG`` sets the level.

atoll logs through :mod:`logging`, under the ``atoll`` logger. :func:`configure`
(the command line calls it for every command) installs one handler on it that
writes to stderr, at the level ``ATOLL_LOG`` names (``debug``, ``info``,
``warning``, ``error``; default ``warning``), and an :class:`ActorFilter` that
stamps each record with ``actor``: the id of the actor whose endpoint was
running when it was logged (``controller/island0``), or ``-`` outside actors.

A process can carry a ``prefix`` before each line (a host process uses
``host 3 | ``), and may send its records elsewhere as well: a host forwards
them to the controller, whose terminal then shows every host's log
(``runtime/deploy/process.py``). :func:`add_sink` registers such a destination.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

from ._system import running_cell
from .config import settings

__all__ = ["FORMAT", "ActorFilter", "add_sink", "configure", "level_of", "set_prefix"]

FORMAT = "%(prefix)s%(levelname)s [%(actor)s] %(name)s: %(message)s"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS["error"] = logging.ERROR
_state = {"prefix": ""}


class ActorFilter(logging.Filter):
    """Stamps ``record.actor`` (the running actor's id, or ``-``) and
    ``record.prefix`` (this process's, e.g. ``host 3 | ``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "actor"):
            try:  # the actor whose own task logs (not one whose context leaked)
                cell = running_cell()
            except Exception:  # no async task here: a thread, or shutdown
                cell = None
            record.actor = cell.actor_id if cell is not None else "-"
        if not hasattr(record, "prefix"):
            record.prefix = _state["prefix"]
        return True


def level_of(text: str | None) -> int:
    """The level ``ATOLL_LOG``'s text names (``warning`` when unset or unknown)."""
    return _LEVELS.get((text or "warning").strip().lower(), logging.WARNING)


# the Python loggers of the libraries under atoll: their lines go out as atoll's
THIRD_PARTY = ("jax", "jaxlib", "absl", "orbax", "etils")


def configure(prefix: str = "", stream: Any = None) -> logging.Logger:
    """Log the ``atoll`` logger's records to stderr (or ``stream``), at
    ``ATOLL_LOG``'s level, each line with its actor; and the records of the
    libraries under atoll (``THIRD_PARTY``) the same way, at that level
    (warnings and above by default). Idempotent."""
    _state["prefix"] = prefix
    logger = logging.getLogger("atoll")
    wanted = settings().log
    # unset: leave the level to the root logger (warning, unless the program says)
    logger.setLevel(level_of(wanted) if wanted else logging.NOTSET)
    handler = _Stderr(stream)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(ActorFilter())
    for name in ("atoll", *THIRD_PARTY):
        target = logging.getLogger(name)
        for old in [h for h in target.handlers if isinstance(h, _Stderr)]:
            target.removeHandler(old)
        target.addHandler(handler)
        if name != "atoll":
            # a level only when ATOLL_LOG names one: JAX reads its logger's level
            # into XLA's C++ log threshold, which quiet_native_logs sets otherwise
            target.setLevel(level_of(wanted) if wanted else logging.NOTSET)
            target.propagate = False  # once, as atoll's, not again by the root's handler
    return logger


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``stream``, else to whatever ``sys.stderr`` is at the time."""

    def __init__(self, stream: Any = None) -> None:
        super().__init__(stream or sys.stderr)
        self._fixed = stream

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = self._fixed or sys.stderr
        super().emit(record)


def set_prefix(prefix: str) -> None:
    """What this process writes before each line from now on (``host 3 | ``)."""
    _state["prefix"] = prefix


class _Sink(logging.Handler):
    """Hands each formatted record to ``send`` (never recursively)."""

    def __init__(self, send: Callable[[str, int, str], None]) -> None:
        super().__init__()
        self._send = send
        self._busy = False
        self.addFilter(ActorFilter())
        self.setFormatter(logging.Formatter("%(levelname)s [%(actor)s] %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if self._busy:  # sending logged something itself
            return
        self._busy = True
        try:
            self._send(record.name, record.levelno, self.format(record))
        except Exception:
            self.handleError(record)
        finally:
            self._busy = False


def add_sink(send: Callable[[str, int, str], None]) -> Callable[[], None]:
    """Also hand every ``atoll`` record to ``send(logger, level, line)``; returns
    what removes it again."""
    logger = logging.getLogger("atoll")
    sink = _Sink(send)
    logger.addHandler(sink)
    return lambda: logger.removeHandler(sink)


# XLA's (TSL's) C++ log threshold for each ATOLL_LOG level: 0 info, 1 warning, 2 error
_NATIVE_LEVELS = {logging.DEBUG: "0", logging.INFO: "0", logging.WARNING: "2"}
# lines native libraries print on stdout that say nothing to a user
_NATIVE_NOISE = re.compile(r"^\[Gloo\] ")


def quiet_native_logs() -> None:
    """Make the native libraries under JAX as quiet as ``ATOLL_LOG`` asks:
    their C++ log threshold (``TF_CPP_MIN_LOG_LEVEL``, read when they first
    log, so call this before JAX starts) shows their warnings only with
    ``ATOLL_LOG=info`` or ``debug``. A threshold the user set is kept; child
    processes inherit it."""
    if "TF_CPP_MIN_LOG_LEVEL" not in os.environ:
        level = level_of(settings().log)
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = _NATIVE_LEVELS.get(level, "2")


def filter_native_stdout() -> None:
    """Drop the lines native libraries print on this process's stdout that
    say nothing to a user (Gloo's "Rank N is connected to M peer ranks"),
    unless ``ATOLL_LOG=debug``; every other line goes through unchanged.

    Gloo writes with C++ streams, past Python: file descriptor 1 becomes a
    pipe, and a thread copies what comes down it, line by line, to the
    stdout the process had. For processes atoll starts (host processes)."""
    if level_of(settings().log) <= logging.DEBUG:
        return
    sys.stdout.flush()
    real = os.dup(1)
    read, write = os.pipe()
    os.dup2(write, 1)
    os.close(write)
    copier = threading.Thread(target=_copy_lines, args=(read, os.dup(real)), daemon=True)
    copier.start()
    atexit.register(_last_lines, copier, real)


def _last_lines(copier: threading.Thread, real: int) -> None:
    """At exit: what is still in the pipe goes out before the process does,
    and fd 1 is the real stdout again (for whatever exits after)."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        os.dup2(real, 1)  # closes the pipe's last writer: the copier reads to its end
    copier.join(timeout=2.0)


def _copy_lines(read: int, write: int) -> None:
    """Copy the pipe to the real stdout, line by line, without the noise; if
    the real stdout goes (its reader gone), go on draining the pipe, so that
    nothing that writes to fd 1 ever blocks on a full pipe."""
    with os.fdopen(read, "rb") as lines, os.fdopen(write, "wb", buffering=0) as out:
        broken = False
        for line in lines:
            if broken or _NATIVE_NOISE.match(line.decode("utf-8", "replace")):
                continue
            try:
                out.write(line)
            except OSError:
                broken = True
