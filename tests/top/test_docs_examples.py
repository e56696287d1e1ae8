"""Every Python block in ``docs/`` runs as written, or compiles where it is a fragment.

A block is a whole program (run in a fresh interpreter, in an empty folder,
and must exit 0) unless its first line is ``# fragment: ...``, which says
where it belongs: a fragment (a few lines of a larger program, awaits
included) must at least compile, as the body of an async function.
``README.md``'s blocks have ``tests/top/test_readme.py``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
BLOCKS = [
    (page.name, index, code)
    for page in sorted(DOCS.glob("*.md"))
    for index, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
]
FRAGMENT = "# fragment:"


def test_the_docs_have_examples_of_both_kinds() -> None:
    fragments = [b for b in BLOCKS if b[2].startswith(FRAGMENT)]
    assert fragments and len(fragments) < len(BLOCKS)


@pytest.mark.parametrize(
    ("page", "index", "code"), BLOCKS, ids=[f"{page}-{index}" for page, index, _ in BLOCKS]
)
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_docs_example_runs_as_written(page: str, index: int, code: str, tmp_path: Path) -> None:
    name = f"docs/{page} block {index}"
    if code.startswith(FRAGMENT):
        compile(f"async def _fragment():\n{textwrap.indent(code, '    ')}", name, "exec")
        return
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
        close_fds=False,
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stderr[-3000:]}"
