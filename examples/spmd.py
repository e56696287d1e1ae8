"""SPMD training of a small MLP over 8 devices, checked against single-device JAX.

The training step is one node: ``value_and_grad`` plus an SGD update, run as
ONE sharded JAX computation over a virtual slice of 8 devices with the batch
split along the ``data`` axis and the parameters replicated, so the gradient
sum is a real all-reduce. Steps are chained through ``outputs.refs``: the
parameters stay on the devices between steps and only the losses come back.

Run it: ``python -m atoll.examples.spmd`` (or ``python examples/spmd.py``).
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import anyio
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import atoll
from atoll.devices.jax import JaxDevice
from atoll.examples import use_fake_cpu_devices

__all__ = ["SpmdResult", "init", "main", "reference", "run", "train_step"]

LR = 0.1


def init(seed: int = 0, sizes: tuple[int, ...] = (16, 32, 32, 4)) -> list[dict[str, Any]]:
    """Parameters of an MLP with the given layer widths (numpy, float32)."""
    rng = np.random.default_rng(seed)
    return [
        {
            "w": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
            "b": np.zeros(b, np.float32),
        }
        for a, b in itertools.pairwise(sizes)
    ]


def loss_fn(params: list[dict[str, Any]], x: Any, y: Any) -> Any:
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    out = h @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean((out - y) ** 2)


def train_step(params: list[dict[str, Any]], x: Any, y: Any) -> tuple[Any, Any]:
    """One SGD step; returns the new parameters and the loss before the step."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    new = jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads)
    return new, loss


def data(step: int, batch: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((batch, 16)).astype(np.float32)
    y = np.stack([x[:, :4].sum(1), x[:, 4:8].mean(1), np.sin(x[:, 0]), x[:, 9]], 1)
    return x, y.astype(np.float32)


@dataclass
class SpmdResult:
    losses: list[float]
    params: list[dict[str, Any]]


async def run(steps: int = 5, devices: int = 8) -> SpmdResult:
    """Train for ``steps`` steps on an in-process cluster of JAX devices."""
    async with atoll.local_cluster(1, 1, devices, device_cls=JaxDevice) as cluster:
        mesh = await cluster.devices(devices, mesh_shape=(devices,), axis_names=("data",))
        step = mesh.jit(train_step, in_specs=(None, P("data"), P("data")), out_specs=P())
        params: Any = init()
        losses = []
        for i in range(steps):
            x, y = data(i)
            out = cluster.run(step, params, x, y)  # returns at once
            params, loss = out.refs  # chain on the devices, no fetch
            losses.append(loss)
        final = await out
        values = [float(await cluster.fetch(loss)) for loss in losses]
        return SpmdResult(values, final[0])


def reference(steps: int = 5) -> SpmdResult:
    """The same training in plain single-device JAX."""
    step = jax.jit(train_step)
    params: Any = init()
    losses = []
    for i in range(steps):
        params, loss = step(params, *data(i))
        losses.append(float(loss))
    return SpmdResult(losses, jax.tree_util.tree_map(np.asarray, params))


async def main() -> None:
    result = await run()
    ref = reference()
    for i, (a, b) in enumerate(zip(result.losses, ref.losses, strict=True)):
        print(f"step {i}: atoll loss {a:.6f}   single-device JAX {b:.6f}")
    print("match:", bool(np.allclose(result.losses, ref.losses, rtol=1e-4)))


if __name__ == "__main__":
    use_fake_cpu_devices()
    anyio.run(main)
