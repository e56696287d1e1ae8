"""Built-in graphs, written in plain JAX and imported with :func:`from_jax`.

Only shapes are used (``jax.ShapeDtypeStruct``): no weight is ever allocated.
``bert`` is BERT-base (12 layers, hidden 768, 12 heads, sequence 128); the
synthetic generator draws MLPs, CNN-like chains, transformers of other
depths and widths, weight-tied encoders and unrolled RNNs for pre-training
the policy.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from ._graph import OpGraph
from ._jaxpr import from_jax

__all__ = [
    "bert_graph",
    "builtin_graph",
    "builtin_names",
    "cnn_graph",
    "decoder_graph",
    "inception_graph",
    "layer_norm",
    "mlp_graph",
    "moe_graph",
    "residual_mlp_graph",
    "rnn_graph",
    "spec",
    "tied_transformer_graph",
    "transformer_graph",
]

Params = dict[str, Any]


def spec(*shape: int) -> Any:
    import jax
    import jax.numpy as jnp

    struct: Any = jax.ShapeDtypeStruct  # untyped in jax's stubs
    return struct(shape, jnp.bfloat16)


def layer_norm(x: Any, g: Any, b: Any) -> Any:
    import jax
    import jax.numpy as jnp

    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-12) * g + b


def _encoder_layer(p: Params, x: Any, heads: int) -> Any:
    import jax
    import jax.numpy as jnp

    seq, hidden = x.shape
    split = (seq, heads, hidden // heads)
    q = (x @ p["wq"] + p["bq"]).reshape(split).transpose(1, 0, 2)
    k = (x @ p["wk"] + p["bk"]).reshape(split).transpose(1, 0, 2)
    v = (x @ p["wv"] + p["bv"]).reshape(split).transpose(1, 0, 2)
    scores = jnp.einsum("hqd,hkd->hqk", q, k) / np.sqrt(hidden // heads)
    ctx = jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(scores, axis=-1), v)
    attn = ctx.transpose(1, 0, 2).reshape(seq, hidden) @ p["wo"] + p["bo"]
    x = layer_norm(x + attn, p["g1"], p["b1"])
    ff = jax.nn.gelu(x @ p["w1"] + p["c1"]) @ p["w2"] + p["c2"]
    return layer_norm(x + ff, p["g2"], p["b2"])


def _encoder_params(layers: int, hidden: int, ffn: int, vocab: int, seq: int) -> Params:
    def layer() -> Params:
        sq, vec = spec(hidden, hidden), spec(hidden)
        return {
            "wq": sq,
            "wk": sq,
            "wv": sq,
            "wo": sq,
            "bq": vec,
            "bk": vec,
            "bv": vec,
            "bo": vec,
            "g1": vec,
            "b1": vec,
            "g2": vec,
            "b2": vec,
            "w1": spec(hidden, ffn),
            "c1": spec(ffn),
            "w2": spec(ffn, hidden),
            "c2": vec,
        }

    return {
        "tok": spec(vocab, hidden),
        "pos": spec(seq, hidden),
        "g0": spec(hidden),
        "b0": spec(hidden),
        "layers": [layer() for _ in range(layers)],
    }


def _encoder(heads: int, repeat: int = 1) -> Callable[[Params, Any], Any]:
    def encoder(params: Params, ids: Any) -> Any:
        x = params["tok"][ids] + params["pos"][: ids.shape[0]]
        x = layer_norm(x, params["g0"], params["b0"])
        for p in params["layers"]:
            for _ in range(repeat):
                x = _encoder_layer(p, x, heads)
        return x

    return encoder


def transformer_graph(
    layers: int = 12,
    hidden: int = 768,
    heads: int = 12,
    seq: int = 128,
    vocab: int = 30522,
    name: str | None = None,
) -> OpGraph:
    """A BERT-style encoder of the given size, traced by shapes.

    ``name`` defaults to ``transformer_l{layers}_h{hidden}_s{seq}``.
    """
    import jax
    import jax.numpy as jnp

    params = _encoder_params(layers, hidden, 4 * hidden, vocab, seq)
    struct: Any = jax.ShapeDtypeStruct
    ids = struct((seq,), jnp.int32)
    name = name or f"transformer_l{layers}_h{hidden}_s{seq}"
    return from_jax(_encoder(heads), params, ids, weight_argnums=(0,), name=name)


def _decoder_layer(p: Params, x: Any, heads: int) -> Any:
    """One pre-norm GPT block: causal self-attention, then the MLP, each residual."""
    import jax
    import jax.numpy as jnp

    seq, hidden = x.shape
    split = (seq, heads, hidden // heads)
    y = layer_norm(x, p["g1"], p["b1"])
    q, k, v = (
        part.reshape(split).transpose(1, 0, 2)
        for part in jnp.split(y @ p["wqkv"] + p["bqkv"], 3, axis=-1)
    )
    scores = jnp.einsum("hqd,hkd->hqk", q, k) / np.sqrt(hidden // heads)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.asarray(-1e9, scores.dtype))
    ctx = jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(scores, axis=-1), v)
    x = x + ctx.transpose(1, 0, 2).reshape(seq, hidden) @ p["wo"] + p["bo"]
    y = layer_norm(x, p["g2"], p["b2"])
    return x + jax.nn.gelu(y @ p["w1"] + p["c1"]) @ p["w2"] + p["c2"]


def decoder_graph(
    layers: int = 12,
    hidden: int = 768,
    heads: int = 12,
    seq: int = 256,
    vocab: int = 50257,
    name: str | None = None,
) -> OpGraph:
    """A GPT-style decoder traced by shapes: token and position embeddings,
    ``layers`` pre-norm blocks of causal attention and MLP, a final norm and
    the language-model head (a matrix of its own). 11 ops a layer and 4 more:
    27 layers make 301 ops, 90 layers 994, 272 layers 2,996.

    ``name`` defaults to ``gpt_l{layers}_h{hidden}_s{seq}``.
    """
    import jax
    import jax.numpy as jnp

    def layer() -> Params:
        vec = spec(hidden)
        return {
            "wqkv": spec(hidden, 3 * hidden),
            "bqkv": spec(3 * hidden),
            "wo": spec(hidden, hidden),
            "bo": vec,
            "g1": vec,
            "b1": vec,
            "g2": vec,
            "b2": vec,
            "w1": spec(hidden, 4 * hidden),
            "c1": spec(4 * hidden),
            "w2": spec(4 * hidden, hidden),
            "c2": vec,
        }

    def gpt(params: Params, ids: Any) -> Any:
        x = params["tok"][ids] + params["pos"][: ids.shape[0]]
        for p in params["layers"]:
            x = _decoder_layer(p, x, heads)
        return layer_norm(x, params["gf"], params["bf"]) @ params["head"]

    params = {
        "tok": spec(vocab, hidden),
        "pos": spec(seq, hidden),
        "layers": [layer() for _ in range(layers)],
        "gf": spec(hidden),
        "bf": spec(hidden),
        "head": spec(hidden, vocab),
    }
    struct: Any = jax.ShapeDtypeStruct  # untyped in jax's stubs
    name = name or f"gpt_l{layers}_h{hidden}_s{seq}"
    return from_jax(gpt, params, struct((seq,), jnp.int32), weight_argnums=(0,), name=name)


@functools.cache
def bert_graph() -> OpGraph:
    """BERT-base: 12 layers, hidden 768, 12 heads, sequence 128 (bfloat16)."""
    return transformer_graph(12, 768, 12, 128, name="bert_base")


def mlp_graph(widths: list[int], batch: int = 256) -> OpGraph:
    """An MLP: one matmul (with its bias and ReLU fused) per pair of widths."""
    import jax

    params = [(spec(a, b), spec(b)) for a, b in itertools.pairwise(widths)]

    def mlp(ps: list[tuple[Any, Any]], x: Any) -> Any:
        for w, b in ps:
            x = jax.nn.relu(x @ w + b)
        return x

    name = f"mlp_{len(params)}x{max(widths)}"
    return from_jax(mlp, params, spec(batch, widths[0]), weight_argnums=(0,), name=name)


def cnn_graph(channels: list[int], size: int = 32, residual_every: int = 2) -> OpGraph:
    """A CNN-like chain of 3x3 convolutions with a residual add every few layers."""
    import jax

    params = [spec(3, 3, a, b) for a, b in itertools.pairwise(channels)]

    def cnn(ps: list[Any], x: Any) -> Any:
        skip = x
        for i, w in enumerate(ps):
            dn = ("NHWC", "HWIO", "NHWC")
            x = jax.nn.relu(
                jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)
            )
            if (i + 1) % residual_every == 0 and skip.shape == x.shape:
                x, skip = x + skip, x
            elif skip.shape != x.shape:
                skip = x
        return x

    name = f"cnn_{len(params)}x{max(channels)}"
    return from_jax(cnn, params, spec(8, size, size, channels[0]), weight_argnums=(0,), name=name)


def tied_transformer_graph(
    layers: int, hidden: int, heads: int, seq: int = 64, vocab: int = 8000
) -> OpGraph:
    """An ALBERT-style encoder: one layer's weights applied ``layers`` times.

    :func:`from_jax` counts a weight on its first reader, so the first layer
    holds every weight and the others none: the shape of any weight-tied model.
    """
    import jax
    import jax.numpy as jnp

    params = _encoder_params(1, hidden, 4 * hidden, vocab, seq)
    struct: Any = jax.ShapeDtypeStruct
    name = f"tied_l{layers}_h{hidden}_s{seq}"
    encoder = _encoder(heads, repeat=layers)
    return from_jax(encoder, params, struct((seq,), jnp.int32), weight_argnums=(0,), name=name)


def rnn_graph(steps: int, hidden: int, layers: int = 1, batch: int = 32) -> OpGraph:
    """Stacked Elman RNNs (``h = tanh(x Wx + h Wh + b)``) unrolled over ``steps``, a
    linear read-out at every step: the recurrent weights are shared by every step."""
    import jax.numpy as jnp

    cells = [(spec(hidden, hidden), spec(hidden, hidden), spec(hidden)) for _ in range(layers)]
    params = {"cells": cells, "out": spec(hidden, hidden)}

    def rnn(p: Params, xs: Any) -> Any:
        hs = [jnp.zeros((xs.shape[0], hidden), xs.dtype) for _ in p["cells"]]
        outs = []
        for t in range(xs.shape[1]):
            x = xs[:, t]
            for i, (wx, wh, b) in enumerate(p["cells"]):
                hs[i] = x = jnp.tanh(x @ wx + hs[i] @ wh + b)
            outs.append(x @ p["out"])
        return jnp.stack(outs, axis=1)

    name = f"rnn_{layers}x{steps}x{hidden}"
    return from_jax(rnn, params, spec(batch, steps, hidden), weight_argnums=(0,), name=name)


def residual_mlp_graph(blocks: int, width: int, batch: int = 256) -> OpGraph:
    """Pre-norm residual MLP blocks (norm, up 4x, GELU, down, add)."""
    import jax

    params = [(spec(width), spec(width, 4 * width), spec(4 * width, width)) for _ in range(blocks)]

    def resmlp(ps: list[tuple[Any, Any, Any]], x: Any) -> Any:
        for g, up, down in ps:
            x = x + jax.nn.gelu(layer_norm(x, g, 0.0) @ up) @ down
        return x

    name = f"resmlp_{blocks}x{width}"
    return from_jax(resmlp, params, spec(batch, width), weight_argnums=(0,), name=name)


def inception_graph(blocks: int, channels: int, size: int = 32) -> OpGraph:
    """A branchy CNN: per block, parallel 1x1, 3x3 and 5x5 (after a 1x1) branches,
    concatenated, then a 1x1 projection back to ``channels``."""
    import jax
    import jax.numpy as jnp

    q = max(channels // 4, 8)

    def block() -> dict[str, Any]:
        return {
            "b1": spec(1, 1, channels, q),
            "r3": spec(1, 1, channels, q),
            "b3": spec(3, 3, q, 2 * q),
            "r5": spec(1, 1, channels, q // 2),
            "b5": spec(5, 5, q // 2, q),
            "proj": spec(1, 1, 4 * q, channels),
        }

    def conv(x: Any, w: Any) -> Any:
        dn = ("NHWC", "HWIO", "NHWC")
        return jax.nn.relu(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn))

    def net(ps: list[dict[str, Any]], x: Any) -> Any:
        for p in ps:
            branches = [conv(x, p["b1"]), conv(conv(x, p["r3"]), p["b3"])]
            branches.append(conv(conv(x, p["r5"]), p["b5"]))
            x = conv(jnp.concatenate(branches, axis=-1), p["proj"])
        return x

    params = [block() for _ in range(blocks)]
    name = f"inception_{blocks}x{channels}"
    return from_jax(net, params, spec(8, size, size, channels), weight_argnums=(0,), name=name)


def moe_graph(layers: int, hidden: int, experts: int, seq: int = 128) -> OpGraph:
    """A mixture-of-experts encoder: attention, then a router and ``experts`` expert
    MLPs (dense: every expert reads every token), combined by the router's weights."""
    import jax
    import jax.numpy as jnp

    def layer() -> dict[str, Any]:
        return {
            "qkv": spec(hidden, 3 * hidden),
            "o": spec(hidden, hidden),
            "g1": spec(hidden),
            "g2": spec(hidden),
            "router": spec(hidden, experts),
            "up": [spec(hidden, 2 * hidden) for _ in range(experts)],
            "down": [spec(2 * hidden, hidden) for _ in range(experts)],
        }

    def net(ps: list[dict[str, Any]], x: Any) -> Any:
        for p in ps:
            q, k, v = jnp.split(layer_norm(x, p["g1"], 0.0) @ p["qkv"], 3, axis=-1)
            x = x + (jax.nn.softmax(q @ k.T, axis=-1) @ v) @ p["o"]
            y = layer_norm(x, p["g2"], 0.0)
            gate = jax.nn.softmax(y @ p["router"], axis=-1)
            outs = [jax.nn.gelu(y @ u) @ d for u, d in zip(p["up"], p["down"], strict=True)]
            x = x + sum(gate[:, e : e + 1] * o for e, o in enumerate(outs))
        return x

    params = [layer() for _ in range(layers)]
    name = f"moe_l{layers}_h{hidden}_e{experts}"
    return from_jax(net, params, spec(seq, hidden), weight_argnums=(0,), name=name)


BUILTINS: dict[str, Callable[[], OpGraph]] = {
    "bert": bert_graph,
    "bert_base": bert_graph,
    "transformer_small": lambda: transformer_graph(4, 256, 4, 64, 8000),
    "mlp": lambda: mlp_graph([1024] * 9),
    "cnn": lambda: cnn_graph([64] * 9),
    "gpt": lambda: decoder_graph(12, name="gpt"),
}


def builtin_names() -> list[str]:
    """Names accepted by :func:`builtin_graph`."""
    return sorted(BUILTINS)


def builtin_graph(name: str) -> OpGraph:
    """A built-in graph by name (see :func:`builtin_names`)."""
    try:
        return BUILTINS[name]()
    except KeyError:
        raise KeyError(f"no built-in graph {name!r}; choose from {builtin_names()}") from None
