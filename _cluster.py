"""An in-process cluster: controller, island schedulers, hosts and devices.

:func:`local_cluster` builds the whole actor tree of a cluster inside one
:class:`~atoll.kernel.ActorSystem`. It is atoll's embedded default: the same
actors later run in separate processes behind a network transport.

Dispatch runs ahead of the data. ``cluster.run(...)`` returns promises at
once; the controller and the island schedulers forward promise-carrying calls
without waiting for their inputs (their endpoints take promises as they are),
and only the devices, which must have the bytes, wait for them. The client
side (:class:`~atoll._client.Cluster`) lives in ``_client.py``.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

from ._client import Cluster
from .devices import BufferHandle, Computation, CostModel, Device, Host, SimDevice
from .devices._gang import GangTask, PushTarget, Rendezvous
from .kernel import Actor, ActorRef, ActorSystem, AtollError, Clock, Promise, endpoint
from .kernel._graph import Graph, Node, ValueRef, all_settled, as_promise, forward, then
from .kernel._latency import DelayLine, Wire
from .kernel._program import VirtualSlice
from .kernel._resources import ResourceManager
from .schedulers import Completed, Dispatch, Submit, get_scheduler

__all__ = [
    "Cluster",
    "Controller",
    "DeviceInfo",
    "IslandScheduler",
    "Topology",
    "local_cluster",
    "spawn_control",
]


@dataclass(frozen=True)
class DeviceInfo:
    """Where a device sits: its global id, its host and its island."""

    id: int
    host: int
    island: int


@dataclass(frozen=True)
class Topology:
    """The devices of a cluster, in id order."""

    devices: tuple[DeviceInfo, ...]

    @classmethod
    def even(cls, islands: int, hosts_per_island: int, devices_per_host: int) -> Topology:
        """Devices numbered host by host, hosts island by island, all alike."""
        per_island = hosts_per_island * devices_per_host
        return cls(
            tuple(
                DeviceInfo(d, d // devices_per_host, d // per_island)
                for d in range(islands * per_island)
            )
        )

    @property
    def islands(self) -> int:
        return len({d.island for d in self.devices})

    def on_host(self, host: int) -> list[int]:
        """The ids of host ``host``'s devices."""
        return [d.id for d in self.devices if d.host == host]

    def device(self, device_id: int) -> DeviceInfo:
        if not 0 <= device_id < len(self.devices):
            raise AtollError(f"no device {device_id}: the cluster has {len(self.devices)}")
        return self.devices[device_id]


class IslandScheduler(Actor):
    """Runs one island's scheduling policy (a pure state machine) as an actor.

    ``submit_gang`` takes the gang's inputs as promises and forwards them to
    the devices unresolved, in the order the policy says: the scheduler never
    waits for data. A child :class:`Rendezvous` serves the gangs' barriers.
    """

    def __init__(
        self,
        island: int,
        policy: str,
        devices: dict[int, ActorRef[Device]],
        wire: Wire | None = None,
    ) -> None:
        self.island = island
        self.wire = wire
        self.policy_name = policy
        self.policy = get_scheduler(policy)
        self.devices = devices
        self._events = itertools.count()
        self._pending: dict[str, tuple[GangTask, Sequence[Any], str, Promise[Any], int]] = {}
        self.rendezvous: ActorRef[Rendezvous] | None = None
        self._completions: list[tuple[str, int]] = []

    async def on_start(self) -> None:
        self.rendezvous = self.ctx.spawn(Rendezvous, name="rendezvous")

    @endpoint(resolve_args=False)
    def submit_gang(
        self, task: GangTask, inputs: Sequence[Any], owner: str = ""
    ) -> Promise[list[BufferHandle]]:
        """Order the gang; returns its leader's promise of the output handles."""
        if task.collective:  # only barriers need it: a capability costs on the wire
            task = replace(task, rendezvous=self.rendezvous)
        result: Promise[list[BufferHandle]] = Promise(task.gang_id)
        self._pending[task.gang_id] = (task, inputs, owner, result, 0)
        self._carry_out(
            self.policy.handle(Submit(next(self._events), task.gang_id, task.devices, owner))
        )
        return result

    def _carry_out(self, instructions: Sequence[Dispatch]) -> None:
        for instruction in instructions:
            gang_id, device = instruction.gang_id, instruction.device
            task, inputs, owner, result, sent = self._pending[gang_id]
            promise = Wire.through(self.wire, self.devices[device], "run_gang", task, inputs, owner)
            promise.add_done_callback(functools.partial(self._report, gang_id, device))
            if device == task.leader:
                forward(promise, result)
            sent += 1
            if sent == len(task.devices):
                del self._pending[gang_id]
            else:
                self._pending[gang_id] = (task, inputs, owner, result, sent)

    def _report(self, gang_id: str, device: int, _: Promise[Any]) -> None:
        """A shard finished: queue the event, and wake the actor once per batch.

        Completions arrive from outside the actor (promise callbacks); they
        are coalesced into one message so that a gang over thousands of
        devices costs one mailbox slot, not one per shard.
        """
        self._completions.append((gang_id, device))
        if len(self._completions) == 1:
            self.ctx.ref.completed()

    @endpoint
    def scheduler_name(self) -> str:
        """The name of this island's scheduling policy."""
        return self.policy_name

    @endpoint
    def completed(self) -> int:
        """Feed every queued completion to the policy; returns how many."""
        done, self._completions = self._completions, []
        for gang_id, device in done:
            self._carry_out(self.policy.handle(Completed(next(self._events), gang_id, device)))
        return len(done)


