"""The controller's view of its tenants: weights, admission and slice ownership.

Each client session is a *tenant*, known by its owner label (see
``runtime/control/sessions.py``). :class:`Tenants` is a plain class (no I/O) that the
controller owns. It keeps, per tenant:

* its **weight**, sent with every gang to the island scheduler, whose
  proportional-share policy (``schedulers/_share.py``) divides device time
  by it;
* its **gang quota**: how many of its gangs may be submitted and not yet
  finished at once. A gang beyond it *stalls* in the controller (the
  tenant's back-pressure: its calls take longer, nobody else's do) and is
  sent, in order, as the tenant's earlier gangs finish; only a tenant that
  piles up more than ``STALL_FACTOR`` times its quota of stalled gangs has
  further gangs refused at once with :class:`~atoll.devices.QuotaExceeded`,
  which fails that tenant's program and nobody else's. Inside the quota the
  island's share policy holds the tenant's gangs back while others are due;
* its **byte quota**, which the controller hands to every host
  (``Host.set_quota``): a store refuses to hold more than that for the
  tenant, again failing only the tenant's own work.

:func:`check_slice` is the isolation rule for slices: a session may use and
release only the slices it allocated.

Owners the controller was never told about (in-process clients, tools) have
weight 1 and no quotas, and their gangs are not counted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...devices import QuotaExceeded
from ...kernel import AtollError, UsageError
from .resources import Allocation

__all__ = [
    "DEFAULT_MAX_GANGS",
    "STALL_FACTOR",
    "NotYourSlice",
    "Tenant",
    "Tenants",
    "check_slice",
    "merge_usage",
    "public_name",
]

DEFAULT_MAX_GANGS = 4096  # gangs a session may have submitted and not finished
STALL_FACTOR = 16  # stalled gangs a session may pile up, in units of its gang quota


class NotYourSlice(UsageError, KeyError):
    """The slice is not one the asking session allocated (or it does not exist)."""

    def __str__(self) -> str:  # KeyError's own would quote the message
        return str(self.args[0]) if self.args else "not this session's slice"


@dataclass
class Tenant:
    """One session's share and limits, and its gangs in flight or stalled."""

    weight: float = 1.0
    max_gangs: int | None = DEFAULT_MAX_GANGS
    max_bytes: int | None = None
    outstanding: int = 0  # gangs sent on and not finished
    submitted: int = 0
    stalled: int = 0  # gangs that had to wait for the quota (so far)
    refused: int = 0
    # stalled gangs: how to send each, and how to refuse it
    waiting: deque[tuple[Callable[[], None], Callable[[BaseException], None]]] = field(
        default_factory=deque
    )

    def has_room(self) -> bool:
        return self.max_gangs is None or self.outstanding < self.max_gangs


