"""The ``atoll`` command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


def test_console_script_is_installed() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "atoll.cli", "version"],
        capture_output=True,
        text=True,
        timeout=60,
        close_fds=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "0.1.0"
