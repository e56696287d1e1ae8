"""The dispatch planner: what every gang of a graph needs to know, computed without I/O.

Parallel dispatch sends a whole graph ahead of its data, so everything about
how values move is decided before anything runs: which physical devices and
island each node's gang uses, which inputs are already resident on a gang's
devices, which inputs a producer pushes straight to its reader's host (and
under which inbox key), and which intermediate values can be freed once their
readers ran. :func:`plan` computes that as plain data from the graph, the
placement of its slices and the topology; :func:`compile_plan` then makes
each device's part of it, which the device keeps, so that a run is one
message per device (``devices/_plan.py``).

A plan depends only on its inputs, so the controller caches it per traced
graph and placement (:class:`PlanCache`); releasing a slice, or losing a host,
invalidates the plans that use it. :attr:`Plan.hosts` groups the work per
host, which is what a host needs to run its part of a plan on its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...devices._gang import PushTarget
from ...devices._plan import MADE_HERE, PUSHED_IN, DeviceProgram, PlannedGang
from ...kernel import AtollError
from ..graph import Graph, Node, ValueRef
from ..topology import Topology
from .resources import Allocation

__all__ = [
    "CompiledPlan",
    "GangPlan",
    "HostPlan",
    "Plan",
    "PlanCache",
    "PushPlan",
    "compile_gangs",
    "compile_plan",
    "place",
    "plan",
    "push_target",
]


@dataclass(frozen=True)
class PushPlan:
    """Output ``output`` of a gang goes to host ``host``, for these readers:
    ``(node, input index)`` pairs, each waiting on an inbox key of its own."""

    output: int
    host: int
    readers: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class GangPlan:
    """One node's gang: where it runs and how its inputs and outputs move.

    ``resident[i]``: input ``i`` was made by a gang over these same devices,
    so every shard already holds its part. ``pushed[i]``: input ``i`` arrives
    by push at the leader's host (``leader_host``).
    """

    node: int
    island: int
    devices: tuple[int, ...]
    leader_host: int
    resident: tuple[bool, ...]
    pushed: tuple[bool, ...]
    push: tuple[PushPlan, ...]


@dataclass(frozen=True)
class HostPlan:
    """A host's part of a plan: for each gang with a device there, in graph
    order, the node and the devices of that host it runs on."""

    host: int
    gangs: tuple[tuple[int, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Plan:
    """Everything dispatch decides about one graph, as plain data.

    ``frees``: the values to drop once all the listed reader nodes ran.
    ``hosts``: the per-host instructions, by host id.
    """

    gangs: tuple[GangPlan, ...]
    hosts: Mapping[int, HostPlan]
    frees: tuple[tuple[ValueRef, tuple[int, ...]], ...]
    push: bool
    slices: frozenset[int]


def place(
    node: Node, placement: Mapping[int, Allocation], topology: Topology, in_processes: bool
) -> Allocation:
    """The allocation a node runs on, checked against the node's needs.

    Raises :class:`AtollError` when the node's slice is unknown, changed
    size, or (in one process, where hosts share one JAX runtime) a JAX node's
    slice spans hosts.
    """
    alloc = placement.get(node.slice.slice_id)
    if alloc is None:
        raise AtollError(
            f"{node.name}: no slice {node.slice.slice_id} (never allocated, or released)"
        )
    if len(alloc.devices) != node.slice.size:
        raise AtollError(f"{node.name}: slice {node.slice.slice_id} changed size")
    one_host = getattr(node.kernel, "single_host", False) and not in_processes
    hosts = sorted({topology.device(d).host for d in alloc.devices})
    if one_host and len(hosts) > 1:
        raise AtollError(
            f"{node.name}: in an in-process cluster a JAX node runs on one host; its "
            f"slice spans hosts {hosts} (host processes, as process_cluster or "
            "atoll up --device jax start them, run it across hosts)"
        )
    return alloc


def plan(
    graph: Graph,
    placement: Mapping[int, Allocation],
    topology: Topology,
    addresses: Sequence[str],
    push: bool,
) -> Plan:
    """Plan a graph's dispatch (pure: no I/O, no actors).

    ``placement`` maps slice ids to their allocations; ``addresses`` holds
    each host's network address ("" for a host in this process); ``push``:
    whether producers push outputs to their readers' hosts.
    """
    in_processes = any(addresses)
    allocs = [place(node, placement, topology, in_processes) for node in graph.nodes]
    leader_hosts = [topology.device(a.devices[0]).host for a in allocs]
    readers: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    resident: list[tuple[bool, ...]] = []
    pushed: list[tuple[bool, ...]] = []
    for node, alloc, host in zip(graph.nodes, allocs, leader_hosts, strict=True):
        made = [ref.node >= 0 for ref in node.inputs]
        same = [
            m and allocs[r.node].devices == alloc.devices
            for m, r in zip(made, node.inputs, strict=True)
        ]
        resident.append(tuple(same))
        pushed.append(tuple(m and push for m in made))
        for i, ref in enumerate(node.inputs):
            if made[i] and push:
                readers.setdefault((ref.node, ref.index, host), []).append((node.id, i))
    pushes: dict[int, list[PushPlan]] = {}
    for (producer, output, host), keys in readers.items():
        pushes.setdefault(producer, []).append(PushPlan(output, host, tuple(keys)))
    gangs = tuple(
        GangPlan(n, a.island, a.devices, h, resident[n], pushed[n], tuple(pushes.get(n, ())))
        for n, (a, h) in enumerate(zip(allocs, leader_hosts, strict=True))
    )
    frees = tuple((ref, tuple(nodes)) for ref, nodes in graph.freeable().items())
    slices = frozenset(node.slice.slice_id for node in graph.nodes)
    return Plan(gangs, _per_host(gangs, topology), frees, push, slices)


def _per_host(gangs: Sequence[GangPlan], topology: Topology) -> dict[int, HostPlan]:
    work: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    for gang in gangs:
        mine: dict[int, list[int]] = {}
        for device in gang.devices:
            mine.setdefault(topology.device(device).host, []).append(device)
        for host, devices in mine.items():
            work.setdefault(host, []).append((gang.node, tuple(devices)))
    return {host: HostPlan(host, tuple(gangs)) for host, gangs in sorted(work.items())}


def push_target(
    output: int,
    host: int,
    keys: Sequence[str],
    addresses: Sequence[str],
    host_refs: Sequence[Any],
) -> PushTarget:
    """Where output ``output`` goes for the readers waiting on ``keys`` at
    ``host``: dialled at the host's address when it has one (a process of
    its own), else reached through its reference (this process)."""
    address = addresses[host]
    return PushTarget(output, host, None if address else host_refs[host], address, tuple(keys))


@dataclass(frozen=True)
class CompiledPlan:
    """A plan as devices run it: each device's part, installed once.

    ``programs``: by device, what ``Device.install_plan`` keeps, the gangs
    in the island's order (the graph's). ``island``: the island all the
    gangs run on, or -1 for a plan over several islands, whose ``parts``
    are then one ``CompiledPlan`` per island (each island orders and sends
    its own; outputs cross islands by push). ``gangs``: every gang as
    ``(node, devices)``, in that order. ``outputs``: per program output,
    ``(node, index, device)``, the device being the producer's leader; a
    program input passed through as an output has node -1 and device -1.
    """

    plan_id: int
    island: int
    programs: Mapping[int, DeviceProgram]
    outputs: tuple[tuple[int, int, int], ...]
    gangs: tuple[tuple[int, tuple[int, ...]], ...] = ()
    parts: tuple[CompiledPlan, ...] = ()

    def by_island(self) -> tuple[CompiledPlan, ...]:
        """The plan's parts, one per island (itself, on one island)."""
        return self.parts or (self,)


