"""``atoll bench scale``: the control plane's and each host's CPU per
computation, attributed by a ledger of nested frames, and the per-host
timelines it writes (tiny clusters, a few computations)."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from atoll.benchmarks import scale
from atoll.devices import Device, Host
from atoll.kernel.lowlevel import message_handler
from atoll.runtime import Controller


def spin(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_a_nested_frame_pauses_the_one_around_it() -> None:
    ledger = scale.CpuLedger()
    began = time.thread_time()
    ledger.enter(0, "outer")
    spin(0.02)
    ledger.enter("inner", "inner")
    spin(0.03)
    ledger.leave()
    ledger.leave()
    total = time.thread_time() - began
    assert ledger.seconds[0] == pytest.approx(0.02, abs=0.005)
    assert ledger.seconds["inner"] == pytest.approx(0.03, abs=0.005)
    assert ledger.seconds[0] + ledger.seconds["inner"] <= total  # nothing counted twice
    assert ledger.frames == {(0, False): 1, ("inner", True): 1}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_stepped_coroutine_is_charged_per_step_and_keeps_its_result(backend: str) -> None:
    ledger = scale.CpuLedger()
    ledger.segments = []

    async def work() -> int:
        spin(0.01)
        await anyio.sleep(0)
        spin(0.01)
        return 7

    async def main() -> int:
        result: int = await scale.Stepped(work(), ledger, 3, "work")
        return result

    assert anyio.run(main, backend=backend) == 7
    assert ledger.seconds[3] == pytest.approx(0.02, abs=0.005)
    assert len(ledger.segments) == 2  # one per step
    assert all(s.key == 3 and s.name == "work" for s in ledger.segments)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_cancellation_reaches_the_stepped_coroutine(backend: str) -> None:
    ledger = scale.CpuLedger()
    seen: list[str] = []

    async def forever() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            seen.append("cleaned up")

    async def main() -> None:
        with anyio.move_on_after(0.01):
            await scale.Stepped(forever(), ledger, 0, "forever")

    anyio.run(main, backend=backend)
    assert seen == ["cleaned up"]
    assert ledger.frames[0, False] == 2  # started, then thrown into
    assert not ledger._stack


def test_metering_puts_every_method_back() -> None:
    before = (message_handler(), Device._gang_settled, Host._accept, Controller.run_graph)
    with scale.metering(per_host=True):
        assert message_handler() is not before[0]
        assert Device._gang_settled is not before[1]
    assert (message_handler(), Device._gang_settled, Host._accept, Controller.run_graph) == before


def run_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    timeline = tmp_path / "scale.json"
    argv = ["--hosts", "2", "4", "--nodes", "4", "--json", "--timeline", str(timeline)]
    assert scale.main([*argv, "--timeline-hosts", "2"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_rows_per_host_and_control_plane(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = run_quick(tmp_path, capsys)
    by = {(r["case"], r["system"], r["hosts"]): r["value"] for r in rows}
    cases = [case for case, _ in scale.CASES]
    assert len(rows) == len(cases) * 2 * 2  # every case, form and size
    for form in ("compiled", "per gang"):
        for hosts in (2, 4):
            got = {case: by[case, form, hosts] for case in cases}
            assert got["control plane CPU"] > 0
            assert got["busiest host's CPU"] >= got["median host's CPU"] > 0
            assert 0 < got["busiest host's CPU, less its meters"] <= got["busiest host's CPU"]
            assert got["all hosts' CPU together"] >= hosts * got["median host's CPU"] / 2
            charged = (
                got["control plane CPU"]
                + got["control plane actor tasks CPU"]
                + got["all hosts' CPU together"]
            )
            # what was charged, plus what was not, is the thread's CPU
            whole = charged + got["unattributed (client, event loop)"]
            assert whole <= got["thread CPU, every meter on"] * 1.0001
            assert got["unattributed (client, event loop)"] >= 0
            control, busiest = got["control plane CPU"], got["busiest host's CPU"]
            assert got["parity point (max: control, busiest host)"] == pytest.approx(
                max(control, busiest) / 1e3
            )
            assert got["parity point, no overlap (sum)"] == pytest.approx((control + busiest) / 1e3)


def test_timeline_has_a_track_per_host_and_one_for_the_control_plane(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_quick(tmp_path, capsys)
    events = json.loads((tmp_path / "scale.json").read_text())["traceEvents"]
    names = {
        (e["pid"], e["args"]["name"])
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert {name for _, name in names} >= {"control plane", "host 0", "host 1"}
    assert {pid for pid, _ in names} == {1, 2}  # compiled, per gang
    slices: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] > 0
            slices.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["dur"]))
    for track in slices.values():  # one CPU per track: its slices never overlap
        track.sort()
        for (start, length), (following, _) in itertools.pairwise(track):
            assert start + length <= following + 1e-3


def test_a_timeline_size_not_measured_is_refused(tmp_path: Path) -> None:
    argv = ["--hosts", "2", "--timeline", str(tmp_path / "t.json"), "--timeline-hosts", "3"]
    with pytest.raises(SystemExit):
        scale.main(argv)


def test_it_is_an_atoll_bench() -> None:
    from atoll.cli import BENCHMARKS

    assert BENCHMARKS["scale"] == "atoll.benchmarks.scale"
