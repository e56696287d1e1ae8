"""A tiny progress bar on stderr, with no dependency."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """Call it with ``(done, total, value)``; it redraws one line on ``stream``.

    ``value`` is shown as ``{name} {value:{fmt}}{unit}`` (by default the best
    throughput so far).
    """

    def __init__(
        self,
        label: str,
        stream: TextIO | None = None,
        width: int = 30,
        unit: str = "/s",
        fmt: str = ",.1f",
        name: str = "best",
    ) -> None:
        self.label, self.width, self.unit, self.fmt, self.name = label, width, unit, fmt, name
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()
        self._last = -1.0
        self._open = False  # a line drawn and not yet ended

    def __call__(self, done: int, total: int, best: float) -> None:
        now = time.perf_counter()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(
            f"\r{self.label} [{bar}] {done}/{total} {self.name} {best:{self.fmt}}{self.unit} "
            f"{now - self.start:5.1f}s"
        )
        self._open = done < total
        if not self._open:
            self.stream.write("\n")
        self.stream.flush()

    def finish(self) -> None:
        """End the line when the work stopped short of its total (a search that
        ended early), so that what is printed next starts on a line of its own."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