class Controller(Actor):
    """The single controller: topology, resource manager, and program dispatch.

    Its dispatch endpoints take inputs as promises and never wait for them:
    ``run_graph`` sends every node of a graph to its island at once and
    returns one promise per output. Data never passes through it.

    ``push``: in parallel dispatch, whether each producer sends its outputs
    straight to the hosts of their readers (who then start without waiting
    for the controller to hear of the producer). None, the default, pushes
    when hosts are processes of their own, where that saves round trips; in
    one process the promise path is already immediate.
    """

    def __init__(
        self,
        topology: Topology,
        schedulers: dict[int, ActorRef[IslandScheduler]],
        devices: Sequence[ActorRef[Device]],
        hosts: Sequence[ActorRef[Host]],
        wire: Wire | None = None,
        push: bool | None = None,
    ) -> None:
        self.wire = wire
        self.push = push
        self.host_addresses = [""] * len(hosts)
        self.topology_ = topology
        self.schedulers = schedulers
        self.device_refs = list(devices)
        self.host_refs = list(hosts)
        self.resources = ResourceManager([(d.id, d.host, d.island) for d in topology.devices])
        self._gangs = itertools.count()

    async def on_start(self) -> None:
        answers = [host.address() for host in self.host_refs]
        self.host_addresses = [await answer for answer in answers]
        self.set_push(self.push)

    @property
    def hosts_in_processes(self) -> bool:
        """Whether hosts run in processes of their own (they have addresses)."""
        return any(self.host_addresses)

    @endpoint
    def set_push(self, push: bool | None) -> bool:
        """Turn pushing on or off (None: automatic); returns the setting in force."""
        self.push = self.hosts_in_processes if push is None else push
        return self.push

    @endpoint
    def topology(self) -> Topology:
        return self.topology_

    @endpoint
    def allocate(
        self,
        n: int,
        island: int | None = None,
        mesh_shape: tuple[int, ...] | None = None,
        axis_names: tuple[str, ...] | None = None,
        owner: str = "",
    ) -> VirtualSlice:
        """A virtual slice of ``n`` devices (see ``ResourceManager``)."""
        shape = tuple(mesh_shape) if mesh_shape is not None else (n,)
        names = tuple(axis_names) if axis_names is not None else _default_axes(len(shape))
        if math.prod(shape) != n or len(names) != len(shape):
            raise AtollError(f"mesh {shape} with axes {names} does not hold {n} devices")
        alloc = self.resources.allocate(n, island, owner)
        return VirtualSlice(alloc.slice_id, shape, names, alloc.island)

    @endpoint
    def release(self, slice_id: int) -> None:
        self.resources.release(slice_id)

    @endpoint
    async def release_owner(self, owner: str) -> int:
        """Free every slice and buffer of ``owner`` (a client going away)."""
        self.resources.release_owner(owner)
        freed = [host.free_owner(owner) for host in self.host_refs]
        return sum([await each for each in freed])

    @endpoint
    def put(self, array: Any, slice_id: int | None, owner: str = "") -> Promise[BufferHandle]:
        """Place a host array on the leader device of a slice (device 0 if None)."""
        device = self.resources.get(slice_id).devices[0] if slice_id is not None else 0
        promise: Promise[BufferHandle] = self.device_refs[device].put(array, owner)
        return promise

    @endpoint(resolve_args=False)
    def run(
        self, computation: Computation, device: int, inputs: Sequence[Any], owner: str = ""
    ) -> Promise[BufferHandle]:
        """One computation on one physical device; returns its output's promise."""
        island = self.topology_.device(device).island
        task = GangTask(f"gang{next(self._gangs)}", computation, (device,), (1,), ("x",))
        return then(self._submit(island, task, inputs, owner), _first)

    @endpoint(resolve_args=False)
    def run_node(
        self, node: Node, inputs: Sequence[Any], owner: str = ""
    ) -> Promise[list[BufferHandle]]:
        """Dispatch one node; returns the promise of its output handles."""
        return self._submit(self._island(node), self._task(node), inputs, owner)

    @endpoint(resolve_args=False)
    def run_graph(
        self, graph: Graph, inputs: Sequence[Any], temporary: Sequence[int], owner: str = ""
    ) -> list[Promise[BufferHandle]]:
        """Parallel asynchronous dispatch of a whole graph; returns at once.

        Every node goes to its island now, with promises for inputs. Values
        that are not outputs are freed once all their readers ran, and so are
        the program inputs listed in ``temporary``.
        """
        tasks = self._wire_up(graph, [self._task(node) for node in graph.nodes])
        values: dict[ValueRef, Promise[BufferHandle]] = {
            ValueRef(-1, i): as_promise(v) for i, v in enumerate(inputs)
        }
        ran: dict[int, Promise[list[BufferHandle]]] = {}
        for node, task in zip(graph.nodes, tasks, strict=True):
            node_inputs = [values[ref] for ref in node.inputs]
            ran[node.id] = self._submit(self._island(node), task, node_inputs, owner)
            for i in range(len(node.outputs)):
                values[ValueRef(node.id, i)] = then(ran[node.id], operator.itemgetter(i))
        for ref, readers in graph.freeable(temporary).items():
            _free_after(values[ref], [ran[n] for n in readers])
        return [values[ref] for ref in graph.outputs]

    def _wire_up(self, graph: Graph, tasks: list[GangTask]) -> list[GangTask]:
        """Tell each gang which inputs are resident, and (when pushing) where
        its inputs land and where its outputs go; see :class:`GangTask`."""
        inbox: list[list[str | None]] = [[None] * len(node.inputs) for node in graph.nodes]
        resident = [[False] * len(node.inputs) for node in graph.nodes]
        readers: dict[tuple[int, int, int], list[str]] = {}  # (node, output, host) -> keys
        leader_hosts = [self.topology_.device(task.leader).host for task in tasks]
        for node, task, host in zip(graph.nodes, tasks, leader_hosts, strict=True):
            for i, ref in enumerate(node.inputs):
                if ref.node < 0:
                    continue
                resident[node.id][i] = tasks[ref.node].devices == task.devices
                if self.push:
                    inbox[node.id][i] = key = f"{task.gang_id}/{i}"
                    readers.setdefault((ref.node, ref.index, host), []).append(key)
        pushes: dict[int, list[PushTarget]] = {}
        for (producer, output, host), keys in readers.items():
            address = self.host_addresses[host]  # a process of its own: dialled directly
            host_ref = None if address else self.host_refs[host]  # a capability costs
            target = PushTarget(output, host, host_ref, address, tuple(keys))
            pushes.setdefault(producer, []).append(target)
        return [
            replace(
                task,
                inbox=tuple(inbox[n]),
                inbox_host=leader_hosts[n] if self.push else -1,
                resident=tuple(resident[n]),
                push=tuple(pushes.get(n, ())),
            )
            for n, task in enumerate(tasks)
        ]

    def _submit(
        self, island: int, task: GangTask, inputs: Sequence[Any], owner: str
    ) -> Promise[list[BufferHandle]]:
        return Wire.through(self.wire, self.schedulers[island], "submit_gang", task, inputs, owner)

    def _task(self, node: Node) -> GangTask:
        alloc = self.resources.get(node.slice.slice_id)
        if len(alloc.devices) != node.slice.size:
            raise AtollError(f"{node.name}: slice {node.slice.slice_id} changed size")
        one_host = getattr(node.kernel, "single_host", False) and not self.hosts_in_processes
        if one_host and len(hosts := self._hosts(alloc.devices)) > 1:  # in-process only:
            raise AtollError(  # host processes run it as one SPMD program over the hosts
                f"{node.name}: in an in-process cluster a JAX node runs on one host; its "
                f"slice spans hosts {hosts} (host processes, as process_cluster or "
                "atoll up --device jax start them, run it across hosts)"
            )
        gang_id = f"gang{next(self._gangs)}"
        shape, axes = node.slice.shape, node.slice.axis_names
        return GangTask(gang_id, node.kernel, alloc.devices, shape, axes, node.outputs)

    def _island(self, node: Node) -> int:
        return self.resources.get(node.slice.slice_id).island

    def _hosts(self, devices: Sequence[int]) -> list[int]:
        return sorted({self.topology_.device(d).host for d in devices})


