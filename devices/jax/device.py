"""JAX device actors: compiled functions on a specific ``jax.devices()[i]``.

A :class:`JaxDevice` with atoll id ``d`` owns ``jax.devices()[d]`` (8 fake CPU
devices in tests, real GPUs when JAX sees them). It runs three kinds of work:

* a :class:`~atoll.devices.Computation` (``cluster.run``): the function is
  jitted onto this one device, and its output stays there;
* a :class:`JaxKernel` gang (a node of a ``@program``): the gang's leader
  runs it as ONE sharded JAX computation over a mesh of the gang's devices,
  so collectives inside it are real; the other shards wait at the gang's
  barriers while it is enqueued (they take part in the same program);
* a :class:`JaxKernel` gang whose devices span host *processes* (that joined
  one ``jax.distributed`` runtime, see ``multi.py``): on every host, the
  gang's first device there (its host leader) runs the same SPMD program
  over the global mesh with that host's shards; collectives cross hosts
  (gloo on CPU). Outputs come out replicated and the gang leader keeps its
  copy, so it holds them whole, as in one process. If one of those host
  processes dies, the gang fails with ``HostLost`` (its barriers are
  abandoned; a shard already in a collective with the dead host gives up
  after ``ATOLL_JAX_COLLECTIVE_TIMEOUT_S``), and the surviving hosts' devices
  go on with work that does not need it (``docs/reliability.md``).

**The device runs ahead of its host.** A computation on this process's
devices is *enqueued*: JAX dispatch returns at once, its outputs enter the
host's store as ``jax.Array`` futures, and the next gang that reads them is
enqueued behind it with no host wait (XLA orders dependent work by the
buffers' definition events). Only what needs a finished value waits for one:
a fetch, a push to another host, busy time, the timeline and the session's
ledger, which the device's :class:`~atoll.devices._inflight.InFlight`
watcher settles off the critical path. A computation that fails after it was
enqueued fails its outputs with the real error: a fetch of them raises it,
and so does every gang that reads them (an error known when a reader is
enqueued fails that reader at once; XLA fails the ones already enqueued).
At most ``WINDOW`` gangs are in flight per device, and each reserves its
output bytes in the store before it is enqueued, so a host that outruns its
accelerator stalls instead of running out of memory. Gangs over processes
run synchronously, as collectives across hosts need.

Compiled executables are cached by signature (function, devices, input
shapes, dtypes and shardings), and so are the meshes and shardings a gang
needs. Outputs stay on the devices, as ``jax.Array`` in the host's object
store, reference-counted and owner-labelled.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

import anyio
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ...kernel import Promise, endpoint, failed
from ...transports.dtypes import dtype_name
from .. import timeline
from .._device import Device, GangOutputs, LeanGang
from .._gang import GangTask
from .._host import Host
from .._inflight import WINDOW, InFlight
from .._jax_kernel import JaxKernel, fn_key
from .._plan import (
    PUSHED_IN,
    DeviceProgram,
    PlannedGang,
    PriorOutput,
    RunReport,
    portable,
    run_key,
)
from .._shards import Layout, ShardedHandle
from .._values import BufferHandle, Computation
from . import multi as _jax_multi
from .compiled import Executable, Executables, Meshes
from .fused import FusedSegment, fusing, segments

__all__ = ["JaxDevice", "JaxHost", "JaxKernel"]

_log = logging.getLogger(__name__)

_KERNELS_KEPT = 1024  # executables a device finds by kernel object (beside its cache)


class JaxHost(Host):
    """A host whose store keeps device arrays; remote readers get numpy bytes."""

    @endpoint
    def placement(self, buffer_id: str) -> list[int]:
        """The JAX device ids that hold a buffer (empty: it is in host memory)."""
        array = self.store.get(buffer_id)
        if isinstance(array, np.ndarray):
            return []
        return sorted(d.id for d in array.devices())

    def placed(self, buffer_id: str, place: int | str) -> Any:
        """A device array retagged to another device of this host goes onto
        it (asynchronously, as JAX copies); one parked by a suspended slice
        goes to host memory, and gives its device memory back."""
        array = self.store.get(buffer_id)
        if isinstance(array, np.ndarray):
            return None  # host memory already: a reader puts it on its device
        if isinstance(place, int) and place in self.device_ids:
            return jax.device_put(array, _jax_multi.jax_device(place))
        return np.asarray(array)


class JaxDevice(Device):
    """A device actor on one JAX device; see the module docstring."""

    host_cls = JaxHost
    device: jax.Device  # set in on_start, once this process's JAX runtime is up
    _single: jax.sharding.Sharding  # the sharding of an array on it alone

    @classmethod
    def available(cls, wanted: int | None = None) -> int | None:
        """JAX's devices in this process. Before JAX has started its backends,
        a cluster that wants several gets them on a machine without
        accelerators: XLA makes ``wanted`` CPU devices when asked with
        ``--xla_force_host_platform_device_count`` (set here in ``XLA_FLAGS``,
        unless the user set a count; the flag counts only for the CPU)."""
        if wanted is not None and wanted > 1:
            _ask_cpu_devices(wanted)
        return len(jax.devices())

    @classmethod
    def more_devices_hint(cls, wanted: int) -> str:
        flag = f"--xla_force_host_platform_device_count={wanted}"
        return (
            f". On a machine without accelerators, JAX makes that many CPU devices when "
            f"XLA_FLAGS={flag} is set before JAX starts (in the environment, or in "
            f"os.environ before the first jax.devices() or computation); atoll sets it "
            f"itself when JAX has not started yet and XLA_FLAGS names no count"
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.executables = Executables()  # every executable: computations, gangs, segments
        self.meshes = Meshes()
        # executables by kernel object: (kernel, input signature, executable)
        self._by_kernel: dict[int, tuple[Any, Any, Executable]] = {}
        # what a lean gang needs, by kernel object, once one ran (alone_now): the
        # kernel, the gang's (mesh shape, axis names), its inputs' (shape,
        # dtype), their shardings, the executable
        self._lean: dict[int, tuple[Any, Any, tuple[tuple[Any, Any], ...], list[Any], Executable]]
        self._lean = {}
        self.inflight = InFlight(_block, _is_ready, WINDOW, f"device{self.device_id}")
        self._last_done = 0.0  # perf_counter time the last gang in flight finished
        self._enqueued: set[str] = set()  # gangs run_shard enqueued; the watcher reports them
        # outputs in flight, by id: the promise that they exist (see _finished)
        self._futures: dict[int, Promise[None]] = {}

    async def on_start(self) -> None:
        """Join the hosts' JAX runtime if there is one, then take the device.

        Joining waits for every host process (on a worker thread: this host
        keeps answering meanwhile); messages queue until it is done.
        """
        await super().on_start()
        if _jax_multi.configured():
            await anyio.to_thread.run_sync(_jax_multi.ensure_runtime)
        self.device = _jax_multi.jax_device(self.device_id)
        self._single = jax.sharding.SingleDeviceSharding(self.device)
        _jax_multi.register(self.device_id, self.device)

    async def on_stop(self) -> None:
        await self.inflight.close()
        await super().on_stop()

    def running_dry(self) -> bool:
        return not self.inflight.count

    def in_flight(self) -> tuple[int, int]:
        return self.inflight.count, self.inflight.peak

    async def execute(self, computation: Computation, inputs: list[np.ndarray]) -> np.ndarray:
        """A plain computation, jitted onto this device, run to its end; host
        bytes (``cluster.run`` keeps its output on the device instead)."""
        compiled, arrays = self._jitted(computation, inputs)
        out = await self._timed(compiled, arrays)
        return np.asarray(out)

    async def _compute(
        self, computation: Computation, inputs: Sequence[BufferHandle], owner: str
    ) -> BufferHandle:
        """Enqueue ``computation`` on this device; its output stays here."""
        values = [await self._read(handle, owner) for handle in inputs]
        compiled, arrays = self._jitted(computation, values)
        [handle] = await self._enqueue(compiled, arrays, owner, computation.name)
        return handle

    def _jitted(
        self, computation: Computation, values: Sequence[Any]
    ) -> tuple[Executable, list[Any]]:
        """``computation`` compiled for these inputs (cached), and the inputs on
        this device."""
        arrays = [self._on_device(x, self._single) for x in values]
        return self._for_computation(computation, arrays), arrays

    def _for_computation(self, computation: Computation, arrays: Sequence[Any]) -> Executable:
        """``computation.fn`` jitted onto this device for ``arrays`` (cached)."""

        def compiled() -> Executable:
            key = (
                "computation",
                fn_key(computation.fn),
                *((a.shape, dtype_name(a.dtype)) for a in arrays),
            )
            return self._cached(key, lambda: jax.jit(computation.fn), arrays)

        return self._fast(computation, arrays, compiled)

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

    def fused_segments(self, program: DeviceProgram) -> dict[int, Any]:
        if not fusing():
            return {}
        try:
            ranges = segments(program, self.runs_alone)
            return {
                start: FusedSegment(program, start, end, self.device, self.meshes)
                for start, end in ranges
            }
        except Exception:  # fusing is an optimization: run such a plan gang by gang
            _log.exception("plan %s cannot be fused", program.plan_id)
            return {}

    async def run_segment(
        self,
        segment: Any,
        epoch: int,
        values: dict[int, Any],
        made: dict[tuple[int, int] | None, Any],
        owner: str,
        report: RunReport,
        passed: dict[int, list[str]],
    ) -> bool:
        """Gangs of a run as one computation (``devices/jax/fused.py``)."""
        try:
            self.store.ledger.check_open(owner)
            arrays = []
            for (kind, where), sharding in zip(segment.sources, segment.in_shardings, strict=True):
                value = values[where] if kind == "input" else made[where]
                arrays.append(self._on_device(await self._alone_input(value, owner), sharding))
            executable = self.executables.get(
                segment.key(arrays), lambda: segment.lowered(arrays), segment.kernels
            )
            ran = LeanGang(f"{run_key(epoch)}/{segment.gangs[0].node}+", segment.kernel)
            handles = await self._enqueue(executable, arrays, owner, segment.name, ran)
        except Exception as exc:  # gang by gang, each failing on its own (or not at all)
            _log.debug("%s run gang by gang: %s", segment.name, exc)
            return False
        for (node, index), handle in zip(segment.exported, handles, strict=True):
            made[node, index] = handle
            if (node, index) in segment.kept:
                report.outputs[node, index] = handle
                self._keep_earlier(epoch, node, [handle], offset=index)
            else:
                passed.setdefault(node, []).append(handle.id)
        self.computations += len(segment.gangs)
        return True

    def runs_alone(self, gang: PlannedGang) -> bool:
        return (
            len(gang.devices) == 1
            and isinstance(gang.kernel, (JaxKernel, Computation))
            and not gang.push
            and PUSHED_IN not in gang.inputs
        )

    async def run_alone(
        self, gang: PlannedGang, gang_id: str, inputs: Sequence[Any], owner: str
    ) -> Promise[list[BufferHandle]]:
        """The lean path of a planned gang on this device alone: its inputs
        (handles here, values, or promises of them) go on the device as
        they are, and its computation is enqueued; no task, no barrier."""
        kernel = gang.kernel
        try:
            self.store.ledger.check_open(owner)
            values = [await self._alone_input(value, owner) for value in inputs]
            if isinstance(kernel, JaxKernel):
                mesh, shardings = self._alone_mesh(gang)
                arrays = [self._on_device(v, s) for v, s in zip(values, shardings, strict=True)]
                executable = self._for_kernel(kernel, gang.devices, mesh, arrays)
                self._keep_lean(gang, arrays, shardings, executable)
            else:
                arrays = [self._on_device(value, self._single) for value in values]
                executable = self._for_computation(kernel, arrays)
            ran = LeanGang(gang_id, kernel)
            outputs = await self._enqueue(executable, arrays, owner, kernel.name, ran)
        except Exception as exc:
            out: Promise[list[BufferHandle]] = failed(exc)
            return out
        self.computations += 1
        return GangOutputs(outputs)

    def alone_now(
        self, gang: PlannedGang, gang_id: str, inputs: Sequence[Any], owner: str
    ) -> Promise[list[BufferHandle]] | None:
        """:meth:`run_alone` with no wait in it, for a gang whose inputs are
        all arrays in this host's store (computed or in flight) with the
        sharding its executable takes, the executable known for their shapes
        (kept per kernel: :attr:`_lean`), and room on the device and in the
        store. Most gangs of a run on one device are such, after its first."""
        kernel = gang.kernel
        lean = self._lean.get(id(kernel))
        if (
            lean is None
            or gang.push  # (the same kernel, in a gang that is not lean)
            or len(gang.devices) != 1
            or lean[0] is not kernel
            or lean[1] != (gang.mesh_shape, gang.axis_names)
            or self.inflight.count >= self.inflight.window
            or len(inputs) != len(lean[2])
        ):
            return None
        _, _, signature, shardings, executable = lean
        store, here = self.store, self.host_id
        arrays = []
        for value, sharding, (shape, dtype) in zip(inputs, shardings, signature, strict=True):
            if value.__class__ is not BufferHandle:  # a promise, a prior output, a value
                value = self._handle_now(value)
                if value is None:
                    return None
            if value.host_id != here:
                return None
            array = store.readable(value.id, owner)
            if array is None or not isinstance(array, jax.Array):
                return None
            if array.shape != shape or array.dtype != dtype:  # (what it was compiled for)
                return None
            have = array.sharding
            if have is not sharding and have != sharding:
                return None
            arrays.append(array)
        if store.ledger.over(owner, executable.nbytes) or not store.reserve_now(executable.nbytes):
            return None
        try:  # (it gives the bytes back itself if it raises)
            outputs = self._enqueue_reserved(
                executable, arrays, owner, kernel.name, LeanGang(gang_id, kernel)
            )
        except Exception as exc:
            return failed(exc)
        self.computations += 1
        return GangOutputs(outputs)

    def _handle_now(self, value: Any) -> BufferHandle | None:
        """The handle an input of :meth:`alone_now` names now: a settled
        promise's, a prior output's (None: a value, a promise not settled or
        failed, a prior output not kept or waiting aside, a sharded value)."""
        if isinstance(value, PriorOutput):
            if value.run in self._aside:  # (its gang waits aside)
                return None
            try:
                value = self.earlier(value)
            except Exception:  # (run_alone says why)
                return None
        if isinstance(value, Promise) and value.done() and value.exception() is None:
            value = value.result()
        return value if value.__class__ is BufferHandle else None

    def _keep_lean(
        self,
        gang: PlannedGang,
        arrays: Sequence[Any],
        shardings: Sequence[Any],
        executable: Executable,
    ) -> None:
        """What :meth:`alone_now` needs of ``gang``'s kernel (on this device,
        in the gang's mesh), once it ran with ``arrays``."""
        kernel, mesh = gang.kernel, (gang.mesh_shape, gang.axis_names)
        kept = self._lean.get(id(kernel))
        if kept is not None and kept[0] is kernel and kept[4] is executable and kept[1] == mesh:
            return  # (known: an executable is for one input signature)
        signature = tuple((a.shape, a.dtype) for a in arrays)
        self._lean[id(kernel)] = (kernel, mesh, signature, list(shardings), executable)
        while len(self._lean) > _KERNELS_KEPT:
            del self._lean[next(iter(self._lean))]

    async def _alone_input(self, value: Any, owner: str) -> Any:
        """An input of the lean path: an array here, a value, or what a handle,
        a promise of one, or a ``PriorOutput`` names."""
        return await self._read(await self._lean_input(value), owner)

    def _alone_mesh(self, gang: PlannedGang) -> tuple[Mesh, list[NamedSharding]]:
        """The mesh of a gang on this one device, and its input shardings (cached)."""
        mesh = self.meshes.mesh([self.device], gang.mesh_shape, gang.axis_names)
        return mesh, self.meshes.shardings(mesh, gang.kernel.in_specs)

    async def _gang(self, task: GangTask) -> list[jax.Device]:
        """The gang's JAX devices in mesh order (looked up once, on a thread)."""
        return await self._devices_of(task.devices)

    async def _devices_of(self, device_ids: Sequence[int]) -> list[jax.Device]:
        """The JAX devices of atoll devices ``device_ids``, in their order."""
        devices = _jax_multi.resolve_now(device_ids)
        if devices is None:
            devices = await anyio.to_thread.run_sync(_jax_multi.resolve, device_ids)
        return devices

    def _mesh(
        self, task: GangTask, devices: Sequence[jax.Device], specs: Sequence[Any] = ()
    ) -> tuple[Mesh, list[NamedSharding]]:
        """The gang's mesh, and a sharding over it per spec in ``specs`` (cached)."""
        mesh = self.meshes.mesh(devices, task.mesh_shape, task.axis_names)
        return mesh, self.meshes.shardings(mesh, specs)

    async def _lead(
        self,
        task: GangTask,
        devices: Sequence[jax.Device],
        inputs: list[BufferHandle],
        owner: str,
    ) -> list[BufferHandle]:
        """One process holds the whole gang: enqueue it, keep the outputs as futures."""
        kernel: JaxKernel = task.kernel
        mesh, shardings = self._mesh(task, devices, kernel.in_specs)
        arrays = [
            self._on_device(await self._read(handle, owner), sharding)
            for handle, sharding in zip(inputs, shardings, strict=True)
        ]
        compiled = self._for_kernel(kernel, task.devices, mesh, arrays)
        self._enqueued.add(task.gang_id)
        try:
            return await self._enqueue(compiled, arrays, owner, kernel.name, task)
        except BaseException:
            self._enqueued.discard(task.gang_id)
            raise

    def _for_kernel(
        self, kernel: JaxKernel, devices: tuple[int, ...], mesh: Mesh, arrays: Sequence[jax.Array]
    ) -> Executable:
        """:meth:`_compiled`, found by the kernel object first (:meth:`_fast`)."""
        return self._fast(kernel, arrays, lambda: self._compiled(kernel, mesh, arrays))

    def _fast(
        self, kernel: Any, arrays: Sequence[Any], compiled: Callable[[], Executable]
    ) -> Executable:
        """The executable of ``kernel`` for ``arrays``, looked up by the kernel
        object itself (a gang of an installed plan brings the same one to
        every run) while the inputs' shapes and dtypes are those it was
        compiled for; else ``compiled()`` (the cache by signature)."""
        signature = tuple((a.shape, a.dtype) for a in arrays)
        key = id(kernel)
        found = self._by_kernel.get(key)
        if found is not None and found[0] is kernel and found[1] == signature:
            return found[2]
        executable = compiled()
        self._by_kernel[key] = (kernel, signature, executable)
        while len(self._by_kernel) > _KERNELS_KEPT:
            del self._by_kernel[next(iter(self._by_kernel))]
        return executable

    def _on_device(self, value: Any, sharding: Any) -> Any:
        """``value`` with ``sharding``: as it is when it already has it (an
        output of an earlier gang here, maybe still being computed), else
        copied there."""
        if isinstance(value, jax.Array):
            have = value.sharding
            if have is sharding or have == sharding:
                return value
        return jax.device_put(value, sharding)

    async def _enqueue(
        self,
        compiled: Executable,
        arrays: Sequence[Any],
        owner: str,
        name: str,
        task: GangTask | LeanGang | None = None,
    ) -> list[BufferHandle]:
        """Enqueue ``compiled(*arrays)`` and store its outputs as futures.

        Waits for room in the in-flight window, then for the outputs' bytes
        in the store (both back-pressure); a session over its quota fails at
        once, never stalls. Errors raised while enqueueing fail the gang now;
        errors of the running computation reach its outputs later (see
        :meth:`_finished`).
        """
        nbytes = compiled.nbytes
        if self.inflight.count >= self.inflight.window:
            await self.inflight.room()
        self.store.ledger.check(owner, nbytes)
        await self.store.reserve(nbytes)
        return self._enqueue_reserved(compiled, arrays, owner, name, task)

    def _enqueue_reserved(
        self,
        compiled: Executable,
        arrays: Sequence[Any],
        owner: str,
        name: str,
        task: GangTask | LeanGang | None,
    ) -> list[BufferHandle]:
        """:meth:`_enqueue`, once its outputs' bytes are reserved in the store."""
        nbytes = compiled.nbytes
        enqueued = time.perf_counter()
        try:  # the session may have ended while this waited; from here on, no await
            self.store.ledger.check_open(owner)
            outs = compiled.compiled(*arrays)
        except BaseException:
            self.store.unreserve(nbytes)
            raise
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        ready: Promise[None] = Promise(name)
        where = (self.host, self.host_id, self.device_id)
        handles = [
            BufferHandle(
                self.store.put(
                    out, owner, reserved=True, ready=ready, nbytes=size, place=self.device_id
                ),
                *where,
                shape,
                dtype,
                size,
                self.island,
                self.plane.address,
            )
            for out, (shape, dtype, size) in zip(outs, compiled.outputs, strict=True)
        ]
        began_us = timeline.start()
        if not self.inflight.count and all(out.is_ready() for out in outs):
            self._finished(
                ready, owner, enqueued, began_us, task, (), None, None, time.perf_counter()
            )
            return handles  # it ran inline (small, on a CPU)
        futures = self._futures
        upstream = [p for a in arrays if (p := futures.get(id(a))) is not None]
        for out in outs:
            futures[id(out)] = ready
        done = functools.partial(
            self._finished, ready, owner, enqueued, began_us, task, upstream, outs
        )
        self.inflight.add(outs, done)
        return handles

    def _finished(
        self,
        ready: Promise[None],
        owner: str,
        enqueued: float,
        began_us: float,
        task: GangTask | LeanGang | None,
        upstream: Sequence[Promise[None]],
        outs: Sequence[Any] | None,
        error: BaseException | None,
        finished: float,
    ) -> None:
        """The watcher saw a gang finish (on the loop): settle its outputs, and
        charge its device time, from when it could start to when it ended.
        A gang that failed because an input in flight with it failed fails
        with that input's error: the real one, not XLA's word for it."""
        for out in outs or ():
            self._futures.pop(id(out), None)
        started = max(enqueued, self._last_done)
        busy = max(0.0, finished - started)
        self._last_done = finished
        self.background_busy_s += busy
        self.store.ledger.charge(owner, busy)
        if task is not None and timeline.RECORDER.on:
            end_us = timeline.now_us() - (time.perf_counter() - finished) * 1e6
            start_us = max(began_us, end_us - busy * 1e6)
            timeline.gang(self.host_id, self.device_id, task, owner, start_us, True, end_us)
        if error is None:
            ready.set_result(None)
            return
        root = next((e for p in upstream if (e := p.exception()) is not None), None)
        ready.set_exception(root or portable(error, task.gang_id if task else "computation"))

    def ran(self, task: GangTask, owner: str, began: float, busy_s: float, leader: bool) -> None:
        if task.gang_id in self._enqueued:  # the watcher reports it once it finished
            self._enqueued.discard(task.gang_id)
            return
        super().ran(task, owner, began, busy_s, leader)

    async def _read(self, handle: BufferHandle | ShardedHandle, owner: str = "") -> Any:
        """As every device's, except that a value split over devices this
        process holds becomes one ``jax.Array`` over them, each shard put on
        its own device (no copy when it is there already)."""
        if not isinstance(handle, ShardedHandle) or not self._addressable(handle):
            return await super()._read(handle, owner)
        layout = handle.layout
        devices = await self._devices_of(layout.devices)
        mesh = self.meshes.mesh(devices, layout.mesh_shape, layout.axis_names)
        [sharding] = self.meshes.shardings(mesh, [jax_spec(layout.spec)])
        holders = layout.holders(handle.shape)
        parts = {}
        for q in sorted(set(holders)):  # (no zero-argument super in a comprehension)
            parts[q] = await super()._read(handle.parts[q], owner)
        arrays = [
            jax.device_put(parts[q], device) for q, device in zip(holders, devices, strict=True)
        ]
        return jax.make_array_from_single_device_arrays(handle.shape, sharding, arrays)

    def _addressable(self, handle: ShardedHandle) -> bool:
        """Whether this process's JAX runtime holds every device of ``handle``."""
        if all(p.host_id == self.host_id for p in handle.parts):
            return True
        # hosts in this process share its runtime (no address: not a host process)
        return not _jax_multi.configured() and not any(p.address for p in handle.parts)

    async def _spmd_input(self, task: GangTask, spec: Any, value: Any, owner: str) -> Any:
        """What this host leader of a gang over processes reads of an input:
        its own devices' shards, when the input is split over the gang as the
        gang reads it (nothing crosses hosts); else the whole, in host memory."""
        if isinstance(value, ShardedHandle) and value.layout == _gang_layout(task, spec, value):
            mine = [(p, part) for p, part in enumerate(value.parts) if part.host_id == self.host_id]
            parts = [(p, await self._bytes_of(part, owner)) for p, part in mine]
            return _LocalShards(value.shape, parts)
        return await self._bytes_of(value, owner)

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
        mesh, _ = self._mesh(task, devices)
        specs = task.kernel.in_specs
        arrays = [
            await self._spmd_input(task, spec, handle, owner)
            for handle, spec in zip(inputs, specs, strict=True)
        ]
        if self.device_id != task.leader:  # the gang leader alone keeps the outputs
            await self._busy(self._run_spmd, task.kernel, mesh, arrays)
            return []
        return await self._keep(
            task.output_bytes, owner, lambda: self._busy(self._run_spmd, task.kernel, mesh, arrays)
        )

    def _run_spmd(self, kernel: JaxKernel, mesh: Mesh, arrays: list[Any]) -> list[Any]:
        """On a worker thread: the SPMD call, blocking in cross-host collectives."""
        shards = [
            x.global_array(mesh, NamedSharding(mesh, spec))
            if isinstance(x, _LocalShards)
            else jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), x.__getitem__)
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
    ) -> Executable:
        """The kernel compiled for this mesh and these inputs (cached).

        ``replicated``: every output whole on every device, whatever the
        kernel's ``out_specs`` say (how a gang over processes hands its
        outputs to the leader).
        """
        key = (
            "kernel",
            fn_key(kernel.fn),  # not the kernel: each message over the wire brings a new copy
            kernel.in_specs,
            kernel.out_specs,
            tuple(d.id for d in mesh.devices.flat),
            mesh.axis_names,
            tuple((a.shape, dtype_name(a.dtype)) for a in arrays),
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

    def _cached(self, key: Any, jitted: Callable[[], Any], arrays: Sequence[Any]) -> Executable:
        """The executable cached under ``key``, compiled from ``jitted()`` for
        ``arrays`` on first use (``Executables``)."""
        return self.executables.get(key, lambda: jitted().lower(*arrays))

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


def _block(arrays: Sequence[Any]) -> None:
    """Wait until ``arrays`` exist; raise the error one failed with."""
    for array in arrays:
        array.block_until_ready()


# whether an output exists (or failed), without waiting (a C call: no frame per ask)
_is_ready: Callable[[Any], bool] = operator.methodcaller("is_ready")


def _ready(compiled: Any, arrays: Sequence[Any]) -> Any:
    """Call ``compiled`` and wait until its outputs exist (on a worker thread)."""
    out = compiled(*arrays)
    jax.block_until_ready(out)  # type: ignore[no-untyped-call]
    return out


def _ask_cpu_devices(wanted: int) -> None:
    """Ask XLA for ``wanted`` CPU devices, if JAX's backends have not started
    and the user's ``XLA_FLAGS`` name no count of their own."""
    from jax._src import xla_bridge

    flags = os.environ.get("XLA_FLAGS", "")
    if xla_bridge.backends_are_initialized() or "xla_force_host_platform_device_count" in flags:
        return
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={wanted}".strip()


def jax_spec(spec: Sequence[Any]) -> PartitionSpec:
    """A layout's spec (``devices/_shards.py``) as JAX's ``PartitionSpec``."""
    entries = [e if e is None or len(e) > 1 else e[0] for e in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)  # type: ignore[no-untyped-call]


def _gang_layout(task: GangTask, spec: Any, value: ShardedHandle) -> Layout | None:
    """How a gang reads an input of ``value``'s rank with ``spec``."""
    try:
        return Layout.of(task.devices, task.mesh_shape, task.axis_names, spec, len(value.shape))
    except ValueError:
        return None


class _LocalShards:
    """A host leader's own shards of a sharded input, by mesh position."""

    def __init__(self, shape: tuple[int, ...], parts: list[tuple[int, np.ndarray]]) -> None:
        # bytes only: this goes to a worker thread, where no handle (and the
        # Cap'n Proto reference in it) may be let go of
        self.shape, self.parts = shape, parts

    def global_array(self, mesh: Mesh, sharding: NamedSharding) -> jax.Array:
        """The global array, from this process's shards alone."""
        flat = list(mesh.devices.flat)
        arrays = [jax.device_put(part, flat[p]) for p, part in self.parts]
        return jax.make_array_from_single_device_arrays(self.shape, sharding, arrays)
