"""A whole-graph CP-SAT solve on a spare core, beside the solver's windows.

The windows (:mod:`._lns`) are a local search: each step re-solves the nodes
of a few adjacent chiplets. Some graphs need the whole layout to shift at
once. On a 24 + 24-layer encoder-decoder at 16 chiplets (hop limit 4) the
best partition puts the encoder's output on one chiplet, the key and value
projections of the late decoder layers four chiplets on, and the decoder
across five more; from the partition fine-tuning hands over (the decoder
squeezed onto half the module, five chiplets nearly idle) no window of any
size found a step in 2 deterministic seconds, while CP-SAT on the whole
graph, started from it, reached the optimum and proved it in about 90.

So RL as shipped starts that whole solve in a thread when the windows
begin, if the process may run on more than one core, and stops it when
the windows end. The windows poll it after each step: a partition it found
that beats the one they walk from is evaluated (one evaluation of the
budget) and they go on from it. CP-SAT releases the interpreter's lock
while it searches, so the thread costs the windows little more than a core
they were not using.

What is asynchronous here: the solve runs in its own thread; :meth:`found`
and :meth:`stop` are called from the search's thread and take a lock for
the partition the solver's callback last recorded. The thread's results
depend on how far it got in wall time, so a search with it is not
repeatable run to run (``rl_background=False`` turns it off).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np

from ._cost import IntArray
from ._graph import OpGraph
from ._hardware import Chiplets
from ._solver import bottleneck_model

__all__ = ["BackgroundSolve", "spare_cores"]

MAX_WORKERS = 8  # CP-SAT's portfolio gains little past this many workers
STOP_POLL_S = 0.05  # how often stop() asks again while the solve has not ended
BACKSTOP_S = 3600.0  # the solve's own limit, should the search never stop it

_log = logging.getLogger(__name__)


def spare_cores() -> int:
    """Cores this process may run on beyond the one the search uses (0 on one core)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    return max(cores - 1, 0)


class BackgroundSolve:
    """CP-SAT on the whole graph in a thread, started from ``hint`` (a valid
    partition), minimizing the slowest stage with ``workers`` workers.

    :meth:`found` returns the best partition the solver has reported so far,
    with its slowest stage in seconds, or None before the first; :meth:`stop`
    ends the search and waits for the thread; :attr:`optimal`
    says whether CP-SAT proved it. As a context manager it starts the thread
    on entry and stops it on exit, so the thread never outlives the search."""

    def __init__(
        self, graph: OpGraph, chiplets: Chiplets, hint: IntArray, seed: int = 0, workers: int = 1
    ) -> None:
        self.graph, self.chiplets = graph, chiplets
        self._hint = np.array(hint, dtype=np.int64)
        self._seed, self._workers = seed, max(1, min(workers, MAX_WORKERS))
        self._lock = threading.Lock()
        self._best: tuple[IntArray, float] | None = None
        self._optimal = False
        self._stopped = threading.Event()
        self._solver: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="atoll-partition-solve", daemon=True)

    def __enter__(self) -> BackgroundSolve:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def found(self) -> tuple[IntArray, float] | None:
        """The best partition found so far and its slowest stage in seconds (the
        solver's measure, each node's time rounded), or None."""
        with self._lock:
            return self._best

    @property
    def optimal(self) -> bool:
        """Whether CP-SAT proved the partition :meth:`found` returns optimal."""
        with self._lock:
            return self._optimal

    @property
    def done(self) -> bool:
        """Whether the solve has ended (proved, stopped, or failed)."""
        return not self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` for the solve to end on its own (proved, or
        its backstop); returns whether it has ended."""
        self._thread.join(timeout_s)
        return self.done

    def stop(self) -> None:
        """Stop the solve (at once: CP-SAT checks the flag often) and wait for it."""
        self._stopped.set()
        while self._thread.is_alive():  # a stop asked before CP-SAT starts is lost: ask again
            with self._lock:
                solver = self._solver
            if solver is not None:
                solver.stop_search()
            self._thread.join(STOP_POLL_S)
        if self._error is not None:
            _log.warning("the whole-graph solve beside the windows failed: %r", self._error)
            self._error = None

    def _run(self) -> None:
        from ortools.sat.python import cp_model

        try:
            bm = bottleneck_model(self.graph, self.chiplets, self._hint)
            bm.sm.model.minimize(bm.bottleneck)
            solver = cp_model.CpSolver()
            solver.parameters.num_workers = self._workers
            solver.parameters.random_seed = self._seed
            solver.parameters.max_time_in_seconds = BACKSTOP_S
            with self._lock:
                if self._stopped.is_set():
                    return
                self._solver = solver
            status = solver.solve(bm.sm.model, _watch(self, bm.sm.ge, bm.bottleneck, bm.unit))
        except Exception as error:  # the search goes on without it (stop() logs it)
            self._error = error
            return
        if status == cp_model.OPTIMAL:
            with self._lock:
                self._optimal = self._best is not None

    def _record(self, assignment: IntArray, slowest_s: float) -> None:
        with self._lock:
            if self._best is None or slowest_s < self._best[1]:
                self._best = (assignment, slowest_s)


def _watch(owner: BackgroundSolve, ge: list[list[Any]], bottleneck: Any, unit: float) -> Any:
    """CP-SAT's solution callback: records each improving solution's chips in
    ``owner`` (ortools is imported only when a solve runs)."""
    from ortools.sat.python import cp_model

    class Watch(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            value = self.value
            chips = [sum(v if isinstance(v, int) else int(value(v)) for v in row[1:]) for row in ge]
            owner._record(np.array(chips, dtype=np.int64), value(bottleneck) * unit)

    return Watch()
