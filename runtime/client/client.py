"""The client side of a cluster: virtual slices, ``run``, fetching and freeing.

A :class:`Cluster` is one client of a running cluster. Its buffers carry its
owner label, so :meth:`Cluster.close` frees all of them (and its slices) at
once. ``run`` returns at once: the whole program has been handed to the
controller, which dispatches every node ahead of the data; awaiting the
returned :class:`Outputs` fetches the arrays.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import operator
import os
import secrets
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

import numpy as np

from ...devices import Aval, BufferHandle, Computation, Device, DeviceStats, Host
from ...devices import timeline as _timelines
from ...devices._host_api import HostEndpoints
from ...devices._runlane import ENDPOINTS, FREE, RUN_CALL, RUN_CALL_DIRECT, RUN_GRAPH
from ...devices._shards import ShardedHandle, read_whole
from ...devices._values import INLINE_VALUE_BYTES
from ...kernel import (
    Actor,
    ActorRef,
    ActorStopped,
    ActorSystem,
    AtollError,
    Clock,
    HostLost,
    Promise,
    UsageError,
    all_settled,
    as_promise,
    flatten,
    forward,
    log_failure,
    then,
    value_of,
)
from ...transports.dtypes import dtype_name
from ...transports.inproc import read_only
from ..graph import Graph, ValueRef
from ..latency import Wire, over
from ..runlanes import Caller
from ..topology import DeviceInfo, Topology
from ..tracing import NotAProgram, PlacedFunction, Program, VirtualSlice, aval_of
from .batching import RunBatcher
from .colocated import dispatch as _colocated
from .leases import ClientLeases, Send
from .ownership import Ownership
from .refs import ArrayRef, ShardedRef

if TYPE_CHECKING:
    from ..control.controller import Controller

__all__ = ["ArrayRef", "Cluster", "Outputs", "ShardedRef"]


A = TypeVar("A", bound=Actor)
_log = logging.getLogger(__name__)
_log_unfreed = log_failure(_log, "a free of what a call put")


class HostLinks(Protocol):
    """Links of a client's own to host processes (``runtime/client/connect.py``)."""

    def get(self, address: str, host_id: int) -> ActorRef[Host] | None:
        """The host at ``address`` over such a link, if one is up (never waits)."""
        ...

    def lane(self, host: ActorRef[Host]) -> Caller | None:
        """The one-way lane to the host process ``host`` names, if there is one."""
        ...

    def answering(self, host_id: int) -> Caller | None:
        """The lane down which host ``host_id`` can answer this client's
        calls to the controller, if one is up."""
        ...

    def lanes(self) -> list[Caller]:
        """Every lane to a host process (each once)."""
        ...


