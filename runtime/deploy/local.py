"""``local_cluster``: a whole cluster in one process, atoll's embedded default.

It builds the actor tree of a cluster (hosts with their devices, one island
scheduler per island, the controller) inside one
:class:`~atoll.kernel.ActorSystem`, and yields the same client
(:class:`~atoll.runtime.Cluster`) a remote user gets. With
``transport="capnp"`` it starts the same actors with each host in a process
of its own instead (:mod:`atoll.runtime.deploy.process`). Both read one validated
:class:`~atoll.runtime.ClusterSpec`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from ...devices import CostModel, Device, SimDevice
from ...kernel import ActorSystem, Clock
from ...schedulers import DEFAULT_POLICY
from ..client.client import Cluster
from ..control.controller import spawn_control
from ..latency import DelayLine, Wire
from .spec import ClusterSpec

__all__ = ["local_cluster", "start_local"]


@asynccontextmanager
async def local_cluster(
    islands: int = 1,
    hosts_per_island: int = 2,
    devices_per_host: int = 4,
    *,
    clock: Clock | None = None,
    cost: CostModel | None = None,
    scheduler: str | Mapping[int, str] = DEFAULT_POLICY,
    device_cls: type[Device] = SimDevice,
    store_bytes: int | None = None,
    owner: str = "client0",
    rpc_latency_s: float = 0.0,
    transport: str = "inproc",
    push: bool | None = None,
    spares: int = 0,
) -> AsyncIterator[Cluster]:
    """Start a controller, one scheduler per island, hosts and devices.

    ``scheduler`` names the island policy, for all islands or per island
    (``{0: "fifo", 1: "my-policy"}``; default ``"share"``). ``device_cls`` is ``SimDevice`` or
    ``JaxDevice`` (device ``d`` then owns ``jax.devices()[d]``).
    ``store_bytes`` bounds each host's object store. Yields a
    :class:`Cluster`, the client whose buffers carry the label ``owner``.
    ``rpc_latency_s`` models the control plane's RPC hops (client to
    controller, controller to island scheduler, scheduler to device, and the
    replies the client waits for) as a fixed latency each; 0 = none.
    ``transport="capnp"`` runs each host in a process of its own, joined to
    this one over Cap'n Proto (asyncio only, wall-clock time), with the same
    actors and the same client; options that cannot work there (``clock``,
    ``rpc_latency_s``) are refused with :class:`BadClusterSpec`. Everything
    stops when the block exits, and calls still pending then fail with
    ``ActorStopped``. ``push`` is the controller's (see ``Controller``).
    ``spares``: hosts per island kept for slices that must leave a host
    (``ClusterSpec.spares``).
    """
    spec = ClusterSpec(
        islands,
        hosts_per_island,
        devices_per_host,
        scheduler,
        device_cls,
        cost or CostModel(),
        store_bytes,
        rpc_latency_s,
        push,
        clock,
        spares=spares,
    )
    spec.check_for(transport)
    if transport == "capnp":
        from .process import process_cluster

        async with process_cluster(spec, owner=owner) as cluster:
            yield cluster
        return
    async with ActorSystem("cluster", clock=clock) as system:
        yield await start_local(system, spec, owner)


async def start_local(system: ActorSystem, spec: ClusterSpec, owner: str = "client0") -> Cluster:
    """Spawn the cluster ``spec`` describes into a running ``system``; its client."""
    topology = spec.topology
    hosts = [
        system.spawn(
            spec.host_cls,
            h,
            topology.island_of_host(h),
            topology.on_host(h),
            spec.device_cls,
            spec.cost,
            spec.store_bytes,
            name=f"host{h}",
        )
        for h in range(spec.hosts)
    ]
    devices = [ref for host in hosts for ref in await host.devices()]
    controller = spawn_control(
        system.spawn,
        topology,
        devices,
        hosts,
        spec.policies,
        lambda sender: _wire(system, spec.rpc_latency_s, sender),
        spec.push,
        spec.spare_hosts,
    )
    client_wire = _wire(system, spec.rpc_latency_s, owner)
    return Cluster(system, controller, topology, devices, hosts, owner, client_wire)


def _wire(system: ActorSystem, latency_s: float, sender: str) -> Wire | None:
    """A modelled RPC link for one sender, or None when latency is zero."""
    if latency_s <= 0:
        return None
    line = system.spawn(DelayLine, latency_s, name=f"wire-{sender}")
    return Wire(system.clock, latency_s, line)
