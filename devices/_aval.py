"""Abstract values: the shape and dtype of an array before it exists.

Dispatch runs ahead of the data, so every buffer a gang will write is known by
its :class:`Aval` first: the runtime's graphs are typed with them, and a device
reserves a gang's output bytes from them before the gang runs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Aval"]


@dataclass(frozen=True)
class Aval:
    """An abstract value: the shape and dtype of an array that may not exist yet."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        import numpy as np

        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize
