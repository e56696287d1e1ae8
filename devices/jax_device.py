"""JAX device actors: compiled functions on a specific ``jax.devices()[i]``.

A :class:`JaxDevice` with atoll id ``d`` owns ``jax.devices()[d]`` (8 fake CPU
devices in tests, real GPUs when JAX sees them). It runs two kinds of work:

* a :class:`~atoll.devices.Computation` (``cluster.run``): the function is
  jitted onto this one device;
* a :class:`JaxKernel` gang (a node of a ``@program``): the gang's leader
  runs it as ONE sharded JAX computation over a mesh of the gang's devices,
  so collectives inside it are real; the other shards wait at the gang's
  barrier while it runs (they are busy with the same program).

Compiled executables are cached by signature (function, devices, input
shapes, dtypes and shardings). Outputs stay on the devices, as ``jax.Array``
in the host's object store, reference-counted and owner-labelled; the store's
byte budget is reserved *before* a computation runs, so a full store stalls
the device (back-pressure) instead of overflowing. Running happens on a worker
thread while the actor awaits it, so other actors keep dispatching.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import anyio
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ..kernel import endpoint
from ..kernel._program import JaxKernel
from ._base import BufferHandle, Computation, Device, Host
from ._gang import GangTask

__all__ = ["JaxDevice", "JaxHost", "JaxKernel"]


class JaxHost(Host):
    """A host whose store keeps device arrays; remote readers get numpy bytes."""

    @endpoint
    def fetch(self, buffer_id: str) -> np.ndarray:
        """The bytes of a buffer held here, copied off its device."""
        return np.asarray(self.store.get(buffer_id))

    @endpoint
    def placement(self, buffer_id: str) -> list[int]:
        """The JAX device ids that hold a buffer (empty: it is in host memory)."""
        array = self.store.get(buffer_id)
        if isinstance(array, np.ndarray):
            return []
        return sorted(d.id for d in array.devices())


def jax_device(device_id: int) -> jax.Device:
    """The JAX device behind atoll device ``device_id``.

    In one process, device ``d`` is ``jax.devices()[d]``. In a cluster of host
    processes (``atoll up --device jax``), each process sees only its own
    devices: ``ATOLL_JAX_LOCAL=1`` makes ``d`` map to ``d % len(jax.devices())``,
    its place among the host's devices when hosts hold equal numbers.
    """
    devices = jax.devices()
    if os.environ.get("ATOLL_JAX_LOCAL") == "1":
        return devices[device_id % len(devices)]
    if device_id >= len(devices):
        raise RuntimeError(f"atoll device {device_id} has no JAX device: JAX sees {len(devices)}")
    return devices[device_id]


class JaxDevice(Device):
    """A device actor on one JAX device; see the module docstring."""

    host_cls = JaxHost

    @classmethod
    def available(cls) -> int | None:
        return len(jax.devices())

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = jax_device(self.device_id)
        self._cache: dict[tuple[Any, ...], Any] = {}
        self.compilations = 0

    async def execute(self, computation: Computation, inputs: list[np.ndarray]) -> np.ndarray:
        """A plain computation, jitted onto this device; returns host bytes."""
        arrays = [jax.device_put(x, self.device) for x in inputs]
        key = (computation.fn, *((a.shape, str(a.dtype)) for a in arrays))
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = jax.jit(computation.fn).lower(*arrays).compile()
            self._cache[key] = compiled
            self.compilations += 1
        out = await self._timed(compiled, arrays)
        return np.asarray(out)

    async def run_shard(
        self, task: GangTask, inputs: list[BufferHandle], owner: str
    ) -> list[BufferHandle]:
        """A JaxKernel gang: the leader runs the sharded program, the rest wait."""
        if not isinstance(task.kernel, JaxKernel):
            return await super().run_shard(task, inputs, owner)
        if self.device_id != task.leader:
            await self.arrive(task, "out")
            return []
        try:
            return await self._lead(task, inputs, owner)
        finally:
            if task.collective:
                await self.arrive(task, "out")

    async def _lead(
        self, task: GangTask, inputs: list[BufferHandle], owner: str
    ) -> list[BufferHandle]:
        kernel: JaxKernel = task.kernel
        mesh = Mesh(
            np.array([jax_device(d) for d in task.devices]).reshape(task.mesh_shape),
            task.axis_names,
        )
        shardings = [NamedSharding(mesh, spec) for spec in kernel.in_specs]
        arrays = [
            jax.device_put(await self._read(handle), sharding)
            for handle, sharding in zip(inputs, shardings, strict=True)
        ]
        compiled = self._compiled(kernel, mesh, arrays)
        nbytes = sum(aval.nbytes for aval in task.outputs)
        await self.store.reserve(nbytes)  # back-pressure: wait for room first
        try:
            outs = await self._timed(compiled, arrays)
        except BaseException:
            self.store.reserved_bytes -= nbytes
            raise
        return [self._handle(self.store.put(out, owner, reserved=True), out) for out in outs]

    def _compiled(self, kernel: JaxKernel, mesh: Mesh, arrays: Sequence[jax.Array]) -> Any:
        key = (
            kernel,
            tuple(d.id for d in mesh.devices.flat),
            mesh.axis_names,
            tuple((a.shape, str(a.dtype)) for a in arrays),
        )
        compiled = self._cache.get(key)
        if compiled is None:
            jitted = jax.jit(
                kernel.fn,
                in_shardings=[NamedSharding(mesh, s) for s in kernel.in_specs],
                out_shardings=[NamedSharding(mesh, s) for s in kernel.out_specs],
            )
            compiled = jitted.lower(*arrays).compile()
            self._cache[key] = compiled
            self.compilations += 1
        return compiled

    async def _timed(self, compiled: Any, arrays: Sequence[Any]) -> Any:
        """Run on a worker thread until the outputs are ready; count busy time."""
        started = time.perf_counter()
        out = compiled(*arrays)
        await anyio.to_thread.run_sync(jax.block_until_ready, out)
        self.busy_s += time.perf_counter() - started
        return out
