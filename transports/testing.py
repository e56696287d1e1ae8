"""Helpers for testing transports, like ``trio.testing``: not used by atoll itself.

:class:`NodeProcess` starts a Cap'n Proto node (``atoll node``) as a child
process and waits, with a real timeout, for the line that says it listens.
The conformance suite's process harness, the transport tests and the
transport benchmark use it. :func:`eventually` waits for what another party
(a process, a thread) does.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import anyio

from ..kernel import TransportError
from ..kernel.config import env_name
from .capnp._process import READY_PREFIX
from .processes import KILL_WAIT_S, stop_processes

__all__ = ["READY_PREFIX", "NodeProcess", "atoll_up", "line_with", "pid_alive"]


class NodeProcess:
    """A node started as a child process; ``address`` once it is ready.

    ``stop()`` asks it to exit (SIGTERM) and waits; ``kill()`` is the hard way.
    """

    def __init__(
        self,
        token: bytes,
        listen: str = "capnp://127.0.0.1:0",
        timeout: float = 60.0,
        extra_args: Sequence[str] = (),
        *,
        command: Sequence[str] | None = None,
    ) -> None:
        """Start the node; raises :class:`TransportError` if not ready in ``timeout`` s.

        ``command`` replaces the default, ``python -m atoll.transports.capnp.node
        --listen LISTEN EXTRA_ARGS`` (a wrapper, another entry point); it must
        print the ``READY_PREFIX`` line like the node does.
        """
        env = dict(os.environ, **{env_name("token"): token.hex()})
        if command is None:
            node = [sys.executable, "-m", "atoll.transports.capnp.node"]
            command = [*node, "--listen", listen, *extra_args]
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives with the process)
        self._stderr_text = ""
        self.process = subprocess.Popen(  # close_fds=False: posix_spawn, no fork hooks
            list(command),
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            close_fds=False,
        )
        self.address = self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> str:
        """The address the node prints; kills it if it exits or is silent for ``timeout`` s."""
        assert self.process.stdout is not None
        address = _ready_address(self.process.stdout, time.monotonic() + timeout)
        if address is not None:
            return address
        code = self.process.poll()
        self.kill()
        why = f"not ready within {timeout} s" if code is None else f"exited with code {code}"
        raise TransportError(f"node process {why}: {self.stderr()[-2000:]}")

    def stderr(self) -> str:
        """What the process wrote to its standard error so far."""
        if self._stderr.closed:
            return self._stderr_text
        self._stderr.seek(0)
        return self._stderr.read()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then wait; returns the exit code (kills after ``timeout``)."""
        [code] = stop_processes([self.process], timeout, close=False)
        self._close_pipes()
        return code

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
            self.process.wait(KILL_WAIT_S)
        self._close_pipes()

    def _close_pipes(self) -> None:
        if self.process.stdout is not None and not self.process.stdout.closed:
            self.process.stdout.close()
        if not self._stderr.closed:
            self._stderr_text = self.stderr()
            self._stderr.close()


def _ready_address(stdout: IO[bytes], deadline: float) -> str | None:
    """The address on the first ``READY_PREFIX`` line of ``stdout``, read until ``deadline``.

    The pipe is read only when a selector says it has data, so a child that
    stays silent cannot block this past the deadline. None when the child
    closes its output (it exited) or the deadline passes first.
    """
    fd, pending = stdout.fileno(), b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not selector.select(left):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line.startswith(READY_PREFIX.encode()):
                    return line[len(READY_PREFIX) :].decode().strip()
    return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (Linux: a zombie, killed and not yet
    reaped, counts as dead), for checks that nothing was left behind."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def line_with(process: subprocess.Popen[str], text: str) -> str:
    """Read ``process``'s output (blocking) up to the first line holding ``text``."""
    assert process.stdout is not None
    for line in process.stdout:
        if text in line:
            return line
    raise RuntimeError(f"the process ended before printing {text!r}")


@contextlib.contextmanager
def atoll_up(
    cluster_file: str | os.PathLike[str], *args: str, until: str = "atoll cluster up"
) -> Iterator[str]:
    """``atoll up ARGS --cluster-file F`` as a child process, until its
    output has a line starting with ``until`` (which it gives); stopped with
    SIGTERM (as Ctrl-C would) and reaped when the block ends."""
    command = [sys.executable, "-m", "atoll.cli", "up", *args]
    process = subprocess.Popen(
        [*command, "--cluster-file", os.fspath(cluster_file)],
        stdout=subprocess.PIPE,
        text=True,
        close_fds=False,
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith(until):
                break
        else:
            raise RuntimeError(f"atoll up ended before printing {until!r}")
        yield line
    finally:
        process.terminate()
        process.wait(60)
        if process.stdout is not None:
            process.stdout.close()


async def eventually(
    check: Callable[[], Any], what: str, timeout: float = 20.0, every: float = 0.01
) -> None:
    """Wait until ``check()`` (or what it returns, when that is awaitable)
    holds: for what another process or thread does, which no clock of ours
    sequences. Fails with ``what`` after ``timeout`` wall-clock seconds.
    Asynchronous: polls every ``every`` seconds on the running loop (asyncio
    or trio), which meanwhile runs everything else."""
    deadline = time.monotonic() + timeout
    while True:
        done = check()
        if inspect.isawaitable(done):
            done = await done
        if done:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await anyio.sleep(every)


def eventually_blocking(
    check: Callable[[], Any], what: str, timeout: float = 20.0, every: float = 0.05
) -> None:
    """:func:`eventually` for synchronous tests: polls ``check()`` every
    ``every`` seconds, blocking the thread, until it holds; fails with
    ``what`` after ``timeout`` wall-clock seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(every)
