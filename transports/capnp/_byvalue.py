"""Functions and classes that the receiver cannot import, pickled by value.

The codec pickles by reference ("module.name"), which needs the receiver to
import the same module. A function or class defined in the user's script
(``__main__``), a lambda or a closure cannot be found that way, so the codec
hands exactly those to :func:`reduce`, which pickles them by value with
cloudpickle (their code, closure cells and the globals they use), the way
Ray and Dask do.

Actors, promises and big arrays inside such a function (in a closure cell or a
global it reads) are set aside by the same rule as everywhere else in the
codec: ``set_aside`` names them, they travel next to the bytes as
capabilities, and :func:`load` puts them back. This module imports cloudpickle,
so the codec imports it only when a value needs it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import socket
import weakref
from collections import ChainMap
from collections.abc import Callable
from types import CodeType
from typing import Any, ClassVar

import cloudpickle

from .._imports import CannotImport, find_class

__all__ = ["load", "reduce"]


_CLOUD_CODE_REDUCE = cloudpickle.Pickler.dispatch_table[CodeType]
_DUMPED: weakref.WeakKeyDictionary[Any, bytes] = weakref.WeakKeyDictionary()  # see reduce


def _code_reduce(code: CodeType) -> tuple[Callable[..., CodeType], tuple[Any, ...]]:
    """cloudpickle's reduction of ``code``, keeping its file name (cloudpickle
    writes ``<dynamic-code>``), so remote tracebacks point at the user's file."""
    rebuild, args = _CLOUD_CODE_REDUCE(code)
    return _named_code, (rebuild, args, code.co_filename)


def _named_code(rebuild: Callable[..., CodeType], args: tuple[Any, ...], filename: str) -> CodeType:
    return rebuild(*args).replace(co_filename=filename)


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, with what ``set_aside`` names kept out of the bytes."""

    dispatch_table: ClassVar[ChainMap[type, Any]] = ChainMap(
        {CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table
    )

    def __init__(self, file: io.BytesIO, set_aside: Callable[[Any], bool]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._set_aside = set_aside
        self.caps: list[Any] = []

    def persistent_id(self, obj: Any) -> int | None:
        if self._set_aside(obj):
            self.caps.append(obj)
            return len(self.caps) - 1
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, caps: tuple[Any, ...]) -> None:
        super().__init__(file)
        self._caps = caps

    def persistent_load(self, pid: Any) -> Any:
        return self._caps[int(pid)]

    def find_class(self, module: str, name: str) -> Any:
        return find_class(super().find_class, module, name)  # says what is missing, where


def reduce(
    obj: Any, set_aside: Callable[[Any], bool]
) -> tuple[Callable[[bytes, tuple[Any, ...]], Any], tuple[bytes, tuple[Any, ...]]]:
    """A pickle reduction of ``obj`` by value: ``load(bytes, caps)``.

    The caps (actors, promises, big arrays) are left in the reduction, so the
    enclosing pickler sends them as capabilities and the receiver decodes them
    before :func:`load` runs.

    A function or class without caps is pickled once, when first sent, and
    its bytes are reused while it lives (cloudpickle costs about a
    millisecond a function, which a call per ``cluster.run`` would pay each
    time). Like a Ray remote function, it carries the values of the globals
    and closure cells it read then: rebinding a global later is not seen on
    the hosts; defining the function again makes a new one.
    """
    known = _DUMPED.get(obj)
    if known is not None:
        return load, (known, ())
    data = io.BytesIO()
    pickler = _Pickler(data, set_aside)
    pickler.dump(obj)
    if not pickler.caps:
        with contextlib.suppress(TypeError):  # an object without weak references
            _DUMPED[obj] = data.getvalue()
    return load, (data.getvalue(), tuple(pickler.caps))


def load(data: bytes, caps: tuple[Any, ...]) -> Any:
    """The object :func:`reduce` pickled, with its caps put back.

    Without caps, the same bytes give the same object each time (remembered,
    most recent first), so caches keyed by a function, such as a JAX
    device's compiled code, keep hitting when the function is sent again.
    """
    try:
        if caps:
            return _Unpickler(io.BytesIO(data), caps).load()
        return _load_plain(data)
    except CannotImport:
        raise
    except ImportError as exc:  # a module the function's globals use (cloudpickle's subimport)
        missing = exc.name or "a module"
        raise CannotImport(
            f"a function sent by value uses {missing!r}, which cannot be imported in process "
            f"{os.getpid()} on {socket.gethostname()}: {exc}. Install it where the hosts run"
        ) from exc


@functools.lru_cache(maxsize=256)
def _load_plain(data: bytes) -> Any:
    return _Unpickler(io.BytesIO(data), ()).load()
