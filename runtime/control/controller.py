"""The single controller: topology, resource manager, and parallel dispatch.

Dispatch runs ahead of the data. ``cluster.run(...)`` returns promises at
once; the controller and the island schedulers forward promise-carrying calls
without waiting for their inputs (their endpoints take promises as they are),
and only the devices, which must have the bytes, wait for them. What each
gang needs to know is planned without I/O by :mod:`atoll.runtime.control.planner`
and cached per graph, and compiled into each device's part; a run is then an
epoch, sent to each island with the other runs of its loop turn. Clients
reach it through :class:`~atoll.runtime.Cluster`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ...devices import BufferHandle, Computation, Device, Host, RunReport, timeline
from ...devices import _runlane as runlane
from ...devices._device import Reply
from ...devices._plan import PriorOutput, portable, run_key
from ...kernel import (
    Actor,
    ActorRef,
    ActorStopped,
    AtollError,
    HostLost,
    Promise,
    all_settled,
    as_promise,
    endpoint,
    failed,
    forward,
    log_failure,
    process_counters,
    when_settled,
)
from ...kernel.lowlevel import call_soon
from ...schedulers import leases_shared
from ..calls import device_of_slice, input_kinds, kinds_graph
from ..graph import Graph, ValueRef
from ..latency import Wire, over
from ..runlanes import lanes_on
from ..topology import Topology
from ..tracing import VirtualSlice
from .elastic import Elastic
from .island import IslandScheduler, RunArgs, Taken
from .leases import LeaseGrant, Leases
from .metrics import RunCounters, controller_metrics
from .planner import (
    CompiledPlan,
    Plan,
    PlanCache,
    compile_gangs,
    compile_plan,
    plan,
)
from .resources import Allocation, ResourceManager
from .tenancy import DEFAULT_MAX_GANGS, Tenants, check_slice, merge_usage

__all__ = ["Controller", "spawn_control"]

_log = logging.getLogger(__name__)
T = TypeVar("T")
_log_failed_notice = log_failure(_log, "a notice to a host")
_log_lease_failed = log_failure(_log, "a lease taken back")


class Controller(Actor):
    """The single controller: topology, resource manager, and program dispatch.

    Its dispatch endpoints take inputs as promises and never wait for them:
    ``run_graph`` sends every node of a graph to its island at once and
    returns one promise per output. Data never passes through it.

    ``push``: in parallel dispatch, whether each producer sends its outputs
    straight to the hosts of their readers (who then start without waiting
    for the controller to hear of the producer). None, the default, pushes:
    compiled plans, every run's path, need it (a reader on the producer's
    own device takes the value where it is).
    """

    def __init__(
        self,
        topology: Topology,
        schedulers: dict[int, ActorRef[IslandScheduler]],
        devices: Sequence[ActorRef[Device]],
        hosts: Sequence[ActorRef[Host]],
        wire: Wire | None = None,
        push: bool | None = None,
        spare_hosts: Sequence[int] = (),
        lane: tuple[bytes, str] | None = None,
        shared_islands: Collection[int] = (),
    ) -> None:
        self.wire = wire
        self.push = push
        self._lane = lane  # (the cluster token, the interface) to take clients' call lanes on
        self.lane_address: tuple[str, int] = ("", 0)  # where, and this controller's id there
        self.host_addresses = [""] * len(hosts)
        self.cluster_topology = topology
        self.schedulers = schedulers
        self.device_refs = list(devices)
        self.host_refs = list(hosts)
        self.resources = ResourceManager(
            [(d.id, d.host, d.island) for d in topology.devices], spare_hosts
        )
        self.elastic = Elastic(self)  # moves, suspends, drains (runtime/control/elastic.py)
        self.plans = PlanCache(on_drop=self._plan_dropped)
        self.tenants = Tenants()  # sessions' weights and quotas (runtime/control/tenancy.py)
        self.runs = RunCounters()  # for /metrics (runtime/control/metrics.py)
        self.leases = Leases(self)  # sessions' runs sent straight to a host (leases.py)
        # (the devices whose island's policy lets several sessions' leases share them)
        self.leases.shared_devices = {d.id for d in topology.devices if d.island in shared_islands}
        self.compile: bool | None = None  # None: when hosts are processes (see set_compile)
        # by (id(plan), compiling): a plan as a whole, or gang by gang
        self._compiled: dict[tuple[int, bool], CompiledPlan | tuple[CompiledPlan, ...]] = {}
        self._plan_ids = itertools.count(1)
        self._runs = itertools.count()
        self._compiled_runs = 0
        self._pending: dict[tuple[str, str], _CompiledRun] = {}  # compiled runs under way
        self._outbox: dict[int, list[tuple[RunArgs, Promise[Any]]]] = {}  # by island: this turn's
        self._calls: dict[tuple[Any, ...], Graph] = {}  # low-level calls' graphs, by shape
        # leases being taken back (another session came), and the runs held behind them
        self._lease_gates: list[Promise[None]] = []
        self._behind_gates: list[_CompiledRun] = []
        self._held_devices: set[int] = set()  # the devices of the runs held

    async def on_start(self) -> None:
        answers = [host.address() for host in self.host_refs]
        self.host_addresses = [await answer for answer in answers]
        self.set_push(self.push)
        self.set_compile(self.compile)
        if self._lane is not None:
            await self._serve_call_lanes(*self._lane)

    async def on_stop(self) -> None:
        if self.lane_address[1]:
            runlane.unregister_controller(self.lane_address[1])

    async def _serve_call_lanes(self, token: bytes, interface: str) -> None:
        """Take clients' runs by call lane (``runtime/runlanes.py``)."""
        try:
            address = await runlane.serve_calls(interface, token)
        except OSError as exc:  # an optimization: runs come by call instead
            _log.warning("the controller takes no runs by lane: %s", exc)
            return
        self.lane_address = (address, runlane.register_controller(self.ctx.ref, self.host_refs))

    @endpoint
    def call_lane(self) -> tuple[str, int]:
        """Where clients send their runs one way ("" : by call only), and
        this controller's id there."""
        return self.lane_address

    @endpoint(resolve_args=False)
    def stash(self, ticket: str, args: tuple[Any, ...]) -> None:
        """The arguments of a call lane's run that needed Cap'n Proto (a
        promise, a reference...), sent with ``ticket``; the run waits for
        them on its lane (``devices/_runlane.py``)."""
        runlane.stash(ticket, tuple(args))

    @property
    def hosts_in_processes(self) -> bool:
        """Whether hosts run in processes of their own (they have addresses)."""
        return any(self.host_addresses)

    @endpoint
    def set_push(self, push: bool | None) -> bool:
        """Turn pushing on or off (None: on); returns the setting in force. Off,
        no plan compiles: every run goes gang by gang, inputs as promises."""
        self.push = True if push is None else push
        return self.push

    @endpoint
    def set_compile(self, compile_: bool | None) -> bool:
        """Run programs as compiled plans, one message per device per run,
        or not (None: on); returns the setting in force. Plans that cannot
        compile (collective gangs over several devices, or several islands)
        are dispatched per gang."""
        self.compile = True if compile_ is None else compile_
        return self.compile

    @endpoint
    async def replace_host(
        self, host_id: int, host: ActorRef[Host], devices: Sequence[ActorRef[Device]]
    ) -> None:
        """A new host process took the place of lost host ``host_id`` (same
        device ids, an empty store; ``runtime/deploy/process.py``): use its
        references from now on. Plans name hosts' addresses, so every cached
        plan is dropped; the islands swap the references too; sessions' byte
        quotas are set on it again. Asynchronous: waits for the host's
        address and for the islands and the host to answer."""
        replaced = dict(zip(self.cluster_topology.on_host(host_id), devices, strict=True))
        self.resources.restore_host(host_id)
        self.elastic.host_back(host_id)
        self.leases.host_gone(host_id)
        self.host_refs[host_id] = host
        self.host_addresses[host_id] = await host.address()
        for device_id, ref in replaced.items():
            self.device_refs[device_id] = ref
        self.plans.clear()
        for answer in [i.replace_host(host_id, host, replaced) for i in self.schedulers.values()]:
            await answer
        for owner in self.tenants.rows():
            quota = self.tenants.byte_quota(owner)
            if quota is not None:
                await host.set_quota(owner, quota)

    @endpoint
    def process_counters(self) -> dict[str, float]:
        """The controller's process: its pid, CPU seconds and message
        counters (``atoll bench controlplane``)."""
        return process_counters()

    @endpoint
    def topology(self) -> Topology:
        return self.cluster_topology

    @endpoint
    async def policies(self) -> dict[int, str]:
        """Each island's scheduling policy, by name."""
        answers = {island: ref.scheduler_name() for island, ref in self.schedulers.items()}
        return {island: await answer for island, answer in answers.items()}

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
    def slice_devices(self, slice_id: int, owner: str = "") -> tuple[int, ...]:
        """A slice's physical devices now, in mesh order (for colocated
        Python, ``runtime/client/colocated.py``); ``owner``'s slices only."""
        return self._placed(slice_id, owner).devices

    @endpoint
    def release(self, slice_id: int, owner: str = "") -> Promise[None] | None:
        """Give a slice back; a session (``owner``) may release only its own.
        A slice being moved (or suspended, resumed) is given back once that
        is over."""
        check_slice(self.resources.get(slice_id), owner)
        busy = self.elastic.change_under_way(slice_id)
        if busy is not None:
            later: Promise[None] = Promise(f"release slice {slice_id}")
            busy.add_done_callback(lambda _: _settle_with(later, self.release, slice_id, owner))
            return later
        self.resources.release(slice_id)
        self.plans.invalidate_slice(slice_id)
        self.elastic.forget(slice_id)
        return None

    @endpoint
    async def release_owner(self, owner: str) -> int:
        """Free every slice and buffer of ``owner`` (a client going away),
        once the changes under way on its slices are over."""
        for alloc in self.resources.slices():
            while alloc.owner == owner and (busy := self.elastic.change_under_way(alloc.slice_id)):
                await busy
        await self.leases.take_back_all(owner=owner)
        self.leases.forget(owner)
        self.tenants.forget(owner)
        for slice_id in self.resources.release_owner(owner):
            self.plans.invalidate_slice(slice_id)
            self.elastic.forget(slice_id)
        freed = [host.free_owner(owner) for host in self.host_refs]
        return sum([await _unless_lost(each) or 0 for each in freed])

    # -- elastic slices (runtime/control/elastic.py) ----------------------------------
    # Each change runs as a task beside the message loop and answers when it
    # is over: the controller goes on dispatching meanwhile.
    @endpoint
    def move_slice(
        self,
        slice_id: int,
        devices: Sequence[int] | None = None,
        host: int | None = None,
        owner: str = "",
    ) -> Promise[dict[str, Any]]:
        """Move a slice to ``devices`` (physical ids, in mesh order), or to
        free devices on ``host``, or anywhere free off its hosts; its buffers
        go with it. What moved (buffers, bytes, seconds). Asynchronous: waits
        for the slice's runs, then for the copies; runs for it wait meanwhile."""
        avoid = self.resources.hosts_of(slice_id) if devices is None and host is None else []
        return self._in_background(
            self._without_leases, self.elastic.move, slice_id, devices, host, owner, avoid
        )

    @endpoint
    def suspend_slice(self, slice_id: int, owner: str = "") -> Promise[dict[str, Any]]:
        """Park a slice's buffers in host memory and give its devices back
        (runs for it wait until it is resumed)."""
        return self._in_background(self._without_leases, self.elastic.suspend, slice_id, owner)

    @endpoint
    def resume_slice(self, slice_id: int, owner: str = "") -> Promise[dict[str, Any]]:
        """Devices again for a suspended slice, and its buffers on them."""
        return self._in_background(self._without_leases, self.elastic.resume, slice_id, owner)

    @endpoint
    def drain_host(self, host_id: int) -> Promise[dict[str, Any]]:
        """Move every slice and buffer off host ``host_id``, which then holds
        nothing and gets no new slice; a host process then leaves."""
        self.cluster_topology.on_host(host_id)  # raises for an unknown host
        return self._in_background(self._without_leases, self._drain, host_id)

    async def _drain(self, host_id: int) -> dict[str, Any]:
        report = await self.elastic.drain(host_id)
        leave = self.host_refs[host_id].leave()
        leave.add_done_callback(_log_failed_notice)
        return report

    @endpoint
    def host_lost(self, host_id: int) -> Promise[list[int]]:
        """Host ``host_id`` is gone: re-place its slices (on spares if need
        be). The slices re-placed; the buffers it held are lost."""
        for island in self.schedulers.values():  # its run lanes go: calls fail, not wait
            island.host_lost(host_id).add_done_callback(_log_failed_notice)
        self.leases.host_gone(host_id)  # (the others stay: its slices go to other devices)
        return self._in_background(self._granting_none, self.elastic.host_lost, host_id)

    async def _granting_none(self, op: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``op(*args)``, with no lease granted until it is over."""
        self.leases.hold_off += 1
        try:
            return await op(*args)
        finally:
            self.leases.hold_off -= 1

    async def _without_leases(self, op: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``op(*args)``, an elastic change, once every lease was taken back
        (their runs ended); none is granted until it is over."""
        self.leases.hold_off += 1
        try:
            await self.leases.take_back_all()
            return await op(*args)
        finally:
            self.leases.hold_off -= 1

    def _in_background(self, op: Callable[..., Awaitable[T]], *args: Any) -> Promise[T]:
        """The promise of ``op(*args)``, run as a task beside the message loop."""
        answer: Promise[T] = Promise(getattr(op, "__name__", "elastic"))

        async def run() -> None:
            try:
                answer.set_result(await op(*args))
            except Exception as exc:
                answer.set_exception(exc)

        self.ctx.start_soon(run)
        return answer

    @endpoint
    def locate(self, buffer_ids: list[str]) -> dict[str, BufferHandle]:
        """Where buffers that moved are now (one that did not is absent)."""
        return self.elastic.locate(buffer_ids)

    @endpoint
    def elastic_status(self) -> dict[str, Any]:
        """Spares, suspended and moving slices, drains and recent changes."""
        return self.elastic.status()

    @endpoint
    def put(self, array: Any, slice_id: int | None, owner: str = "") -> Promise[BufferHandle]:
        """Place a host array on the leader device of a slice (device 0 if None)."""
        if slice_id is not None and self.elastic.gates:
            again = functools.partial(self.put, array, slice_id, owner)
            held = self.elastic.hold([slice_id], again)
            if held is not None:
                return held
        alloc = check_slice(self.resources.get(slice_id), owner) if slice_id is not None else None
        device = alloc.devices[0] if alloc is not None else 0
        promise: Promise[BufferHandle] = self.device_refs[device].put(array, owner)
        if slice_id is not None:  # a move of the slice waits for it
            self.elastic.track([slice_id], promise)
        return promise

    @endpoint(resolve_args=False, share_args=False, inline=True)
    def run_graph(
        self,
        graph: Graph,
        inputs: Sequence[Any],
        owner: str = "",
        tag: str = "",
        sources: Sequence[tuple[str, int] | None] = (),
        reply: tuple[str, int] | None = None,
    ) -> Promise[list[BufferHandle | Promise[BufferHandle]] | str]:
        """Parallel asynchronous dispatch of a whole graph; returns at once.

        Every node goes to its island now, with promises for inputs. Values
        that are not outputs are freed once all their readers ran; the
        program inputs are the caller's (it owns them, and frees them).
        Returns one promise of the graph's outputs (a handle each, or the
        failed promise of one that failed), which settles once every gang
        has taken its inputs (the caller may free them then): one answer per
        run, whatever its size.

        ``tag`` names this run for the client, and ``sources`` says, per
        input, which earlier run's output it is (``(tag, output index)``):
        an input still on its way from an earlier compiled run on the very
        device that reads it goes to that device as a ``PriorOutput``, which it
        takes from what it kept of that run, with no round trip.

        ``reply`` (a client's call by its call lane: the name of its lanes,
        the call's number): when one device makes every output, that device
        answers the client itself, and the answer here is ``DIRECT``
        (``devices/_runlane.py``), which the call lane does not send.
        """
        if self.elastic.gates:  # a slice of it is moving, or suspended: wait for it
            again = functools.partial(self.run_graph, graph, inputs, owner, tag, sources)
            held = self.elastic.hold({n.slice.slice_id for n in graph.nodes}, again)
            if held is not None:
                return held
        if self.elastic.located:  # buffers moved: name where they are now
            inputs = self.elastic.fresh(inputs)
        plan_ = self.plan_for(graph, owner)
        compiled = self._compiled_plan(plan_, graph)
        if isinstance(compiled, CompiledPlan):
            earlier = self._earlier_inputs(owner, inputs, sources)
            run = self._run_compiled(compiled, inputs, owner, tag, earlier, reply)
            outs, done = run.outs, run.done
        else:
            run, (outs, done) = None, self._gang_by_gang(compiled, plan_, graph, inputs, owner)
        answer: Promise[Any] = _together(outs, done, run)
        self.elastic.track(plan_.slices, answer)
        self.runs.observe(answer)
        return answer

    @endpoint(resolve_args=False, share_args=False, inline=True)
    def run_call(
        self,
        computation: Computation,
        device: int,
        inputs: Sequence[Any],
        owner: str = "",
        tag: str = "",
        sources: Sequence[tuple[str, int] | None] = (),
        reply: tuple[str, int] | None = None,
    ) -> Promise[list[BufferHandle | Promise[BufferHandle]] | str]:
        """A low-level call, ``computation`` on physical ``device``: what
        :meth:`run_graph` does with its graph of one node, which is made here
        (and kept, by the call's shape) so that only the call travels."""
        graph = self._call_graph(computation, device, input_kinds(inputs))
        return self.run_graph(graph, inputs, owner, tag, sources, reply)

    def _call_graph(
        self, computation: Computation, device: int, kinds: tuple[tuple[Any, ...], ...]
    ) -> Graph:
        """The one-node graph of a low-level call of this shape (kept)."""
        key = (computation, device, kinds)
        graph = self._calls.get(key)
        if graph is None:
            graph = self._calls[key] = kinds_graph(computation, device, kinds)
            while len(self._calls) > _CALLS_KEPT:
                del self._calls[next(iter(self._calls))]
        return graph

    @endpoint
    def lease(
        self,
        computation: Computation,
        device: int,
        kinds: Sequence[Sequence[Any]],
        owner: str = "",
    ) -> Promise[LeaseGrant | None]:
        """A lease for session ``owner``'s low-level calls of ``computation``
        on ``device`` with inputs of these kinds (``runtime/calls.py``,
        ``input_kinds``): its client may send them to the device's host
        itself (``runtime/control/leases.py``). None when it may not now.
        Asynchronous: answered once the plan is installed and the host has
        the lease, while the controller goes on with its messages."""
        self.cluster_topology.device(device)  # raises for an unknown device
        shape = tuple(tuple(kind) for kind in kinds)
        if self.leases.refusal(device, owner) is not None:
            return as_promise(None)
        graph = self._call_graph(computation, device, shape)
        compiled = self._compiled_plan(self.plan_for(graph, owner), graph)
        if not isinstance(compiled, CompiledPlan):
            return as_promise(None)
        return self._in_background(self.leases.grant, compiled, device, owner)

    @endpoint
    def lease_graph(self, graph: Graph, owner: str = "") -> Promise[LeaseGrant | None]:
        """A lease for session ``owner``'s runs of ``graph``, when its plan
        is one program on one device (as :meth:`lease` for a call)."""
        if self.elastic.gates:
            return as_promise(None)
        compiled = self._compiled_plan(self.plan_for(graph, owner), graph)
        if not isinstance(compiled, CompiledPlan) or len(compiled.programs) != 1:
            return as_promise(None)
        (device,) = compiled.programs
        if self.leases.refusal(device, owner) is not None:
            return as_promise(None)
        return self._in_background(self.leases.grant, compiled, device, owner)

    def plan_live(self, compiled: CompiledPlan) -> bool:
        """Whether ``compiled`` is still a plan the controller keeps (one let
        go was dropped from its devices)."""
        return any(found is compiled for found in self._compiled.values())

    @endpoint
    def leased(self, lease_id: int, ran: int, failed: int) -> None:
        """A host's count of the runs lease ``lease_id`` let through."""
        self.runs.leased(ran, failed)

    @endpoint
    def lease_status(self) -> dict[str, Any]:
        """The leases held (by device: owner, id, plans), granted, taken back."""
        return self.leases.status()

    def _earlier_inputs(
        self, owner: str, inputs: Sequence[Any], sources: Sequence[tuple[str, int] | None]
    ) -> dict[int, tuple[int, PriorOutput]]:
        """Per input made by a compiled run still under way: the device that
        made it, and the ``PriorOutput`` that names it there."""
        earlier: dict[int, tuple[int, PriorOutput]] = {}
        for i, source in enumerate(sources):
            producer = self._pending.get((owner, source[0])) if source else None
            if source is None or producer is None:
                continue
            node, index, device = producer.compiled.outputs[source[1]]
            if node >= 0:  # a device in a process of its own gets no promise (see PriorOutput)
                here = not self.host_addresses[self.cluster_topology.device(device).host]
                value = inputs[i] if here else None
                earlier[i] = (device, PriorOutput(producer.epoch, node, index, value))
        return earlier

    def _gang_by_gang(
        self,
        steps: Sequence[CompiledPlan],
        plan_: Plan,
        graph: Graph,
        inputs: Sequence[Any],
        owner: str,
    ) -> tuple[list[Promise[BufferHandle]], Promise[None]]:
        """Run a plan that does not compile as a whole one gang at a time:
        each gang is a compiled plan of its own (``compile_gangs``), sent at
        once with its inputs as the promises of their producers' outputs,
        and values the program does not keep are freed once their readers
        ran (see :meth:`run_graph`)."""
        values: dict[ValueRef, Promise[BufferHandle]] = {
            ValueRef(-1, i): as_promise(v) for i, v in enumerate(inputs)
        }
        ran: list[Promise[None]] = []
        for node, step in zip(graph.nodes, steps, strict=True):
            run = self._run_compiled(step, [values[ref] for ref in node.inputs], owner)
            ran.append(run.done)
            values.update((ValueRef(node.id, i), out) for i, out in enumerate(run.outs))
        for ref, readers in plan_.frees:
            _free_after(values[ref], [ran[n] for n in readers])
        return [values[ref] for ref in graph.outputs], all_settled(ran)

    def _compiled_plan(self, plan_: Plan, graph: Graph) -> CompiledPlan | tuple[CompiledPlan, ...]:
        """``plan_`` compiled for its devices (once per plan): as a whole,
        or, when it does not compile so (or compiling is off), gang by gang."""
        # the plan cache holds the plan, so its id stays its own
        key = (id(plan_), bool(self.compile))
        found = self._compiled.get(key)
        if found is None:
            whole = None
            if self.compile:
                whole = compile_plan(
                    plan_, graph, next(self._plan_ids), self.host_addresses, self.host_refs
                )
            found = whole or compile_gangs(plan_, graph, self._plan_ids, self.host_of_device)
            self._compiled[key] = found
        return found

    def host_of_device(self, device: int) -> int:
        """The host of physical device ``device``."""
        return self.cluster_topology.device(device).host

    @property
    def report_to(self) -> ActorRef[Controller]:
        """This controller, for hosts to count leases' runs to (``leased``)."""
        return self.ctx.ref

    def _plan_dropped(self, plan_: Plan) -> None:
        """The plan cache let a plan go: so do the devices it was installed on."""
        by_island: dict[int, list[int]] = {}
        for mode in (True, False):
            compiled = self._compiled.pop((id(plan_), mode), None)
            parts = compiled.by_island() if isinstance(compiled, CompiledPlan) else compiled or ()
            for part in parts:
                by_island.setdefault(part.island, []).append(part.plan_id)
        self.leases.plans_dropped(p for ids in by_island.values() for p in ids)
        for island, plan_ids in by_island.items():
            dropped = self.schedulers[island].drop_plans(plan_ids)
            dropped.add_done_callback(_log_failed_notice)

    def _run_compiled(
        self,
        compiled: CompiledPlan,
        inputs: Sequence[Any],
        owner: str,
        tag: str = "",
        earlier: dict[int, tuple[int, PriorOutput]] | None = None,
        reply: tuple[str, int] | None = None,
    ) -> _CompiledRun:
        """One run of a compiled plan: the island sends each device one
        ``run_plan``; each output settles from its device's report (one its
        device sent to the client itself: see :meth:`_ran_on_one`). A
        session's run goes through its gang quota as one entry (sent now,
        after a stall, or refused). A client's call (``reply``) is answered by
        the run's device when one device makes every output."""
        epoch = next(self._runs)
        self._compiled_runs += 1
        outs: list[Promise[BufferHandle]] = [
            as_promise(inputs[index]) if node < 0 else Promise(f"output {node}/{index}")
            for node, index, _ in compiled.outputs
        ]
        run = _CompiledRun(
            compiled, list(inputs), owner, epoch, outs, Promise("ran"), earlier or {}
        )
        run.made = made = all(node >= 0 for node, _, _ in compiled.outputs)  # none is an input
        if reply is not None and made and len(compiled.programs) == 1:
            outputs = [(node, index) for node, index, _ in compiled.outputs]
            run.reply = (*reply, outputs)
        if tag:  # while it goes, later runs may read its outputs where they are
            self._pending[owner, tag] = run
            run.done.add_done_callback(functools.partial(self._settled, (owner, tag)))
        refuse = functools.partial(self._refused, run)
        self.tenants.admit(owner, functools.partial(self._send_run, run), refuse)
        return run

    def _refused(self, run: _CompiledRun, error: BaseException) -> None:
        """The session's gang quota refused ``run`` (or its session ended)."""
        self._compiled_sent(run, failed(error), counted=False)

    def _settled(self, key: tuple[str, str], _: Promise[None]) -> None:
        self._pending.pop(key, None)

    def _send_run(self, run: _CompiledRun) -> None:
        """Send an admitted compiled run on, unless another session's lease
        on one of its devices is being taken back: then it waits until the
        lease's runs ended (the island orders it among what the device
        really has), and so does every later run on a device of a run held
        (each device's runs reach the island in the order they came; a run
        may read an earlier one's output where it was made). Runs on other
        devices go on meanwhile."""
        devices = run.compiled.programs
        taken = self.leases.seen(devices, run.owner)
        if taken is not None:
            self._lease_gates.append(taken)
            taken.add_done_callback(self._gate_settled)
        if taken is not None or not self._held_devices.isdisjoint(devices):
            self._behind_gates.append(run)
            self._held_devices.update(devices)
            return
        self._dispatch(run)

    def _gate_settled(self, _: Promise[None]) -> None:
        """A lease was taken back: once every one was, the runs held go, in order."""
        if all(gate.done() for gate in self._lease_gates):
            self._lease_gates.clear()
            self._held_devices.clear()
            held, self._behind_gates = self._behind_gates, []
            for run in held:
                self._dispatch(run)

    def _dispatch(self, run: _CompiledRun) -> None:
        """Send an admitted compiled run to its island (each of its parts to
        its own, when it has several: their devices' reports, together)."""
        weight = self.tenants.weight(run.owner)  # its share, for the policy's accounting
        parts = run.compiled.by_island()
        sent = [self._send_part(run, part, weight) for part in parts]
        if len(sent) == 1:
            sent[0].add_done_callback(functools.partial(self._compiled_sent, run))
            return
        merged = when_settled(sent, lambda: _reports_of(parts, sent))
        merged.add_done_callback(functools.partial(self._compiled_sent, run))

    def _send_part(
        self, run: _CompiledRun, part: CompiledPlan, weight: float
    ) -> Promise[dict[int, Promise[RunReport]]]:
        """Send one island its part of a run: with the others of this loop
        turn for it (:meth:`_send_outbox`), or at once when no other run is
        waiting to go and no message is waiting in the mailbox (a call
        alone, as an awaited one is, pays no extra turn). The promise of its
        devices' reports."""
        inputs, earlier = run.inputs, run.earlier
        given = {
            d: [earlier[i][1] if earlier.get(i, (-1,))[0] == d else inputs[i] for i in p.inputs]
            for d, p in part.programs.items()
        }
        args: RunArgs = (part, run.epoch, given, run.owner, weight, run.reply)
        if not self._outbox and not self.ctx.queued:  # nothing more this turn: at once
            to_island = over(self.wire, self.schedulers[part.island])
            at_once: Promise[dict[int, Promise[RunReport]]] = to_island.run_plan(*args)
            return at_once
        sent: Promise[dict[int, Promise[RunReport]]] = Promise("sent")
        runs = self._outbox.get(part.island)
        if runs is None:
            if not self._outbox:
                call_soon(self._send_outbox)  # at the end of this loop turn
            runs = self._outbox[part.island] = []
        runs.append((args, sent))
        return sent

    def _send_outbox(self) -> None:
        """Send each island the runs this loop turn made for it, in order,
        as one message (``IslandScheduler.run_plans``). The outbox empties
        one island at a time: a run made while it sends (a call run inline,
        from a callback of what it sent) joins it behind the older runs,
        never ahead of them."""
        while self._outbox:
            island = next(iter(self._outbox))
            runs = self._outbox.pop(island)
            answer = over(self.wire, self.schedulers[island]).run_plans([a for a, _ in runs])
            answer.add_done_callback(functools.partial(_hand_out, [sent for _, sent in runs]))

    def _compiled_sent(self, run: _CompiledRun, sent: Promise[Any], counted: bool = True) -> None:
        """The island took a compiled run (and sends each device its part
        when its policy dispatches it), or it failed to, or the session's
        quota refused it (not ``counted``)."""
        error = sent.exception()
        reports: dict[int, Promise[RunReport]] | None = None if error else sent.result()
        if reports is not None and len(reports) == 1:  # (most runs: one device, one callback)
            ((device, report),) = reports.items()
            report.add_done_callback(functools.partial(self._ran_on_one, run, device, counted))
            return
        for (node, index, device), out in zip(run.compiled.outputs, run.outs, strict=True):
            if node >= 0 and reports is not None:
                reports[device].add_done_callback(functools.partial(_output, node, index, out))
            elif node >= 0:
                out.set_exception(error or AtollError("a compiled run was not sent"))
        for device, report in (reports or {}).items():
            report.add_done_callback(functools.partial(self._reported, run, device))
        every = all_settled(list((reports or {}).values()), into=run.done)
        if reports:  # read in place by readers on any device: free once all ran
            every.add_done_callback(functools.partial(self._free_held, reports))
        if counted:  # its place in the session's gang quota
            every.add_done_callback(functools.partial(self.tenants.finished, run.owner))

    def _ran_on_one(
        self, run: _CompiledRun, device: int, counted: bool, report: Promise[RunReport]
    ) -> None:
        """The report of a run of one device: what :meth:`_compiled_sent`'s
        callbacks do for a run of several (its outputs, its failed gangs'
        readers, the outputs kept for readers elsewhere, the run's end, its
        place in the session's quota), in one callback. Outputs its device
        sent to the client itself are not in the report: their promises here
        fail with ``_SENT_TO_CLIENT`` (nobody reads them: the answer is
        ``DIRECT``). The run ends, and leaves the quota, whatever raised."""
        try:
            self._reported(run, device, report)  # (whether its device answered the client)
            for (node, index, _), out in zip(run.compiled.outputs, run.outs, strict=True):
                if run.answered:  # the report carries no outputs: the client has them
                    out.set_exception(_SENT_TO_CLIENT)
                elif node >= 0:
                    _output(node, index, out, report)
        finally:
            run.done.set_result(None)
            try:
                if report.exception() is None and report.result().held:
                    self._free_held({device: report}, run.done)
            finally:
                if counted:
                    self.tenants.finished(run.owner)

    def _free_held(self, reports: dict[int, Promise[RunReport]], _: Promise[None]) -> None:
        """The whole run is over: free the outputs devices kept because a
        reader elsewhere read them in place (a declined push), one message
        per host. One that is gone already is skipped: its session ended
        (a client killed with runs in flight) and took it."""
        by_host: dict[int, list[str]] = {}
        for device, report in reports.items():
            if report.exception() is None and report.result().held:
                host_id = self.cluster_topology.device(device).host
                by_host.setdefault(host_id, []).extend(report.result().held)
        for host_id, buffer_ids in by_host.items():
            freed = self.host_refs[host_id].free_many(buffer_ids)
            freed.add_done_callback(_log_failed_notice)

    def _reported(self, run: _CompiledRun, device: int, report: Promise[RunReport]) -> None:
        """A device's report: the gangs it led that failed (all of them, if
        the report itself failed: its host was lost) fail the inboxes their
        outputs were due in, so that their readers do not wait forever (an
        inbox that settled already ignores it; a gang that failed before it
        pushed did this itself)."""
        error = report.exception()
        errors = report.result().errors if error is None else {}
        run.answered = error is None and report.result().answered
        prefix = run_key(run.epoch)
        notices: dict[tuple[int, int], tuple[list[str], BaseException]] = {}  # one per host, error
        boxed_lost = portable(error, f"{prefix}/device{device}") if error is not None else None
        for gang in run.compiled.programs[device].gangs:
            if gang.devices[0] != device or (error is None and gang.node not in errors):
                continue
            boxed: BaseException = boxed_lost or portable(
                errors[gang.node], f"{prefix}/{gang.node}"
            )
            for target in gang.push:
                keys, _ = notices.setdefault((target.host_id, id(boxed)), ([], boxed))
                keys.extend(f"{prefix}/{k}" for k in target.keys)
        for (host_id, _), (keys, boxed) in notices.items():  # a lost host: one notice each
            notice = self.host_refs[host_id].fail_inbox(keys, boxed)
            notice.add_done_callback(_log_failed_notice)

    def plan_for(self, graph: Graph, owner: str = "") -> Plan:
        """The dispatch plan of ``graph`` (cached; see :mod:`atoll.runtime.control.planner`),
        for session ``owner``, which must own its slices (checked when planned:
        a released slice drops its plans)."""
        options = (bool(self.push), owner)
        cached = self.plans.get(graph, options)
        if cached is not None:
            return cached
        slices = {n.slice.slice_id for n in graph.nodes}
        placement = {s: self._placed(s, owner) for s in slices}
        made = plan(graph, placement, self.cluster_topology, self.host_addresses, bool(self.push))
        self.plans.put(graph, options, made)
        return made

    def _placed(self, slice_id: int, owner: str) -> Allocation:
        """A slice's allocation, if ``owner`` may use it; a negative id pins a
        batch's call to one physical device, as ``run`` does (runtime/client/batching.py)."""
        device = device_of_slice(slice_id)
        if device is None:
            return check_slice(self.resources.get(slice_id), owner)
        return Allocation(slice_id, (device,), self.cluster_topology.device(device).island, owner)

    @endpoint
    def timeline(self, record: bool) -> list[dict[str, Any]]:
        """Switch this process's timeline recorder on or off; what it held
        (the islands' dispatches, ``devices/timeline.py``)."""
        return timeline.RECORDER.switch(record)

    @endpoint
    async def islands_load(self) -> list[dict[str, Any]]:
        """Each island's counters (``IslandScheduler.load``), in island order."""
        answers = [ref.load() for _, ref in sorted(self.schedulers.items())]
        return [await answer for answer in answers]

    @endpoint
    def plan_stats(self) -> dict[str, int]:
        """Plan counters, for tests and tools: plans held, cache hits and
        misses; ``compiled``: plans held that run compiled as a whole (the
        others run one compiled plan per gang); ``compiled_runs``: compiled
        runs sent, a plan run gang by gang counting one per gang
        (``IslandScheduler.load`` counts those its policy held back)."""
        compiled = sum(isinstance(c, CompiledPlan) for c in self._compiled.values())
        return {
            "plans": len(self.plans),
            "hits": self.plans.hits,
            "misses": self.plans.misses,
            "compiled": compiled,
            "compiled_runs": self._compiled_runs,
        }

    @endpoint
    async def set_tenant(
        self,
        owner: str,
        weight: float | None = None,
        max_gangs: int | None = DEFAULT_MAX_GANGS,
        max_bytes: int | None = None,
        quotas: bool = True,
    ) -> dict[str, Any]:
        """Register session ``owner`` or change its weight (None: keep it) and,
        with ``quotas``, its quotas (queued gangs; store bytes, per host)."""
        if weight is not None:
            changed = weight != self.tenants.weight(owner)
            self.tenants.set_weight(owner, weight)
            if changed:  # (its hosts order its leased runs by the weight they were told)
                self.leases.take_back_all(owner=owner).add_done_callback(_log_lease_failed)
        if quotas:
            held = self.tenants.byte_quota(owner)  # hosts know it (None: they have none)
            self.tenants.set_quotas(owner, max_gangs, max_bytes)
            if max_bytes != held:
                for done in [host.set_quota(owner, max_bytes) for host in self.host_refs]:
                    await _unless_lost(done)
        return self.tenants.rows()[owner]

    @endpoint
    def metrics(self) -> dict[str, Any]:
        """Runs submitted and taken, their dispatch times and failures, and
        this process's message counters (``runtime/control/metrics.py``)."""
        return controller_metrics(self.runs)

    @endpoint
    async def tenant_usage(self) -> dict[str, dict[str, Any]]:
        """Per owner: its weight and quotas here, the islands' queued and
        running gangs, and the hosts' bytes, buffers and device seconds."""
        islands = [ref.tenants() for ref in self.schedulers.values()]
        hosts = [ref.owner_usage() for ref in self.host_refs]
        by_island = [await answer for answer in islands]
        live = [usage for h in hosts if (usage := await _unless_lost(h)) is not None]
        return merge_usage(self.tenants.rows(), by_island, live)


@dataclass(eq=False)
class _CompiledRun:
    """What the controller keeps of one run of a compiled plan while it goes."""

    compiled: CompiledPlan
    inputs: list[Any]
    owner: str
    epoch: int
    outs: list[Promise[BufferHandle]]
    done: Promise[None]  # every device's report settled (its gangs took their inputs)
    earlier: dict[int, tuple[int, PriorOutput]]  # inputs the device that made them keeps
    reply: Reply | None = None  # a client's call its one device answers
    answered: bool = False  # ... and did (its report said so)
    made: bool = False  # every output is made by the run (none is one of its inputs)


_CALLS_KEPT = 1024  # one-node graphs of low-level calls kept (by shape)
# what the controller's promise of an output holds once its device answered the client
# (one instance for all: never raised, only a marker for whoever looks)
_SENT_TO_CLIENT = AtollError("this output went from its device to the client that ran it")


def _together(
    outs: Sequence[Promise[BufferHandle]], done: Promise[None], run: _CompiledRun | None = None
) -> Promise[list[BufferHandle | Promise[BufferHandle]] | str]:
    """One answer for a run: every output (a handle, or its failed promise),
    once all of them and ``done`` settled; ``DIRECT`` if ``run``'s device
    sent them to the client itself."""

    def whole() -> list[BufferHandle | Promise[BufferHandle]] | str:
        if run is not None and run.answered:
            return runlane.DIRECT
        return [out.result() if out.exception() is None else out for out in outs]

    if run is not None and run.made:  # its outputs settle first, from its reports
        return when_settled([done], whole)
    return when_settled([*outs, done], whole)


def _hand_out(
    sent: Sequence[Promise[dict[int, Promise[RunReport]]]],
    answer: Promise[list[Taken]],
) -> None:
    """An island's answer to a batch of runs, run by run (its failure, to each)."""
    error = answer.exception()
    if error is not None:
        for each in sent:
            each.set_exception(error)
        return
    for each, taken in zip(sent, answer.result(), strict=True):
        if isinstance(taken, Promise):
            forward(taken, each)
        else:
            each.set_result(taken)


def _reports_of(
    parts: Sequence[CompiledPlan], sent: Sequence[Promise[dict[int, Promise[RunReport]]]]
) -> dict[int, Promise[RunReport]]:
    """The reports of a run sent in parts, by device: a part its island did
    not take fails its devices' reports with why."""
    reports: dict[int, Promise[RunReport]] = {}
    for part, answer in zip(parts, sent, strict=True):
        error = answer.exception()
        if error is None:
            reports.update(answer.result())
        else:
            reports.update((device, failed(error)) for device in part.programs)
    return reports


def _output(node: int, index: int, out: Promise[BufferHandle], report: Promise[RunReport]) -> None:
    """Settle ``out`` with output ``index`` of ``node``, out of its device's
    run report (or with why there is none)."""
    error = report.exception()
    if error is None:
        try:
            out.set_result(report.result().output(node, index))
            return
        except Exception as exc:  # the gang that makes it failed
            error = exc
    out.set_exception(error)


async def _unless_lost(answer: Promise[Any]) -> Any:
    """``answer``'s value, or None if its host is gone: a lost host holds
    nothing to limit or count, and must not fail what asks every host."""
    try:
        return await answer
    except (HostLost, ActorStopped):
        return None


def _settle_with(answer: Promise[Any], fn: Callable[..., Any], *args: Any) -> None:
    """Settle ``answer`` with what ``fn(*args)`` gives (a promise's value
    later), or its error."""
    try:
        forward(as_promise(fn(*args)), answer)
    except Exception as exc:
        answer.set_exception(exc)


def _default_axes(rank: int) -> tuple[str, ...]:
    return ("x", "y", "z", "w")[:rank] if rank <= 4 else tuple(f"a{i}" for i in range(rank))


def _free_after(value: Promise[BufferHandle], readers: Sequence[Promise[Any]]) -> None:
    """Drop the value's reference once every reader has run (or failed) and
    the value itself settled (a reader fed by a push may finish first)."""

    def free(_: Promise[None]) -> None:
        if value.exception() is None:
            handle = value.result()
            handle.host.free(handle.id)

    all_settled([*readers, value]).add_done_callback(free)


def spawn_control(
    spawn: Callable[..., ActorRef[Any]],
    topology: Topology,
    devices: Sequence[ActorRef[Device]],
    hosts: Sequence[ActorRef[Host]],
    policies: Mapping[int, str],
    wire: Callable[[str], Wire | None] = lambda sender: None,
    push: bool | None = None,
    spare_hosts: Sequence[int] = (),
    token: bytes = b"",
    interface: str = "",
) -> ActorRef[Controller]:
    """Spawn one island scheduler per island and the controller over them.

    ``spawn`` is ``system.spawn`` or an actor's ``ctx.spawn``; ``wire(sender)``
    gives each sender's modelled link (None: direct calls). With the
    cluster's ``token``, islands send runs to host processes by run lane,
    and clients in other processes send theirs by call lane, taken on
    ``interface`` (``runtime/runlanes.py``; ``ATOLL_RUN_LANES=0``: all by
    call, for A/B runs).
    """
    by_lane = bool(token) and lanes_on()

    def lanes(island: int) -> tuple[bytes, dict[int, int]] | None:
        hosts = {d.id: d.host for d in topology.devices if d.island == island}
        return (token, hosts) if by_lane else None

    schedulers = {
        island: spawn(
            IslandScheduler,
            island,
            policies[island],
            {d.id: devices[d.id] for d in topology.devices if d.island == island},
            wire(f"island{island}"),
            dict(enumerate(hosts)),
            lanes(island),
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
        spare_hosts,
        (token, interface) if by_lane and interface else None,
        {island for island, name in policies.items() if leases_shared(name)},
        name="controller",
    )
    return controller
