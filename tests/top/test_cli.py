"""The ``atoll`` command line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import atoll
from atoll.cli import main


def test_demo_runs_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--virtual-clock", "--steps", "6", "--backend", "trio"]) == 0
    out = capsys.readouterr().out
    assert "matches plain numpy: yes" in out
    assert "busy %" in out and out.count("%") >= 8


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--steps", "0"])
    assert info.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_drain_without_a_cluster_says_so(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["drain", "--host", "0", "--cluster-file", str(tmp_path / "none.json")])
    assert str(info.value.code).startswith("atoll drain: ")


def test_console_script_is_installed() -> None:
    """The ``atoll`` script that installing the package put beside this Python."""
    bin_dir = Path(sys.executable).parent
    script = shutil.which("atoll", path=str(bin_dir))
    assert script is not None, f"no atoll console script in {bin_dir}"
    done = subprocess.run(
        [script, "version"], capture_output=True, text=True, timeout=60, close_fds=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == atoll.__version__


def test_bench_runs_a_benchmark_from_the_source_tree(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "partition", "--help"])
    assert info.value.code == 0
    assert "atoll bench partition" in capsys.readouterr().out


def test_bench_without_a_source_checkout_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed wheel has no ``atoll.benchmarks``: the message says where they are."""
    monkeypatch.setitem(sys.modules, "atoll.benchmarks", None)  # import raises ModuleNotFoundError
    with pytest.raises(SystemExit, match="source checkout"):
        main(["bench", "dispatch", "--small"])