def compile_plan(
    plan_: Plan,
    graph: Graph,
    plan_id: int,
    addresses: Sequence[str],
    host_refs: Sequence[Any],
) -> CompiledPlan | None:
    """Each device's part of ``plan_``, or None when the plan cannot run as one.

    A plan compiles when producers push (``plan_.push``, unless no gang
    reads another's output) and no gang needs an input where no push brings
    it (see :func:`_compiles`): pushes go to a gang's leader only.
    Each device then runs its gangs in order, collectives meeting at their
    barriers, and a run is one message per device. A plan that does not
    compile runs gang by gang (:func:`compile_gangs`).
    """
    made = any(ref.node >= 0 for node in graph.nodes for ref in node.inputs)
    if made and not plan_.push:
        return None
    spans = _spanning(plan_)
    if not all(_compiles(gang, graph.nodes[gang.node], spans) for gang in plan_.gangs):
        return None
    kept = set(graph.outputs)
    leaders = {gang.node: gang.devices[0] for gang in plan_.gangs}
    planned = {
        gang.node: _compiled_gang(gang, graph.nodes[gang.node], kept, leaders, addresses, host_refs)
        for gang in plan_.gangs
    }
    outputs = tuple((r.node, r.index, leaders.get(r.node, -1)) for r in graph.outputs)
    islands = sorted({gang.island for gang in plan_.gangs})
    parts = tuple(
        _part(plan_id, island, [g for g in plan_.gangs if g.island == island], planned, outputs)
        for island in islands
    )
    if len(parts) == 1:
        return parts[0]
    programs = {device: p for part in parts for device, p in part.programs.items()}
    order = tuple(gang for part in parts for gang in part.gangs)
    return CompiledPlan(plan_id, -1, programs, outputs, order, parts)


