"""The solver's large-neighbourhood polish: RL as shipped's last phase.

Fine-tuning hands over the best partition it found. Each step here frees the
nodes on a window of a few adjacent chiplets next to the slowest stage, pins
every other node where it is, and lets CP-SAT re-solve the bottleneck over
the freed nodes for a short, fixed *deterministic* time, starting from the
current partition (so a step never gets worse, and a step gives the same
result however busy the machine is). A window of 3 or 4 chiplets of a
160-node graph is a problem CP-SAT usually proves optimal in a fraction of
a second, where the whole graph at 8 chiplets is not proved in 10 minutes.

A step's second objective is the slowest of the window's stages and their
neighbours (``focus``), and the walk moves on when the stage times improve
slowest first, then the next slowest (:func:`_faster`): so where two stages
far apart tie for the slowest, one window shortens one of them (the
throughput stays), and the next window the other.

Where the slack lies further off than a window of 4 chiplets reaches, so
that the slowest stage's neighbours are nearly as slow, the first windows
(on 9 chiplets or more, :data:`BAND_CHIPLETS`) come with *bands*
(:func:`bands`): the chiplets from the slowest stage to the nearest one
faster than the mean, with only the nodes at each boundary between two of
them free, so that one step passes load along the whole span. On a
1,000-op WaveNet on a ring of 32 the windows alone ended 11% short of the
best known, nine chiplets 11 to 85% faster than the slowest and the other
23 within 7% of it; with bands (2026-12-07) 31 of 38 band steps gained,
and it ended 14% higher, 0.5% short of the best known made with them.
The next windows (of 4 chiplets) come with *wide* bands: from the stage
behind the slowest, so that both its boundaries are free, to the nearest
stage faster than the mean and to the fastest. On a 1,000-op GRU on a
ring of 16 the bands alone stuck with one chiplet 70% faster than the
rest, beyond a nearer one 17% faster, and a stage tied for the slowest
pinned behind the slowest.

While some stage is idle (faster than :data:`IDLE` of the slowest), every
:data:`RESPLIT_EVERY` window steps and when the first windows are stuck,
the walk *re-splits* its partition (:mod:`._resplit`, one evaluation): an
annealed walk over the cuts of the partition's own order, which passes load
along every boundary a node at a time, where a window or a band must free
all of them at once. What it finds, when faster, the windows go on from;
after one that finds nothing the steps to the next double. On the 1,000-op
GRU on the ring of 16 the windows and bands drained the last chiplet to
one node and stuck 5.1% short of the best known; with re-splits the plain
call ended 1.4 and 2.6% short (2026-12-08, seeds 0 and 1), and the GRU at
8, 5.3% short before at seed 1, 1.2%. Re-splits with no stage idle as well
did better on both rings, 0.9 and 1.0%, but ended the GRU at 8 6.3% short.

Every step is one evaluation of the search's budget. When every window next
to the slowest stage has been tried since the last improvement, the windows
grow by one chiplet; a window of every chiplet is the whole problem. Once
that is tried too, the partition is a local optimum of every window at this
much solver time: the windows start again at 3 chiplets with twice the time
each, up to 2 deterministic seconds (back to 0.5 after an improvement),
skipping those CP-SAT proved optimal, which more time cannot improve. A step
whose CP-SAT run returns nothing in its time (a model too large to take
even the current partition, which it is given whole) counts all the same,
and from then on windows with as many free nodes are skipped at that time:
on a 1,000-op GRU at 8 chiplets 70 such steps took 35 s of a 304 s call,
uncounted, before 2026-12-07.
When no window improves even at 2 seconds, the rest of the budget goes to
kicks (an iterated local search): a few random moves off the best
partition's slowest stage, one evaluation, then a short descent from there
with windows of 3 and 4 chiplets at 0.5 seconds; every kick starts again
from the best. Beside all of it a whole-graph solve may run on a spare
core (:mod:`._background`): after each step the windows take what it found
when that is faster than where they stand. The polish stops early, leaving
the rest of the budget, only when CP-SAT proves the whole problem optimal
(in a window of every chiplet, or in that solve).
The plain call's windows run on a clock (:class:`Overtime`): they end at a
time that grows with the graph, and until then its default budget may
stretch while they still gain, one evaluation past it at a time. An
evaluation's cost varies by graph and topology (a window step of a
1,000-op WaveNet on a ring of 32 took 0.4 s on average, of a 1,000-op GRU
on a ring of 16 0.8 to 3 s), so a count alone ended some searches while
they still gained fast, with time to spare, and ran others well past it.
Each step is one blocking CP-SAT call on the caller's thread; the solve
beside them runs in a thread of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from ._background import BackgroundSolve
from ._baselines import Stall, Tracker, _bottleneck_neighbour
from ._cost import IntArray, stage_times
from ._resplit import resplit
from ._solver import solver_step

__all__ = [
    "BAND",
    "BAND_CHIPLETS",
    "BAND_SIDE",
    "IDLE",
    "MAX_WINDOW_S",
    "RESPLIT_EVERY",
    "WINDOW_S",
    "Overtime",
    "bands",
    "chiplets_of",
    "freed",
    "lns_polish",
    "windows",
]

WINDOW_S = 0.5  # deterministic seconds of CP-SAT per window
MAX_WINDOW_S = 2.0  # doubled up to this when every window is stuck
FIRST_WINDOW = 3  # chiplets freed by the first windows
KICK = (2, 6)  # the fewest and most random moves of a kick
BAND = -1  # a band's key is (BAND, first chiplet, last chiplet); a window's, its chiplets
# the fewest chiplets given bands: on 8, a window of 4 is half the chain, the growing windows
# reach any slack, and with bands a 1,000-op GRU ended 1.2 and 1.5% lower (seeds 0 and 1)
BAND_CHIPLETS = 9
# the fewest nodes a band frees each side of a boundary: a band over 30 chiplets of a
# WaveNet on a ring of 32 freed one a side, and its walk stuck, one chiplet 73% faster
BAND_SIDE = 3
# window steps between re-splits (:func:`._resplit.resplit`): on a 1,000-op GRU on a ring
# of 16 (seed 0, 300 evaluations from the handover, idle stages or not) re-splits only when
# the first windows were stuck ended at 8,772.2; every 15 window steps too, at 8,885.4
RESPLIT_EVERY = 15
IDLE = 0.75  # a stage faster than this share of the slowest is idle: re-splits only then


@dataclass(frozen=True)
class Overtime:
    """The plain call's clock on its windows: they end once the search (from its
    tracker's start) has run ``until_s`` seconds, within the budget or past it;
    past it, evaluations are granted one at a time (:meth:`_Walk.more`) while
    the windows' best has not stalled (:class:`._baselines.Stall`, the rule
    fine-tuning ends on, with ``patience``) and that time is not up."""

    until_s: float
    patience: int

    def expired(self, tracker: Tracker) -> bool:
        """Whether ``tracker``'s search has run its ``until_s`` seconds."""
        return time.perf_counter() - tracker.started >= self.until_s

    def grants(self, tracker: Tracker, stall: Stall) -> bool:
        """Whether ``tracker``, on its budget's last evaluation, gets one more."""
        return not self.expired(tracker) and not stall.stalled()


