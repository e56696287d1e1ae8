"""Arrays to and from a checkpoint directory, with orbax-checkpoint.

A host saves the buffers it holds (``Host.save_arrays``) and a device loads
them back into its host's store (``Device.load_arrays``): checkpoint bytes
go between a host's memory and the disk, never through a client. Each
host writes its own directory (``host<N>`` under the checkpoint's; see
``Cluster.save``). Synchronous: the actors call these on a worker thread.
orbax-checkpoint is the ``[train]`` extra; without it, a clear error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..kernel import AtollError

__all__ = ["CheckpointError", "load", "save"]


class CheckpointError(AtollError):
    """A checkpoint could not be written or read."""


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as exc:
        raise CheckpointError(
            "checkpoints need orbax-checkpoint: pip install 'atoll[train]'"
        ) from exc
    return ocp


def save(directory: str, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` by name into ``directory`` (which must not exist yet)."""
    path = Path(directory).absolute()
    if path.exists():
        raise CheckpointError(f"{path} exists: a checkpoint is never written over")
    _orbax().PyTreeCheckpointer().save(path, dict(arrays))


def load(directory: str, names: list[str]) -> dict[str, np.ndarray]:
    """The arrays ``names`` of the checkpoint in ``directory``."""
    path = Path(directory).absolute()
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}")
    found: dict[str, Any] = _orbax().PyTreeCheckpointer().restore(path)
    missing = [name for name in names if name not in found]
    if missing:
        raise CheckpointError(f"{path} has no arrays {missing}")
    return {name: np.asarray(found[name]) for name in names}
