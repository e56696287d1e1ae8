"""Built-in graphs, written in plain JAX and imported with :func:`from_jax`.

Only shapes are used (``jax.ShapeDtypeStruct``): no weight is ever allocated.
``bert`` is BERT-base (12 layers, hidden 768, 12 heads, sequence 128); the
synthetic generator draws MLPs, CNN-like chains and transformers of other
depths and widths for pre-training the policy.
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
    "mlp_graph",
    "transformer_graph",
]

Params = dict[str, Any]


def _spec(*shape: int) -> Any:
    import jax
    import jax.numpy as jnp

    struct: Any = jax.ShapeDtypeStruct  # untyped in jax's stubs
    return struct(shape, jnp.bfloat16)


def _layer_norm(x: Any, g: Any, b: Any) -> Any:
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
    x = _layer_norm(x + attn, p["g1"], p["b1"])
    ff = jax.nn.gelu(x @ p["w1"] + p["c1"]) @ p["w2"] + p["c2"]
    return _layer_norm(x + ff, p["g2"], p["b2"])


def _encoder_params(layers: int, hidden: int, ffn: int, vocab: int, seq: int) -> Params:
    def layer() -> Params:
        sq, vec = _spec(hidden, hidden), _spec(hidden)
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
            "w1": _spec(hidden, ffn),
            "c1": _spec(ffn),
            "w2": _spec(ffn, hidden),
            "c2": vec,
        }

    return {
        "tok": _spec(vocab, hidden),
        "pos": _spec(seq, hidden),
        "g0": _spec(hidden),
        "b0": _spec(hidden),
        "layers": [layer() for _ in range(layers)],
    }


def _encoder(heads: int) -> Callable[[Params, Any], Any]:
    def encoder(params: Params, ids: Any) -> Any:
        x = params["tok"][ids] + params["pos"][: ids.shape[0]]
        x = _layer_norm(x, params["g0"], params["b0"])
        for p in params["layers"]:
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


@functools.cache
def bert_graph() -> OpGraph:
    """BERT-base: 12 layers, hidden 768, 12 heads, sequence 128 (bfloat16)."""
    return transformer_graph(12, 768, 12, 128, name="bert_base")


def mlp_graph(widths: list[int], batch: int = 256) -> OpGraph:
    """An MLP: one matmul (with its bias and ReLU fused) per pair of widths."""
    import jax

    params = [(_spec(a, b), _spec(b)) for a, b in itertools.pairwise(widths)]

    def mlp(ps: list[tuple[Any, Any]], x: Any) -> Any:
        for w, b in ps:
            x = jax.nn.relu(x @ w + b)
        return x

    name = f"mlp_{len(params)}x{max(widths)}"
    return from_jax(mlp, params, _spec(batch, widths[0]), weight_argnums=(0,), name=name)


def cnn_graph(channels: list[int], size: int = 32, residual_every: int = 2) -> OpGraph:
    """A CNN-like chain of 3x3 convolutions with a residual add every few layers."""
    import jax

    params = [_spec(3, 3, a, b) for a, b in itertools.pairwise(channels)]

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
    return from_jax(cnn, params, _spec(8, size, size, channels[0]), weight_argnums=(0,), name=name)


BUILTINS: dict[str, Callable[[], OpGraph]] = {
    "bert": bert_graph,
    "bert_base": bert_graph,
    "transformer_small": lambda: transformer_graph(4, 256, 4, 64, 8000),
    "mlp": lambda: mlp_graph([1024] * 9),
    "cnn": lambda: cnn_graph([64] * 9),
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
