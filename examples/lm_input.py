"""The language model's input pipeline on the hosts: each makes its own rows of each batch.

``atoll run train_lm --input hosts`` (the default for data-parallel
training) does not build batches in the client. Each host of the
data-parallel slice runs :func:`host_rows`, a colocated function
(``docs/colocated.md``): it cuts its own rows of step ``n``'s batch out of
the corpus, in its own process, into its own devices' store, where the step
reads them. The client sends only the step's number; no byte of a batch
passes through it.

:class:`HostBatches` is the iterator the training loop holds. It asks for
each batch ``prefetch`` steps before the step that reads it, so the hosts
make batches ahead of the devices (at most ``prefetch`` batches wait in the
stores). Its position is what a checkpoint keeps (:meth:`HostBatches.state`);
a run restored from it sees the same batches, in the same order, as one that
never stopped. The data order is :func:`atoll.examples.lm.batch_at`'s, so the
losses are those of ``--input client``, bit for bit.

Why not Grain: its data loaders read a random-access source through an
index sampler, and their checkpoint is the next index; the corpus here is one
byte array in each host's memory and a batch is a function of its step, so a
loader is that function and its position the next step. Grain would add a
dependency (and its worker processes) for no more than that.
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

import atoll
from atoll.devices import Aval, Shard

from . import lm

__all__ = ["HostBatches", "batch_rows", "host_rows"]


def batch_rows(step: int, config: lm.LMConfig, rows: slice, split: str = "train") -> np.ndarray:
    """Rows ``rows`` of :func:`~atoll.examples.lm.batch_at`'s batch of
    ``step``, read from the corpus alone (the same windows, the same bytes)."""
    data = lm.corpus(split)
    rng = np.random.default_rng([config.seed, step, split == "eval"])
    starts = rng.integers(0, len(data) - config.context - 1, config.batch)[rows]
    return np.stack([data[s : s + config.context + 1] for s in starts]).astype(np.int32)


def _host_rows(step: int, config: lm.LMConfig, shard: Shard) -> np.ndarray:
    """This host's rows of step ``step``'s batch (runs on the host)."""
    return batch_rows(step, config, shard.blocks[0][0])


def host_rows(config: lm.LMConfig) -> atoll.runtime.ColocatedFunction:
    """The colocated function that makes a host's rows of a batch."""
    shape = Aval((config.batch, config.context + 1), "int32")
    return atoll.colocated(_host_rows, out=shape, out_specs=P("data"), name="batch rows")


class HostBatches:
    """Batches made on the hosts of ``mesh``, one step at a time, asked for
    ``prefetch`` steps ahead (see the module docstring).

    ``next()`` is asynchronous only as far as the hosts taking the call: it
    returns the batch's :class:`~atoll.ShardedRef` once they have been asked
    for it, long before the rows exist.
    """

    def __init__(
        self,
        cluster: atoll.Cluster,
        mesh: atoll.VirtualSlice,
        config: lm.LMConfig,
        start: int = 0,
        prefetch: int = 4,
    ) -> None:
        self.cluster, self.mesh, self.config = cluster, mesh, config
        self.position = start  # the step of the next batch handed out
        self.prefetch = prefetch
        self._rows = host_rows(config)
        self._asked: deque[tuple[int, atoll.ShardedRef]] = deque()

    async def next(self) -> atoll.ShardedRef:
        """The next step's batch; the hosts are asked for the ones after it."""
        while len(self._asked) <= self.prefetch:
            step = self.position + len(self._asked)
            ref = await self.cluster.colocated(self._rows, self.mesh, step, self.config)
            self._asked.append((step, ref))
        step, ref = self._asked.popleft()
        self.position = step + 1
        return ref

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the next step, and the seed of the order."""
        return {"next_step": np.int64(self.position), "seed": np.int64(self.config.seed)}

    @classmethod
    def restored(
        cls,
        cluster: atoll.Cluster,
        mesh: atoll.VirtualSlice,
        config: lm.LMConfig,
        state: dict[str, Any],
        prefetch: int = 4,
    ) -> HostBatches:
        """An iterator that goes on where :meth:`state` was taken."""
        if int(state["seed"]) != config.seed:
            raise ValueError(
                f"the saved input order has seed {int(state['seed'])}, this model {config.seed}"
            )
        return cls(cluster, mesh, config, int(state["next_step"]), prefetch)
