"""Stopping the child processes a cluster, a test or a benchmark started.

Node and host processes, clients and ``atoll up`` all stop the same way:
SIGTERM (or nothing, for one that is leaving by itself), a grace period
shared by all of them, SIGKILL for those still running at its end, and
their pipes closed. Nothing here is asynchronous: the waits block, so an
event loop runs them in a worker thread (``anyio.to_thread.run_sync``).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["reap", "stop_processes"]

KILL_WAIT_S = 10.0  # how long a killed process is waited for


def stop_processes(
    processes: Sequence[subprocess.Popen[Any]], grace: float = 10.0, *, close: bool = True
) -> list[int]:
    """SIGTERM every process still running, then :func:`reap` them within
    ``grace`` seconds in all; their exit codes, in order."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    return reap(processes, time.monotonic() + grace, close=close)


def reap(
    processes: Sequence[subprocess.Popen[Any]], deadline: float, *, close: bool = True
) -> list[int]:
    """Wait for each process until ``deadline`` (``time.monotonic()``), SIGKILL
    those still running then, and close their pipes (unless not ``close``);
    their exit codes, in order."""
    codes = []
    for process in processes:
        try:
            code = process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait(KILL_WAIT_S)
        if close:
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None and not stream.closed:
                    stream.close()
        codes.append(code)
    return codes
