"""Logging: actor names in every record, ``ATOLL_LOG``, host logs on the controller's terminal."""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import atoll
from atoll.devices import Computation
from atoll.kernel import logs
from atoll.runtime.client.connect import connect

pytestmark = pytest.mark.anyio


class Talker(atoll.Actor):
    @atoll.endpoint
    def talk(self) -> None:
        log = logging.getLogger("atoll.test")
        log.debug("a detail")
        log.info("hello from an actor")


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    stream = io.StringIO()
    yield stream
    logger = logging.getLogger("atoll")
    for handler in list(logger.handlers):
        if isinstance(handler, logging.StreamHandler) and handler.stream is stream:
            logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)


@pytest.mark.parametrize("level", ["info", "debug"])
async def test_records_name_their_actor_at_the_level_atoll_log_says(
    level: str, captured: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ATOLL_LOG", level)
    logs.configure(stream=captured)
    async with atoll.ActorSystem("logs") as system:
        await system.spawn(Talker, name="talker").talk()
    logging.getLogger("atoll.test").info("outside any actor")
    lines = captured.getvalue().splitlines()
    assert "INFO [logs/talker] atoll.test: hello from an actor" in lines
    assert "INFO [-] atoll.test: outside any actor" in lines
    assert any("a detail" in line for line in lines) == (level == "debug")


def test_unknown_levels_fall_back_to_warning() -> None:
    assert logs.level_of(None) == logging.WARNING
    assert logs.level_of("DEBUG") == logging.DEBUG
    assert logs.level_of("loud") == logging.WARNING


def chatty(x: np.ndarray) -> np.ndarray:
    """Runs on a host: logs there (host processes import this module by name)."""
    logging.getLogger("atoll.user").warning("device says hello")
    return x


@pytest.mark.timeout(120)
async def test_host_logs_reach_the_controller_terminal_prefixed_by_host(tmp_path: Path) -> None:
    """Host 0 is started by ``atoll up`` (it shares the terminal); host 1 joins
    as from another machine, and its records travel to the controller."""
    cluster_file, err = tmp_path / "cluster.json", tmp_path / "up.err"
    env = dict(os.environ, ATOLL_LOG="info", ATOLL_TOKEN="5a" * 16)
    args = ["up", "--hosts", "1", "--remote-hosts", "1", "--devices-per-host", "1"]
    command = [sys.executable, "-m", "atoll.cli", *args, "--cluster-file", str(cluster_file)]
    with err.open("w") as stderr:
        up = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, close_fds=False
        )
    assert up.stdout is not None
    joiner = None
    try:
        for line in up.stdout:
            if "listening at" in line:
                break
        address = line.split("listening at ")[1].split(";")[0]
        joiner = subprocess.Popen(
            [sys.executable, "-m", "atoll.cli", "host", "--join", address],
            env={k: v for k, v in env.items() if k != "ATOLL_PARENT_PID"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,  # its own terminal: not the controller's
            close_fds=False,
        )
        for line in up.stdout:
            if "cluster up" in line:
                break
        async with connect(cluster_file) as client:
            cluster = await client.cluster()
            step = Computation("chatty", chatty, flops=1e6)
            for device in (0, 1):
                await cluster.fetch(cluster.run(step, device, [np.ones(2)]))
            await client.node.ping()
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        up.stdout.close()
        if joiner is not None:
            joiner.wait(30)
    text = err.read_text()
    for host in (0, 1):
        assert any(
            line.startswith(f"host {host} | WARNING [") and "atoll.user: device says hello" in line
            for line in text.splitlines()
        ), text


def test_the_libraries_under_atoll_log_as_atoll_at_atoll_log_level(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io
    import logging

    from atoll.kernel import logs

    saved = {
        n: (logging.getLogger(n).level, logging.getLogger(n).propagate) for n in logs.THIRD_PARTY
    }
    monkeypatch.delenv("ATOLL_LOG", raising=False)
    out = io.StringIO()
    try:
        logs.configure(stream=out)
        logging.getLogger("jax._src.xla_bridge").warning("a warning of jax's")
        logging.getLogger("jax._src.xla_bridge").info("an info of jax's")
        assert "a warning of jax's" in out.getvalue() and "jax._src.xla_bridge" in out.getvalue()
        assert "an info of jax's" not in out.getvalue()  # ATOLL_LOG unset: warnings and above
    finally:  # atoll's logger to stderr again; the libraries' as they were
        logs.configure()
        for name, (level, propagate) in saved.items():
            logger = logging.getLogger(name)
            logger.setLevel(level)
            logger.propagate = propagate
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
