"""The policy network, in plain JAX: a small GNN with attention.

It reads any graph on any number of chiplets: node features go through two
rounds of message passing (mean over producers, mean over consumers) and one
self-attention layer. Each node's embedding then shifts its position along
the pipeline, a fraction ``f`` in (0, 1), away from a prior (a learned blend of
the node's midpoints in the cumulative compute and in the cumulative weights),
in logit space; the logit of chiplet ``k`` is
``-precision * (f * count - 0.5 - k)^2`` (a bump centred on the chiplet at that
fraction), plus a correction from a shared scorer of (node, chiplet) pair
features (where the node sits in the cumulative compute and weights, scaled
by the chiplet count, against ``k``). The logits are per node and per chiplet,
and neither the graph size nor the chiplet count is baked into the weights. Parameters are a flat
``dict[str, np.ndarray]`` and save to ``.npz``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._cost import node_times
from ._dp import cut_traffic
from ._graph import OpGraph
from ._hardware import Chiplets

__all__ = ["PRETRAINED", "PRETRAINED_SET", "Encoded", "Policy", "encode", "init_params", "logits"]

Params = dict[str, Any]
KINDS = (("matmul", "conv"), ("attention",), ("norm", "softmax", "reduce"), ("add",))
SPECTRAL = 4  # Laplacian eigenvectors per node (see _spectral)
NODE_FEATURES = 9 + SPECTRAL + len(KINDS)
PAIR_FEATURES = 6
PAD = 32
PRETRAINED = "pretrained.npz"  # package data: see Policy.pretrained and docs/partition.md
# the shipped set: the policy above (the default training families), then one trained
# with the weight-sharing families too (``partition-train --families all``)
PRETRAINED_SET = (PRETRAINED, "pretrained_shared.npz")


@dataclass(frozen=True)
class Encoded:
    """A (graph, chiplets) pair as padded arrays the network reads."""

    nodes: NDArray[np.float32]  # (n_pad, NODE_FEATURES)
    pairs: NDArray[np.float32]  # (n_pad, count, PAIR_FEATURES)
    a_in: NDArray[np.float32]  # (n_pad, n_pad): mean over producers
    a_out: NDArray[np.float32]  # (n_pad, n_pad): mean over consumers
    mask: NDArray[np.float32]  # (n_pad,): 1 for real nodes
    n: int


def _mid_cumulative(x: NDArray[np.float64]) -> NDArray[np.float64]:
    total = max(float(x.sum()), 1e-30)
    c = np.cumsum(x)
    result: NDArray[np.float64] = (c - x / 2) / total
    return result


def _node_features(graph: OpGraph, chiplets: Chiplets) -> NDArray[np.float64]:
    n = len(graph)
    t, w, out = node_times(graph, chiplets), graph.array("weights"), graph.array("out")
    cut = cut_traffic(graph)[1:]
    kinds = [[float(node.kind in group) for group in KINDS] for node in graph.nodes]
    cols = [
        np.arange(n) / max(n - 1, 1),
        _mid_cumulative(t),
        _mid_cumulative(w) if w.sum() > 0 else _mid_cumulative(t),
        np.log1p(t / max(float(t.mean()), 1e-30)),
        w / chiplets.sram_bytes,
        np.log1p(out / max(float(out.mean()), 1e-30)),
        np.log1p(cut / max(float(out.mean()), 1e-30)),
        np.full(n, graph.total_weight_bytes / (chiplets.count * chiplets.sram_bytes)),
        np.full(n, float(chiplets.topology == "ring")),
    ]
    return np.concatenate([np.stack(cols, axis=1), _spectral(graph), np.array(kinds)], axis=1)


def _spectral(graph: OpGraph, k: int = SPECTRAL) -> NDArray[np.float64]:
    """The ``k`` smoothest non-constant eigenvectors of the graph's normalized
    Laplacian, edges weighted by their bytes: a relaxed low-traffic embedding
    (spectral partitioning's coordinates). Each is scaled to unit RMS and its
    sign fixed so that it rises along the node order; missing ones are 0."""
    n = len(graph)
    out = np.zeros((n, k))
    if n < 3 or not graph.edges:
        return out
    w = np.zeros((n, n))
    src, dst = graph.array("src"), graph.array("dst")
    size = graph.array("ebytes")
    np.add.at(w, (src, dst), 1.0 + np.log1p(size / max(float(size.mean()), 1e-30)))
    w = w + w.T
    deg = np.maximum(w.sum(axis=1), 1e-12)
    inv = 1.0 / np.sqrt(deg)
    lap = np.eye(n) - inv[:, None] * w * inv[None, :]
    _, vecs = np.linalg.eigh(lap)
    vecs = vecs[:, 1 : k + 1] * inv[:, None]  # back from the symmetric form
    order = np.arange(n) - (n - 1) / 2
    for j in range(vecs.shape[1]):
        v = vecs[:, j] - vecs[:, j].mean()
        v /= max(float(np.sqrt(np.mean(v * v))), 1e-12)
        out[:, j] = v if float(v @ order) >= 0 else -v
    return out


def encode(graph: OpGraph, chiplets: Chiplets) -> Encoded:
    """Features and adjacency of ``graph`` on ``chiplets``, padded to a multiple of 32."""
    n, c = len(graph), chiplets.count
    size = -(-n // PAD) * PAD
    feats = _node_features(graph, chiplets)
    nodes = np.zeros((size, NODE_FEATURES), np.float32)
    nodes[:n] = feats
    k = np.arange(c)[None, :]
    mem_pos = np.cumsum(graph.array("weights")) / chiplets.sram_bytes
    pairs = np.zeros((size, c, PAIR_FEATURES), np.float32)
    pairs[:n, :, 0] = feats[:, 1:2] * c - k - 0.5
    pairs[:n, :, 1] = feats[:, 2:3] * c - k - 0.5
    pairs[:n, :, 2] = np.minimum(mem_pos[:, None] - k, 4.0)
    pairs[:n, :, 3] = k / max(c - 1, 1)
    pairs[:n, :, 4] = 1.0 / c
    if chiplets.topology == "ring":  # links from chiplet k back to chiplet 0, the short way
        pairs[:n, :, 5] = np.minimum(k, c - k) / c
    a_in = np.zeros((size, size), np.float32)
    a_in[graph.array("dst"), graph.array("src")] = 1.0
    a_out = a_in.T.copy()
    for a in (a_in, a_out):
        a /= np.maximum(a.sum(axis=1, keepdims=True), 1.0)
    mask = np.zeros(size, np.float32)
    mask[:n] = 1.0
    return Encoded(nodes, pairs, a_in, a_out, mask, n)


def init_params(seed: int = 0, hidden: int = 32) -> Params:
    """Fresh parameters (Glorot-style scale) for a network of width ``hidden``."""
    rng = np.random.default_rng(seed)

    def dense(i: int, o: int) -> NDArray[np.float32]:
        w: NDArray[np.float32] = (rng.normal(size=(i, o)) * np.sqrt(2.0 / (i + o))).astype(
            np.float32
        )
        return w

    p: Params = {"w_in": dense(NODE_FEATURES, hidden), "b_in": np.zeros(hidden, np.float32)}
    for r in range(2):
        p[f"w_mp{r}"] = dense(3 * hidden, hidden)
        p[f"b_mp{r}"] = np.zeros(hidden, np.float32)
    for name in ("wq", "wk", "wv", "wo"):
        p[name] = dense(hidden, hidden)
    p["w_node"] = dense(hidden, hidden)
    p["w_pair"] = dense(PAIR_FEATURES, hidden)
    p["b_pair"] = np.zeros(hidden, np.float32)
    p["w_logit"] = np.zeros((hidden, 1), np.float32)
    p["w_skip"] = np.zeros((PAIR_FEATURES, 1), np.float32)
    p["w_pos"] = dense(hidden, 1) * 0.1
    p["w_pos_direct"] = np.zeros((NODE_FEATURES, 1), np.float32)
    p["b_pos"] = np.zeros(1, np.float32)
    p["log_precision"] = np.ones(1, np.float32)
    p["mix"] = np.full(1, 2.0, np.float32)
    return p


def logits(p: Params, nodes: Any, pairs: Any, a_in: Any, a_out: Any, mask: Any) -> Any:
    """Per-node, per-chiplet logits ``(n_pad, count)``; traceable by ``jax.jit``."""
    import jax
    import jax.numpy as jnp

    def norm(h: Any) -> Any:  # RMS norm keeps embeddings O(1) on graphs of any size
        return h / jnp.sqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + 1e-6)

    h = norm(jax.nn.relu(nodes @ p["w_in"] + p["b_in"]))
    for r in range(2):
        msg = jnp.concatenate([h, a_in @ h, a_out @ h], axis=1)
        h = norm(h + jax.nn.relu(msg @ p[f"w_mp{r}"] + p[f"b_mp{r}"]))
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    scores = q @ k.T / np.sqrt(h.shape[1]) + (mask[None, :] - 1.0) * 1e9
    h = norm(h + (jax.nn.softmax(scores, axis=-1) @ v) @ p["wo"])
    count = pairs.shape[1]
    mix = jax.nn.sigmoid(p["mix"])  # learned blend of compute- and weight-balanced positions
    prior = jnp.clip(mix * nodes[:, 1:2] + (1 - mix) * nodes[:, 2:3], 1e-3, 1 - 1e-3)
    shift = h @ p["w_pos"] + nodes @ p["w_pos_direct"] + p["b_pos"]
    frac = jax.nn.sigmoid(jnp.log(prior / (1 - prior)) + shift)  # (n, 1)
    dist = frac * count - 0.5 - jnp.arange(count)[None, :]
    z = jax.nn.relu((h @ p["w_node"])[:, None, :] + pairs @ p["w_pair"] + p["b_pair"])
    bump = -jnp.square(dist) * jnp.exp(p["log_precision"])
    return bump + (z @ p["w_logit"] + pairs @ p["w_skip"])[..., 0]


class Policy:
    """A partitioning policy: parameters plus save/load. Train it with :mod:`._rl`."""

    def __init__(self, params: Params | None = None, seed: int = 0) -> None:
        self.params: Params = params if params is not None else init_params(seed)
        self.trained_evaluations = 0

    def save(self, path: str | Path) -> None:
        """Write the parameters to a ``.npz`` checkpoint."""
        arrays: dict[str, Any] = {k: np.asarray(v) for k, v in self.params.items()}
        arrays["__evaluations__"] = np.array(self.trained_evaluations)
        with Path(path).open("wb") as f:
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        """Read a checkpoint written by :meth:`save`."""
        with np.load(path) as data:
            params = {k: data[k].astype(np.float32) for k in data.files if not k.startswith("__")}
            policy = cls(params)
            policy.trained_evaluations = int(data["__evaluations__"])
        fresh = init_params(hidden=params["w_in"].shape[1] if "w_in" in params else 32)
        missing = set(fresh) - set(params)
        if missing:
            raise ValueError(f"{path}: not a partition policy checkpoint (missing {missing})")
        wrong = [k for k in fresh if params[k].shape != fresh[k].shape]
        if wrong:
            raise ValueError(
                f"{path}: a policy checkpoint of another version (shapes differ in {wrong});"
                " retrain it with atoll partition-train"
            )
        return policy

    @classmethod
    def pretrained(cls, name: str = PRETRAINED) -> Policy:
        """A fresh copy of the policy shipped with atoll, pre-trained on the synthetic set
        (``name``: another of :data:`PRETRAINED_SET`).

        ``atoll partition-train`` rebuilds it; ``docs/partition.md`` gives the
        command. Raises ``FileNotFoundError`` when the package data is missing.
        """
        from importlib import resources

        ref = resources.files(__package__ or "atoll.partition") / name
        if not ref.is_file():
            raise FileNotFoundError(f"the pre-trained partition policy {name} is not installed")
        with resources.as_file(ref) as path:
            return cls.load(path)

    @classmethod
    def pretrained_set(cls) -> list[Policy]:
        """Fresh copies of every policy shipped (:data:`PRETRAINED_SET`): the one
        trained on the default families first, then one trained with the
        weight-sharing families too. Each is a different draw of what a graph
        never seen looks like: ``search`` scores the greedy assignment of each
        and fine-tunes the best (``docs/partition.md``, The policy)."""
        return [cls.pretrained(name) for name in PRETRAINED_SET]

    def logits(self, enc: Encoded) -> NDArray[np.float64]:
        """Logits ``(n, count)`` for the real nodes of an encoded graph."""
        out = _jit_logits()(self.params, enc.nodes, enc.pairs, enc.a_in, enc.a_out, enc.mask)
        return np.asarray(out, dtype=np.float64)[: enc.n]


_JIT: dict[str, Any] = {}


def _jit_logits() -> Any:
    if "logits" not in _JIT:
        import jax

        _JIT["logits"] = jax.jit(logits)
    return _JIT["logits"]
