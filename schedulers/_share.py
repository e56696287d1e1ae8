"""Proportional share over gangs: stride scheduling (registered as ``"share"``).

Each client (a session's owner label, :attr:`Submit.client`) has a weight and
a *pass*: the device time it was given so far, divided by its weight. When a
device has room, the policy sends the head gang of the client with the
lowest pass, and charges that client ``cost * len(devices) / weight``. Over a
long run every busy client gets device time in proportion to its weight.

The guarantees, and how they are kept:

* **One island-wide order.** A gang gets its ``seq`` when it is dispatched,
  and all of its shards are dispatched together, in one batch of
  instructions, so every device receives its gangs in increasing ``seq``:
  two devices never disagree on the order of two gangs they share, and
  collectives cannot deadlock (the same argument as gang FIFO).
* **FIFO within a client.** Each client's gangs wait in one queue, and only
  its head may go.
* **Work-conserving.** A client with nothing queued is skipped, so its share
  goes to the others. A client whose head gang cannot go (one of its
  devices is full) does not stop the clients behind it from using other
  devices, but it *reserves* its devices: a client with a higher pass may
  not take them, so a wide gang is never starved by narrow ones.
* **No banked credit.** A client that comes back after being idle starts at
  the lowest pass among the busy clients (or its own, if higher): idling
  earns nothing. Nor banked debt: what ran while one client was alone (see
  below) was nobody's share, so all passes are levelled when sharing starts.

Devices are kept only ``depth`` gangs deep while several clients are
present, so that the order the policy chooses is the order devices run; a
device that runs dry while work waits for it is kept a gang deeper each
time (up to ``max_depth``): its gangs are shorter than the round trip
from its completion to its next dispatch.
While one client alone has used the island (for the last ``horizon``
dispatches), there is nothing to share and the policy dispatches every gang
as it is submitted, exactly like gang FIFO; that is why it can be every
island's default. The mode is decided again at each completion only, never
in the middle of a run of submissions, so a caller that reads
:attr:`SharePolicy.dispatches_on_submit` can rely on it for every submit
until the next completion.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from ._protocol import (
    Completed,
    Dispatch,
    Event,
    Instruction,
    PolicyError,
    Submit,
    register_scheduler,
)

__all__ = ["ClientShare", "SharePolicy"]


@dataclass
class ClientShare:
    """One client as the policy sees it (also what :meth:`SharePolicy.clients` reports).

    ``charged`` is the weighted-free device time dispatched for it
    (``cost * devices`` summed), ``pass_`` the same divided by its weight.
    """

    weight: float = 1.0
    pass_: float = 0.0
    charged: float = 0.0
    dispatched: int = 0
    running: int = 0  # gangs dispatched and not finished on every device
    last_seen: int = 0  # the island seq when it last submitted or finished work
    queue: deque[Submit] = field(default_factory=deque)
    order: int = 0  # when it came (ties in pass go to the earlier)


class SharePolicy:
    """Stride scheduling over gangs, an :class:`~atoll.schedulers.IslandPolicy`.

    ``depth``: how many gangs a device is sent ahead while clients share it,
    at first. A device that runs dry while work waits for it (its last gang
    completed before the next could reach it: the control plane's round
    trip is longer than the gangs queued there) is kept one gang deeper each
    time, up to ``max_depth``. ``horizon``: how many dispatches a client
    stays *present* after its last work (while one client alone is present,
    gangs go at once, as in FIFO).
    """

    # sessions' leases may share a device: its host orders their runs by
    # this same stride rule, per device (devices/_lease.py)
    leases_shared = True

    def __init__(self, depth: int = 8, horizon: int = 256, max_depth: int = 32) -> None:
        if depth < 1 or horizon < 0 or max_depth < depth:
            raise PolicyError(
                f"depth must be >= 1, horizon >= 0 and max_depth >= depth, "
                f"got {depth}, {horizon}, {max_depth}"
            )
        self.depth = depth
        self.max_depth = max_depth
        self.horizon = horizon
        self._depth: dict[int, int] = {}  # device -> how deep it is kept (if not `depth`)
        self._seq = 0
        self._clients: dict[str, ClientShare] = {}
        self._left: dict[str, tuple[str, set[int]]] = {}  # gang -> client, devices not done
        self._held: set[str] = set()  # gangs queued in the policy, not dispatched
        self._busy: Counter[int] = Counter()  # device -> shards sent, not completed
        self._full: set[int] = set()  # devices sent as many gangs as they are kept deep
        self._devices: set[int] = set()  # every device a gang was submitted for
        self._floor = 0.0  # the pass of the last client served
        self._came = 0  # clients made so far (each one's order)
        # the clients whose head gang is on one device, by that device; and
        # how many heads span several (while none does, the choice is a look
        # at the devices with room: see _next)
        self._heads: dict[int, set[str]] = {}
        self._wide_heads = 0
        self._sharing = False  # several clients present: devices kept `depth` deep

    # -- events ---------------------------------------------------------------
    def handle(self, event: Event) -> list[Instruction]:
        if isinstance(event, Submit):
            self._submit(event)
        else:
            self._complete(event)
        return self._fill(event.event_id)

    def _submit(self, event: Submit) -> None:
        if not event.devices:
            raise PolicyError(f"gang {event.gang_id!r} has no devices")
        if event.gang_id in self._left or event.gang_id in self._held:
            raise PolicyError(f"gang {event.gang_id!r} was already submitted")
        if not event.weight > 0 or event.cost < 0:
            raise PolicyError(
                f"gang {event.gang_id!r}: weight must be > 0 and cost >= 0, "
                f"got {event.weight} and {event.cost}"
            )
        client = self._clients.get(event.client)
        if client is None:
            client = self._clients[event.client] = ClientShare(order=self._came)
            self._came += 1
        if not client.queue and not client.running:  # back from idle: no credit for it
            client.pass_ = max(client.pass_, self._lowest_pass())
        client.weight = event.weight
        client.last_seen = self._seq
        client.queue.append(event)
        if len(client.queue) == 1:
            self._head(event.client, event, 1)
        self._held.add(event.gang_id)
        self._devices.update(event.devices)

    def _complete(self, event: Completed) -> None:
        owner, left = self._left.get(event.gang_id, ("", set()))
        if event.device not in left:
            raise PolicyError(f"{event.gang_id!r} was not running on device {event.device}")
        left.discard(event.device)
        device = event.device
        self._busy[device] -= 1
        if self._sharing and event.idle and self._wanted(device):
            deeper = min(self.max_depth, self._depth.get(device, self.depth) + 1)
            self._depth[device] = deeper  # it ran dry: keep it deeper
        if self._busy[device] < self._depth.get(device, self.depth):
            self._full.discard(device)
        if not left:
            del self._left[event.gang_id]
            client = self._clients[owner]
            client.running -= 1
            client.last_seen = self._seq
        sharing = self._shared()
        if sharing and not self._sharing:
            self._level()
        self._sharing = sharing

    def _wanted(self, device: int) -> bool:
        """Whether a client's next gang needs ``device``."""
        return any(c.queue and device in c.queue[0].devices for c in self._clients.values())

    def _level(self) -> None:
        """The island starts being shared: what went before was nobody's
        share, so no client owes the others for it (nor is owed)."""
        level = max((c.pass_ for c in self._clients.values()), default=0.0)
        for client in self._clients.values():
            client.pass_ = level

    # -- choosing -------------------------------------------------------------
    def _fill(self, cause: int) -> list[Instruction]:
        """Dispatch gangs, lowest pass first, while devices have room."""
        out: list[Instruction] = []
        while (chosen := self._next(self._sharing)) is not None:
            out += self._dispatch(cause, chosen)
        return out

    def _head(self, name: str, gang: Submit, change: int) -> None:
        """``gang`` became (``change`` 1) or stopped being (-1) the head of
        client ``name``'s queue."""
        devices = set(gang.devices)
        if len(devices) != 1:
            self._wide_heads += change
            return
        (device,) = devices
        if change > 0:
            self._heads.setdefault(device, set()).add(name)
        else:
            self._heads[device].discard(name)

    def _next(self, limited: bool) -> str | None:
        """The client whose head gang goes next, or None when none can.

        Clients are taken lowest pass first (ties in the order they came).
        Unlimited, that is simply the first. Limited, it is the first whose
        head gang's devices all have room and are not reserved: each client
        passed over whose head touches a device with room reserves all of
        that head's devices (a head on full devices only reserves none)."""
        clients = self._clients
        if not limited:
            best, lowest = None, float("inf")
            for name, client in clients.items():
                if client.queue and client.pass_ < lowest:
                    best, lowest = name, client.pass_
            return best
        full = self._full
        if len(full) == len(self._devices):  # every device is full: no one goes
            return None
        if not self._wide_heads:  # heads of one device each: none reserves another's
            return self._lowest_with_room(full)
        return self._scan(full)

    def _scan(self, full: set[int]) -> str | None:
        """:meth:`_next`, limited, in general: the waiting clients' heads in
        order, each one passed over reserving its devices with room."""
        clients = self._clients
        waiting = [
            (c.pass_, i, c.queue[0].devices, n)
            for i, (n, c) in enumerate(clients.items())
            if c.queue
        ]
        waiting.sort()
        reserved: set[int] = set()
        for _, _, devices, name in waiting:
            if full.isdisjoint(devices):
                if reserved.isdisjoint(devices):
                    return name
                reserved.update(devices)
            elif not full.issuperset(devices):
                reserved.update(devices)  # held for this client: no one behind takes them
        return None

    def _lowest_with_room(self, full: set[int]) -> str | None:
        """:meth:`_next` while every client's head gang is on one device: a
        head on a full device is passed over and reserves nothing, so the
        one that goes is the lowest pass (then the earliest client) among
        the heads on devices with room."""
        best: str | None = None
        best_key = (float("inf"), 0)
        clients = self._clients
        for device, names in self._heads.items():
            if device in full:
                continue
            for name in names:
                client = clients[name]
                key = (client.pass_, client.order)
                if key < best_key:
                    best, best_key = name, key
        return best

    def _dispatch(self, cause: int, name: str) -> list[Instruction]:
        client = self._clients[name]
        gang = client.queue.popleft()
        self._head(name, gang, -1)
        if client.queue:
            self._head(name, client.queue[0], 1)
        self._held.discard(gang.gang_id)
        devices = sorted(set(gang.devices))
        self._floor = client.pass_
        charge = gang.cost * len(devices)
        client.charged += charge
        client.pass_ += charge / client.weight
        client.dispatched += 1
        client.running += 1
        client.last_seen = seq = self._seq
        self._seq += 1
        self._left[gang.gang_id] = (name, set(devices))
        self._busy.update(devices)
        for device in devices:
            if self._busy[device] >= self._depth.get(device, self.depth):
                self._full.add(device)
        if self.horizon and seq % self.horizon == 0:
            self._prune()
        return [Dispatch(cause, gang.gang_id, device, seq) for device in devices]

    def _shared(self) -> bool:
        """Whether more than one client is present (has work, or had lately)."""
        since = self._seq - self.horizon
        present = 0
        for client in self._clients.values():
            if client.queue or client.running or client.last_seen >= since:
                present += 1
                if present > 1:
                    return True
        return False

    def _prune(self) -> None:
        """Forget clients idle for a whole horizon (sessions come and go): one
        that comes back starts at the lowest busy pass, as it would anyway."""
        since = self._seq - self.horizon
        idle = [
            name
            for name, c in self._clients.items()
            if not c.queue and not c.running and c.last_seen < since
        ]
        for name in idle:
            del self._clients[name]

    def _lowest_pass(self) -> float:
        busy = [c.pass_ for c in self._clients.values() if c.queue]
        return min(busy, default=self._floor)

    # -- reading --------------------------------------------------------------
    @property
    def dispatches_on_submit(self) -> bool:
        """Whether every gang submitted from now until the next completion
        is dispatched at once, in submission order (one client alone)."""
        return not self._sharing

    def clients(self) -> dict[str, dict[str, float]]:
        """Per client: weight, queued and running gangs, dispatched, charged."""
        return {
            name: {
                "weight": c.weight,
                "queued": len(c.queue),
                "running": c.running,
                "dispatched": c.dispatched,
                "charged": c.charged,
            }
            for name, c in self._clients.items()
        }

    def outstanding(self, client: str) -> int:
        """Gangs of ``client`` queued here or running (for admission control)."""
        share = self._clients.get(client)
        return 0 if share is None else len(share.queue) + share.running

    def validate(self) -> None:
        pending = Counter(d for _, left in self._left.values() for d in left)
        assert +pending == +self._busy, (pending, self._busy)
        full = {d for d, n in self._busy.items() if n >= self._depth.get(d, self.depth)}
        assert full == self._full, (full, self._full)
        assert self._full <= self._devices, (self._full, self._devices)
        assert all(left for _, left in self._left.values()), "a finished gang is still tracked"
        running = Counter(owner for owner, _ in self._left.values())
        for name, client in self._clients.items():
            assert client.running == running[name], (name, client.running, running[name])
        held = {g.gang_id for c in self._clients.values() for g in c.queue}
        assert held == self._held, "the held set drifted from the queues"
        heads = [(n, set(c.queue[0].devices)) for n, c in self._clients.items() if c.queue]
        assert self._wide_heads == sum(len(d) != 1 for _, d in heads), "wide heads drifted"
        by_device: dict[int, set[str]] = {}
        for name, devices in heads:
            if len(devices) == 1:
                by_device.setdefault(next(iter(devices)), set()).add(name)
        assert {d: n for d, n in self._heads.items() if n} == by_device, "heads drifted"


register_scheduler("share", SharePolicy)
