"""Checkpoints of values on the cluster, written and read by the hosts that hold them.

``await cluster.save(tree, directory)`` takes a pytree whose leaves are
:class:`~atoll.runtime.client.ArrayRef` (or handles, or plain values). Each
host writes the buffers it holds into ``directory/host<N>`` with
orbax-checkpoint (``Host.save_arrays``): the bytes go from the hosts'
memory to the disk, not through the client. The client writes only
``directory/tree.pkl``: the tree's structure, where each leaf went, and the
small values that ride in their handles (which it already has).

``await cluster.restore(directory, device)`` reads them back: each host's
part is loaded by ``device`` (``Device.load_arrays``, onto its host's
store: possibly another device than the one that saved it), and the same
tree comes back with :class:`ArrayRef` leaves, owned and freed like the
outputs of a run. A directory is written once, never over.

Asynchronous: both wait for the hosts (and for values still being computed).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..devices import Aval, BufferHandle
from ..devices._checkpoint import CheckpointError
from ..kernel import Promise, as_promise, value_of

if TYPE_CHECKING:
    from .client import Cluster

__all__ = ["CheckpointError", "restore", "save"]

TREE = "tree.pkl"


async def save(cluster: Cluster, tree: Any, directory: str | Path) -> None:
    """Write ``tree``'s values into ``directory`` from the hosts that hold them."""
    import jax

    from .client import ArrayRef

    root = Path(directory).absolute()
    if root.exists():
        raise CheckpointError(f"{root} exists: a checkpoint is never written over")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    by_host: dict[int, tuple[Any, dict[str, str]]] = {}
    places: list[tuple[str, Any]] = []  # per leaf: ("host", (host id, name)) or ("value", v)
    for i, leaf in enumerate(leaves):
        value = leaf.promise if isinstance(leaf, ArrayRef) else leaf
        if isinstance(value, (Promise, BufferHandle)):
            handle = await value_of(value)
            if handle.value is None:  # in its host's store: that host writes it
                by_host.setdefault(handle.host_id, (handle.host, {}))[1][f"leaf{i}"] = handle.id
                places.append(("host", (handle.host_id, f"leaf{i}")))
                continue
            value = handle.value  # small: it rode along in its handle
        places.append(("value", np.asarray(value)))
    root.mkdir(parents=True)
    for host_id, (host, buffers) in by_host.items():
        await host.save_arrays(str(root / f"host{host_id}"), buffers, cluster.owner)
    (root / TREE).write_bytes(pickle.dumps((treedef, places)))


async def restore(
    cluster: Cluster,
    directory: str | Path,
    device: int,
    track: Callable[[Promise[BufferHandle]], Promise[BufferHandle]],
) -> Any:
    """The tree saved in ``directory``, its arrays loaded by physical
    ``device``; ``track`` makes each the client's own (freed when dropped)."""
    from .client import ArrayRef

    root = Path(directory).absolute()
    if not (root / TREE).is_file():
        raise CheckpointError(f"no checkpoint at {root} (no {TREE})")
    treedef, places = pickle.loads((root / TREE).read_bytes())
    wanted: dict[int, list[str]] = {}
    for kind, place in places:
        if kind == "host":
            wanted.setdefault(place[0], []).append(place[1])
    ref = cluster.device_ref(device)
    loaded: dict[str, BufferHandle] = {}
    for host_id, names in wanted.items():
        part = await ref.load_arrays(str(root / f"host{host_id}"), names, cluster.owner)
        loaded.update(part)
    leaves: list[Any] = []
    for kind, place in places:
        if kind == "value":
            leaves.append(place)
            continue
        handle = loaded[place[1]]
        promise = track(as_promise(handle))
        leaves.append(ArrayRef(promise, Aval(tuple(handle.shape), str(handle.dtype))))
    return treedef.unflatten(leaves)