def windows(count: int, slow: int, size: int, ring: bool = False) -> list[tuple[int, ...]]:
    """Every window of ``size`` adjacent chiplets (clipped to ``count``) that holds
    the slowest stage ``slow`` or a neighbour of it, as a tuple of chiplets:
    only those can make the slowest stage faster (a neighbour's nodes set the
    traffic on its links). On a ``ring`` windows and neighbours wrap round."""
    size = min(size, count)
    if ring and size < count:
        near = {(slow + d) % count for d in (-1, 0, 1)}
        spans = [tuple((lo + j) % count for j in range(size)) for lo in range(count)]
        return [w for w in spans if near & set(w)]
    return [
        tuple(range(lo, lo + size))
        for lo in range(count - size + 1)
        if lo <= slow + 1 and lo + size - 1 >= slow - 1
    ]


def bands(times: NDArray[np.float64], slow: int, wide: bool = False) -> list[tuple[int, ...]]:
    """The bands of the slowest stage ``slow`` (see :func:`freed`): in each
    direction along the chiplets' order (a ring's too: it does not wrap, as the
    flow does not), the span from it to the nearest stage faster than the
    mean. ``wide``: from the stage behind it (so that both its boundaries
    are free), to that stage and to the fastest stage that way. Each only
    where that stage is too far for a window of :data:`FIRST_WINDOW` + 1
    chiplets to hold both. A window can only move load between neighbours
    of the slowest stage, all of them nearly as slow where the slack is far
    off; the nearest slack may be too little, where the most lies at the
    chain's end; and a stage tied for the slowest behind it, pinned, can
    hold the throughput where it is."""
    out: list[tuple[int, ...]] = []
    mean, count = float(times.mean()), len(times)
    for step in (-1, 1):
        side = list(range(slow + step, count if step > 0 else -1, step))
        ends = [k for k in side if times[k] < mean][:1]
        if wide and side:
            ends = list(dict.fromkeys([*ends, side[int(np.argmin(times[side]))]]))
        back = min(max(slow - step, 0), count - 1) if wide else slow
        for k in ends:
            if abs(k - slow) > FIRST_WINDOW:
                out.append((BAND, min(back, k), max(back, k)))
    return out


