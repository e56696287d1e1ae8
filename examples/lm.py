"""A GPT-style language model and its data, in plain JAX: what ``train_lm`` trains.

* **The model**: decoder-only, as GPT-2 is: token and position embeddings,
  ``layers`` blocks of (layer norm, causal multi-head attention, residual,
  layer norm, MLP with GELU, residual), a final layer norm, and the output
  head tied to the token embedding. Parameters are a pytree of float32
  numpy arrays made from a seed (:func:`init`), so every run that starts
  from the same seed starts from the same bits.
* **The tokens**: bytes (vocabulary 256): no tokenizer, nothing to download.
* **The corpus**: the Python standard library's own ``.py`` sources, read
  from ``sysconfig``'s ``stdlib`` path (every machine with Python has it).
  Every tenth file, in sorted order, is held out for evaluation.
* **Batches**: ``batch`` windows of ``context + 1`` bytes at offsets drawn
  from a seeded generator per step (:func:`batch_at`): step ``i`` gives
  the same batch in every run.
* **The step**: AdamW from optax (:func:`make_optimizer`);
  :func:`train_step` takes ``(params, opt_state, tokens)`` and returns the
  new parameters, the new optimizer state and the loss before the step.

Nothing here knows atoll: ``train_lm`` runs these functions through it, and
plain JAX runs the same ones for the reference losses.
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import functools
import math
import sysconfig
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "CONFIGS",
    "LMConfig",
    "batch_at",
    "corpus",
    "flops_per_token",
    "init",
    "loss_fn",
    "make_optimizer",
    "parameter_count",
    "train_step",
]

VOCAB = 256  # bytes
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class LMConfig:
    """The model's shape and the training's settings."""

    layers: int = 4
    width: int = 128
    heads: int = 4
    context: int = 128
    batch: int = 16  # sequences per step (the global batch)
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0
    dtype: str = "float32"  # of the computation; "bfloat16": mixed precision
    # each block's MLP width, in multiples of ``width`` (empty: 4 for every
    # block, as GPT-2); blocks of unequal cost are what a pipeline's cut must
    # balance (``lm_pipeline.cut``)
    mlp: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if min(self.layers, self.width, self.heads, self.context, self.batch) < 1:
            raise ValueError(f"every size must be positive: {self}")
        if self.mlp and (len(self.mlp) != self.layers or min(self.mlp) < 1):
            raise ValueError(f"mlp needs a positive multiple per block ({self.layers}): {self}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not a multiple of heads {self.heads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, not {self.dtype!r}")

    def mlp_of(self, block: int) -> int:
        """Block ``block``'s MLP width, in multiples of ``width``."""
        return self.mlp[block] if self.mlp else 4

    def with_(self, **changes: Any) -> LMConfig:
        """This config with some fields changed (checked again)."""
        return replace(self, **changes)


CONFIGS = {
    "tiny": LMConfig(layers=2, width=32, heads=2, context=32, batch=8),  # tests
    "small": LMConfig(),  # this machine: a few minutes
    "gpt2": LMConfig(layers=12, width=768, heads=12, context=1024, batch=8, lr=6e-4),
    # the first two blocks' MLPs 4x as wide as GPT-2's, the others' a quarter:
    # equal block counts per stage put most of the work on the first stage
    "uneven": LMConfig(layers=6, mlp=(16, 16, 1, 1, 1, 1)),
}


# -- parameters ----------------------------------------------------------------
def init(config: LMConfig) -> dict[str, Any]:
    """Parameters from ``config.seed`` (numpy float32; GPT-2's init scales)."""
    rng = np.random.default_rng(config.seed)
    w, std = config.width, 0.02
    residual_std = std / math.sqrt(2 * config.layers)

    def normal(shape: tuple[int, ...], scale: float = std) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm() -> dict[str, np.ndarray]:
        return {"g": np.ones(w, np.float32), "b": np.zeros(w, np.float32)}

    blocks = [
        {
            "ln1": norm(),
            "qkv": {"w": normal((w, 3 * w)), "b": np.zeros(3 * w, np.float32)},
            "proj": {"w": normal((w, w), residual_std), "b": np.zeros(w, np.float32)},
            "ln2": norm(),
            "fc": {"w": normal((w, m * w)), "b": np.zeros(m * w, np.float32)},
            "out": {"w": normal((m * w, w), residual_std), "b": np.zeros(w, np.float32)},
        }
        for m in (config.mlp_of(i) for i in range(config.layers))
    ]
    return {
        "wte": normal((VOCAB, w)),
        "wpe": normal((config.context, w), 0.01),
        "blocks": blocks,
        "ln_f": norm(),
    }


def parameter_count(params: Any) -> int:
    return sum(int(np.prod(np.shape(leaf))) for leaf in jax.tree_util.tree_leaves(params))


