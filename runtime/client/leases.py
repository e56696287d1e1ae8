"""A client's side of leases: its runs of one device sent straight to the device's host.

The controller may lease a device to a session (to it alone, or beside
other sessions' leases under the share policy: ``runtime/control/leases.py``).
:class:`ClientLeases` asks for a lease once a run of one shape (a
low-level call: computation, device, its inputs' kinds; or a graph whose
plan is one program on one device), of one owner, went through the
controller ``ASK_AFTER`` times, and then sends such runs down its own lane
to the device's host (``devices/_lease.py``), which answers with the
device's run report. What goes that way: a run whose
every input is a value, a handle, or the promise of an output the same
lease is making (the device takes it from what it keeps of that run, as
``PriorOutput``); at most the lease's ``window`` runs at once. Everything
else goes through the controller, as before.

A lease ends without a word to the client: its host refuses the next run
under it with ``LeaseEnded``, before that run started, and the client sends
that run (and every later one the host refuses) through the controller,
asks again no sooner than ``RETRY_S`` later, and goes on.

What is asynchronous: asking for a lease is a Cap'n Proto call whose
answer comes later (the runs meanwhile go through the controller); a
leased run's answer is a promise settled from the host's report.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...devices import BufferHandle, Computation, RunReport
from ...devices._lease import LeaseEnded
from ...devices._plan import PriorOutput
from ...devices._runlane import LEASED
from ...kernel import Promise, failed, forward, log_failure
from ...kernel.config import settings
from ...kernel.lowlevel import counts
from ..calls import input_kinds
from ..graph import Graph

if TYPE_CHECKING:
    from ...kernel import ActorRef
    from ..control.controller import Controller
    from ..control.leases import LeaseGrant
    from ..runlanes import Caller
    from ..topology import Topology

__all__ = ["ASK_AFTER", "RETRY_S", "ClientLeases", "Send"]

ASK_AFTER = 2  # calls of one shape through the controller before a lease is asked for
RETRY_S = 1.0  # after a refusal, or a lease's end, none is asked for that long
SHAPES_KEPT = 256  # call shapes remembered (the oldest go first)

Send = Callable[[str, list[tuple[str, int] | None]], Promise[Any]]
Ask = Callable[[], "Promise[LeaseGrant | None]"]

_log = logging.getLogger(__name__)
_log_refused = log_failure(_log, "asking for a lease", logging.DEBUG)


@dataclass(eq=False)
class _Leased:
    """A run sent under a lease, until its host answered it or it went
    through the controller (refused)."""

    # how it goes through the controller; None once settled (it holds the
    # run's inputs, which a chain's later outputs must not keep alive)
    again: Callable[[], Promise[Any]] | None
    answer: Promise[Any]
    settled: bool = False


@dataclass(eq=False)
class _Asked:
    """What the client knows of one call shape's lease."""

    calls: int = 0  # through the controller, since the last ask
    grant: LeaseGrant | None = None
    asking: bool = False
    not_before: float = 0.0