def freed(key: tuple[int, ...], current: IntArray, free: int) -> NDArray[np.bool_]:
    """The nodes a step on ``key`` frees: a window's, every node on its chiplets;
    a band's, at each boundary between two of its chiplets, the last nodes (in
    the graph's topological order) of the one and the first of the other,
    about ``free`` in all, and at least :data:`BAND_SIDE` a side. The rest
    stay pinned, so those can only pass load along the band, a few nodes a
    boundary, from the slowest stage to slack."""
    if key[0] != BAND:
        return np.isin(current, key)
    lo, hi = key[1], key[2]
    per_side = max(BAND_SIDE, free // (2 * (hi - lo)))
    out = np.zeros(len(current), dtype=bool)
    for chip in range(lo, hi + 1):
        on = np.flatnonzero(current == chip)
        if chip < hi:
            out[on[-per_side:]] = True
        if chip > lo:
            out[on[:per_side]] = True
    return out


def chiplets_of(key: tuple[int, ...]) -> tuple[int, ...]:
    """The chiplets a window or band (its ``key``) spans."""
    return tuple(range(key[1], key[2] + 1)) if key[0] == BAND else key


def lns_polish(
    tracker: Tracker,
    rng: np.random.Generator,
    seed: int = 0,
    window_s: float = WINDOW_S,
    background: BackgroundSolve | None = None,
    overtime: Overtime | None = None,
) -> None:
    """Improve ``tracker.best`` window by window until the budget is spent or the
    whole problem is proved optimal (see the module's docstring); with an
    ``overtime``, the spent budget grows while it grants more, and the
    polish ends when its time is up.

    First a descent from the best, with windows of every size and, when
    stuck, more time per window up to :data:`MAX_WINDOW_S`. Then, while
    budget is left, kicks: a few random moves off the best partition's
    slowest stage (:func:`._baselines._bottleneck_neighbour`, valid without
    a repair), one evaluation, and a short descent from there (windows of
    :data:`FIRST_WINDOW` and one more chiplet, at ``window_s``).

    With a ``background`` solve (:mod:`._background`, already started) every
    step first takes what it found, when that beats the partition the
    windows walk from; its last partition is taken when the windows end
    (one evaluation is kept back for it)."""
    count, walk = tracker.chiplets.count, _Walk(tracker, rng, seed, background, overtime)
    held = 1 if background is not None and tracker.left > 1 else 0
    tracker.held += held
    try:
        if _descend(walk, tracker.best, window_s, MAX_WINDOW_S, count):
            return
        while walk.more() and tracker.best is not None:
            kicked = tracker.best
            for _ in range(int(rng.integers(KICK[0], KICK[1] + 1))):
                kicked = _bottleneck_neighbour(tracker.graph, tracker.chiplets, kicked, rng)
            kicked, _ = tracker.evaluate(kicked)
            top = FIRST_WINDOW + 1
            if _descend(walk, kicked, window_s, window_s, top):
                return
    finally:
        tracker.held -= held
    if background is not None and tracker.left > 0 and tracker.best is not None:
        best = stage_times(tracker.graph, tracker.chiplets, tracker.best)
        background.stop()
        _taken(tracker, background, best)


def _proved(background: BackgroundSolve | None, times: NDArray[np.float64]) -> bool:
    """Whether the background solve has ended proving its partition optimal, and
    stage times ``times`` are no slower (nothing is left to find)."""
    if background is None or not background.done or not background.optimal:
        return False
    found = background.found()
    if found is None:
        return False
    best = stage_times(background.graph, background.chiplets, found[0])
    return float(times.max()) <= float(best.max()) * (1 + 1e-9)


def _taken(
    tracker: Tracker, background: BackgroundSolve | None, times: NDArray[np.float64]
) -> IntArray | None:
    """The background solve's partition, evaluated, when it is :func:`_faster`
    than stage times ``times`` under the cost model; else None. (The solver's
    own measure rounds each node's time, so it only says where to look.)"""
    found = background.found() if background is not None else None
    if found is None or tracker.left <= 0 or found[1] > float(times.max()) * (1 + 1e-3):
        return None
    if not _faster(stage_times(tracker.graph, tracker.chiplets, found[0]), times):
        return None
    taken, _ = tracker.evaluate(found[0])
    return taken


@dataclass
class _Walk:
    """What every descent of one polish shares: the search, its random draws, the
    solve beside it, and per step time the fewest free nodes of a window
    whose CP-SAT run returned nothing (``too_big``): windows with as many
    are skipped at that time, in this descent and the kicks' after it."""

    tracker: Tracker
    rng: np.random.Generator
    seed: int
    background: BackgroundSolve | None
    overtime: Overtime | None = None
    too_big: dict[float, int] = field(default_factory=dict)
    resplit_from: set[bytes] = field(default_factory=set)  # partitions already re-split
    steps: int = 0  # window steps since the last re-split
    every: int = RESPLIT_EVERY  # window steps between re-splits
    stall: Stall = field(init=False)  # the overtime's, counted from the polish's start
    granting: bool = True  # until the overtime's first refusal

    def __post_init__(self) -> None:
        self.stall = Stall(self.tracker, None if self.overtime is None else self.overtime.patience)

    def more(self) -> bool:
        """Whether another step may run: not once an overtime's time is up. An
        overtime is asked on the budget's last evaluation, and one it grants
        keeps one in hand; its first refusal ends its grants. So a progress bar
        sees its total only when the search ends (or is ended early)."""
        t, overtime = self.tracker, self.overtime
        if overtime is not None and overtime.expired(t):
            return False
        if t.left <= 1 and overtime is not None and self.granting:
            if overtime.grants(t, self.stall):
                t.budget = t.held + len(t.history) + 2
            else:
                self.granting = False
        return t.left > 0

    @property
    def band_nodes(self) -> int:
        """The nodes a band frees: as many as a first window holds on average."""
        return FIRST_WINDOW * len(self.tracker.graph) // self.tracker.chiplets.count

    def todo(
        self,
        current: IntArray,
        times: NDArray[np.float64],
        size: int,
        step_s: float,
        skip: set[tuple[int, ...]],
    ) -> list[tuple[int, ...]]:
        """The windows of ``size`` chiplets next to the slowest stage (with the
        first windows, on :data:`BAND_CHIPLETS` or more, its :func:`bands` too;
        with the next, its wide bands) not in ``skip`` and freeing few enough
        nodes (:func:`freed`) to try at ``step_s``."""
        chips, slow = self.tracker.chiplets, int(np.argmax(times))
        limit = self.too_big.get(step_s, len(current) + 1)
        keys = windows(chips.count, slow, size, chips.topology == "ring")
        if size in (FIRST_WINDOW, FIRST_WINDOW + 1) and chips.count >= BAND_CHIPLETS:
            keys += bands(times, slow, wide=size > FIRST_WINDOW)
        small = [k for k in keys if int(freed(k, current, self.band_nodes).sum()) < limit]
        return [k for k in small if k not in skip]

    def resplit_due(self, current: IntArray, times: NDArray[np.float64], stuck: bool) -> bool:
        """Whether to re-split ``current`` (stage times ``times``) now: while some
        stage is idle (:data:`IDLE`), every :attr:`every` window steps and when
        the first windows are ``stuck``; never twice the same partition."""
        due = stuck or self.steps >= self.every
        idle = float(times.min()) < IDLE * float(times.max())
        return due and idle and current.tobytes() not in self.resplit_from

    def resplit(self, current: IntArray, times: NDArray[np.float64]) -> IntArray | None:
        """A walk over the cuts of ``current``'s own order (:func:`._resplit.resplit`),
        one evaluation: its partition when that is :func:`_faster` than stage
        times ``times``, else None. The steps to the next one double after each
        that finds nothing, and return to :data:`RESPLIT_EVERY` after one that
        does."""
        t = self.tracker
        self.resplit_from.add(current.tobytes())
        self.steps = 0
        found = resplit(t.graph, t.chiplets, current, self.rng)
        if not _faster(stage_times(t.graph, t.chiplets, found), times):
            self.every *= 2
            t.evaluate(current)
            return None
        self.every = RESPLIT_EVERY
        self.resplit_from.add(found.tobytes())
        taken, _ = t.evaluate(found)
        return taken

    def found_nothing(self, current: IntArray, free: NDArray[np.bool_], step_s: float) -> None:
        """A step's run returned nothing: no step with as many ``free`` nodes at
        ``step_s`` from now on, and the step counts in the budget all the same."""
        count = int(free.sum())
        self.too_big[step_s] = min(self.too_big.get(step_s, count), count)
        self.tracker.evaluate(current)


def _descend(
    walk: _Walk, start: IntArray | None, window_s: float, max_s: float, max_size: int
) -> bool:
    """Window steps from ``start`` until no window of up to ``max_size`` chiplets
    improves it at up to ``max_s`` per window, or the budget is spent. Every
    step's partition is evaluated; the descent goes on from the last one that
    was :func:`_faster`, which may tie the best throughput. Returns whether
    CP-SAT proved the whole problem optimal."""
    tracker, background = walk.tracker, walk.background
    graph, chips, count = tracker.graph, tracker.chiplets, tracker.chiplets.count
    ring, top = chips.topology == "ring", min(max_size, count)
    size, step_s = min(FIRST_WINDOW, count), window_s
    tried, proved = set[tuple[int, ...]](), set[tuple[int, ...]]()  # since the last gain
    if start is None:
        return False
    current, times = start, stage_times(graph, chips, start)
    while walk.more():
        taken = _taken(tracker, background, times)
        if taken is not None:  # the whole-graph solve beside the windows got further
            current, times = taken, stage_times(graph, chips, taken)
            size, step_s, tried, proved = min(FIRST_WINDOW, count), window_s, set(), set()
            continue  # (the evaluation may have been the last)
        if _proved(background, times):
            return True
        todo = walk.todo(current, times, size, step_s, tried | proved)
        if walk.resplit_due(current, times, not todo and size == min(FIRST_WINDOW, count)):
            split = walk.resplit(current, times)
            if split is not None:
                current, times = split, stage_times(graph, chips, split)
                size, step_s, tried, proved = min(FIRST_WINDOW, count), window_s, set(), set()
            continue  # (the evaluation may have been the last)
        if not todo:
            if size < top:
                size += 1
            elif step_s * 2 <= max_s * (1 + 1e-9):
                size, tried, step_s = min(FIRST_WINDOW, count), set(), step_s * 2
            else:
                return False  # a local optimum of every window up to this size and time
            continue
        window = todo[int(walk.rng.integers(len(todo)))]
        tried.add(window)
        free = freed(window, current, walk.band_nodes)
        span = chiplets_of(window)
        focus = sorted({(k + d) % count if ring else k + d for k in span for d in (-1, 0, 1)})
        focus = [k for k in focus if 0 <= k < count]
        new, optimal = solver_step(graph, chips, step_s, current, walk.seed, ~free, focus)
        walk.steps += 1
        if new is None:  # too many free nodes to take even the current partition in time
            walk.found_nothing(current, free, step_s)
            continue
        tracker.evaluate(new)
        if optimal and len(window) == count and window[0] != BAND:
            return True  # the whole problem, proved optimal
        new_times = stage_times(graph, chips, new)
        if _faster(new_times, times):
            current, times, size, step_s = new, new_times, min(FIRST_WINDOW, count), window_s
            tried, proved = set(), set()
        elif optimal:
            proved.add(window)  # no more time can improve it: skip it until the next gain
    return False


def _faster(new: NDArray[np.float64], old: NDArray[np.float64]) -> bool:
    """Whether stage times ``new`` beat ``old``: the slowest stage first, then the
    next slowest, and so on (equal within a relative 1e-9)."""
    tol = 1e-9 * float(old.max())
    for a, b in zip(np.sort(new)[::-1], np.sort(old)[::-1], strict=True):
        if abs(a - b) > tol:
            return bool(a < b)
    return False
