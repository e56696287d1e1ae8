"""JAX device actors: compiled functions on a specific ``jax.devices()[i]``.

A :class:`JaxDevice` with atoll id ``d`` owns ``jax.devices()[d]`` (8 fake CPU
devices in tests, real GPUs when JAX sees them). It runs two kinds of work:

* a :class:`~atoll.devices.Computation` (``cluster.run``): the function is
  jitted onto this one device;
* a :class:`JaxKernel` gang (a node of a ``@program``): the gang's leader
  runs it as ONE sharded JAX computation over a mesh of the gang's devices,
  so collectives inside it are real; the other shards wait at the gang's
  barrier while it runs (they are busy with the same program).
* a :class:`JaxKernel` gang whose devices span host *processes* (that joined
  one ``jax.distributed`` runtime, see ``_jax_multi``): on every host, the
  gang's first device there (its host leader) runs the same SPMD program
  over the global mesh with that host's shards; collectives cross hosts
  (gloo on CPU). Outputs come out replicated and the gang leader keeps its
  copy, so it holds them whole, as in one process. If one of those host
  processes dies, the gang fails with ``HostLost`` (its barriers are
  abandoned; a shard already in a collective with the dead host gives up
  after ``ATOLL_JAX_COLLECTIVE_TIMEOUT_S``), and the surviving hosts' devices
  go on with work that does not need it (``docs/reliability.md``).

Compiled executables are cached by signature (function, devices, input
shapes, dtypes and shardings). Outputs stay on the devices, as ``jax.Array``
in the host's object store, reference-counted and owner-labelled; the store's
byte budget is reserved *before* a computation runs, so a full store stalls
the device (back-pressure) instead of overflowing. Running happens on a worker
thread while the actor awaits it, so other actors keep dispatching.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

import anyio
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..kernel import endpoint
from . import _jax_multi
from ._device import Device
from ._gang import GangTask
from ._host import Host
from ._jax_kernel import JaxKernel
from ._values import BufferHandle, Computation

__all__ = ["JaxDevice", "JaxHost", "JaxKernel"]


class JaxHost(Host):
    """A host whose store keeps device arrays; remote readers get numpy bytes."""

    @endpoint
    def placement(self, buffer_id: str) -> list[int]:
        """The JAX device ids that hold a buffer (empty: it is in host memory)."""
        array = self.store.get(buffer_id)
        if isinstance(array, np.ndarray):
            return []
        return sorted(d.id for d in array.devices())


class JaxDevice(Device):
    """A device actor on one JAX device; see the module docstring."""

    host_cls = JaxHost
    device: jax.Device  # set in on_start, once this process's JAX runtime is up

    @classmethod
    def available(cls) -> int | None:
        return len(jax.devices())

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cache: dict[tuple[Any, ...], Any] = {}
        self.compilations = 0

    async def on_start(self) -> None:
        """Join the hosts' JAX runtime if there is one, then take the device.

        Joining waits for every host process (on a worker thread: this host
        keeps answering meanwhile); messages queue until it is done.
        """
        await super().on_start()
        if _jax_multi.configured():
            await anyio.to_thread.run_sync(_jax_multi.ensure_runtime)
        self.device = _jax_multi.jax_device(self.device_id)
        _jax_multi.register(self.device_id, self.device)

    async def execute(self, computation: Computation, inputs: list[np.ndarray]) -> np.ndarray:
        """A plain computation, jitted onto this device; returns host bytes."""
        arrays = [jax.device_put(x, self.device) for x in inputs]
        key = (computation.fn, *((a.shape, str(a.dtype)) for a in arrays))
        compiled = self._cached(key, lambda: jax.jit(computation.fn), arrays)
        out = await self._timed(compiled, arrays)
        return np.asarray(out)

    async def _gather(
        self, task: GangTask, inputs: Sequence[Any], leader: bool, taken: list[str]
    ) -> list[BufferHandle]:
        """As every device, except that a JAX gang's host leaders read inputs too.

        (A failed device lookup here leaves the shard a reader of nothing:
        :meth:`run_shard` meets it again and fails past the barrier.)
        """
        if not leader and isinstance(task.kernel, JaxKernel):
            with suppress(Exception):
                leader = self.device_id == _jax_multi.host_leader(
                    task.devices, await self._gang(task)
                )
        return await super()._gather(task, inputs, leader, taken)

    async def leave_barriers(self, task: GangTask) -> None:
        """A JAX gang's shards meet at ``out`` too: a failed shard passes both."""
        await super().leave_barriers(task)
        if task.collective and isinstance(task.kernel, JaxKernel):
            await self.arrive(task, "out")

    async def run_shard(
        self, task: GangTask, inputs: list[BufferHandle], owner: str
    ) -> list[BufferHandle]:
        """A JaxKernel gang: each host leader runs the sharded program, the rest wait.

        Every shard arrives at the ``out`` barrier, whatever happens, so that
        no shard of the gang waits there for one that failed.
        """
        if not isinstance(task.kernel, JaxKernel):
            return await super().run_shard(task, inputs, owner)
        try:
            devices = await self._gang(task)
            if self.device_id != _jax_multi.host_leader(task.devices, devices):
                return []
            if _jax_multi.spans_processes(devices):
                return await self._lead_spmd(task, devices, inputs, owner)
            return await self._lead(task, devices, inputs, owner)
        finally:
            if task.collective:
                await self.arrive(task, "out")

    async def _gang(self, task: GangTask) -> list[jax.Device]:
        """The gang's JAX devices in mesh order (looked up once, on a thread)."""
        devices = _jax_multi.resolve_now(task.devices)
        if devices is None:
            devices = await anyio.to_thread.run_sync(_jax_multi.resolve, task.devices)
        return devices

    def _mesh(self, task: GangTask, devices: Sequence[jax.Device]) -> Mesh:
        return Mesh(np.array(devices).reshape(task.mesh_shape), task.axis_names)

    async def _lead(
        self,
        task: GangTask,
        devices: Sequence[jax.Device],
        inputs: list[BufferHandle],
        owner: str,
    ) -> list[BufferHandle]:
        """One process holds the whole gang: run it, keep the outputs as they come."""
        kernel: JaxKernel = task.kernel
        mesh = self._mesh(task, devices)
        shardings = [NamedSharding(mesh, spec) for spec in kernel.in_specs]
        arrays = [
            jax.device_put(await self._read(handle, owner), sharding)
            for handle, sharding in zip(inputs, shardings, strict=True)
        ]
        compiled = self._compiled(kernel, mesh, arrays)
        return await self._keep(task.output_bytes, owner, lambda: self._timed(compiled, arrays))

    async def _lead_spmd(
        self,
        task: GangTask,
        devices: Sequence[jax.Device],
        inputs: list[BufferHandle],
        owner: str,
    ) -> list[BufferHandle]:
        """This host's part of a gang over several processes.

        Every host leader reads the whole inputs and hands its own devices
        their shards; the program's outputs come out replicated (XLA gathers
        them), and the gang leader keeps its device's copy.
        """
        mesh = self._mesh(task, devices)
        arrays = [np.asarray(await self._read(handle, owner)) for handle in inputs]
        if self.device_id != task.leader:  # the gang leader alone keeps the outputs
            await self._busy(self._run_spmd, task.kernel, mesh, arrays)
            return []
        return await self._keep(
            task.output_bytes, owner, lambda: self._busy(self._run_spmd, task.kernel, mesh, arrays)
        )

    def _run_spmd(self, kernel: JaxKernel, mesh: Mesh, arrays: list[np.ndarray]) -> list[Any]:
        """On a worker thread: the SPMD call, blocking in cross-host collectives."""
        shards = [
            jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), x.__getitem__)
            for x, spec in zip(arrays, kernel.in_specs, strict=True)
        ]
        compiled = self._compiled(kernel, mesh, shards, replicated=True)
        outs = compiled(*shards)
        jax.block_until_ready(outs)  # type: ignore[no-untyped-call]
        return [_jax_multi.local_copy(out, self.device) for out in outs]

    def _compiled(
        self,
        kernel: JaxKernel,
        mesh: Mesh,
        arrays: Sequence[jax.Array],
        *,
        replicated: bool = False,
    ) -> Any:
        """The kernel compiled for this mesh and these inputs (cached).

        ``replicated``: every output whole on every device, whatever the
        kernel's ``out_specs`` say (how a gang over processes hands its
        outputs to the leader).
        """
        key = (
            kernel.fn,  # not the kernel: each message over the wire brings a new copy
            kernel.in_specs,
            kernel.out_specs,
            tuple(d.id for d in mesh.devices.flat),
            mesh.axis_names,
            tuple((a.shape, str(a.dtype)) for a in arrays),
            replicated,
        )
        whole = PartitionSpec()  # type: ignore[no-untyped-call]
        out_specs = [whole] * len(kernel.out_specs) if replicated else kernel.out_specs

        def jitted() -> Any:
            return jax.jit(
                kernel.fn,
                in_shardings=[NamedSharding(mesh, s) for s in kernel.in_specs],
                out_shardings=[NamedSharding(mesh, s) for s in out_specs],
            )

        return self._cached(key, jitted, arrays)

    def _cached(self, key: Any, jitted: Callable[[], Any], arrays: Sequence[Any]) -> Any:
        """The executable cached under ``key``, compiled from ``jitted()`` for
        ``arrays`` on first use (counted in ``compilations``)."""
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._cache[key] = jitted().lower(*arrays).compile()
            self.compilations += 1
        return compiled

    async def _timed(self, compiled: Any, arrays: Sequence[Any]) -> Any:
        """Run ``compiled`` until its outputs are ready (see :meth:`_busy`)."""
        return await self._busy(_ready, compiled, arrays)

    async def _busy(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a worker thread, so other actors keep dispatching;
        the time it takes counts as this device's busy time."""
        started = time.perf_counter()
        try:
            return await anyio.to_thread.run_sync(fn, *args)
        finally:
            self.busy_s += time.perf_counter() - started


def _ready(compiled: Any, arrays: Sequence[Any]) -> Any:
    """Call ``compiled`` and wait until its outputs exist (on a worker thread)."""
    out = compiled(*arrays)
    jax.block_until_ready(out)  # type: ignore[no-untyped-call]
    return out
