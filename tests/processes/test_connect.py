"""``atoll.connect`` against a node process started from the command line,
on asyncio and on trio (there through the bridge, unchanged)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from atoll.kernel import AtollError, TransportError
from atoll.runtime.client.connect import connect
from atoll.transports.capnp import ClusterFile
from atoll.transports.capnp.clusterfile import default_cluster_file
from atoll.transports.testing import READY_PREFIX

pytestmark = pytest.mark.anyio
CONF = "atoll.transports.conformance"


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # trio: through the bridge
async def test_a_second_process_reaches_a_node_through_its_cluster_file(tmp_path: Path) -> None:
    cluster_file = tmp_path / "cluster.json"
    env = dict(os.environ, ATOLL_TOKEN="ab" * 16)
    process = subprocess.Popen(
        [sys.executable, "-m", "atoll.cli", "node", "--cluster-file", str(cluster_file)],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
        close_fds=False,
    )
    try:
        assert process.stdout is not None
        ready = process.stdout.readline()  # printed after the cluster file is written
        assert ready.startswith(READY_PREFIX), ready
        assert stat.S_IMODE(cluster_file.stat().st_mode) == 0o600
        spec = ClusterFile.read(cluster_file)
        assert spec.token == bytes.fromhex("ab" * 16)
        async with connect(cluster_file) as client:
            counter = await client.spawn(f"{CONF}:Counter", name="shared")
            assert await counter.add(5) == 5
            again = await client.lookup("shared")
            assert await again.add(1) == 6
        with pytest.raises(TransportError, match="refused"):
            async with connect(spec.address, token=b"not the token"):
                pass
    finally:
        process.terminate()
        assert process.wait(30) == 0
        assert process.stdout is not None
        process.stdout.close()


def test_unreadable_cluster_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(AtollError, match="cannot read cluster file"):
        ClusterFile.read(bad)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_default_cluster_file_is_private_under_xdg_runtime_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = default_cluster_file()
    assert path == tmp_path / "atoll" / "cluster.json"
    assert _mode(path.parent) == 0o700
    ClusterFile("capnp://127.0.0.1:1", b"secret").write(path)
    assert _mode(path) == 0o600


def test_default_cluster_file_falls_back_to_home_and_tightens_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".atoll").mkdir(mode=0o755)
    (tmp_path / ".atoll").chmod(0o755)  # whatever the umask
    assert default_cluster_file() == tmp_path / ".atoll" / "cluster.json"
    assert _mode(tmp_path / ".atoll") == 0o700