def _default_axes(rank: int) -> tuple[str, ...]:
    return ("x", "y", "z", "w")[:rank] if rank <= 4 else tuple(f"a{i}" for i in range(rank))


def _first(handles: list[BufferHandle]) -> BufferHandle:
    return handles[0]


def _free_after(value: Promise[BufferHandle], readers: list[Promise[list[BufferHandle]]]) -> None:
    """Drop the value's reference once every reader has run (or failed) and
    the value itself settled (a reader fed by a push may finish first)."""

    def free(_: Promise[None]) -> None:
        if value.exception() is None:
            handle = value.result()
            handle.host.free(handle.id)

    all_settled([*readers, value]).add_done_callback(free)


@asynccontextmanager
async def local_cluster(
    islands: int = 1,
    hosts_per_island: int = 2,
    devices_per_host: int = 4,
    *,
    clock: Clock | None = None,
    cost: CostModel | None = None,
    scheduler: str | Mapping[int, str] = "fifo",
    device_cls: type[Device] = SimDevice,
    store_bytes: int | None = None,
    owner: str = "client0",
    rpc_latency_s: float = 0.0,
    transport: str = "inproc",
    push: bool | None = None,
) -> AsyncIterator[Cluster]:
    """Start a controller, one scheduler per island, hosts and devices, in-process.

    ``scheduler`` names the island scheduler, for all islands or per island
    (``{0: "fifo", 1: "my-policy"}``). ``device_cls`` is ``SimDevice`` or
    ``JaxDevice`` (device ``d`` then owns ``jax.devices()[d]``). Yields a
    :class:`Cluster`, the client whose buffers carry the label ``owner``.
    ``rpc_latency_s`` models the control plane's RPC hops (client to
    controller, controller to island scheduler, scheduler to device, and the
    replies the client waits for) as a fixed latency each; 0 = in-process.
    ``transport="capnp"`` runs each host in a process of its own, joined to
    this one over Cap'n Proto (asyncio only; simulated devices on wall-clock
    time), with the same actors and the same client;
    everything stops when the block exits, and calls still pending then fail
    with ``ActorStopped``. ``push`` is the controller's (see ``Controller``).
    """
    for label, value in [
        ("islands", islands),
        ("hosts_per_island", hosts_per_island),
        ("devices_per_host", devices_per_host),
    ]:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if transport == "capnp":
        async with _in_processes(
            islands,
            hosts_per_island,
            devices_per_host,
            clock,
            cost,
            scheduler,
            device_cls,
            owner,
            push,
        ) as cluster:
            yield cluster
        return
    if transport != "inproc":
        raise ValueError(f"transport must be 'inproc' or 'capnp', got {transport!r}")
    policies = _policies(scheduler, islands)
    total, limit = islands * hosts_per_island * devices_per_host, device_cls.available()
    if limit is not None and total > limit:
        raise ValueError(f"{device_cls.__name__}: {total} devices asked for, {limit} exist")
    cost = cost or CostModel()
    host_cls = device_cls.host_cls or Host
    async with ActorSystem("cluster", clock=clock) as system:
        topology = Topology.even(islands, hosts_per_island, devices_per_host)
        hosts = [
            system.spawn(
                host_cls,
                h,
                h // hosts_per_island,
                topology.on_host(h),
                device_cls,
                cost,
                store_bytes,
                name=f"host{h}",
            )
            for h in range(islands * hosts_per_island)
        ]
        devices = [ref for host in hosts for ref in await host.devices()]
        controller = spawn_control(
            system.spawn,
            topology,
            devices,
            hosts,
            policies,
            lambda sender: _wire(system, rpc_latency_s, sender),
            push,
        )
        client_wire = _wire(system, rpc_latency_s, owner)
        yield Cluster(system, controller, topology, devices, hosts, owner, client_wire)


