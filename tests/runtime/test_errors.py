"""Errors a user can act on: each says what went wrong and what to do."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import atoll
from atoll.cli import main
from atoll.devices import Computation
from atoll.kernel import AtollError, TransportError
from atoll.kernel.extras import MissingExtra, require
from atoll.runtime.client.connect import connect
from atoll.transports.testing import READY_PREFIX

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _node(token: str) -> tuple[subprocess.Popen[str], str]:
    """``atoll node`` with ``token``, and the address its ready line gives."""
    process = subprocess.Popen(
        [sys.executable, "-m", "atoll.cli", "node"],
        stdout=subprocess.PIPE,
        env=dict(os.environ, ATOLL_TOKEN=token),
        text=True,
        close_fds=False,
    )
    assert process.stdout is not None
    ready = process.stdout.readline()
    assert ready.startswith(READY_PREFIX), ready
    return process, ready.removeprefix(READY_PREFIX).strip()


def _stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    assert process.wait(30) == 0
    assert process.stdout is not None
    process.stdout.close()


@pytest.mark.timeout(90)
async def test_a_wrong_token_says_so_not_connection_reset() -> None:
    node, address = _node("ab" * 16)
    try:
        for _ in range(5):  # the answer must win the race with the close, every time
            with pytest.raises(TransportError, match="wrong cluster token") as info:
                async with connect(address, token=b"not the token"):
                    pass
            assert "reset" not in str(info.value) and "Broken pipe" not in str(info.value)
        async with connect(address, token=bytes.fromhex("ab" * 16)) as client:
            await client.node.ping()  # the right one still gets in
    finally:
        _stop(node)


def test_a_host_with_a_wrong_token_exits_saying_so() -> None:
    node, address = _node("cd" * 16)
    try:
        joined = subprocess.run(
            [sys.executable, "-m", "atoll.cli", "host", "--join", address],
            env=dict(os.environ, ATOLL_TOKEN="ee" * 16),
            capture_output=True,
            text=True,
            timeout=60,
            close_fds=False,
        )
        assert joined.returncode != 0
        assert "wrong cluster token" in joined.stderr and "Traceback" not in joined.stderr
    finally:
        _stop(node)


def test_a_missing_extra_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ["ortools", *(m for m in sys.modules if m.startswith("ortools."))]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed (nor imported)
    with pytest.raises(MissingExtra, match=r"pip install 'atoll\[partition\]'"):
        require("ortools.sat.python.cp_model", "the CP-SAT repair")
    with pytest.raises(SystemExit, match=r"pip install 'atoll\[partition\]'"):
        main(["partition", "mlp", "--chiplets", "2", "--method", "solver"])


def test_a_missing_module_that_no_extra_provides_stays_as_it_is() -> None:
    with pytest.raises(ModuleNotFoundError) as info:
        require("atoll_no_such_module")
    assert not isinstance(info.value, MissingExtra)


USER_MODULE = """
import numpy as np


def twice(x):
    return 2 * x
"""


@pytest.mark.timeout(120)
async def test_a_host_that_cannot_import_a_function_says_which_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The module is importable here (the client and controller) but not in
    the host processes: the error names the function, the process and the fix."""
    (tmp_path / "only_here_mod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    only_here_mod = importlib.import_module("only_here_mod")

    async with atoll.local_cluster(1, 1, 1, transport="capnp") as cluster:
        step = Computation("twice", only_here_mod.twice, flops=1e6)
        with pytest.raises(AtollError) as info:
            await cluster.fetch(cluster.run(step, 0, [np.arange(3.0)]))
    text = str(info.value)
    assert "cannot import only_here_mod.twice in process" in text, text
    assert "No module named 'only_here_mod'" in text
    assert "Install 'only_here_mod' where the hosts run" in text


def test_the_license_is_a_plain_spdx_string() -> None:
    """PEP 639: a ``{text = ...}`` table makes setuptools warn on every install."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    requires = project["build-system"]["requires"]
    assert "setuptools>=77" in requires  # the first that reads an SPDX string