def flops_per_token(config: LMConfig, params: Any) -> float:
    """Training FLOPs per token: 6 per parameter (forward and backward of
    the matmuls) plus attention's scores and mixing (PaLM's count)."""
    attention = 12 * config.layers * config.context * config.width
    return 6.0 * parameter_count(params) + attention


# -- the model -----------------------------------------------------------------
def _layer_norm(x: Any, p: dict[str, Any]) -> Any:
    """Layer norm; its statistics in float32 whatever ``x``'s dtype."""
    wide = x.astype(jnp.float32)
    mean = jnp.mean(wide, -1, keepdims=True)
    var = jnp.mean(jnp.square(wide - mean), -1, keepdims=True)
    normed = ((wide - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype)
    return normed * p["g"] + p["b"]


def cast(params: Any, dtype: str) -> Any:
    """``params`` in the computation's dtype (the float32 master copy stays
    with the optimizer: gradients flow back through the cast)."""
    if dtype == "float32":
        return params
    return jax.tree_util.tree_map(lambda p: p.astype(dtype), params)


def _attention(x: Any, block: dict[str, Any], heads: int) -> Any:
    b, t, w = x.shape
    qkv = x @ block["qkv"]["w"] + block["qkv"]["b"]
    q, k, v = (z.reshape(b, t, heads, w // heads) for z in jnp.split(qkv, 3, axis=-1))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(w // heads)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    mixed = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), v).reshape(b, t, w)
    return mixed @ block["proj"]["w"] + block["proj"]["b"]


def block_forward(x: Any, block: dict[str, Any], heads: int) -> Any:
    """One transformer block (pre-norm, as GPT-2)."""
    x = x + _attention(_layer_norm(x, block["ln1"]), block, heads)
    h = jax.nn.gelu(_layer_norm(x, block["ln2"]) @ block["fc"]["w"] + block["fc"]["b"])
    return x + h @ block["out"]["w"] + block["out"]["b"]


def logits(params: dict[str, Any], tokens: Any, heads: int, dtype: str = "float32") -> Any:
    """Next-byte logits for ``tokens`` (batch, time), computed in ``dtype``
    and returned in float32."""
    p = cast(params, dtype)
    t = tokens.shape[1]
    x = p["wte"][tokens] + p["wpe"][:t]
    for block in p["blocks"]:
        x = block_forward(x, block, heads)
    return (_layer_norm(x, p["ln_f"]) @ p["wte"].T).astype(jnp.float32)


def loss_fn(params: dict[str, Any], tokens: Any, heads: int, dtype: str = "float32") -> Any:
    """Mean cross-entropy of each next byte; ``tokens`` is (batch, context + 1)."""
    out = logits(params, tokens[:, :-1], heads, dtype)
    logp = jax.nn.log_softmax(out, -1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)
    return -jnp.mean(picked)


# -- training ------------------------------------------------------------------
def make_optimizer(config: LMConfig) -> Any:
    """AdamW (optax; the ``[train]`` extra)."""
    try:
        import optax
    except ImportError as exc:  # a lean install
        raise ImportError(
            "training a language model needs optax: pip install 'atoll[train]'"
        ) from exc
    return optax.adamw(config.lr, weight_decay=config.weight_decay)


def train_step(
    params: Any, opt_state: Any, tokens: Any, *, config: LMConfig
) -> tuple[Any, Any, Any]:
    """One AdamW step on ``tokens``; the new parameters and optimizer state,
    and the loss before the step."""
    import optax

    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, config.heads, config.dtype)
    updates, opt_state = make_optimizer(config).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def step_function(config: LMConfig) -> Any:
    """:func:`train_step` for ``config``, as a function of the three arrays."""
    return functools.partial(train_step, config=config)


# -- data ----------------------------------------------------------------------
@functools.cache
def corpus(split: str = "train") -> np.ndarray:
    """The standard library's ``.py`` sources as one byte array: ``train``
    (nine files in ten, in sorted order) or ``eval`` (every tenth)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if len(files) < 20:
        raise FileNotFoundError(f"too few Python sources under {root} to train on")
    chosen = [f for i, f in enumerate(files) if (i % 10 == 0) == (split == "eval")]
    return np.frombuffer(b"\n".join(f.read_bytes() for f in chosen), np.uint8)


def batch_at(step: int, config: LMConfig, split: str = "train") -> np.ndarray:
    """The batch of step ``step``: (batch, context + 1) int32 byte windows."""
    data = corpus(split)
    rng = np.random.default_rng([config.seed, step, split == "eval"])
    starts = rng.integers(0, len(data) - config.context - 1, config.batch)
    return np.stack([data[s : s + config.context + 1] for s in starts]).astype(np.int32)
