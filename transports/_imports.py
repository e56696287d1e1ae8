"""What a receiver says when it cannot import what a message names.

A function or class travels by reference ("module.name") unless it lives in
the sender's ``__main__`` or a closure (``_byvalue``). A host that lacks the
module, or has another version of it, cannot find it; instead of a bare
``ModuleNotFoundError`` the call fails with :class:`CannotImport`, which names
what was looked for, where, and what to do about it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

from ..kernel import AtollError

__all__ = ["CannotImport", "find_class"]


class CannotImport(AtollError, ImportError):
    """A message names a function or class this process cannot import."""


_FOUND: dict[tuple[str, str], Any] = {}  # what pickles named, as found here
_FOUND_KEPT = 4096


def find_class(find: Callable[[str, str], Any], module: str, name: str) -> Any:
    """``find(module, name)`` (an unpickler's own ``find_class``), with an
    error that names the missing object and this process. What was found is
    kept: the import machinery runs once per name, not for every message
    (about a microsecond a name, and a run's message names a few)."""
    found = _FOUND.get((module, name))
    if found is not None:
        return found
    try:
        found = find(module, name)
    except (ImportError, AttributeError) as exc:
        where = f"process {os.getpid()} on {socket.gethostname()}"
        raise CannotImport(
            f"cannot import {module}.{name} in {where}: {type(exc).__name__}: {exc}. "
            f"Install {module.partition('.')[0]!r} where the hosts run (the same version as "
            "here), or define the function in your script: functions of __main__, "
            "lambdas and closures travel by value"
        ) from exc
    if len(_FOUND) < _FOUND_KEPT:
        _FOUND[module, name] = found
    return found
