"""The resource manager: virtual slices mapped onto physical devices.

Clients ask for ``n`` devices (optionally on one island, in a mesh shape) and
get a slice id; only the controller knows which physical devices stand behind
it, so a slice could later be moved. Allocation is best fit: a slice that fits
on one host goes to the host with the fewest free devices that still holds
it; larger slices take whole hosts, fullest-free first, so that the fewest
hosts (and links between them) are involved. A slice never spans islands: its
shards form one gang, and gangs are scheduled per island.

Slices are elastic (``runtime/control/elastic.py``): one can be given other devices
(:meth:`ResourceManager.reassign`), give its devices back while suspended
(:meth:`ResourceManager.suspend`), and lose a host that leaves or is lost
(:meth:`ResourceManager.retire_host`). Spare hosts' devices are kept out of
allocation; only a slice that must leave a host takes them.

This is a plain class with no I/O; the controller actor owns one.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace

from ...kernel import AtollError, UsageError

__all__ = ["Allocation", "ResourceManager"]


@dataclass(frozen=True)
class Allocation:
    """One slice: its id, its physical devices in mesh order, owner and island."""

    slice_id: int
    devices: tuple[int, ...]
    island: int
    owner: str


class ResourceManager:
    """Tracks free devices; hands out and takes back slices (see module docstring)."""

    def __init__(
        self, devices: Sequence[tuple[int, int, int]], spare_hosts: Collection[int] = ()
    ) -> None:
        """``devices``: (device id, host, island) for every physical device;
        ``spare_hosts``: hosts kept out of allocation, for slices that must
        leave a host."""
        self._host = {d: h for d, h, _ in devices}
        self._island = {d: i for d, _, i in devices}
        self._spare_hosts = set(spare_hosts)
        self._spare: set[int] = {d for d, h, _ in devices if h in spare_hosts}
        self._free: set[int] = {d for d, _, _ in devices} - self._spare
        self._gone_hosts: set[int] = set()  # hosts that left or were lost
        self._slices: dict[int, Allocation] = {}
        self._sizes: dict[int, int] = {}  # devices of slices that were moved or suspended
        self._ids = itertools.count()

    def __contains__(self, slice_id: object) -> bool:
        return slice_id in self._slices

    def free_count(self, island: int | None = None) -> int:
        return sum(1 for d in self._free if island is None or self._island[d] == island)

    @property
    def spares(self) -> list[int]:
        """Spare devices not taken yet."""
        return sorted(self._spare)

    @property
    def spare_hosts(self) -> list[int]:
        """The hosts kept for slices that must leave a host (taken or not)."""
        return sorted(self._spare_hosts)

    @property
    def gone_hosts(self) -> list[int]:
        return sorted(self._gone_hosts)

    def slices(self) -> list[Allocation]:
        return list(self._slices.values())

    def allocate(self, n: int, island: int | None = None, owner: str = "") -> Allocation:
        """Reserve ``n`` devices; raises AtollError when they are not free."""
        if n < 1:
            raise UsageError(f"a slice needs at least one device, got {n}")
        islands = sorted(set(self._island.values())) if island is None else [island]
        if island is not None and island not in self._island.values():
            raise UsageError(
                f"no island {island}: this cluster has islands {sorted(set(self._island.values()))}"
            )
        for candidate in sorted(islands, key=lambda i: -self.free_count(i)):
            if self.free_count(candidate) >= n:
                chosen = self._pick(n, candidate)
                alloc = Allocation(next(self._ids), tuple(chosen), candidate, owner)
                self._free.difference_update(chosen)
                self._slices[alloc.slice_id] = alloc
                return alloc
        where = "any island" if island is None else f"island {island}"
        free = self.free_count(island)
        raise UsageError(
            f"{n} devices are not free on {where} ({free} free, {len(self._island)} in the "
            f"cluster): ask for at most {free}, or release a slice (cluster.release) first"
        )

    def _pick(self, n: int, island: int, pool: Collection[int] | None = None) -> list[int]:
        by_host: dict[int, list[int]] = {}
        for d in sorted(self._free if pool is None else pool):
            if self._island[d] == island:
                by_host.setdefault(self._host[d], []).append(d)
        fits = [h for h, ds in by_host.items() if len(ds) >= n]
        if fits:
            host = min(fits, key=lambda h: (len(by_host[h]), h))
            return by_host[host][:n]
        chosen: list[int] = []
        for host in sorted(by_host, key=lambda h: (-len(by_host[h]), h)):
            chosen.extend(by_host[host][: n - len(chosen)])
            if len(chosen) == n:
                break
        return sorted(chosen)

    def get(self, slice_id: int) -> Allocation:
        try:
            return self._slices[slice_id]
        except KeyError:
            raise UsageError(f"no slice {slice_id} (never allocated, or released)") from None

    def release(self, slice_id: int) -> None:
        """Give a slice's devices back."""
        alloc = self.get(slice_id)  # raises for an unknown slice
        del self._slices[slice_id]
        self._sizes.pop(slice_id, None)
        self.give_back(alloc.devices)

    def release_owner(self, owner: str) -> list[int]:
        """Give back every slice of ``owner``; returns their ids."""
        doomed = [s for s, a in self._slices.items() if a.owner == owner]
        for slice_id in doomed:
            self.release(slice_id)
        return doomed

    def targets(
        self,
        slice_id: int,
        host: int | None = None,
        avoid: Collection[int] = (),
        spares: bool = False,
    ) -> list[int]:
        """Devices a slice could move to, on its island: free ones on
        ``host``, or else off the hosts in ``avoid`` (free ones first, then,
        with ``spares``, spares). Reserves nothing; raises AtollError when
        too few are there."""
        alloc = self.get(slice_id)
        n, island = self.size(slice_id), alloc.island
        if host is not None:
            mine = [
                d for d in sorted(self._free) if (self._host[d], self._island[d]) == (host, island)
            ]
            if len(mine) < n:
                raise AtollError(f"host {host} has {len(mine)} free devices on island {island}")
            return mine[:n]
        for pool in (self._free, self._free | self._spare) if spares else (self._free,):
            usable = {d for d in pool if self._host[d] not in avoid and self._island[d] == island}
            if len(usable) >= n:
                return self._pick(n, island, usable)
        raise AtollError(f"no {n} free devices for slice {slice_id} on island {island}")

    def reassign(self, slice_id: int, devices: Sequence[int], give_back: bool = True) -> Allocation:
        """Give slice ``slice_id`` ``devices`` (free, spare, or its own, in
        mesh order) in place of its own, which go back to the free ones
        (unless not ``give_back``: the caller does that later)."""
        alloc = self.get(slice_id)
        devices = tuple(devices)
        if len(devices) != self.size(slice_id) or len(set(devices)) != len(devices):
            raise AtollError(f"slice {slice_id} needs {self.size(slice_id)} distinct devices")
        usable = self._free | self._spare | set(alloc.devices)
        if not set(devices) <= usable:
            raise AtollError(f"devices {sorted(set(devices) - usable)} are not free")
        if any(self._island[d] != alloc.island for d in devices):
            raise AtollError(f"slice {slice_id} stays on island {alloc.island}")
        if give_back:
            self.give_back(d for d in alloc.devices if d not in devices)
        self._free.difference_update(devices)
        self._spare.difference_update(devices)
        moved = replace(alloc, devices=devices)
        self._slices[slice_id] = moved
        self._sizes[slice_id] = len(devices)
        return moved

    def undo(self, alloc: Allocation, taken: Iterable[int]) -> None:
        """A change of ``alloc``'s slice failed: it has its devices again,
        and the ones ``taken`` for it go back (all of them, if it was
        released meanwhile)."""
        if alloc.slice_id not in self._slices:  # released: its new devices went back then
            self.give_back(alloc.devices)
            return
        self._slices[alloc.slice_id] = alloc
        self.give_back(d for d in taken if d not in alloc.devices)

    def suspend(self, slice_id: int) -> Allocation:
        """The slice keeps its id but gives its devices back; what it had."""
        alloc = self.get(slice_id)
        self._sizes[slice_id] = self.size(slice_id)
        self.give_back(alloc.devices)
        self._slices[slice_id] = replace(alloc, devices=())
        return alloc

    def size(self, slice_id: int) -> int:
        """How many devices a slice has (or had, while suspended)."""
        return self._sizes.get(slice_id) or len(self.get(slice_id).devices)

    def retire_host(self, host: int) -> list[int]:
        """Host ``host`` left or was lost: its devices are no longer free or
        spare. The slices that hold devices on it (they must move)."""
        self._gone_hosts.add(host)
        gone = {d for d, h in self._host.items() if h == host}
        self._free -= gone
        self._spare -= gone
        return [s for s, a in self._slices.items() if gone & set(a.devices)]

    def restore_host(self, host: int) -> None:
        """A new host took the place of host ``host``: its devices that no
        slice holds are free again."""
        if host not in self._gone_hosts:
            return
        self._gone_hosts.discard(host)
        held = {d for a in self._slices.values() for d in a.devices}
        self.give_back(d for d, h in self._host.items() if h == host and d not in held)

    def give_back(self, devices: Iterable[int]) -> None:
        """Devices no slice holds now: free again (a spare host's: spare)."""
        for d in devices:
            if self._host[d] in self._gone_hosts:
                continue
            (self._spare if self._host[d] in self._spare_hosts else self._free).add(d)

    def hosts_of(self, slice_id: int) -> list[int]:
        """The hosts a slice touches, in first-device order."""
        return list(dict.fromkeys(self._host[d] for d in self.get(slice_id).devices))