class Outputs:
    """What ``run`` returns at once. ``await outputs`` gives the arrays (numpy),
    in the structure the program returned; ``outputs.refs`` gives
    :class:`ArrayRef` in that structure, to chain into further runs."""

    def __init__(self, client: Cluster, refs: list[ArrayRef], out_tree: Any, graph: Graph) -> None:
        self.client = client
        self.flat = refs
        self.out_tree = out_tree
        self.graph = graph  # the dataflow graph that was dispatched

    @property
    def refs(self) -> Any:
        import jax

        return jax.tree_util.tree_unflatten(self.out_tree, self.flat)

    def __await__(self) -> Any:
        return self._fetch().__await__()

    async def timeline(self, path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """For ``run(..., record=True)``: once the outputs exist, stop recording
        and return the timeline, a Chrome trace event file (written to ``path``
        too, if given)."""
        from .timelines import stop, write_timeline

        await all_settled([ref.promise for ref in self.flat])
        for ref in self.flat:  # computed: every gang that made them is recorded
            with contextlib.suppress(Exception):
                await self.client.ready(ref)
        document = await stop(self.client)
        if path is not None:
            write_timeline(document, path)
        return document

    async def _fetch(self) -> Any:
        import jax

        arrays = [await self.client.fetch(ref) for ref in self.flat]
        return jax.tree_util.tree_unflatten(self.out_tree, arrays)


class Cluster:
    """A client's handle on a running cluster (see :func:`atoll.local_cluster`)."""

    def __init__(
        self,
        system: ActorSystem,
        controller: ActorRef[Controller],
        topology: Topology,
        devices: list[ActorRef[Device]],
        hosts: list[ActorRef[Host]],
        owner: str = "client0",
        wire: Wire | None = None,
        direct: HostLinks | None = None,
        lane: Caller | None = None,
    ) -> None:
        self.wire = wire
        # runs to the controller one way, from a client in another process
        # (runtime/runlanes.py); None: by call
        self._lane = lane if wire is None else None
        self.system = system
        self.controller = controller
        self.topology = topology
        self.owner = owner
        self._devices = devices
        # host processes over this client's own links, by address: a client
        # fetches and frees at the host that holds a buffer, not through the
        # controller (which proxies the references it passed on)
        self._direct = direct
        self._hosts = hosts
        self._host_addresses: dict[int, str] = {}  # host id -> its process's address
        # run calls made in one loop turn go as one graph (runtime/client/batching.py)
        self._batcher = RunBatcher(self._send_graph, self._send_call)
        # what this client's references keep alive (runtime/client/ownership.py)
        self._refs = Ownership(owner, controller.locate, self.host_of, self._free_at)
        # which run made each output promise handed out: (run tag, output index)
        self._made: weakref.WeakKeyDictionary[Promise[Any], tuple[str, int]] = (
            weakref.WeakKeyDictionary()
        )
        self._tags = itertools.count()
        self._tag_prefix = secrets.token_hex(6)  # unique to this handle
        # low-level calls sent straight to their device's host, under a lease
        # from the controller (runtime/client/leases.py); None: in one process
        self._leases: ClientLeases | None = None
        if direct is not None and wire is None:
            self._leases = ClientLeases(controller, topology, self._lease_lane)

    @property
    def device_infos(self) -> tuple[DeviceInfo, ...]:
        return self.topology.devices

    @property
    def clock(self) -> Clock:
        return self.system.clock

    @property
    def host_refs(self) -> list[ActorRef[Host]]:
        """The host actors (for tools; users go through run)."""
        return list(self._hosts)

    def recording(self, path: str | os.PathLike[str] | None = None) -> Any:
        """``async with cluster.recording("run.json") as log:`` records what
        every device, host and island does in the block, and writes it as a
        Chrome trace event file (``log.document``; see ``docs/observability.md``)."""
        from .timelines import record

        return record(self, path)

    def client(self, owner: str) -> Cluster:
        """Another client of the same cluster, whose buffers carry ``owner``."""
        other = Cluster(
            self.system,
            self.controller,
            self.topology,
            self._devices,
            self._hosts,
            owner,
            self.wire,
            self._direct,
            self._lane,
        )
        other._leases = self._leases  # (one count of each lease's runs)
        return other

    def _lease_lane(self, host_id: int) -> Caller | None:
        """This client's lane to host ``host_id``'s process, if it is up."""
        return self._direct.answering(host_id) if self._direct is not None else None

    def _free_at(self, host: ActorRef[Host], buffer_ids: list[str], owner: str) -> Promise[Any]:
        """Free ``buffer_ids`` at ``host``: a notice down its lane when this
        client has one to its process (no answer, so no wake-up of this
        process for it), else ``free_many`` by call."""
        lane = self._direct.lane(host) if self._direct is not None else None
        far = lane.far if lane is not None else None
        if (
            lane is not None
            and far is not None
            and lane.notify(FREE, -1 - far, (buffer_ids, owner))
        ):
            return as_promise(None)
        freed: Promise[Any] = host.free_many(buffer_ids, owner)
        return freed

    def host_of(self, handle: BufferHandle) -> ActorRef[HostEndpoints]:
        """The host that holds ``handle``'s buffer, over this client's own link
        to its process where there is one (else the handle's reference)."""
        if handle.address and self._direct is not None:
            return self._direct.get(handle.address, handle.host_id) or handle.host
        return handle.host

    # -- virtual devices ------------------------------------------------
    async def devices(
        self,
        n: int,
        island: int | None = None,
        mesh_shape: tuple[int, ...] | None = None,
        axis_names: tuple[str, ...] | None = None,
    ) -> VirtualSlice:
        """A virtual slice of ``n`` devices from the resource manager."""
        slice_: VirtualSlice = await self.controller.allocate(
            n, island, mesh_shape, axis_names, self.owner
        )
        return slice_

    # -- elastic slices (runtime/control/elastic.py) ------------------------------
    async def move(
        self,
        slice_: VirtualSlice,
        host: int | None = None,
        devices: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        """Move a slice to free devices on ``host``, or to physical
        ``devices`` (in mesh order), or anywhere free off its hosts; its
        buffers go with it, and this client's handles and ``ArrayRef`` s keep
        working. What moved: buffers, bytes, seconds. Asynchronous: the
        runs made before go first; the ones made meanwhile wait for it."""
        await self._in_order()
        devices = list(devices) if devices is not None else None
        report: dict[str, Any] = await self.controller.move_slice(
            slice_.slice_id, devices, host, self.owner
        )
        return report

    async def suspend(self, slice_: VirtualSlice) -> dict[str, Any]:
        """Give a slice's devices back, its buffers kept in host memory;
        runs on it wait until :meth:`resume`."""
        await self._in_order()
        report: dict[str, Any] = await self.controller.suspend_slice(slice_.slice_id, self.owner)
        return report

    async def resume(self, slice_: VirtualSlice) -> dict[str, Any]:
        """Devices again for a suspended slice (maybe others), its buffers on them."""
        await self._in_order()
        report: dict[str, Any] = await self.controller.resume_slice(slice_.slice_id, self.owner)
        return report

    async def drain(self, host: int) -> dict[str, Any]:
        """Move every slice and buffer off ``host``, which then leaves (an
        operator's call: it moves other sessions' slices too)."""
        await self._in_order()
        report: dict[str, Any] = await self.controller.drain_host(host)
        return report

    async def elastic_status(self) -> dict[str, Any]:
        """Spares, suspended and moving slices, drains and recent changes."""
        status: dict[str, Any] = await self.controller.elastic_status()
        return status

    async def _where(self, handle: BufferHandle) -> BufferHandle | None:
        """Where a buffer is now, if it moved (its old host left or is lost)."""
        found: dict[str, BufferHandle] = await self.controller.locate([handle.id])
        return found.get(handle.id)

    async def release(self, slice_: VirtualSlice) -> None:
        """Give a slice's devices back."""
        await self._in_order()
        await self.controller.release(slice_.slice_id, self.owner)

    async def close(self) -> int:
        """This client goes away: free its slices and every buffer it owns.

        Its owner label is closed for good: the hosts store nothing more for
        it (its gangs still running fail with ``SessionEnded``), so a client
        that wants to go on needs a label of its own (:meth:`client`)."""
        await self._in_order()
        self._refs.close()
        freed: int = await self.controller.release_owner(self.owner)
        return freed

    async def _in_order(self) -> None:
        """Send the runs collected so far, and wait until those sent by call
        lane reached the controller, and those sent under a lease their
        devices: the Cap'n Proto call that follows travels on another
        connection, and must come after them."""
        self.flush()
        barrier = self._lane.sync() if self._lane is not None else None
        barriers = [barrier] if barrier is not None else []
        if self._leases is not None:
            barriers += self._leases.sync()
        await all_settled(barriers)  # either way: a lost lane failed what it had

    def flush(self) -> None:
        """Send the ``run`` calls collected in this loop turn now (they go
        by themselves once the caller yields; see ``runtime/client/batching.py``)."""
        self._batcher.flush()

    # -- running --------------------------------------------------------
    @overload
    def run(
        self,
        target: Computation,
        device: int,
        inputs: Sequence[Any] = (),
        owner: str = "",
    ) -> Promise[BufferHandle]: ...
    @overload
    def run(
        self, target: Program | PlacedFunction, *args: Any, record: bool = False
    ) -> Outputs: ...
    def run(self, target: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a program (or a placed function, as a one-node program).

        Returns :class:`Outputs` at once; every node is already on its way to
        its devices. ``run(computation, device, inputs)`` is the low-level
        form: one :class:`Computation` on one physical device. With
        ``record=True`` the cluster records its timeline until
        ``await outputs.timeline(path)`` (``docs/observability.md``).
        """
        if isinstance(target, Computation):
            return self._run_computation(target, *args, **kwargs)
        program = _program_of(target)
        leaves, traced = _trace(program, args)
        if kwargs.pop("record", False):  # Outputs.timeline() gives what it recorded
            from .timelines import start

            start(self)
        if kwargs:
            raise TypeError(f"run got unexpected keyword arguments {sorted(kwargs)}")
        if _timelines.RECORDER.on:  # the node names cost a list per run
            _timelines.control(
                "run", "client", program=program.name, nodes=_names(traced.graph), client=self.owner
            )
        return Outputs(self, self.run_graph(traced.graph, leaves), traced.out_tree, traced.graph)

    async def run_sequential(self, target: Program | PlacedFunction, *args: Any) -> Outputs:
        """Like ``run``, but each node is dispatched only after the one before finished."""
        leaves, traced = _trace(_program_of(target), args)
        refs = await self.run_graph_sequential(traced.graph, leaves)
        return Outputs(self, refs, traced.out_tree, traced.graph)

    def run_graph(self, graph: Graph, leaves: Sequence[Any]) -> list[ArrayRef]:
        """Parallel asynchronous dispatch of a graph; returns its outputs at once."""
        inputs = self._inputs(graph, leaves)
        outs: list[Promise[BufferHandle]] = [Promise(f"output {i}") for i in graph.outputs]
        self._batcher.add_graph(graph, inputs, self.owner, outs)
        return [
            ArrayRef(self._refs.track(out), graph.aval(ref))
            for out, ref in zip(outs, graph.outputs, strict=True)
        ]

    def _send_graph(
        self,
        graph: Graph,
        inputs: list[Any],
        owner: str,
        outputs: Sequence[Promise[Any]],
    ) -> None:
        """One ``run_graph`` call: ``outputs`` (a promise per graph output)
        follow the graph's outputs; the inputs it reads are kept until every
        gang took them. The run is tagged, and so are its outputs, so that a
        later run reading one where it was made need not wait for it to come
        back (``Controller.run_graph``)."""
        send: Send = functools.partial(self._to_controller, RUN_GRAPH, graph, inputs, owner)
        if self._leases is not None:  # under a lease, straight to the device's host
            send = self._leases.route_graph(graph, inputs, owner, outputs, send)
        self._sent(inputs, outputs, send)

    def _send_call(
        self,
        computation: Computation,
        device: int,
        inputs: list[Any],
        owner: str,
        output: Promise[Any],
    ) -> None:
        """One low-level call on its own (``Controller.run_call``)."""
        call = (computation, device, inputs, owner)
        send: Send = functools.partial(self._to_controller, RUN_CALL, *call)
        if self._leases is not None:  # under a lease, straight to the device's host
            send = self._leases.route(computation, device, inputs, owner, output, send)
        self._sent(inputs, [output], send)

    def _to_controller(self, kind: int, *args: Any) -> Promise[Any]:
        """A run to the controller: by this client's call lane if it has one."""
        by_call: Callable[[], Promise[Any]] = functools.partial(self._by_call, kind, args)
        if self._lane is None:
            return by_call()
        direct = self._answering(args[1]) if kind == RUN_CALL else None
        if direct is not None:  # the device's host may answer it (Controller.run_graph)
            return self._lane.call(RUN_CALL_DIRECT, 0, args, by_call, direct)
        return self._lane.call(kind, 0, args, by_call)

    def _by_call(self, kind: int, args: tuple[Any, ...]) -> Promise[Any]:
        """A run to the controller by Cap'n Proto call (no lane, or it cannot)."""
        answer: Promise[Any] = getattr(over(self.wire, self.controller), ENDPOINTS[kind])(*args)
        return answer

    def _answering(self, device: int) -> Caller | None:
        """The lane down which ``device``'s host can answer a call on it."""
        if self._direct is None:
            return None
        return self._direct.answering(self.topology.device(device).host)

    def _sent(
        self,
        inputs: list[Any],
        outputs: Sequence[Promise[Any]],
        send: Callable[[str, list[tuple[str, int] | None]], Promise[Any]],
    ) -> None:
        """Send a run to the controller (``send(tag, sources)``), tagged:
        ``outputs`` follow its answer; ``inputs`` are kept until it has read
        them."""
        tag = f"{self._tag_prefix}/{next(self._tags)}"
        sources = [self._made.get(x) if isinstance(x, Promise) else None for x in inputs]
        answer = send(tag, sources)
        if inputs:  # kept until it read them (not its handles: they count)
            self._refs.reading(inputs, then(answer, _nothing))
        for i, out in enumerate(outputs):
            self._made[out] = (tag, i)
            if self.wire is None:  # the answer's i-th value, straight into ``out``
                answer.add_done_callback(functools.partial(_output_of, i, out))
            else:
                forward(self._reply(flatten(then(answer, operator.itemgetter(i)))), out)

    async def run_graph_sequential(self, graph: Graph, leaves: Sequence[Any]) -> list[ArrayRef]:
        """Sequential dispatch: one node at a time, each after its inputs exist."""
        inputs = self._inputs(graph, leaves)
        values: dict[ValueRef, Any] = {ValueRef(-1, i): v for i, v in enumerate(inputs)}
        for node in graph.nodes:
            node_inputs = [await value_of(values[ref]) for ref in node.inputs]
            ran = self._flushed_controller().run_graph(graph.alone(node), node_inputs, self.owner)
            for i, handle in enumerate(await self._reply(ran)):
                values[ValueRef(node.id, i)] = await value_of(handle)  # raises its failure
        for ref in graph.freeable():
            handle = await value_of(values[ref])
            await self.host_of(handle).free(handle.id, self.owner)
        return [
            ArrayRef(self._refs.track(as_promise(await value_of(values[r]))), graph.aval(r))
            for r in graph.outputs
        ]

    def _inputs(self, graph: Graph, leaves: Sequence[Any]) -> list[Any]:
        """A run's inputs as it sends them. An array is put first (a promise,
        so the run still leaves at once), unless it is small enough to go in
        the call; what is put is this client's, like anything it makes, and
        freed once the run read it and no reference here holds it."""
        readers: dict[ValueRef, list[int]] | None = None  # only for an input to put
        inputs: list[Any] = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, ArrayRef):
                inputs.append(leaf.promise)
            elif isinstance(leaf, (BufferHandle, Promise)):
                inputs.append(leaf)
            elif (small := _by_value(leaf)) is not None and ValueRef(-1, i) not in graph.outputs:
                inputs.append(small)  # an output must be stored: it needs a handle
            else:
                readers = graph.consumers() if readers is None else readers
                first = readers.get(ValueRef(-1, i))
                slice_id = graph.nodes[first[0]].slice.slice_id if first else None
                put = self._flushed_controller().put(np.asarray(leaf), slice_id, self.owner)
                inputs.append(self._refs.track(put))
        return inputs

    def _flushed_controller(self) -> ActorRef[Controller]:
        """The controller, over the modelled RPC link if there is one, once
        the ``run`` calls collected before are sent."""
        self.flush()
        return over(self.wire, self.controller)

    def _reply(self, promise: Promise[Any]) -> Promise[Any]:
        return promise if self.wire is None else self.wire.reply(promise)

    def _run_computation(
        self,
        computation: Computation,
        device: int,
        inputs: Sequence[Any] = (),
        owner: str = "",
    ) -> Promise[BufferHandle]:
        """``inputs``: handles, their promises, ``ArrayRef`` or arrays. A small
        array (up to ``INLINE_VALUE_BYTES``) is copied into the call itself,
        so it costs no message of its own; a larger one is put on the device
        first (a promise, so the call still leaves at once), this client's
        to free once the call read it, as anything it put. The call joins
        this loop turn's batch (``runtime/client/batching.py``) and leaves
        when the caller yields."""
        self.topology.device(device)
        owner = owner or self.owner
        puts: list[Promise[BufferHandle]] = []
        args = [self._argument(value, device, owner, puts) for value in inputs]
        out = self._batcher.add(computation, device, args, owner)
        if owner == self.owner:
            return self._refs.track(out)
        for put in puts:  # another session's: freed as that session, once the call ran
            all_settled([out, put]).add_done_callback(functools.partial(self._free_put, put, owner))
        return out

    def _free_put(self, put: Promise[BufferHandle], owner: str, _: Promise[Any]) -> None:
        """Free what a call put for session ``owner``, now that the call ran."""
        if put.exception() is None:
            handle = put.result()
            self.host_of(handle).free(handle.id, owner).add_done_callback(_log_unfreed)

    def _argument(
        self, value: Any, device: int, owner: str, puts: list[Promise[BufferHandle]]
    ) -> Any:
        if isinstance(value, ArrayRef):
            return value.promise
        if isinstance(value, (BufferHandle, Promise)):
            return value
        small = _by_value(value)
        if small is not None:
            return small
        put = self._put(np.asarray(value), device, owner)
        puts.append(put)
        return self._refs.track(put) if owner == self.owner else put

    # -- data -----------------------------------------------------------
    def device_ref(self, device: int) -> ActorRef[Device]:
        """The actor of one device (for tools and tests; users go through run)."""
        self.topology.device(device)
        return self._devices[device]

    async def spawn(
        self,
        cls: type[A],
        *args: Any,
        host: int | None = None,
        device: int | None = None,
        on_failure: str = "restart",
        **kwargs: Any,
    ) -> ActorRef[A]:
        """Start an actor of ``cls`` (any :class:`~atoll.Actor` class) in a
        host's process, beside its devices: host ``host``, or the host of
        ``device``. Colocated Python (``docs/colocated.md``).

        The class travels by reference, or by value when it is defined in a
        script or a function. The actor belongs to this session: it stops
        when the session ends, and only the reference returned reaches it
        (nothing names it for others). Its calls are promises, as any
        actor's; an endpoint that raises gives the caller the error with its
        traceback, and the host goes on. ``on_failure``: what becomes of the
        actor when it fails (its ``on_start`` raises, or an endpoint of a
        class with ``fail_on_error``): ``"restart"`` (a fresh instance, the
        same reference) or ``"stop"``. If its host is lost, calls fail with
        ``HostLost``.
        """
        where = self._spawn_host(host, device)
        target = await self.host_link(where)
        ref: ActorRef[A] = await target.spawn_user(cls, args, kwargs, self.owner, on_failure)
        return ref

    def _spawn_host(self, host: int | None, device: int | None) -> int:
        if (host is None) == (device is None):
            raise UsageError("spawn needs one of host= or device=")
        if device is not None:
            return self.topology.device(device).host
        assert host is not None
        if not 0 <= host < len(self._hosts):
            raise UsageError(f"no host {host}: this cluster has hosts 0 to {len(self._hosts) - 1}")
        return host

    async def host_link(self, host_id: int) -> ActorRef[Host]:
        """Host ``host_id``, over this client's own link to its process when
        one is up (its actors' calls then go straight there), else through
        the controller."""
        proxied = self._hosts[host_id]
        if self._direct is None:
            return proxied
        address = self._host_addresses.get(host_id)
        if address is None:
            address = self._host_addresses[host_id] = await proxied.address()
        link = self._direct.get(address, host_id)
        if link is None:  # not up (yet), or a host process that took its place: ask again
            self._host_addresses.pop(host_id, None)
        return link or proxied

    async def colocated(self, fn: Any, slice_: VirtualSlice, *args: Any) -> Any:
        """Run ``fn`` (made with :func:`atoll.colocated`) on each host of
        ``slice_``, beside its devices: each host gets its block of each
        array argument (``ArrayRef`` s), and keeps its block of each output
        as shards on its devices. Returns a :class:`ShardedRef` per output
        (one, or a tuple), which runs read like any value, once the hosts
        have the call: not once it ran. No byte of the arrays passes through
        this client; a call that reads a run's output waits for it there,
        and a run that reads an output waits for the call
        (``docs/colocated.md``)."""
        refs = await _colocated(self, fn, slice_, args)
        return refs[0] if len(refs) == 1 else tuple(refs)

    def track(self, promise: Promise[BufferHandle]) -> Promise[BufferHandle]:
        """Count ``promise`` as this client's reference to the buffer it
        settles with: freed once it and its handle are gone."""
        return self._refs.track(promise)

    def put(self, array: Any, device: int, owner: str = "") -> Promise[BufferHandle]:
        """Copy a host array onto physical ``device``; returns its handle's
        promise (freed once the promise and the handle are gone, or by hand)."""
        promise = self._put(array, device, owner or self.owner)
        return self._refs.track(promise) if _is_mine(owner, self.owner) else promise

    def _put(self, array: Any, device: int, owner: str) -> Promise[BufferHandle]:
        self.topology.device(device)
        promise: Promise[BufferHandle] = self._devices[device].put(np.asarray(array), owner)
        return promise

    async def fetch(self, value: ArrayRef | BufferHandle | Promise[BufferHandle]) -> np.ndarray:
        """The value of a buffer, read from the host that holds it."""
        handle = await value_of(value.promise if isinstance(value, ArrayRef) else value)
        if isinstance(handle, ShardedHandle):  # split over devices: its shards put together
            return await read_whole(handle, self.fetch)
        if handle.value is not None:  # a small value rides along in its handle
            return handle.value
        try:
            array: np.ndarray = await self.host_of(handle).fetch(handle.id, self.owner)
        except (HostLost, ActorStopped):
            moved = await self._where(handle)
            if moved is None:  # lost with its host
                raise
            array = await self.host_of(moved).fetch(moved.id, self.owner)
        return array

    async def ready(self, value: ArrayRef | BufferHandle | Promise[BufferHandle]) -> None:
        """Return once a buffer exists: devices run ahead, so a handle (and an
        ``ArrayRef``'s promise) can settle while its computation is still
        under way; this waits for the computation itself, and raises its
        error if it failed. Moves no bytes."""
        handle = await value_of(value.promise if isinstance(value, ArrayRef) else value)
        if isinstance(handle, ShardedHandle):
            for part in handle.parts:
                await self.ready(part)
            return
        try:
            await self.host_of(handle).ready(handle.id, self.owner)
        except (HostLost, ActorStopped):
            moved = await self._where(handle)
            if moved is None:
                raise
            await self.host_of(moved).ready(moved.id, self.owner)

    async def save(self, tree: Any, directory: str | os.PathLike[str]) -> None:
        """Checkpoint a pytree of :class:`ArrayRef` (and values) into
        ``directory``: each host writes what it holds (orbax); the bytes do
        not pass through this client (``runtime/client/checkpoints.py``)."""
        import jax

        from . import checkpoints

        def promise(leaf: Any) -> Any:
            if isinstance(leaf, ShardedRef):
                raise UsageError(
                    "save takes ArrayRefs made by runs; a ShardedRef (colocated) is not saved yet"
                )
            return leaf.promise if isinstance(leaf, ArrayRef) else leaf

        plain = jax.tree_util.tree_map(promise, tree, is_leaf=_is_array_ref)
        await checkpoints.save(plain, os.fspath(directory), self.owner, self.controller.locate)

    async def restore(self, directory: str | os.PathLike[str], device: int = 0) -> Any:
        """The pytree :meth:`save` wrote, its arrays loaded by physical
        ``device`` (any device: a run moves them where it needs them)."""
        from . import checkpoints

        def own(handle: BufferHandle) -> ArrayRef:
            aval = Aval(tuple(handle.shape), dtype_name(handle.dtype))
            return ArrayRef(self._refs.track(as_promise(handle)), aval)

        ref = self.device_ref(device)
        return await checkpoints.restore(os.fspath(directory), ref, self.owner, own)

    async def free(self, value: ArrayRef | BufferHandle | Promise[BufferHandle]) -> bool:
        """Drop this client's reference to a buffer; True if it was freed."""
        handle = await value_of(value.promise if isinstance(value, ArrayRef) else value)
        if isinstance(handle, ShardedHandle):
            return all([await self.free(part) for part in handle.parts])
        self._refs.by_hand(handle)
        try:
            freed: bool = await self.host_of(handle).free(handle.id, self.owner)  # its own only
        except (HostLost, ActorStopped):
            moved = await self._where(handle)
            if moved is None:
                raise
            freed = await self.host_of(moved).free(moved.id, self.owner)
        return freed

    async def store_usage(self, reset_peak: bool = False) -> list[dict[str, int]]:
        """Buffers and bytes held by each host's object store (``peak_bytes``:
        the most held at once, since the last call with ``reset_peak``), once
        the frees of buffers this client let go of reached their hosts (those
        put off while frees keep coming too: ``runtime/client/ownership.py``;
        not those whose last reader still runs)."""
        sent = self._refs.send_put_off()  # before the count
        await all_settled(sent)  # (by call: answered once done; one that failed was logged)
        lanes = self._direct.lanes() if self._direct is not None else []
        synced = [s for s in (lane.sync(notices=True) for lane in lanes) if s is not None]
        await all_settled(synced)  # every free sent down a lane, now or before, was made
        return [await p for p in [host.store_usage(reset_peak) for host in self._hosts]]

    async def device_stats(self) -> list[DeviceStats]:
        """Busy time, transfers and computations of every device."""
        promises = [ref.stats() for ref in self._devices]
        return [await p for p in promises]


def _by_value(value: Any) -> np.ndarray | None:
    """A small array-like as it travels inside a call: a read-only copy taken
    now (the caller may change its own array afterwards); None when it is too
    large for that and must be put on a device first."""
    array = np.asarray(value)
    return read_only(array.copy()) if array.nbytes <= INLINE_VALUE_BYTES else None


def _nothing(_: Any) -> None:
    return None


def _is_array_ref(leaf: Any) -> bool:
    return isinstance(leaf, ArrayRef)


def _is_mine(asked: str, mine: str) -> bool:
    """Whether a buffer made for owner ``asked`` ('' : the client's) is this client's."""
    return not asked or asked == mine


def _names(graph: Graph) -> list[str]:
    return [node.name for node in graph.nodes]


def _program_of(target: Any) -> Program:
    if isinstance(target, PlacedFunction):
        return target.as_program()
    if isinstance(target, Program):
        return target
    raise NotAProgram(
        f"run needs a Computation, a Program or a placed function, got {type(target).__name__}"
    )


def _trace(program: Program, args: tuple[Any, ...]) -> tuple[list[Any], Any]:
    import jax

    leaves, in_tree = jax.tree_util.tree_flatten(args)
    for leaf in leaves:
        if isinstance(leaf, Promise):
            raise AtollError(
                "pass an ArrayRef (outputs.refs), not a bare promise: its shape is needed"
            )
    return leaves, program.trace([aval_of(leaf) for leaf in leaves], in_tree)


def _output_of(index: int, out: Promise[Any], answer: Promise[Any]) -> None:
    """Settle ``out`` as the ``index``-th value of a run's answer settles (a
    handle, or the promise of one): ``flatten(then(answer, itemgetter(i)))``
    without its two promises, on the path every run's every output takes."""
    error = answer.exception()
    if error is not None:
        out.set_exception(error)
        return
    try:
        value = answer.result()[index]
    except Exception as exc:
        out.set_exception(exc)
        return
    if isinstance(value, Promise):
        forward(value, out)
    else:
        out.set_result(value)
