"""Array dtypes as they travel: a name for each, and which ones travel as raw bytes.

numpy names its own dtypes exactly by ``dtype.str`` (``'<f4'``, ``'|b1'``),
but not the ones ML adds through ``ml_dtypes`` (what JAX's ``bfloat16``,
``float8_*`` and ``int4`` are): ``bfloat16`` is ``'<V2'``, a bare void of two
bytes, and ``float8_e5m2`` is ``'<f1'``, which numpy reads back as nothing at
all. Every path that sends an array's bytes (inline values, pulled buffers,
shared memory, lanes, the byte stream) names its dtype with
:func:`wire_dtype` and reads it back with :func:`dtype_from_wire`, so every
dtype a user meets comes back as itself.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

import numpy as np

__all__ = ["dtype_from_wire", "dtype_name", "raw_bytes", "wire_dtype"]

_ML_MODULE = "ml_dtypes"


def dtype_name(dtype: Any) -> str:
    """``str(dtype)`` (``'float32'``, ``'bfloat16'``), remembered per dtype:
    numpy works it out in Python each time, and every run's outputs name
    theirs."""
    name = _NAMES.get(dtype)
    if name is None:
        name = str(dtype)
        if len(_NAMES) < _NAMES_KEPT:
            _NAMES[dtype] = name
    return name


_NAMES: dict[Any, str] = {}
_NAMES_KEPT = 1024


def _is_ml(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is one of ml_dtypes' scalar types (bfloat16, float8...)."""
    return dtype.type.__module__.partition(".")[0] == _ML_MODULE


def raw_bytes(dtype: np.dtype) -> bool:
    """Whether an array of ``dtype`` is its bytes and nothing else: numbers,
    bools, dates and ml_dtypes' types, not objects or records."""
    if dtype.hasobject or dtype.fields:
        return False
    return dtype.kind in "biufcmM" or _is_ml(dtype)


def wire_dtype(dtype: np.dtype) -> str:
    """The name that :func:`dtype_from_wire` turns back into ``dtype``."""
    return dtype.name if _is_ml(dtype) else dtype.str


@lru_cache(maxsize=256)
def dtype_from_wire(name: str) -> np.dtype:
    """The dtype :func:`wire_dtype` named; ``TypeError`` for a name that is
    not one (checked before any byte of the array is read)."""
    kind = getattr(importlib.import_module(_ML_MODULE), name, None) if name.isidentifier() else None
    dtype = np.dtype(kind) if isinstance(kind, type) else np.dtype(name)
    if not raw_bytes(dtype):
        raise TypeError(f"dtype {name!r} is not raw bytes")
    return dtype
