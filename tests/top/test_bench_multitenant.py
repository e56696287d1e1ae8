"""``atoll bench multitenant``: its rows, without starting processes (the
benchmark itself starts a cluster and client processes; see the module)."""

from __future__ import annotations

import json

import pytest

from atoll.benchmarks import multitenant


def test_share_rows_compare_each_weight_with_its_due_share() -> None:
    used = {"w1": 1.0, "w2": 2.0, "w4": 4.0, "w8": 8.0, "flood": 3.0}
    rows = multitenant._share_rows("shares", used, wall=20.0, devices=1)
    by = {(row.case, row.system): row.value for row in rows}
    assert by["shares_share_w8", "atoll"] == pytest.approx(100 * 8 / 15)
    assert by["shares_share_w8", "due"] == pytest.approx(100 * 8 / 15)
    assert by["shares_max_share_error", "atoll"] == pytest.approx(0.0)
    assert by["shares_utilization", "atoll"] == pytest.approx(100 * 18 / 20)  # all sessions
    for row in rows:
        assert {"bench", "case", "system", "value", "unit"} <= set(json.loads(row.json()))
    assert "shares_share_w1" in multitenant.format_table(rows)


def test_it_is_an_atoll_bench() -> None:
    from atoll.cli import BENCHMARKS

    assert BENCHMARKS["multitenant"] == "atoll.benchmarks.multitenant"
