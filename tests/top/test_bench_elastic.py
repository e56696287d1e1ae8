"""``atoll bench elastic``, run small: its rows are measured, and right.

It starts three host processes (simulated devices) and moves, suspends and
resumes a slice whose buffer is checked on the way; a small run takes a
few seconds.
"""

from __future__ import annotations

import json

import pytest

from atoll.benchmarks import elastic


@pytest.mark.timeout(180)
def test_a_small_run_measures_moves_suspends_and_the_other_client(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert elastic.main(["--sizes", "1", "4", "--repeats", "2", "--runs", "10", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    by = {(r["case"], r["system"]): r["value"] for r in rows}
    for mib in (1, 4):
        move, plane = by[f"move {mib} MiB", "move"], by[f"move {mib} MiB", "data plane"]
        assert move > 0 and plane > 0
        assert by[f"move {mib} MiB", "ratio"] == pytest.approx(move / plane)
    assert by["suspend and resume 4 MiB", "suspend"] > 0
    assert by["suspend and resume 4 MiB", "resume elsewhere"] > 0
    assert by["other client during 4 MiB moves", "median during"] > 0


def test_bad_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        elastic.main(["--sizes", "0"])
    assert "--sizes" in capsys.readouterr().err


def test_it_is_an_atoll_bench() -> None:
    from atoll.cli import BENCHMARKS

    assert BENCHMARKS["elastic"] == "atoll.benchmarks.elastic"
