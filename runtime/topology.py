"""The topology: every physical device of a cluster, with its host and island.

Plain data, computed once from the cluster's spec (:class:`ClusterSpec`) and
shared by the launchers, the controller and clients. Device ids are global
and dense; hosts and islands are numbered the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel import AtollError

__all__ = ["DeviceInfo", "Topology"]


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

    @property
    def hosts(self) -> int:
        return len({d.host for d in self.devices})

    def island_of_host(self, host: int) -> int:
        """The island host ``host`` belongs to."""
        for device in self.devices:
            if device.host == host:
                return device.island
        raise AtollError(f"no host {host}: the cluster has {self.hosts}")

    def on_host(self, host: int) -> list[int]:
        """The ids of host ``host``'s devices."""
        return [d.id for d in self.devices if d.host == host]

    def device(self, device_id: int) -> DeviceInfo:
        if not 0 <= device_id < len(self.devices):
            raise AtollError(f"no device {device_id}: the cluster has {len(self.devices)}")
        return self.devices[device_id]
