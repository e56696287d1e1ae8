"""The resource manager: virtual slices mapped onto physical devices.

Clients ask for ``n`` devices (optionally on one island, in a mesh shape) and
get a slice id; only the controller knows which physical devices stand behind
it, so a slice could later be moved. Allocation is best fit: a slice that fits
on one host goes to the host with the fewest free devices that still holds
it; larger slices take whole hosts, fullest-free first, so that the fewest
hosts (and links between them) are involved. A slice never spans islands: its
shards form one gang, and gangs are scheduled per island.

This is a plain class with no I/O; the controller actor owns one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ..kernel import AtollError

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

    def __init__(self, devices: Sequence[tuple[int, int, int]]) -> None:
        """``devices``: (device id, host, island) for every physical device."""
        self._host = {d: h for d, h, _ in devices}
        self._island = {d: i for d, _, i in devices}
        self._free: set[int] = {d for d, _, _ in devices}
        self._slices: dict[int, Allocation] = {}
        self._ids = itertools.count()

    def free_count(self, island: int | None = None) -> int:
        return sum(1 for d in self._free if island is None or self._island[d] == island)

    def allocate(self, n: int, island: int | None = None, owner: str = "") -> Allocation:
        """Reserve ``n`` devices; raises AtollError when they are not free."""
        if n < 1:
            raise AtollError(f"a slice needs at least one device, got {n}")
        islands = sorted(set(self._island.values())) if island is None else [island]
        if island is not None and island not in self._island.values():
            raise AtollError(f"no island {island}")
        for candidate in sorted(islands, key=lambda i: -self.free_count(i)):
            if self.free_count(candidate) >= n:
                chosen = self._pick(n, candidate)
                alloc = Allocation(next(self._ids), tuple(chosen), candidate, owner)
                self._free.difference_update(chosen)
                self._slices[alloc.slice_id] = alloc
                return alloc
        where = "any island" if island is None else f"island {island}"
        raise AtollError(f"{n} devices are not free on {where} ({self.free_count(island)} free)")

    def _pick(self, n: int, island: int) -> list[int]:
        by_host: dict[int, list[int]] = {}
        for d in sorted(self._free):
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
            raise AtollError(f"no slice {slice_id} (never allocated, or released)") from None

    def release(self, slice_id: int) -> None:
        """Give a slice's devices back."""
        alloc = self.get(slice_id)  # raises for an unknown slice
        del self._slices[slice_id]
        self._free.update(alloc.devices)

    def release_owner(self, owner: str) -> list[int]:
        """Give back every slice of ``owner``; returns their ids."""
        doomed = [s for s, a in self._slices.items() if a.owner == owner]
        for slice_id in doomed:
            self.release(slice_id)
        return doomed

    def hosts_of(self, slice_id: int) -> list[int]:
        """The hosts a slice touches, in first-device order."""
        return list(dict.fromkeys(self._host[d] for d in self.get(slice_id).devices))
