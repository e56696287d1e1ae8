"""Two islands joined by the "datacenter network": a program whose value crosses it.

The cluster has two islands of 2 hosts x 2 JAX devices. An encoder runs on a
slice of island 0 and a decoder on a slice of island 1; the encoded
activations travel from island 0's host to island 1's host over the modelled
datacenter link (slower, with more latency, than the links inside an island),
straight between the hosts' object stores. Each island has its own gang
scheduler. The result is checked against plain JAX, and the transfer time the
receiving device spent is reported next to the cost model's figure.

Run it: ``python -m atoll.examples.two_islands``.
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import atoll
from atoll.devices import CostModel
from atoll.devices.jax import JaxDevice
from atoll.examples import use_fake_cpu_devices

__all__ = ["COST", "IslandsResult", "main", "reference", "run"]

# 10 GB/s, 20 us inside an island; 1.25 GB/s (10 Gbit/s), 200 us between islands
COST = CostModel(dcn_bytes_per_s=1.25e9, dcn_latency_s=200e-6)


def params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "enc": (rng.standard_normal((32, 64)) / 6).astype(np.float32),
        "dec": (rng.standard_normal((64, 8)) / 8).astype(np.float32),
    }


def encode(w: Any, x: Any) -> Any:
    return jnp.tanh(x @ w)


def decode(w: Any, h: Any) -> Any:
    return jax.nn.softmax(h @ w, axis=-1)


def inputs(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + 1).standard_normal((128, 32)).astype(np.float32)


@dataclass
class IslandsResult:
    output: np.ndarray
    crossed_bytes: int
    transfer_s: float
    modelled_s: float
    islands_of_work: list[int]


async def run(seed: int = 0) -> IslandsResult:
    """Encode on island 0, decode on island 1; report the crossing."""
    async with atoll.local_cluster(2, 2, 2, device_cls=JaxDevice, cost=COST) as cluster:
        near = await cluster.devices(2, island=0, axis_names=("b",))
        far = await cluster.devices(2, island=1, axis_names=("b",))
        enc = near.jit(encode, in_specs=(None, P("b")), out_specs=P("b"))
        dec = far.jit(decode, in_specs=(None, P("b")), out_specs=P("b"))

        @atoll.program
        def model(p: dict[str, Any], x: Any) -> Any:
            return dec(p["dec"], enc(p["enc"], x))

        p, x = params(seed), inputs(seed)
        out = await cluster.run(model, p, x)
        stats = await cluster.device_stats()
    crossed = x.shape[0] * p["enc"].shape[1] * 4
    busy = [s for s in stats if s.computations]
    far_side = [s for s in busy if s.island == 1]
    return IslandsResult(
        out,
        crossed,
        sum(s.transfer_s for s in far_side),
        COST.transfer_time(crossed, across_islands=True),
        sorted({s.island for s in busy}),
    )


def reference(seed: int = 0) -> np.ndarray:
    p = params(seed)
    return np.asarray(jax.jit(lambda x: decode(p["dec"], encode(p["enc"], x)))(inputs(seed)))


async def main() -> None:
    result = await run()
    ref = reference()
    print(f"work ran on islands {result.islands_of_work}")
    print(
        f"{result.crossed_bytes} bytes crossed the datacenter link: "
        f"{result.transfer_s * 1e6:.0f} us on the receiving device "
        f"(model: {result.modelled_s * 1e6:.0f} us)"
    )
    print("match:", bool(np.allclose(result.output, ref, atol=1e-5)))


if __name__ == "__main__":
    use_fake_cpu_devices()
    anyio.run(main)
