"""Optional dependencies: which ``pip install 'atoll[EXTRA]'`` brings a module.

Parts of atoll need packages that a plain install leaves out (the
partitioner's solver, plotting). When one is missing, the user should read
which extra to install, not a bare ``ModuleNotFoundError: No module named
'ortools'``. :func:`require` imports a module or raises :class:`MissingExtra`
saying so; :func:`explain` turns a ``ModuleNotFoundError`` raised anywhere into
one, when it is about a module an extra provides (the command line does this
for every command).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ._errors import AtollError

__all__ = ["EXTRAS", "MissingExtra", "explain", "require"]

EXTRAS: dict[str, str] = {  # top-level module -> the extra that installs it
    "ortools": "partition",
    "matplotlib": "partition",
}


class MissingExtra(AtollError, ModuleNotFoundError):
    """A module that an optional extra of atoll provides is not installed."""


def _message(module: str, extra: str, purpose: str) -> str:
    needs = f"{purpose} needs {module}" if purpose else f"{module} is not installed"
    return f"{needs}: pip install 'atoll[{extra}]'"


def require(module: str, purpose: str = "") -> ModuleType:
    """Import ``module``; if it is missing, say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        found = explain(exc, purpose)
        if found is None:
            raise
        raise found from exc


def explain(exc: ModuleNotFoundError, purpose: str = "") -> MissingExtra | None:
    """``exc`` as a :class:`MissingExtra`, if an extra provides the missing module."""
    if isinstance(exc, MissingExtra):
        return exc
    top = (exc.name or "").partition(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    error = MissingExtra(_message(top, extra, purpose))
    error.name = top
    return error
