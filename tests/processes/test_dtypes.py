"""Every dtype users meet, on every path an array takes, comes back exact.

The dtypes: numpy's numbers and bools, and the ones ML adds through
``ml_dtypes`` (bfloat16, the float8 types), whose ``dtype.str`` does not name
them. The sizes sit on both sides of each threshold: values up to 16 KiB ride
inline (in handles, calls and lanes), arrays above 1 MiB live in shared memory
(or go by the bulk byte stream between machines). The paths: put, fetch, a
push between hosts (by lane when small, by call otherwise) and a read in place.
Values are compared byte for byte, so NaNs and every bit pattern count.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import atoll
from atoll.devices import Computation, CostModel
from atoll.runtime import Cluster
from atoll.transports.dtypes import dtype_from_wire, raw_bytes, wire_dtype

pytestmark = pytest.mark.anyio

FLOAT8 = [
    getattr(ml_dtypes, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz", "float8_e5m2fnuz")
]
DTYPES = [
    np.dtype(t)
    for t in (
        ml_dtypes.bfloat16,
        np.float16,
        np.float32,
        np.float64,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint32,
        np.bool_,
        np.complex64,
        *FLOAT8,
    )
]
# inline (<= 16 KiB), between inline and shared memory, above 1 MiB
SIZES = (1 << 10, 64 << 10, (1 << 20) + 4096)
FREE = CostModel(link_bytes_per_s=float("inf"), link_latency_s=0.0)


def same(x: np.ndarray) -> np.ndarray:
    """The identity, as a computation on a host (host processes import it by name)."""
    return np.asarray(x)


SAME = Computation("same", same, 1.0)


def sample(dtype: np.dtype, nbytes: int, seed: int = 0) -> np.ndarray:
    """``nbytes`` of ``dtype``, every bit pattern possible (bools: 0 or 1)."""
    rng = np.random.default_rng(seed)
    count = max(1, nbytes // dtype.itemsize)
    if dtype.kind == "b":
        return rng.integers(0, 2, count).astype(dtype).reshape(count // 2 or 1, -1)
    raw = rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(-1, 2) if count % 2 == 0 else raw.view(dtype)


def assert_exact(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def test_every_dtype_has_a_wire_name_that_comes_back() -> None:
    for dtype in DTYPES:
        assert raw_bytes(dtype)
        assert dtype_from_wire(wire_dtype(dtype)) == dtype
    assert wire_dtype(np.dtype(ml_dtypes.bfloat16)) == "bfloat16"  # not '<V2'
    for bad in ("<V2", "|O", "nosuch", "finfo"):
        with pytest.raises(TypeError):
            dtype_from_wire(bad)


async def _round_trips(cluster: Cluster, dtype: np.dtype, nbytes: int) -> None:
    """Put on host 0, push to host 1 (a reader there), fetch both and the put."""
    want = sample(dtype, nbytes)
    put = cluster.put(want, 0)
    here = cluster.run(SAME, 0, [put])
    there = cluster.run(SAME, 1, [here])  # pushed from host 0 to host 1
    for ref in (put, here, there):
        assert_exact(await cluster.fetch(ref), want)
    for ref in (put, here, there):
        await cluster.free(ref)


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_every_dtype_over_host_processes() -> None:
    async with atoll.local_cluster(1, 2, 1, transport="capnp", cost=FREE) as cluster:
        for dtype in DTYPES:
            for nbytes in SIZES:
                await _round_trips(cluster, dtype, nbytes)
        usage = await cluster.store_usage()
        assert [u["buffers"] for u in usage] == [0, 0]
        assert sum(u["lane_out"] for u in usage) > 0  # small pushes took lanes
        assert sum(u["shm_in"] for u in usage) > 0  # large ones were mapped


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_ml_dtypes_over_the_byte_stream(other_machines: None) -> None:
    async with atoll.local_cluster(1, 2, 1, transport="capnp", cost=FREE) as cluster:
        for dtype in (np.dtype(ml_dtypes.bfloat16), np.dtype(FLOAT8[1]), np.dtype(np.float32)):
            await _round_trips(cluster, dtype, SIZES[-1])
        usage = await cluster.store_usage()
        assert sum(u["stream_in"] for u in usage) > 0


def ident(x: np.ndarray) -> np.ndarray:
    """The identity as a JAX device runs it (host processes import it by name)."""
    return x


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_jax_dtypes_computed_in_a_host_process_come_back_exact() -> None:
    """Arrays made by a JAX device in a host process (device arrays, not
    numpy) fetched from there: bfloat16 above 1 MiB among them."""
    from atoll.devices.jax import JaxDevice

    kinds = [np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)]
    kinds += [np.dtype(np.int8), np.dtype(np.uint8), np.dtype(np.bool_), np.dtype(FLOAT8[0])]
    async with atoll.local_cluster(1, 1, 1, device_cls=JaxDevice, transport="capnp") as cluster:
        for dtype in kinds:
            for nbytes in (1 << 10, (2 << 20) + 4096):
                want = sample(dtype, nbytes)
                out = cluster.run(Computation("ident", ident), 0, [cluster.put(want, 0)])
                assert_exact(await cluster.fetch(out), want)
