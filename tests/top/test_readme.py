"""What the README promises: its Python examples run as written and print
what they say, on asyncio and on trio; its two commands are the ones
``./dev`` and CI run; its command line names real commands; its figures
about the suite and small values hold."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from atoll.cli import BENCHMARKS, _parser
from atoll.devices._values import INLINE_VALUE_BYTES

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
COMMANDS = re.search(r"## The command line\n\n```\n(.*?)```", README, flags=re.S)


def _run_block(index: int, backend: str = "asyncio") -> None:
    code = BLOCKS[index]
    if backend != "asyncio":  # what the comment beside anyio.run says it may be
        code = code.replace("anyio.run(main)", f"anyio.run(main, backend={backend!r})")
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "readme"})


def test_the_two_commands_come_first_and_are_what_ci_runs() -> None:
    first = re.search(r"```bash\n(.*?)```", README, flags=re.S)
    assert first is not None and README.index(first.group(0)) < README.index("## ")
    lines = [line.split("#")[0].strip() for line in first.group(1).splitlines()]
    assert lines == ["./dev demo", "./dev test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^exec \./dev test$", ci, flags=re.M), ci
    dev = (ROOT / "dev").read_text()
    assert re.search(r"^\s+demo\) setup;", dev, flags=re.M)
    assert re.search(r"^\s+test\) setup; run_tests", dev, flags=re.M)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_first_example_prints_the_chain_it_describes(
    backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _run_block(0, backend)
    assert capsys.readouterr().out.split() == ["[", "0.", "16.", "32.", "48.]"]


@pytest.mark.parametrize("index", range(1, len(BLOCKS)))
def test_the_other_examples_run_and_check_themselves(index: int) -> None:
    assert "assert " in BLOCKS[index]  # each says what it shows
    _run_block(index)


def test_the_command_line_names_real_commands() -> None:
    assert COMMANDS is not None
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    choices: set[str] = set(sub.choices)
    named = set(re.findall(r"^atoll ([a-z][a-z_-]*)", COMMANDS.group(1), flags=re.M))
    assert named and named <= choices, named - choices
    benches = set(re.findall(r"^atoll bench ([a-z_]+)", COMMANDS.group(1), flags=re.M))
    assert benches <= set(BENCHMARKS), benches - set(BENCHMARKS)


def test_small_values_ride_in_the_call_up_to_the_size_said() -> None:
    said = re.search(r"copies an array of up to (\d+) KiB into the call", README)
    assert said is not None and int(said.group(1)) << 10 == INLINE_VALUE_BYTES


@pytest.mark.slow
def test_the_quick_suite_leaves_out_what_the_readme_says() -> None:
    """ "about N of M" tests are marked slow: within a fifth of the count."""
    pattern = r"marked\s+`slow` \(processes, training, benchmarks: about (\S+) of (\S+)\)"
    said = re.search(pattern, README)
    assert said is not None
    slow, total = (int(x.replace(",", "")) for x in said.groups())
    counts = []
    for marks in ("slow", ""):
        command = [sys.executable, "-m", "pytest", "--collect-only", "-q", str(ROOT / "tests")]
        out = subprocess.run(
            [*command, *(["-m", marks] if marks else [])],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        ).stdout
        found = re.search(r"(\d+)(?:/\d+)? tests? collected", out)
        assert found is not None, out[-500:]
        counts.append(int(found.group(1)))
    assert abs(counts[0] - slow) <= slow / 5 and abs(counts[1] - total) <= total / 5, counts