def compile_gangs(
    plan_: Plan, graph: Graph, plan_ids: Iterator[int], host_of: Callable[[int], int]
) -> tuple[CompiledPlan, ...]:
    """A plan that does not compile as a whole (:func:`compile_plan`), as
    one compiled plan per gang, in the graph's order: every input of a gang
    is an input of its plan (the controller passes the producer's promise),
    and every output an output (reported to the controller, which frees it
    once its readers ran). ``host_of``: a device's host."""
    steps = []
    for gang in plan_.gangs:
        node = graph.nodes[gang.node]
        every = tuple(range(len(node.inputs)))
        kept = (True,) * len(node.outputs)
        planned = _entry(gang, node, every, (), kept, host_of(gang.devices[0]))
        outputs = tuple((node.id, o, gang.devices[0]) for o in range(len(node.outputs)))
        steps.append(_part(next(plan_ids), gang.island, [gang], {node.id: planned}, outputs))
    return tuple(steps)


def _part(
    plan_id: int,
    island: int,
    gangs: Sequence[GangPlan],
    planned: Mapping[int, PlannedGang],
    outputs: tuple[tuple[int, int, int], ...],
) -> CompiledPlan:
    """The compiled plan of ``gangs``, all on ``island``: each device's gangs, in order."""
    mine: dict[int, list[PlannedGang]] = {}
    reads: dict[int, dict[int, None]] = {}
    for gang in gangs:
        entry = planned[gang.node]
        for device in gang.devices:
            mine.setdefault(device, []).append(entry)
            reads.setdefault(device, {}).update(dict.fromkeys(i for i in entry.inputs if i >= 0))
    programs = {
        device: DeviceProgram(plan_id, device, tuple(entries), tuple(reads[device]))
        for device, entries in mine.items()
    }
    order = tuple((gang.node, gang.devices) for gang in gangs)
    return CompiledPlan(plan_id, island, programs, outputs, order)


def _spanning(plan_: Plan) -> set[int]:
    """The nodes whose gangs have devices on several hosts."""
    hosts: dict[int, int] = {}
    for host_plan in plan_.hosts.values():
        for node, _ in host_plan.gangs:
            hosts[node] = hosts.get(node, 0) + 1
    return {node for node, count in hosts.items() if count > 1}


def _compiles(gang: GangPlan, node: Node, spanning: set[int]) -> bool:
    """Whether a gang can run from an installed plan (see :func:`compile_plan`):
    every input it reads is given to its devices or pushed to its leader. A
    gang over several hosts whose kernel reads its inputs on each of them
    (``every_host_reads``: a JAX program over host processes) reads only
    program inputs; any other reads made values only where they were made."""
    if gang.node not in spanning:
        return True
    made = [ref.node >= 0 for ref in node.inputs]
    if getattr(node.kernel, "every_host_reads", False):
        return not any(made)
    return all(local or not m for local, m in zip(gang.resident, made, strict=True))


