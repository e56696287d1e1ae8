"""Checkpoints of values on the cluster, written and read by the hosts that hold them.

``await cluster.save(tree, directory)`` takes a pytree whose leaves are
:class:`~atoll.runtime.client.client.ArrayRef` (or handles, or plain values). Each
host writes the buffers it holds into ``directory/host<N>`` with
orbax-checkpoint (``Host.save_arrays``): the bytes go from the hosts'
memory to the filesystem, not through the client. The client writes only
``directory/tree.pkl``: the tree's structure, where each leaf went, and the
small values that ride in their handles (which it already has).

``await cluster.restore(directory, device)`` reads them back: one device
loads every host's part (``Device.load_arrays``, into its host's store:
possibly another device than the one that saved it), and the same tree
comes back with :class:`ArrayRef` leaves, owned and freed like the outputs
of a run.

Where it works: the directory must be one the hosts and the client all see
at the same path (one machine, or a shared filesystem), and the checkpoint
must fit in the loading host's store. ``tree.pkl`` is a pickle: restore only
checkpoints you trust. A directory is written once, never over; a save that
fails removes what it wrote.

Asynchronous: both wait for the hosts (and for values still being computed).
"""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ...devices import BufferHandle, Device
from ...devices._checkpoint import CheckpointError
from ...kernel import ActorRef, Promise, value_of

__all__ = ["CheckpointError", "restore", "save"]

TREE = "tree.pkl"


async def save(
    tree: Any,
    directory: str,
    owner: str,
    locate: Callable[[list[str]], Promise[dict[str, BufferHandle]]] | None = None,
) -> None:
    """Write ``tree`` (leaves: promises of handles, handles, or plain values)
    into ``directory`` from the hosts that hold it (see the module docstring).
    ``locate``: where buffers that moved are now (``Controller.locate``),
    asked once: each is written by the host that holds it now."""
    import jax

    root = Path(directory).absolute()
    if root.exists():
        raise CheckpointError(f"{root} exists: a checkpoint is never written over")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaves = [await value_of(v) if isinstance(v, Promise) else v for v in leaves]
    moved: dict[str, BufferHandle] = {}
    if locate is not None:
        held = [v.id for v in leaves if isinstance(v, BufferHandle) and v.value is None]
        moved = await locate(held) if held else {}
    by_host: dict[int, tuple[Any, dict[str, str]]] = {}
    places: list[tuple[str, Any]] = []  # per leaf: ("host", (host id, name)) or ("value", v)
    for i, leaf in enumerate(leaves):
        value = leaf
        if isinstance(value, BufferHandle):
            handle = moved.get(value.id, value)
            if handle.value is None:  # in its host's store: that host writes it
                by_host.setdefault(handle.host_id, (handle.host, {}))[1][f"leaf{i}"] = handle.id
                places.append(("host", (handle.host_id, f"leaf{i}")))
                continue
            value = handle.value  # small: it rode along in its handle
        places.append(("value", np.asarray(value)))
    root.mkdir(parents=True)
    try:
        for host_id, (host, buffers) in by_host.items():
            await host.save_arrays(str(root / f"host{host_id}"), buffers, owner)
        (root / TREE).write_bytes(pickle.dumps((treedef, places)))
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)  # no half checkpoint blocks a retry
        raise


async def restore(
    directory: str, device: ActorRef[Device], owner: str, wrap: Callable[[BufferHandle], Any]
) -> Any:
    """The tree saved in ``directory``, its arrays loaded by ``device``; each
    loaded handle goes through ``wrap`` at once (the client's ownership, so
    that a later failure leaves nothing unowned)."""
    root = Path(directory).absolute()
    if not (root / TREE).is_file():
        raise CheckpointError(f"no checkpoint at {root} (no {TREE})")
    treedef, places = pickle.loads((root / TREE).read_bytes())
    wanted: dict[int, list[str]] = {}
    for kind, place in places:
        if kind == "host":
            wanted.setdefault(place[0], []).append(place[1])
    loaded: dict[str, Any] = {}
    for host_id, names in wanted.items():
        part = await device.load_arrays(str(root / f"host{host_id}"), names, owner)
        loaded.update({name: wrap(handle) for name, handle in part.items()})
    leaves = [loaded[place[1]] if kind == "host" else place for kind, place in places]
    return treedef.unflatten(leaves)
