"""An in-process cluster: controller, island schedulers, hosts and devices.

:func:`local_cluster` builds the whole actor tree of a cluster inside one
:class:`~atoll.kernel.ActorSystem`. It is atoll's embedded default: the same
actors later run in separate processes behind a network transport.

Dispatch runs ahead of the data. ``cluster.run(...)`` returns a promise at
once; the controller and the island scheduler forward that promise-carrying
call without waiting for its inputs (their endpoints take promises as they
are), and only the device, which must have the bytes, waits for them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from .devices import BufferHandle, Computation, CostModel, Device, DeviceStats, Host, SimDevice
from .kernel import Actor, ActorRef, ActorSystem, AtollError, Clock, Promise, endpoint
from .schedulers import Completed, Submit, get_scheduler

__all__ = ["Cluster", "Controller", "DeviceInfo", "IslandScheduler", "Topology", "local_cluster"]


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

    @property
    def islands(self) -> int:
        return len({d.island for d in self.devices})

    @property
    def hosts(self) -> int:
        return len({d.host for d in self.devices})

    def device(self, device_id: int) -> DeviceInfo:
        if not 0 <= device_id < len(self.devices):
            raise AtollError(f"no device {device_id}: the cluster has {len(self.devices)}")
        return self.devices[device_id]


class IslandScheduler(Actor):
    """Runs one island's scheduling policy (a pure state machine) as an actor."""

    def __init__(self, island: int, policy: str, devices: dict[int, ActorRef[Device]]) -> None:
        self.island = island
        self.policy = get_scheduler(policy)
        self.devices = devices
        self._events = itertools.count()

    @endpoint(resolve_args=False)
    def submit(
        self,
        gang_id: str,
        computation: Computation,
        devices: tuple[int, ...],
        inputs: Sequence[Any],
        owner: str = "",
    ) -> Promise[BufferHandle]:
        """Order the gang and send it to its devices; returns the first shard's promise."""
        event = Submit(next(self._events), gang_id, devices, owner)
        outputs: list[Promise[BufferHandle]] = []
        for instruction in self.policy.handle(event):
            device = instruction.device
            promise = self.devices[device].run(computation, inputs, owner)
            promise.add_done_callback(functools.partial(self._report, gang_id, device))
            outputs.append(promise)
        return outputs[0]

    def _report(self, gang_id: str, device: int, _: Promise[BufferHandle]) -> None:
        self.ctx.ref.completed(gang_id, device)  # a message to itself, handled in turn

    @endpoint
    def completed(self, gang_id: str, device: int) -> None:
        self.policy.handle(Completed(next(self._events), gang_id, device))


class Controller(Actor):
    """The single controller: knows the topology, routes work to islands."""

    def __init__(self, topology: Topology, schedulers: dict[int, ActorRef[IslandScheduler]]):
        self.topology_ = topology
        self.schedulers = schedulers
        self._gangs = itertools.count()

    @endpoint
    def topology(self) -> Topology:
        return self.topology_

    @endpoint(resolve_args=False)
    def run(
        self, computation: Computation, device: int, inputs: Sequence[Any], owner: str = ""
    ) -> Promise[BufferHandle]:
        """Dispatch at once, inputs still unresolved; returns the output's promise."""
        island = self.topology_.device(device).island
        gang_id = f"gang{next(self._gangs)}"
        return self.schedulers[island].submit(gang_id, computation, (device,), inputs, owner)


class Cluster:
    """A client's handle on a running cluster (see :func:`local_cluster`)."""

    def __init__(
        self,
        system: ActorSystem,
        controller: ActorRef[Controller],
        topology: Topology,
        devices: list[ActorRef[Device]],
        hosts: list[ActorRef[Host]],
    ) -> None:
        self.system = system
        self.controller = controller
        self.topology = topology
        self._devices = devices
        self._hosts = hosts

    @property
    def devices(self) -> tuple[DeviceInfo, ...]:
        return self.topology.devices

    @property
    def clock(self) -> Clock:
        return self.system.clock

    def device_ref(self, device: int) -> ActorRef[Device]:
        """The actor of one device (for tools and tests; users go through run)."""
        self.topology.device(device)
        return self._devices[device]

    def put(self, array: Any, device: int, owner: str = "") -> Promise[BufferHandle]:
        """Copy a host array onto ``device``; returns its handle's promise at once."""
        self.topology.device(device)
        return self._devices[device].put(np.asarray(array), owner)

    def run(
        self,
        computation: Computation,
        device: int,
        inputs: Sequence[BufferHandle | Promise[BufferHandle]] = (),
        owner: str = "",
    ) -> Promise[BufferHandle]:
        """Run ``computation`` on ``device``; inputs may still be promises."""
        self.topology.device(device)
        if not isinstance(computation, Computation):
            raise TypeError(f"run needs a Computation, got {type(computation).__name__}")
        return self.controller.run(computation, device, list(inputs), owner)

    async def fetch(self, handle: BufferHandle | Promise[BufferHandle]) -> np.ndarray:
        """The value of a buffer, read from the host that holds it."""
        resolved: BufferHandle = await handle if isinstance(handle, Promise) else handle
        array: np.ndarray = await resolved.host.fetch(resolved.id)
        return array

    async def device_stats(self) -> list[DeviceStats]:
        """Busy time, transfers and computations of every device."""
        promises = [ref.stats() for ref in self._devices]
        return [await p for p in promises]


@asynccontextmanager
async def local_cluster(
    islands: int = 1,
    hosts_per_island: int = 2,
    devices_per_host: int = 4,
    *,
    clock: Clock | None = None,
    cost: CostModel | None = None,
    scheduler: str = "fifo",
    device_cls: type[Device] = SimDevice,
    store_bytes: int | None = None,
) -> AsyncIterator[Cluster]:
    """Start a controller, one scheduler per island, hosts and devices, in-process.

    Yields a :class:`Cluster`; everything stops when the block exits, and calls
    still pending then fail with ``ActorStopped``.
    """
    for label, value in [
        ("islands", islands),
        ("hosts_per_island", hosts_per_island),
        ("devices_per_host", devices_per_host),
    ]:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    get_scheduler(scheduler)  # fail early on an unknown name
    cost = cost or CostModel()
    async with ActorSystem("cluster", clock=clock) as system:
        infos = [
            DeviceInfo(d, d // devices_per_host, d // (devices_per_host * hosts_per_island))
            for d in range(islands * hosts_per_island * devices_per_host)
        ]
        topology = Topology(tuple(infos))
        hosts = [
            system.spawn(
                Host,
                h,
                h // hosts_per_island,
                [i.id for i in infos if i.host == h],
                device_cls,
                cost,
                store_bytes,
                name=f"host{h}",
            )
            for h in range(islands * hosts_per_island)
        ]
        devices = [ref for host in hosts for ref in await host.devices()]
        schedulers = {
            island: system.spawn(
                IslandScheduler,
                island,
                scheduler,
                {i.id: devices[i.id] for i in infos if i.island == island},
                name=f"island{island}",
            )
            for island in range(islands)
        }
        controller = system.spawn(Controller, topology, schedulers, name="controller")
        yield Cluster(system, controller, topology, devices, hosts)
