"""What every benchmark shares: one row type, one table, one way to time.

A benchmark measures :class:`Row` values, prints them with :func:`emit`
(``--json``: one object per line; otherwise a :func:`table`), and times its
work with :func:`timings` or :func:`median_time`.

``atoll bench`` runs every benchmark inside :func:`progress_bars`: on a
terminal, each :func:`timings` call then shows a rich progress bar (on
stderr, gone when done) named after the job it times; off a terminal
(pipes, CI, tests) nothing is drawn.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

__all__ = [
    "Column",
    "Log",
    "Row",
    "emit",
    "first_reach",
    "median_time",
    "p99",
    "progress_bars",
    "system_column",
    "table",
    "timings",
    "track",
    "unit_column",
    "wait_for_line",
]


@dataclass(frozen=True)
class Row:
    """One measured figure: which benchmark, which case, which system, how much.

    ``value`` is None when there is no figure (for example a parity point not
    reached). ``devices`` and ``hosts`` say how big the cluster was, when that
    matters to the case.
    """

    bench: str
    case: str
    system: str
    value: float | None
    unit: str
    devices: int | None = None
    hosts: int | None = None

    def json(self) -> str:
        """One JSON object: bench, case, system, value, unit, and the sizes that are set."""
        fields = asdict(self)
        return json.dumps({k: v for k, v in fields.items() if v is not None or k == "value"})


# -- printing ----------------------------------------------------------------------
Group = Mapping[str, Row]  # the rows of one case, by system


@dataclass(frozen=True)
class Column:
    """One column of a :func:`table`: its title, width, and what a case shows in it."""

    title: str
    width: int
    cell: Callable[[Group], str]


def system_column(
    system: str,
    width: int,
    fmt: str | Callable[[float], str] = ",.1f",
    *,
    title: str = "",
    also: Sequence[str] = (),
    missing: str = "-",
) -> Column:
    """The value that ``system`` (or, failing it, the first of ``also``) measured.

    ``fmt`` is a format spec or a function. ``missing`` when neither system
    measured the case, ``not reached`` when the value is None.
    """

    def cell(group: Group) -> str:
        row = next((group[s] for s in (system, *also) if s in group), None)
        if row is None:
            return missing
        if row.value is None:
            return "not reached"
        return format(row.value, fmt) if isinstance(fmt, str) else fmt(row.value)

    return Column(title or system, width, cell)


def unit_column(width: int = 8) -> Column:
    """The unit of the case."""
    return Column("unit", width, lambda group: next(iter(group.values())).unit)


def table(
    rows: Sequence[Row],
    columns: Sequence[Column],
    *,
    case_width: int = 28,
    key: Callable[[Row], Hashable] = lambda row: row.case,
    keep: Callable[[Group], bool] = lambda group: True,
) -> str:
    """The rows as a text table: one line per ``key`` (a case, by default), in order.

    Rows with the same key are one line, each system in its own columns;
    ``keep`` leaves out the lines it rejects.
    """
    groups: dict[Hashable, dict[str, Row]] = {}
    for row in rows:
        groups.setdefault(key(row), {})[row.system] = row
    lines = [f"{'case':<{case_width}}" + "".join(f" {c.title:>{c.width}}" for c in columns)]
    for group in groups.values():
        if keep(group):
            case = next(iter(group.values())).case
            cells = "".join(f" {c.cell(group):>{c.width}}" for c in columns)
            lines.append(f"{case:<{case_width}}{cells}")
    return "\n".join(lines)


def emit(rows: Sequence[Row], as_json: bool, render: Callable[[Sequence[Row]], str]) -> None:
    """Print ``rows``: one JSON object per line, or the table ``render`` makes."""
    print("\n".join(row.json() for row in rows) if as_json else render(rows), flush=True)


# -- timing ------------------------------------------------------------------------
_bars: list[Progress] = []  # the live progress display, inside progress_bars()


@contextmanager
def progress_bars(enabled: bool | None = None) -> Iterator[None]:
    """Show a progress bar for each :func:`timings` call inside (on stderr,
    transient). ``enabled`` defaults to whether stderr is a terminal."""
    if not (sys.stderr.isatty() if enabled is None else enabled):
        yield
        return
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bars:
        _bars.append(bars)
        try:
            yield
        finally:
            _bars.remove(bars)


def track(items: Sequence[Any], label: str) -> Iterator[Any]:
    """``items``, one by one, with a progress bar inside :func:`progress_bars`
    (for loops that do not time through :func:`timings`)."""
    bars = _bars[-1] if _bars else None
    task = bars.add_task(label, total=len(items)) if bars is not None else None
    for item in items:
        yield item
        if bars is not None and task is not None:
            bars.advance(task)
    if bars is not None and task is not None:
        bars.remove_task(task)


async def timings(job: Callable[[], Awaitable[Any]], reps: int = 1) -> list[float]:
    """Wall-clock seconds of each of ``reps`` runs of ``job``, one after another."""
    bars = _bars[-1] if _bars and reps > 1 else None
    task = bars.add_task(getattr(job, "__name__", "job"), total=reps) if bars else None
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        await job()
        samples.append(time.perf_counter() - started)
        if bars is not None and task is not None:
            bars.advance(task)
    if bars is not None and task is not None:
        bars.remove_task(task)
    return samples


async def median_time(job: Callable[[], Awaitable[Any]], reps: int = 1) -> float:
    """The median wall-clock seconds of ``reps`` runs of ``job`` (one run: its time)."""
    return statistics.median(await timings(job, reps))


def p99(samples: Sequence[float]) -> float:
    """The 99th percentile of ``samples`` (the nearest sample at or below it)."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


# -- processes ---------------------------------------------------------------------
def wait_for_line(process: subprocess.Popen[str], prefix: str) -> str:
    """Read ``process``'s output until a line starts with ``prefix`` (a
    cluster that is up, a client that is ready); that line. Raise if it
    ends first."""
    from atoll.kernel import AtollError

    assert process.stdout is not None
    while True:
        line = process.stdout.readline()
        if not line:
            raise AtollError(f"process {process.pid} ended before printing {prefix!r}")
        if line.startswith(prefix):
            return line


# -- partition searches ----------------------------------------------------------
class Log(list[str]):
    """Log lines, echoed to stderr as they come when ``echo`` is set."""

    def __init__(self, echo: bool = False) -> None:
        super().__init__()
        self.echo = echo

    def append(self, line: str) -> None:
        """Keep ``line`` (and print it at once when echoing)."""
        super().append(line)
        if self.echo:
            print(line, file=sys.stderr, flush=True)


def first_reach(part: Any, target: float) -> float | None:
    """The wall time at which a partition search (its ``Partition``, ``part``)
    first reached ``target`` (None: never)."""
    walls = part.extra["history_wall_s"]
    return next((t for t, tp in zip(walls, part.history, strict=True) if tp >= target), None)
