"""One validated description of a cluster, consumed by every launcher.

:class:`ClusterSpec` says how many islands, hosts and devices there are, which
devices and island policies they run, and how the runtime behaves. Both
launchers take it: :func:`~atoll.runtime.local_cluster` (one process) and the
process cluster (``atoll up``, ``process_cluster``). Each option either works
with a launcher or is refused there with a clear error
(:meth:`ClusterSpec.check_for`); nothing is silently dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...devices import CostModel, Device, Host, SimDevice
from ...kernel import AtollError, Clock
from ...kernel.config import Settings
from ...kernel.config import settings as current_settings
from ...schedulers import DEFAULT_POLICY, check_scheduler
from ..topology import Topology

__all__ = ["BadClusterSpec", "ClusterSpec"]


class BadClusterSpec(AtollError, ValueError):
    """A cluster option is out of range, or not supported by the chosen launcher."""


@dataclass(frozen=True)
class ClusterSpec:
    """The shape and options of a cluster (see the module docstring).

    ``scheduler`` names the island policy for every island, or per island
    (``{0: "fifo", 1: "my-policy"}``; islands not named get ``"share"``,
    proportional shares between sessions, gang FIFO while one client is alone).
    ``remote_hosts`` of the hosts are not started by the launcher but join
    from elsewhere (``atoll host --join``); process clusters only.
    ``clock`` (a ``VirtualClock`` for simulated time) and ``rpc_latency_s``
    (a modelled RPC hop) only make sense in one process.
    ``spares``: the last hosts of every island are kept out of allocation
    for slices that must leave a host (lost, or drained; ``runtime/control/elastic.py``).
    ``settings`` (``atoll.kernel.config``): the cluster-scoped ones go to every
    host process when it joins, so that each runs the dispatch path as the
    controller does; by default the settings in force where the spec is made.
    """

    islands: int = 1
    hosts_per_island: int = 2
    devices_per_host: int = 4
    scheduler: str | Mapping[int, str] = DEFAULT_POLICY
    device_cls: type[Device] = SimDevice
    cost: CostModel = field(default_factory=CostModel)
    store_bytes: int | None = None
    rpc_latency_s: float = 0.0
    push: bool | None = None
    clock: Clock | None = None
    remote_hosts: int = 0
    spares: int = 0  # spare hosts per island
    settings: Settings = field(default_factory=current_settings)

    def __post_init__(self) -> None:
        for label in ("islands", "hosts_per_island", "devices_per_host"):
            value = getattr(self, label)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BadClusterSpec(f"{label} must be a positive integer, got {value!r}")
        if self.store_bytes is not None and self.store_bytes < 1:
            raise BadClusterSpec(f"store_bytes must be positive or None, got {self.store_bytes}")
        if self.rpc_latency_s < 0:
            raise BadClusterSpec(f"rpc_latency_s must not be negative, got {self.rpc_latency_s}")
        if not 0 <= self.remote_hosts <= self.hosts:
            raise BadClusterSpec(
                f"remote_hosts must be between 0 and {self.hosts} (the hosts in all), "
                f"got {self.remote_hosts}"
            )
        if not 0 <= self.spares < self.hosts_per_island:
            raise BadClusterSpec(
                f"spares must leave a host per island for slices: 0 to "
                f"{self.hosts_per_island - 1}, got {self.spares}"
            )
        if not (isinstance(self.device_cls, type) and issubclass(self.device_cls, Device)):
            raise BadClusterSpec(f"device_cls must be a Device class, got {self.device_cls!r}")
        self.host_cls  # noqa: B018  (checks it)
        for name in set(self.policies.values()):
            check_scheduler(name)  # fails early, naming the known ones; builds none

    @classmethod
    def of_hosts(cls, hosts: int, islands: int = 1, **options: Any) -> ClusterSpec:
        """A spec with ``hosts`` hosts in all, split evenly into ``islands``."""
        if islands < 1 or hosts < 1 or hosts % islands:
            raise BadClusterSpec(f"{hosts} hosts do not split evenly into {islands} islands")
        return cls(islands, hosts // islands, **options)

    @property
    def hosts(self) -> int:
        return self.islands * self.hosts_per_island

    @property
    def local_hosts(self) -> int:
        """The hosts a launcher starts itself (the rest join from elsewhere)."""
        return self.hosts - self.remote_hosts

    @property
    def spare_hosts(self) -> list[int]:
        """The spare hosts: the last ``spares`` of each island."""
        per = self.hosts_per_island
        return [i * per + h for i in range(self.islands) for h in range(per - self.spares, per)]

    @property
    def host_cls(self) -> type[Host]:
        """The host actor class the devices run under (``Device.host_cls``, else Host)."""
        found = self.device_cls.host_cls or Host
        if not (isinstance(found, type) and issubclass(found, Host)):
            name = self.device_cls.__name__
            raise BadClusterSpec(f"{name}.host_cls must be a Host class, got {found!r}")
        return found

    @property
    def topology(self) -> Topology:
        return Topology.even(self.islands, self.hosts_per_island, self.devices_per_host)

    @property
    def policies(self) -> dict[int, str]:
        """The policy name of every island."""
        if isinstance(self.scheduler, str):
            return dict.fromkeys(range(self.islands), self.scheduler)
        unknown = sorted(set(self.scheduler) - set(range(self.islands)))
        if unknown:
            raise BadClusterSpec(f"scheduler names islands {unknown}, which do not exist")
        return {i: self.scheduler.get(i, DEFAULT_POLICY) for i in range(self.islands)}

    def check_for(self, transport: str) -> None:
        """Refuse options the launcher for ``transport`` cannot honour."""
        if transport == "inproc":
            if self.remote_hosts:
                raise BadClusterSpec("remote_hosts needs host processes (transport='capnp')")
            self._check_devices()  # one process: its devices are all there are
            if self.settings.cluster() != current_settings().cluster():
                raise BadClusterSpec(
                    "settings= other than this process's: one process has one set of settings "
                    "(put them in force with atoll.kernel.config.use, or overridden)"
                )
            return
        if transport != "capnp":
            raise BadClusterSpec(f"transport must be 'inproc' or 'capnp', got {transport!r}")
        if self.clock is not None:
            raise BadClusterSpec(
                "transport='capnp' runs on wall-clock time: a clock= cannot span processes"
            )
        if self.rpc_latency_s:
            raise BadClusterSpec(
                "rpc_latency_s models RPC hops inside one process; with transport='capnp' "
                "the hops are real"
            )

    def _check_devices(self) -> None:
        total = self.hosts * self.devices_per_host
        limit = self.device_cls.available(total)
        if limit is not None and total > limit:
            raise BadClusterSpec(
                f"{self.device_cls.__name__}: {total} devices asked for, {limit} exist"
                + self.device_cls.more_devices_hint(total)
            )