def _compiled_gang(
    gang: GangPlan,
    node: Node,
    kept: set[ValueRef],
    leaders: Mapping[int, int],
    addresses: Sequence[str],
    host_refs: Sequence[Any],
) -> PlannedGang:
    """One gang as its devices keep it: per input, the program input it is,
    ``PUSHED_IN`` when a producer pushes it to the leader, or ``MADE_HERE`` when
    its producer is led by the same device (no push: the leader keeps it
    for the run; see ``PlannedGang``)."""
    leader = gang.devices[0]
    local = tuple(
        (ref.node, ref.index) if ref.node >= 0 and leaders[ref.node] == leader else None
        for ref in node.inputs
    )
    sources = tuple(
        ref.index if ref.node < 0 else MADE_HERE if here else PUSHED_IN
        for ref, here in zip(node.inputs, local, strict=True)
    )
    targets = tuple(
        push_target(p.output, p.host, [f"{n}/{i}" for n, i in readers], addresses, host_refs)
        for p in gang.push
        if (readers := [(n, i) for n, i in p.readers if leaders[n] != leader])
    )
    keep = tuple(ValueRef(node.id, o) in kept for o in range(len(node.outputs)))
    made_here = local if MADE_HERE in sources else ()
    return _entry(gang, node, sources, targets, keep, gang.leader_host, made_here)


def _entry(
    gang: GangPlan,
    node: Node,
    sources: tuple[int, ...],
    push: tuple[PushTarget, ...],
    keep: tuple[bool, ...],
    host: int,
    local: tuple[tuple[int, int] | None, ...] = (),
) -> PlannedGang:
    """The ``PlannedGang`` of ``node``'s gang: where its inputs come from
    (``sources``), where its outputs go and which it keeps."""
    shape, axes = node.slice.shape, node.slice.axis_names
    return PlannedGang(
        node.id, node.kernel, gang.devices, shape, axes, node.outputs, sources,
        gang.resident, push, keep, host, local,
    )  # fmt: skip


class PlanCache:
    """Plans by graph and dispatch options, most recently used kept (no I/O).

    Keyed by the graph's structure (equal graphs share a plan, so one that
    arrives again from a client, unpickled, finds it) or, for a graph that
    cannot be hashed, by the object itself; and by the options that change
    a plan. A
    cached plan is dropped when one of its slices is released
    (:meth:`invalidate_slice`) or the topology changes (:meth:`clear`), and
    ``on_drop`` hears of every plan dropped (the controller then drops what
    it installed for it on the devices).
    """

    def __init__(self, capacity: int = 256, on_drop: Callable[[Plan], None] | None = None) -> None:
        self.capacity = capacity
        self.on_drop = on_drop
        self.hits = 0
        self.misses = 0
        self._plans: OrderedDict[tuple[Hashable, Hashable], tuple[Graph, Plan]] = OrderedDict()

    def get(self, graph: Graph, options: Hashable) -> Plan | None:
        """The cached plan of ``graph`` under ``options``, or None."""
        key = _key(graph, options)
        found = self._plans.get(key)
        if found is None or (isinstance(key[0], int) and found[0] is not graph):
            self.misses += 1
            return None
        self._plans.move_to_end(key)
        self.hits += 1
        return found[1]

    def put(self, graph: Graph, options: Hashable, plan_: Plan) -> None:
        """Remember a plan (the graph is held, so an id key stays unique)."""
        key = _key(graph, options)
        old = self._plans.get(key)
        self._plans[key] = (graph, plan_)
        self._plans.move_to_end(key)
        if old is not None and old[1] is not plan_:
            self._dropped(old[1])
        while len(self._plans) > self.capacity:
            self._dropped(self._plans.popitem(last=False)[1][1])

    def invalidate_slice(self, slice_id: int) -> int:
        """Drop every plan that uses slice ``slice_id``; returns how many."""
        doomed = [k for k, (_, p) in self._plans.items() if slice_id in p.slices]
        for k in doomed:
            self._dropped(self._plans.pop(k)[1])
        return len(doomed)

    def clear(self) -> None:
        while self._plans:
            self._dropped(self._plans.popitem(last=False)[1][1])

    def _dropped(self, plan_: Plan) -> None:
        if self.on_drop is not None:
            self.on_drop(plan_)

    def __len__(self) -> int:
        return len(self._plans)


def _key(graph: Graph, options: Hashable) -> tuple[Hashable, Hashable]:
    """A graph's cache key: itself (by structure) when it hashes, else its id."""
    try:
        hash(graph)
    except TypeError:  # a kernel that cannot be hashed
        return id(graph), options
    return graph, options