@asynccontextmanager
async def _in_processes(
    islands: int,
    hosts_per_island: int,
    devices_per_host: int,
    clock: Clock | None,
    cost: CostModel | None,
    scheduler: str | Mapping[int, str],
    device_cls: type[Device],
    owner: str,
    push: bool | None,
) -> AsyncIterator[Cluster]:
    """``transport="capnp"``: the same actors, each host in a process of its own."""
    from ._distributed import process_cluster

    if clock is not None or not isinstance(scheduler, str):
        raise ValueError(
            "transport='capnp' runs on wall-clock time with one scheduler for every "
            "island (no clock= and no per-island scheduler)"
        )
    async with process_cluster(
        islands * hosts_per_island,
        islands,
        devices_per_host,
        scheduler=scheduler,
        cost=cost,
        owner=owner,
        device_cls=device_cls,
    ) as cluster:
        if push is not None:
            await cluster.controller.set_push(push)
        yield cluster


def spawn_control(
    spawn: Callable[..., ActorRef[Any]],
    topology: Topology,
    devices: Sequence[ActorRef[Device]],
    hosts: Sequence[ActorRef[Host]],
    policies: Mapping[int, str],
    wire: Callable[[str], Wire | None] = lambda sender: None,
    push: bool | None = None,
) -> ActorRef[Controller]:
    """Spawn one island scheduler per island and the controller over them.

    ``spawn`` is ``system.spawn`` or an actor's ``ctx.spawn``; ``wire(sender)``
    gives each sender's modelled link (None: direct calls).
    """
    schedulers = {
        island: spawn(
            IslandScheduler,
            island,
            policies[island],
            {d.id: devices[d.id] for d in topology.devices if d.island == island},
            wire(f"island{island}"),
            name=f"island{island}",
        )
        for island in range(topology.islands)
    }
    controller: ActorRef[Controller] = spawn(
        Controller,
        topology,
        schedulers,
        devices,
        hosts,
        wire("controller"),
        push,
        name="controller",
    )
    return controller


def _wire(system: ActorSystem, latency_s: float, sender: str) -> Wire | None:
    """A modelled RPC link for one sender, or None when latency is zero."""
    if latency_s <= 0:
        return None
    line = system.spawn(DelayLine, latency_s, name=f"wire-{sender}")
    return Wire(system.clock, latency_s, line)


def _policies(scheduler: str | Mapping[int, str], islands: int) -> dict[int, str]:
    names = (
        {i: scheduler for i in range(islands)}
        if isinstance(scheduler, str)
        else {i: scheduler.get(i, "fifo") for i in range(islands)}
    )
    for name in set(names.values()):
        get_scheduler(name)  # fail early on an unknown name
    return names
