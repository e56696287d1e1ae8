"""``atoll bench partition``'s worker processes end with their parent, however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from atoll.transports.testing import eventually_blocking, pid_alive

# The parent: a pool as the benchmark makes it, two jobs that write their
# worker's pid and then block. ``job`` is in a script file (not ``-c``) so
# that the spawned workers can import it. ``keep_pdeathsig = False`` clears
# the kernel's parent-death signal in the worker: then only the portable
# watcher thread can end it.
PARENT = """
import ctypes, os, sys, time
from pathlib import Path

from atoll.benchmarks.partition import _pool

def job(path: str, keep_pdeathsig: bool) -> None:
    if not keep_pdeathsig:
        ctypes.CDLL(None).prctl(1, 0)  # PR_SET_PDEATHSIG: none
    Path(path + ".tmp").write_text(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(120)

if __name__ == "__main__":
    out, keep = sys.argv[1], sys.argv[2] == "1"
    pool = _pool(2)
    futures = [pool.submit(job, f"{out}/worker{i}", keep) for i in range(2)]
    futures[0].result()
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="pids from /proc, prctl")
@pytest.mark.timeout(30)
@pytest.mark.parametrize("keep_pdeathsig", [True, False], ids=["pdeathsig", "watcher"])
def test_workers_end_when_the_parent_is_killed(tmp_path: Path, keep_pdeathsig: bool) -> None:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(PARENT))
    files = [tmp_path / f"worker{i}" for i in range(2)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    parent = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), "1" if keep_pdeathsig else "0"], env=env
    )
    pids: list[int] = []
    try:
        eventually_blocking(lambda: all(f.exists() for f in files), "workers started", 15)
        pids = [int(f.read_text()) for f in files]
        assert all(pid_alive(pid) for pid in pids) and parent.pid not in pids
        parent.kill()  # SIGKILL: no cleanup of its own
        parent.wait(5)
        eventually_blocking(lambda: not any(pid_alive(pid) for pid in pids), "no orphans", 5)
    finally:
        parent.kill()
        parent.wait(5)
        for pid in pids:  # do not leave them behind if the test failed
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
