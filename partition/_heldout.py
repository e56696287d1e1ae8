"""The held-out set: real architectures the pre-trained policy never trains on.

Each graph is written in plain JAX and traced with :func:`from_jax` by shapes
only. The families are deliberately unlike both BERT and the synthetic
generator of :mod:`._synthetic` (MLPs, residual MLPs, CNN chains, branchy
inception-style CNNs, transformer encoders and mixture-of-experts encoders):

- ``unet``: a U-Net, encoder-decoder convolutions whose skip connections span
  the whole network (a tensor made at the start is read at the end);
- ``mixer``: an MLP-Mixer, token-mixing and channel-mixing MLPs on transposed
  activations;
- ``wavenet``: dilated causal 1-D convolutions with gated activations and a
  skip sum fed by every layer;
- ``gru``: a byte-level two-layer GRU language model unrolled in time (the
  recurrent weights are read at every step, the hidden state is a long
  dependency chain);
- ``densenet``: dense blocks, each layer reading the concatenation of every
  earlier layer of its block;
- ``t5``: an encoder-decoder transformer whose encoder output feeds the
  cross-attention of every decoder layer.

Nothing in training imports this module: ``synthetic_cases`` draws only from
:mod:`._synthetic`, and a test checks that no held-out name can come out of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ._graph import OpGraph
from ._jaxpr import from_jax
from ._models import layer_norm, spec

__all__ = ["HELDOUT", "heldout_graph", "heldout_names"]


def _conv(x: Any, w: Any, stride: int = 1, dilation: int = 1) -> Any:
    import jax

    return jax.lax.conv_general_dilated(
        x,
        w,
        (stride,) * (x.ndim - 2),
        "SAME",
        rhs_dilation=(dilation,) * (x.ndim - 2),
        dimension_numbers=("NHWC", "HWIO", "NHWC") if x.ndim == 4 else ("NWC", "WIO", "NWC"),
    )


def unet_graph(base: int = 32, depth: int = 4, size: int = 64) -> OpGraph:
    """A U-Net: ``depth`` down blocks (two 3x3 convs, 2x2 pool), a bottleneck,
    ``depth`` up blocks (upsample, concat with the skip, two 3x3 convs)."""
    import jax
    import jax.numpy as jnp

    chans = [base * 2**i for i in range(depth + 1)]
    down = [
        (spec(3, 3, c_in, c), spec(3, 3, c, c)) for c_in, c in zip([3, *chans], chans, strict=False)
    ]
    up = [
        (spec(3, 3, chans[i + 1] + chans[i], chans[i]), spec(3, 3, chans[i], chans[i]))
        for i in reversed(range(depth))
    ]
    params = {"down": down, "up": up, "head": spec(1, 1, base, 8)}

    def unet(p: dict[str, Any], x: Any) -> Any:
        skips = []
        for i, (w1, w2) in enumerate(p["down"]):
            x = jax.nn.relu(_conv(jax.nn.relu(_conv(x, w1)), w2))
            if i < depth:
                skips.append(x)
                n, h, w, c = x.shape
                x = x.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))
        for (w1, w2), skip in zip(p["up"], reversed(skips), strict=True):
            x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
            x = jnp.concatenate([x, skip], axis=-1)
            x = jax.nn.relu(_conv(jax.nn.relu(_conv(x, w1)), w2))
        return _conv(x, p["head"])

    return from_jax(unet, params, spec(2, size, size, 3), weight_argnums=(0,), name="unet")


def mixer_graph(blocks: int = 8, patches: int = 196, hidden: int = 512) -> OpGraph:
    """An MLP-Mixer (B/16-like widths, fewer blocks): per block a token-mixing MLP
    on the transposed activations and a channel-mixing MLP, each pre-norm and residual."""
    import jax

    def block() -> dict[str, Any]:
        return {
            "g1": spec(hidden),
            "t1": spec(patches, 256),
            "t2": spec(256, patches),
            "g2": spec(hidden),
            "c1": spec(hidden, 4 * hidden),
            "c2": spec(4 * hidden, hidden),
        }

    params = {"stem": spec(768, hidden), "blocks": [block() for _ in range(blocks)]}
    params["head"] = spec(hidden, 1000)

    def mixer(p: dict[str, Any], x: Any) -> Any:
        x = x @ p["stem"]
        for b in p["blocks"]:
            y = layer_norm(x, b["g1"], 0.0).T
            x = x + (jax.nn.gelu(y @ b["t1"]) @ b["t2"]).T
            y = layer_norm(x, b["g2"], 0.0)
            x = x + jax.nn.gelu(y @ b["c1"]) @ b["c2"]
        return x.mean(axis=0) @ p["head"]

    return from_jax(mixer, params, spec(patches, 768), weight_argnums=(0,), name="mixer")


def wavenet_graph(
    stacks: int = 2, layers: int = 10, channels: int = 64, length: int = 4096
) -> OpGraph:
    """WaveNet: ``stacks`` of dilated causal convolutions (dilation 1..512), each
    gated (tanh x sigmoid), with a residual 1x1 and a skip 1x1 summed at the end."""
    import jax
    import jax.numpy as jnp

    layer = {
        "dil": spec(2, channels, 2 * channels),
        "res": spec(1, channels, channels),
        "skip": spec(1, channels, 2 * channels),
    }
    params = {
        "stem": spec(1, 1, channels),
        "layers": [dict(layer) for _ in range(stacks * layers)],
        "out1": spec(1, 2 * channels, 2 * channels),
        "out2": spec(1, 2 * channels, 256),
    }

    def wavenet(p: dict[str, Any], x: Any) -> Any:
        x = _conv(x, p["stem"])
        skips = []
        for i, w in enumerate(p["layers"]):
            h = _conv(x, w["dil"], dilation=2 ** (i % layers))
            a, b = jnp.split(h, 2, axis=-1)
            z = jnp.tanh(a) * jax.nn.sigmoid(b)
            x = x + _conv(z, w["res"])
            skips.append(_conv(z, w["skip"]))
        s = functools.reduce(jnp.add, skips)
        return _conv(jax.nn.relu(_conv(jax.nn.relu(s), p["out1"])), p["out2"])

    return from_jax(wavenet, params, spec(1, length, 1), weight_argnums=(0,), name="wavenet")


def gru_graph(
    steps: int = 12, hidden: int = 1024, layers: int = 2, vocab: int = 256, batch: int = 32
) -> OpGraph:
    """A byte-level GRU language model (``layers`` stacked GRUs) unrolled over ``steps``."""
    import jax
    import jax.numpy as jnp

    cells = [
        {"wx": spec(hidden, 3 * hidden), "wh": spec(hidden, 3 * hidden)} for _ in range(layers)
    ]
    params = {"emb": spec(vocab, hidden), "cells": cells, "out": spec(hidden, vocab)}

    def cell(p: dict[str, Any], x: Any, h: Any) -> Any:
        xr, xz, xn = jnp.split(x @ p["wx"], 3, axis=-1)
        hr, hz, hn = jnp.split(h @ p["wh"], 3, axis=-1)
        r, z = jax.nn.sigmoid(xr + hr), jax.nn.sigmoid(xz + hz)
        return (1 - z) * jnp.tanh(xn + r * hn) + z * h

    def gru(p: dict[str, Any], ids: Any) -> Any:
        xs = p["emb"][ids]  # (batch, steps, hidden)
        hs = [jnp.zeros((ids.shape[0], hidden), xs.dtype) for _ in p["cells"]]
        outs = []
        for t in range(ids.shape[1]):
            x = xs[:, t]
            for i, c in enumerate(p["cells"]):
                hs[i] = x = cell(c, x, hs[i])
            outs.append(x)
        return jnp.stack(outs, axis=1) @ p["out"]

    struct: Any = _struct()
    return from_jax(gru, params, struct((batch, steps), np.int32), weight_argnums=(0,), name="gru")


def densenet_graph(blocks: int = 3, layers: int = 6, growth: int = 32, size: int = 32) -> OpGraph:
    """A DenseNet: each layer (1x1 bottleneck, 3x3 conv) reads the concatenation of
    every earlier output in its block; blocks are joined by a 1x1 conv and a 2x2 pool."""
    import jax
    import jax.numpy as jnp

    c, params_blocks = 2 * growth, []
    for _ in range(blocks):
        block = []
        for i in range(layers):
            block.append((spec(1, 1, c + i * growth, 4 * growth), spec(3, 3, 4 * growth, growth)))
        c = (c + layers * growth) // 2
        params_blocks.append((block, spec(1, 1, 2 * c, c)))
    params = {"stem": spec(3, 3, 3, 2 * growth), "blocks": params_blocks, "head": spec(c, 100)}

    def densenet(p: dict[str, Any], x: Any) -> Any:
        x = _conv(x, p["stem"])
        for block, trans in p["blocks"]:
            feats = [x]
            for w1, w2 in block:
                h = jnp.concatenate(feats, axis=-1)
                feats.append(_conv(jax.nn.relu(_conv(jax.nn.relu(h), w1)), w2))
            x = _conv(jnp.concatenate(feats, axis=-1), trans)
            n, hh, ww, cc = x.shape
            x = x.reshape(n, hh // 2, 2, ww // 2, 2, cc).mean(axis=(2, 4))
        return x.mean(axis=(1, 2)) @ p["head"]

    return from_jax(densenet, params, spec(8, size, size, 3), weight_argnums=(0,), name="densenet")


def t5_graph(layers: int = 4, hidden: int = 512, heads: int = 8, seq: int = 128) -> OpGraph:
    """A T5-small-like encoder-decoder: ``layers`` pre-norm encoder layers, then
    ``layers`` decoder layers with self- and cross-attention to the encoder output."""
    import jax

    ffn, vocab = 4 * hidden, 32128

    def attn_params() -> dict[str, Any]:
        return {k: spec(hidden, hidden) for k in ("q", "k", "v", "o")} | {"g": spec(hidden)}

    def ffn_params() -> dict[str, Any]:
        return {"w1": spec(hidden, ffn), "w2": spec(ffn, hidden), "g": spec(hidden)}

    params = {
        "emb": spec(vocab, hidden),
        "enc": [{"self": attn_params(), "ffn": ffn_params()} for _ in range(layers)],
        "dec": [
            {"self": attn_params(), "cross": attn_params(), "ffn": ffn_params()}
            for _ in range(layers)
        ],
        "out": spec(hidden, vocab),
    }

    def attend(p: dict[str, Any], x: Any, mem: Any) -> Any:
        y = layer_norm(x, p["g"], 0.0)
        kv = y if mem is None else mem
        split = (-1, heads, hidden // heads)
        q = (y @ p["q"]).reshape(split).transpose(1, 0, 2)
        k = (kv @ p["k"]).reshape(split).transpose(1, 0, 2)
        v = (kv @ p["v"]).reshape(split).transpose(1, 0, 2)
        w = jax.nn.softmax(q @ k.transpose(0, 2, 1), axis=-1)
        return x + (w @ v).transpose(1, 0, 2).reshape(-1, hidden) @ p["o"]

    def feed(p: dict[str, Any], x: Any) -> Any:
        return x + jax.nn.relu(layer_norm(x, p["g"], 0.0) @ p["w1"]) @ p["w2"]

    def t5(p: dict[str, Any], src: Any, tgt: Any) -> Any:
        x = p["emb"][src]
        for lay in p["enc"]:
            x = feed(lay["ffn"], attend(lay["self"], x, None))
        mem, y = x, p["emb"][tgt]
        for lay in p["dec"]:
            y = attend(lay["cross"], attend(lay["self"], y, None), mem)
            y = feed(lay["ffn"], y)
        return y @ p["out"]

    struct: Any = _struct()
    ids = struct((seq,), np.int32)
    return from_jax(t5, params, ids, ids, weight_argnums=(0,), name="t5")


def _struct() -> Any:
    import jax

    return jax.ShapeDtypeStruct


HELDOUT: dict[str, Callable[[], OpGraph]] = {
    "unet": unet_graph,
    "mixer": mixer_graph,
    "wavenet": wavenet_graph,
    "gru": gru_graph,
    "densenet": densenet_graph,
    "t5": t5_graph,
}


def heldout_names() -> list[str]:
    """The held-out graphs' names, in the order the benchmark reports them."""
    return list(HELDOUT)


@functools.cache
def heldout_graph(name: str) -> OpGraph:
    """One held-out graph by name (cached: tracing takes a second or two)."""
    try:
        return HELDOUT[name]()
    except KeyError:
        raise KeyError(f"no held-out graph {name!r}; choose from {heldout_names()}") from None
