"""One configuration: every ``ATOLL_*`` setting in ``atoll.kernel.config``,
read once, documented once, and carried from the controller to its hosts."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import numpy as np
import pytest

from atoll.cli import main
from atoll.kernel import config
from atoll.kernel.config import BadSetting, Settings, settings
from atoll.runtime import BadClusterSpec, ClusterSpec, process_cluster

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("kernel", "transports", "devices", "schedulers", "runtime", "partition")
DECLARED = {env for env, *_ in Settings().rows()}
NOT_SETTINGS = {"ATOLL_PORT", "ATOLL_DEVICE", "ATOLL_DEVICES_PER_HOST", "ATOLL_PROGRAM"}
NOT_SETTINGS |= {"ATOLL_INSTALL_BROWSER", "ATOLL_INSTALL_PROMETHEUS"}
NOT_SETTINGS |= {"ATOLL_STOP_RUNS", "ATOLL_FUZZ_EXAMPLES"}


def _sources() -> list[Path]:
    paths = [ROOT / "cli.py", ROOT / "__init__.py"]
    for name in PACKAGE_DIRS:
        paths += sorted((ROOT / name).rglob("*.py"))
    return paths


def test_the_docs_are_the_object() -> None:
    assert (ROOT / "docs" / "configuration.md").read_text() == config.markdown(), (
        "docs/configuration.md is stale: atoll config --markdown > docs/configuration.md"
    )


def test_every_variable_the_package_names_is_a_setting() -> None:
    named: dict[str, str] = {}
    for path in _sources():
        for env in re.findall(r"\bATOLL_[A-Z0-9_]+", path.read_text()):
            named.setdefault(env, str(path.relative_to(ROOT)))
    unknown = {env: where for env, where in named.items() if env not in DECLARED | NOT_SETTINGS}
    assert not unknown, f"not in atoll.kernel.config.Settings: {unknown}"
    docs = (ROOT / "docs" / "configuration.md").read_text()
    for env in DECLARED | NOT_SETTINGS:
        assert f"`{env}`" in docs


def test_only_the_configuration_reads_the_environment_for_settings() -> None:
    """No module but ``kernel/config.py`` reads an ``ATOLL_*`` variable from
    ``os.environ``, and none reads one at import (launchers write them for
    their children, and check whether one is set)."""
    for path in _sources():
        if path == ROOT / "kernel" / "config.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _reads_environ(node):
                first = node.args[0] if node.args else None
                assert not (
                    isinstance(first, ast.Constant) and str(first.value).startswith("ATOLL_")
                ), f"{path.relative_to(ROOT)}:{node.lineno} reads {first.value!r}"


def _reads_environ(node: ast.Call) -> bool:
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr == "get":
        return "environ" in ast.unparse(func.value)
    return isinstance(func, ast.Attribute) and func.attr == "getenv"


def test_values_parse_and_a_bad_one_names_its_variable() -> None:
    got = Settings.from_env(
        {"ATOLL_FUSE": "0", "ATOLL_STORE_WAIT_S": "2.5", "ATOLL_HOST_HEARTBEAT": "1,4"}
    )
    assert (got.fuse, got.store_wait_s, got.host_heartbeat) == (False, 2.5, (1.0, 4.0))
    assert got.run_lanes and got.connection_calls is None  # the rest: defaults
    assert Settings.from_env({"ATOLL_CONNECTION_CALLS": "0"}).connection_calls == 0
    for env, text in [
        ("ATOLL_FUSE", "maybe"),
        ("ATOLL_STORE_WAIT_S", "-1"),
        ("ATOLL_HOST_HEARTBEAT", "2"),
        ("ATOLL_SHM_KEEP_BYTES", "lots"),
        ("ATOLL_LOG", "loud"),
    ]:
        with pytest.raises(BadSetting, match=f"{env}='{text}'"):
            Settings.from_env({env: text})


def test_a_process_reads_its_settings_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATOLL_STORE_WAIT_S", "5")
    assert settings().store_wait_s == 5.0
    monkeypatch.setenv("ATOLL_STORE_WAIT_S", "6")  # too late: read at start
    assert settings().store_wait_s == 5.0
    with config.overridden(store_wait_s=1.0):
        assert settings().store_wait_s == 1.0
    assert settings().store_wait_s == 5.0


def test_a_child_gets_the_settings_as_variables() -> None:
    changed = Settings().replace(fuse=False, store_wait_s=3.0, host_heartbeat=(1.0, 2.0))
    env = changed.to_env()
    assert env == {"ATOLL_FUSE": "0", "ATOLL_STORE_WAIT_S": "3", "ATOLL_HOST_HEARTBEAT": "1,2"}
    assert Settings.from_env(env) == changed


def test_the_cli_refuses_a_bad_value_and_shows_the_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ATOLL_TOKEN", "ab" * 16)
    monkeypatch.setenv("ATOLL_FUSE", "0")
    assert main(["config", "--json"]) == 0
    rows = {row["variable"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["ATOLL_FUSE"]["value"] == "0" and rows["ATOLL_FUSE"]["default"] == "1"
    assert rows["ATOLL_TOKEN"]["value"] == "(set)"  # a secret is not shown
    config.reset()
    monkeypatch.setenv("ATOLL_FUSE", "maybe")
    with pytest.raises(SystemExit, match="ATOLL_FUSE='maybe': expected 1 or 0"):
        main(["config"])


def test_one_process_has_one_set_of_settings() -> None:
    spec = ClusterSpec(1, 1, 1, settings=Settings().replace(fuse=False))
    with pytest.raises(BadClusterSpec, match="one process has one set of settings"):
        spec.check_for("inproc")
    with config.overridden(fuse=False):
        spec.check_for("inproc")  # the same as in force: fine


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # capnp runs on asyncio
@pytest.mark.timeout(120)
async def test_hosts_run_the_path_with_their_controllers_settings(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host process whose own environment says otherwise takes the
    cluster-scoped settings of the spec it joins, and keeps its own
    process-scoped ones."""
    monkeypatch.setenv("ATOLL_STORE_WAIT_S", "3")  # what the host processes inherit
    monkeypatch.setenv("ATOLL_BATCH_RUNS", "0")
    spec = ClusterSpec(1, 1, 1, settings=Settings().replace(store_wait_s=7.0, fuse=False))
    async with process_cluster(spec) as cluster:
        (host,) = cluster._hosts
        got = await host.settings_in_force()
        assert (got["store_wait_s"], got["fuse"]) == (7.0, False)
        assert "batch_runs" not in got  # each process's own
        assert float(await cluster.fetch(cluster.put(np.float32(2.0), 0))) == 2.0