class ClientLeases:
    """One client's leases, by call shape (see the module docstring).

    ``lanes(host_id)``: the client's lane to that host process, if up.
    """

    def __init__(
        self,
        controller: ActorRef[Controller],
        topology: Topology,
        lanes: Callable[[int], Caller | None],
    ) -> None:
        self._controller = controller
        self._topology = topology
        self._lanes = lanes
        self._shapes: dict[Hashable, _Asked] = {}  # by call shape, or graph, and owner
        self._epochs: dict[int, itertools.count[int]] = {}  # by lease id
        self._in_flight: dict[int, int] = {}  # by lease id
        self._lane_of: dict[int, Caller] = {}  # by lease id: the lane its runs went down
        # outputs of leased runs: (lease id, epoch, node, index, the run)
        self._made: weakref.WeakKeyDictionary[Promise[Any], tuple[int, int, int, int, _Leased]] = (
            weakref.WeakKeyDictionary()
        )
        self._unsettled: dict[int, deque[_Leased]] = {}  # by lease id, in the order sent
        self._over: set[int] = set()  # leases a host refused a run under (ended)
        # runs for the controller held back, in order, behind a leased run they
        # read (which may yet be refused, and go through the controller first)
        self._held: deque[tuple[Callable[[], Promise[Any]], Promise[Any], list[Any]]] = deque()
        self.sent = 0  # runs sent under a lease (for tests and benchmarks)
        self.refused = 0  # ... that their host refused (sent again through the controller)

    def sync(self) -> list[Promise[Any]]:
        """Promises that settle once the runs sent under a lease so far
        reached their devices (or were refused there): a Cap'n Proto call
        that must come after them (a slice's release) waits for these."""
        lanes = {id(lane): lane for i, lane in self._lane_of.items() if self._in_flight.get(i)}
        return [p for p in (lane.sync() for lane in lanes.values()) if p is not None]

    def granted(self) -> int:
        """How many call shapes go under a lease now."""
        return sum(asked.grant is not None for asked in self._shapes.values())

    def route(
        self,
        computation: Computation,
        device: int,
        inputs: Sequence[Any],
        owner: str,
        output: Promise[BufferHandle],
        controller: Send,
    ) -> Send:
        """How to send one low-level call: under its shape's lease, when it
        has one and the call can go so, else ``controller`` (asking for a
        lease when the shape has come often enough)."""
        kinds = input_kinds(inputs)
        asked = self._asked((computation, device, owner, kinds))
        if asked.grant is None:
            host = self._topology.device(device).host
            ask = functools.partial(self._controller.lease, computation, device, kinds, owner)
            self._count(asked, ask, host)
            return self._in_order(controller, inputs)
        return self._route(asked.grant, inputs, [output], controller)

    def route_graph(
        self,
        graph: Graph,
        inputs: Sequence[Any],
        owner: str,
        outputs: Sequence[Promise[BufferHandle]],
        controller: Send,
    ) -> Send:
        """How to send one run of ``graph``, as :meth:`route` says for a call
        (a graph whose plan is one program on one device may have a lease)."""
        asked = self._asked((graph, owner))
        if asked.calls == 0 and asked.grant is None and not _on_one_device(graph):
            asked.not_before = math.inf  # (its plan spans devices: never asked for)
        if asked.grant is None:
            self._count(asked, functools.partial(self._controller.lease_graph, graph, owner))
            return self._in_order(controller, inputs)
        return self._route(asked.grant, inputs, outputs, controller)

    def _asked(self, key: Hashable) -> _Asked:
        asked = self._shapes.get(key)
        if asked is None:
            asked = self._shapes[key] = _Asked()
            while len(self._shapes) > SHAPES_KEPT:
                del self._shapes[next(iter(self._shapes))]
        return asked

    def _count(self, asked: _Asked, ask: Ask, host: int | None = None) -> None:
        """One more run of a shape with no lease: ask for one (in the
        background) once it came often enough, if it is time to and its
        host's lane is up (``host``: None when not known before)."""
        asked.calls += 1
        if asked.calls < ASK_AFTER or asked.asking or time.monotonic() < asked.not_before:
            return
        if not settings().leases or (host is not None and self._lanes(host) is None):
            return
        try:
            asking = ask()
        except Exception:  # (not a run's business: it goes through the controller)
            _log.debug("asking for a lease", exc_info=True)
            asked.not_before = time.monotonic() + RETRY_S
            return
        asked.asking = True
        asking.add_done_callback(functools.partial(self._granted, asked))

    def _route(
        self,
        grant: LeaseGrant,
        inputs: Sequence[Any],
        outputs: Sequence[Promise[BufferHandle]],
        controller: Send,
    ) -> Send:
        lane = self._lanes(grant.host)
        if lane is None or self._in_flight.get(grant.lease_id, 0) >= grant.window:
            return self._in_order(controller, inputs)
        given = self._given(grant, inputs)
        if given is None or len(outputs) != len(grant.outputs):
            return self._in_order(controller, inputs)
        return functools.partial(self._send, grant, given, list(outputs), lane, controller)

    def _in_order(self, controller: Send, inputs: Sequence[Any]) -> Send:
        """``controller``, unless the run reads the output of a leased run
        not answered yet (or runs wait so already): its host may yet refuse
        that one, which then goes through the controller, and it must get
        there first (a run that reads a promise the controller has not seen
        made holds its device's later calls back at the island). Held back,
        in order, until then."""
        if not self._held and not self._blocked(inputs):
            return controller
        return functools.partial(self._hold, controller, list(inputs))

    def _blocked(self, inputs: Sequence[Any]) -> bool:
        """Whether an input is the output of a leased run not settled yet."""
        for value in inputs:
            if isinstance(value, Promise) and not value.done():
                made = self._made.get(value)
                if made is not None and not made[4].settled:
                    return True
        return False

    def _hold(
        self,
        controller: Send,
        inputs: list[Any],
        tag: str,
        sources: list[tuple[str, int] | None],
    ) -> Promise[Any]:
        answer: Promise[Any] = Promise("held back")
        self._held.append((functools.partial(controller, tag, sources), answer, inputs))
        self._release()
        return answer

    def _release(self) -> None:
        """Send the runs held back whose leased inputs settled, in order."""
        while self._held:
            send, answer, inputs = self._held[0]
            if self._blocked(inputs):
                return
            self._held.popleft()
            _forward_sent(send, answer)

    def _given(self, grant: LeaseGrant, inputs: Sequence[Any]) -> list[Any] | None:
        """The device program's inputs, as a leased run sends them; None
        when one cannot go that way (a promise of something else, unsettled)."""
        given = []
        for index in grant.inputs:
            value = inputs[index]
            if isinstance(value, Promise):
                if value.done():
                    if value.exception() is not None:
                        return None  # (the controller says how it failed, as ever)
                    value = value.result()
                else:
                    made = self._made.get(value)
                    if made is None or made[0] != grant.lease_id:
                        return None
                    value = PriorOutput(*made[1:4])
            given.append(value)
        return given

    def _send(
        self,
        grant: LeaseGrant,
        given: list[Any],
        outputs: list[Promise[BufferHandle]],
        lane: Caller,
        controller: Send,
        tag: str,
        sources: list[tuple[str, int] | None],
    ) -> Promise[Any]:
        """Send one run under ``grant``; the promise of its outputs (a list,
        as the controller's answer is)."""
        counter = self._epochs.get(grant.lease_id)
        if counter is None:
            counter = self._epochs[grant.lease_id] = itertools.count(grant.first_epoch)
        epoch = next(counter)
        again = functools.partial(controller, tag, sources)
        args = (grant.lease_id, grant.plan_id, epoch, given)
        report: Promise[RunReport] = lane.call(LEASED, grant.device, args, _no_lane)
        self._in_flight[grant.lease_id] = self._in_flight.get(grant.lease_id, 0) + 1
        self._lane_of[grant.lease_id] = lane
        self.sent += 1
        counts["runs_leased"] += 1
        leased = _Leased(again, Promise("leased run"))
        self._unsettled.setdefault(grant.lease_id, deque()).append(leased)
        for output, (node, index) in zip(outputs, grant.outputs, strict=True):
            self._made[output] = (grant.lease_id, epoch, node, index, leased)
        report.add_done_callback(functools.partial(self._answered, grant, leased))
        return leased.answer

    def _answered(self, grant: LeaseGrant, leased: _Leased, report: Promise[RunReport]) -> None:
        """A leased run's report came: its outputs. Or the lease had ended:
        this run and every later one under it (all refused, or about to be)
        go through the controller now, in the order they were sent."""
        lease_id = grant.lease_id
        self._in_flight[lease_id] -= 1
        error = report.exception()
        if leased.settled:  # refused, and sent again with an earlier one
            pass
        elif isinstance(error, LeaseEnded):
            self._ended(lease_id)
            later = list(self._unsettled.get(lease_id, ()))
            for run in later[later.index(leased) :]:
                if not run.settled and run.again is not None:
                    run.settled = True
                    self.refused += 1
                    again, run.again = run.again, None
                    _forward_sent(again, run.answer)
        else:
            leased.settled, leased.again = True, None
            if error is not None:
                leased.answer.set_exception(error)
            else:
                leased.answer.set_result([_output(report.result(), *o) for o in grant.outputs])
        unsettled = self._unsettled.get(lease_id)
        while unsettled and unsettled[0].settled:
            unsettled.popleft()
        if lease_id in self._over and not self._in_flight[lease_id] and not unsettled:
            self._forget(lease_id)
        if self._held:
            self._release()

    def _forget(self, lease_id: int) -> None:
        """An ended lease's last run was answered: what was kept of it goes
        (a client whose leases are taken back and granted again keeps
        nothing of the old ones)."""
        self._over.discard(lease_id)
        for kept in (self._epochs, self._in_flight, self._lane_of, self._unsettled):
            kept.pop(lease_id, None)

    def _ended(self, lease_id: int) -> None:
        """Lease ``lease_id`` ended: its shapes go through the controller."""
        self._over.add(lease_id)
        later = time.monotonic() + RETRY_S
        for asked in self._shapes.values():
            if asked.grant is not None and asked.grant.lease_id == lease_id:
                asked.grant, asked.calls, asked.not_before = None, 0, later

    def _granted(self, asked: _Asked, answer: Promise[LeaseGrant | None]) -> None:
        asked.asking = False
        asked.calls = 0
        grant = answer.result() if answer.exception() is None else None
        if answer.exception() is not None:
            _log_refused(answer)
        if grant is None:
            asked.not_before = time.monotonic() + RETRY_S
        asked.grant = grant


def _forward_sent(send: Callable[[], Promise[Any]], answer: Promise[Any]) -> None:
    """``answer`` follows what ``send()`` sends; fails with why if it sent nothing."""
    try:
        forward(send(), answer)
    except Exception as exc:
        answer.set_exception(exc)


def _no_lane() -> Promise[Any]:
    """A leased run whose lane went down before it left: it goes through the
    controller (as one its host refused)."""
    return failed(LeaseEnded("the lane to the lease's host is down"))


def _on_one_device(graph: Graph) -> bool:
    """Whether every node of ``graph`` is on one slice of one device."""
    slices = {node.slice.slice_id for node in graph.nodes}
    return len(slices) == 1 and graph.nodes[0].slice.size == 1


def _output(report: RunReport, node: int, index: int) -> BufferHandle | Promise[BufferHandle]:
    """Output ``index`` of ``node`` in a leased run's report; the failed
    promise of one whose gang failed (as the controller's answer has it)."""
    try:
        handle: BufferHandle = report.output(node, index)
    except Exception as exc:
        return failed(exc)
    return handle