class Tenants:
    """Every known tenant by owner label (see the module docstring)."""

    def __init__(self) -> None:
        self._tenants: dict[str, Tenant] = {}

    def __contains__(self, owner: str) -> bool:
        return owner in self._tenants

    def set_weight(self, owner: str, weight: float) -> Tenant:
        """Register ``owner`` (if new) with ``weight``, or change its weight."""
        if not weight > 0:
            raise AtollError(f"a session's weight must be positive, got {weight}")
        tenant = self._tenants.setdefault(owner, Tenant())
        tenant.weight = float(weight)
        return tenant

    def set_quotas(self, owner: str, max_gangs: int | None, max_bytes: int | None) -> Tenant:
        """Register ``owner`` (if new) with these quotas (None: no limit)."""
        for name, value in (("max_gangs", max_gangs), ("max_bytes", max_bytes)):
            if value is not None and value < 1:
                raise AtollError(f"{name} must be positive or None, got {value}")
        tenant = self._tenants.setdefault(owner, Tenant())
        tenant.max_gangs, tenant.max_bytes = max_gangs, max_bytes
        self._release(tenant)  # a larger quota lets stalled gangs go
        return tenant

    def byte_quota(self, owner: str) -> int | None:
        """``owner``'s store-byte quota (None: none, or not a tenant)."""
        tenant = self._tenants.get(owner)
        return None if tenant is None else tenant.max_bytes

    def weight(self, owner: str) -> float:
        tenant = self._tenants.get(owner)
        return 1.0 if tenant is None else tenant.weight

    def admit(
        self, owner: str, send: Callable[[], None], refuse: Callable[[BaseException], None]
    ) -> None:
        """Have ``send`` send one gang of ``owner`` now, or once its gang
        quota has room (the stall); ``refuse`` is called with
        :class:`~atoll.devices.QuotaExceeded` instead if too many already
        wait (or with why, if its session ends while it waits). An owner
        with no session is sent at once, uncounted."""
        tenant = self._tenants.get(owner)
        if tenant is None:
            send()
        elif tenant.has_room() and not tenant.waiting:
            tenant.outstanding += 1
            tenant.submitted += 1
            send()
        elif len(tenant.waiting) >= STALL_FACTOR * (tenant.max_gangs or 1):
            tenant.refused += 1
            refuse(
                QuotaExceeded(
                    f"session {public_name(owner)} has {tenant.outstanding} gangs queued or "
                    f"running and {len(tenant.waiting)} stalled; its quota is "
                    f"{tenant.max_gangs} (wait for some to finish)"
                )
            )
        else:
            tenant.stalled += 1
            tenant.waiting.append((send, refuse))

    def finished(self, owner: str, _: Any = None) -> None:
        """One gang of ``owner`` finished (or failed); a promise callback.
        Stalled gangs go on, in order, while the quota has room."""
        tenant = self._tenants.get(owner)
        if tenant is None:
            return
        tenant.outstanding = max(0, tenant.outstanding - 1)
        self._release(tenant)

    def reserve(self, owner: str, most: int) -> int:
        """Hold up to ``most`` of ``owner``'s gang quota for a lease
        (``runtime/control/leases.py``), at most half the room it has left,
        none while gangs of it stall; how many were held (``most`` for an
        owner with no session: it is not counted)."""
        tenant = self._tenants.get(owner)
        if tenant is None:
            return most
        if tenant.waiting:
            return 0
        room = most if tenant.max_gangs is None else (tenant.max_gangs - tenant.outstanding) // 2
        held = max(0, min(most, room))
        tenant.outstanding += held
        return held

    def unreserve(self, owner: str, held: int) -> None:
        """A lease ended: the quota it held is ``owner``'s again."""
        tenant = self._tenants.get(owner)
        if tenant is not None:
            tenant.outstanding = max(0, tenant.outstanding - held)
            self._release(tenant)

    def _release(self, tenant: Tenant) -> None:
        while tenant.waiting and tenant.has_room():
            send, _ = tenant.waiting.popleft()
            tenant.outstanding += 1
            tenant.submitted += 1
            send()

    def forget(self, owner: str) -> None:
        """The session ended: its stalled gangs fail, and it is forgotten."""
        tenant = self._tenants.pop(owner, None)
        for _, refuse in tenant.waiting if tenant is not None else ():
            refuse(AtollError(f"session {public_name(owner)} ended"))

    def rows(self) -> dict[str, dict[str, Any]]:
        """Per owner: weight, quotas, gangs outstanding, submitted, refused."""
        return {
            owner: {
                "weight": t.weight,
                "max_gangs": t.max_gangs,
                "max_bytes": t.max_bytes,
                "outstanding": t.outstanding,
                "stalled_now": len(t.waiting),
                "submitted": t.submitted,
                "stalled": t.stalled,
                "refused": t.refused,
            }
            for owner, t in self._tenants.items()
        }


def check_slice(alloc: Allocation, owner: str) -> Allocation:
    """``alloc`` if session ``owner`` may use it; else :class:`NotYourSlice`.

    An empty ``owner`` is the runtime or an in-process tool, which may use
    any slice; a slice allocated with no owner is anyone's.
    """
    if owner and alloc.owner and alloc.owner != owner:
        raise NotYourSlice(f"no slice {alloc.slice_id} allocated by session {public_name(owner)}")
    return alloc


def public_name(owner: str) -> str:
    """An owner label without its secret part (``"alice#3"``), safe to show."""
    return owner.split(".", 1)[0]


def merge_usage(
    tenants: dict[str, dict[str, Any]],
    islands: list[dict[str, dict[str, float]]],
    hosts: list[dict[str, dict[str, float]]],
) -> dict[str, dict[str, Any]]:
    """One row per owner out of the controller's, the islands' and the hosts'.

    ``queued`` (held by an island's policy), ``running`` (sent to devices),
    ``device_s``, ``bytes`` and ``buffers`` are summed over islands and
    hosts; owners the controller does not know still get a row.
    """
    rows: dict[str, dict[str, Any]] = {
        owner: {**row, "queued": 0, "running": 0, "device_s": 0.0, "bytes": 0, "buffers": 0}
        for owner, row in tenants.items()
    }
    for part, keys in ((islands, ("queued", "running")), (hosts, ("device_s", "bytes", "buffers"))):
        for report in part:
            for owner, usage in report.items():
                row = rows.setdefault(owner, _unknown_row())
                for key in keys:
                    row[key] += usage.get(key, 0)
    for row in rows.values():
        row["bytes"], row["buffers"] = int(row["bytes"]), int(row["buffers"])
        row["queued"], row["running"] = int(row["queued"]), int(row["running"])
    return rows


def _unknown_row() -> dict[str, Any]:
    """The row of an owner with no session (an in-process client, a tool)."""
    return {
        "weight": 1.0,
        "max_gangs": None,
        "max_bytes": None,
        "outstanding": 0,
        "stalled_now": 0,
        "submitted": 0,
        "stalled": 0,
        "refused": 0,
        "queued": 0,
        "running": 0,
        "device_s": 0.0,
        "bytes": 0,
        "buffers": 0,
    }
