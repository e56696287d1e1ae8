"""Colocated Python: the hosts prepare the data, a JAX program reads it where it is.

Each host of a 4-device slice holds a :class:`Tokenizer` actor of this
session (``cluster.spawn(..., host=h)``): its vocabulary, and how many rows
it tokenized. Each step, every host runs :func:`prepare` beside its
devices: it cuts its own rows out of a text corpus (the standard library's
sources), augments them (a seeded random crop, case folding, masked bytes)
and has its host's tokenizer turn them into tokens, straight into its
devices' store. A JAX program
over the slice then scores each row (a fixed linear model over byte counts),
reading each host's rows where they are; and each host runs :func:`label`
on its rows of the scores, beside the devices that made them. The client
sends each step's number, and fetches the labels: no byte of the data
passes through it.

The labels are checked against the same steps in plain numpy and JAX, in
this process. ``--hosts 2`` runs the devices in two host processes (each
prepares its own rows, in its own process); without it, one in-process host
holds them all. ``docs/colocated.md`` says what runs where.

Run it: ``atoll run colocated [--hosts 2] [--steps N] [--backend trio]``.
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import atoll
from atoll.devices import Aval, Shard
from atoll.examples import lm
from atoll.kernel import Actor, ActorRef, endpoint

__all__ = ["ROWS", "WIDTH", "ColocatedResult", "Tokenizer", "main", "reference", "run"]

ROWS, WIDTH, DEVICES = 32, 64, 4  # rows per step, bytes per row, devices of the slice
CLASSES = 4


def rows_of(step: int, rows: slice) -> np.ndarray:
    """Rows ``rows`` of step ``step``'s tokens: windows of the corpus, cropped
    (a random start within the window), case-folded at random, with a tenth
    of the bytes masked (0); int32. The same wherever it runs."""
    data = lm.corpus("train")
    out = np.zeros((rows.stop - rows.start, WIDTH), np.int32)
    for i, row in enumerate(range(rows.start, rows.stop)):
        rng = np.random.default_rng([step, row])
        start = int(rng.integers(0, len(data) - 2 * WIDTH))
        crop = int(rng.integers(0, WIDTH // 4))
        window = data[start + crop : start + crop + WIDTH].astype(np.int32)
        if rng.random() < 0.5:
            window = np.where((window >= 65) & (window <= 90), window + 32, window)
        out[i] = np.where(rng.random(WIDTH) < 0.1, 0, window)
    return out


def vocabulary() -> np.ndarray:
    """Byte value to token id (a fixed permutation)."""
    return np.random.default_rng(3).permutation(256).astype(np.int32)


class Tokenizer(Actor):
    """A session's actor on one host: its vocabulary, and the rows it tokenized."""

    def __init__(self) -> None:
        self.table = vocabulary()
        self.rows = 0

    @endpoint
    def tokenize(self, rows: np.ndarray) -> np.ndarray:
        self.rows += len(rows)
        tokens: np.ndarray = self.table[rows]
        return tokens

    @endpoint
    def tokenized(self) -> int:
        return self.rows


async def _prepare(step: int, tokenizers: dict[int, ActorRef[Tokenizer]], shard: Shard) -> Any:
    """This host's rows of step ``step``, tokenized by this host's tokenizer
    (runs on the host's event loop, beside its devices and its actor)."""
    tokens: np.ndarray = await tokenizers[shard.host_id].tokenize(rows_of(step, shard.blocks[0][0]))
    return tokens


prepare = atoll.colocated(
    _prepare, out=Aval((ROWS, WIDTH), "int32"), out_specs=P("data"), name="prepare"
)


def weights() -> np.ndarray:
    """The fixed linear model: one score per class for each byte value."""
    return np.random.default_rng(7).standard_normal((256, CLASSES)).astype(np.float32)


def score(w: Any, tokens: Any) -> Any:
    """Each row's class probabilities, from its byte counts."""
    counts = jax.nn.one_hot(tokens, 256, dtype=jnp.float32).sum(axis=1)
    return jax.nn.softmax(counts @ w / WIDTH, axis=-1)


def _label(probabilities: np.ndarray) -> np.ndarray:
    """Each row's class and this host's process id (runs on the host)."""
    labels = np.argmax(probabilities, axis=1).astype(np.int32)
    return np.stack([labels, np.full_like(labels, os.getpid())], axis=1)


label = atoll.colocated(
    _label, out=Aval((ROWS, 2), "int32"), in_specs=[P("data")], out_specs=P("data"), name="label"
)


@dataclass
class ColocatedResult:
    labels: np.ndarray  # (steps, ROWS)
    pids: list[set[int]]  # per step, the processes that labelled its rows
    # bytes of arrays this process sent after the first step (None in one
    # process, where nothing is sent: the hosts are here)
    client_array_bytes: int | None
    tokenized: dict[int, int]  # rows each host's tokenizer tokenized


async def run(steps: int = 3, hosts: int = 0) -> ColocatedResult:
    """``steps`` steps of prepare, score, label; ``hosts``: host processes (0: none)."""
    from atoll.kernel.lowlevel import counts

    if hosts not in (0, 1, 2, 4):
        raise ValueError(f"{DEVICES} devices split over 1, 2 or 4 host processes, not {hosts}")
    from atoll.examples.train_lm import cluster_for  # (optax only where a model trains)

    async with cluster_for(DEVICES, hosts) as cluster:
        mesh = await cluster.devices(DEVICES, axis_names=("data",))
        scored = mesh.jit(score, in_specs=(None, P("data")), out_specs=P("data"))
        w = atoll.ArrayRef(cluster.put(weights(), 0), Aval((256, CLASSES), "float32"))
        hosts_of = sorted({cluster.topology.device(d).host for d in range(DEVICES)})
        tokenizers = {h: await cluster.spawn(Tokenizer, host=h) for h in hosts_of}
        tables, pids, sent = [], [], 0
        for step in range(steps):
            before = counts["array_bytes_out"]
            tokens = await cluster.colocated(prepare, mesh, step, tokenizers)  # made on the hosts
            probabilities = cluster.run(scored, w, tokens).refs
            labelled = await cluster.fetch(await cluster.colocated(label, mesh, probabilities))
            sent += counts["array_bytes_out"] - before if step else 0
            tables.append(labelled[:, 0])
            pids.append({int(p) for p in labelled[:, 1]})
        tokenized = {h: await t.tokenized() for h, t in tokenizers.items()}
    return ColocatedResult(np.stack(tables), pids, sent if hosts else None, tokenized)


def reference(steps: int = 3) -> np.ndarray:
    """The same labels in this process: numpy's rows, JAX's scores, on one device."""
    w, table = weights(), vocabulary()
    return np.stack(
        [
            np.argmax(jax.jit(score)(w, table[rows_of(s, slice(0, ROWS))]), axis=1)
            for s in range(steps)
        ]
    )


async def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(prog="atoll run colocated", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hosts", type=int, default=0, help="host processes (0: in-process)")
    args = parser.parse_args(list(argv))
    result = await run(args.steps, args.hosts)
    same = np.array_equal(result.labels, reference(args.steps))
    where = sorted(set().union(*result.pids))
    print(f"labels of {args.steps} steps x {ROWS} rows, made on the hosts: {result.labels[-1]}")
    print(f"rows prepared and labelled in processes {where} (this one: {os.getpid()})")
    if result.client_array_bytes is not None:
        print(f"array bytes this client sent after the first step: {result.client_array_bytes}")
    print(f"rows each host's tokenizer tokenized: {result.tokenized}")
    print(f"matches plain numpy and JAX: {same}")
    if not same:
        sys.exit(1)
