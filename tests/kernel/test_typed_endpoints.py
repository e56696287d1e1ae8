"""Actor calls are type-checked: mypy, with atoll's plugin, on small files.

``ref.method(...)`` is ``Promise[R]`` with the method's parameters; a wrong
argument, a name that is no endpoint, or a misused result fails to type-check.
Each case runs mypy (``--strict``, the plugin from ``pyproject.toml``) on a
file written here, the package seen through ``.typecheck`` as ``./dev`` does.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api", reason="mypy is a dev dependency")

ROOT = Path(__file__).resolve().parents[2]

HEADER = """\
from __future__ import annotations
from collections.abc import Sequence
from typing import Any, TypeVar
from atoll.kernel import Actor, ActorRef, ActorSystem, NodeActor, Promise, endpoint

T = TypeVar("T")

class Counter(Actor):
    @endpoint
    def add(self, n: int, *, label: str = "") -> int:
        return n

    @endpoint
    async def total(self, values: Sequence[int]) -> float:
        return float(sum(values))

    @endpoint
    def later(self) -> Promise[str]:
        return Promise("later")

    @endpoint(resolve_args=False)
    def keep(self, value: int) -> None:
        pass

    def helper(self) -> int:  # not an endpoint
        return 1

    @endpoint
    def echo(self, value: T) -> T:  # generic: left untyped
        return value

class Doubled(Counter):
    @endpoint
    def double(self, n: int) -> int:
        return 2 * n

    def add(self, n: int, *, label: str = "") -> int:  # still an endpoint, as at run time
        return 2 * n

def calls(
    ref: ActorRef[Counter],
    sub: ActorRef[Doubled],
    anything: ActorRef[Any],
    node: ActorRef[NodeActor],
) -> None:
"""

GOOD = """\
    one: Promise[int] = ref.add(1, label="x")
    two: Promise[int] = ref.add(one)  # a promise where a value goes: pipelined
    total: Promise[float] = ref.total([1, one, two])  # promises inside a list
    text: Promise[str] = ref.later()  # a returned promise's value
    doubled: Promise[int] = sub.double(sub.add(2))  # inherited endpoints too
    anything.whatever(1, "x")  # an untyped reference stays untyped
    pong: Promise[str] = node.ping()  # an actor from another module
    same = ref.echo("x")
    print(one, two, total, text, doubled, pong, same, ref.name, ref.id)
"""

BAD = {
    "wrong_type": ('    ref.add("one")', 'Argument 1 to "__call__" of "EndpointRef" has incom'),
    "wrong_keyword": ("    ref.add(1, labl='x')", 'Unexpected keyword argument "labl"'),
    "too_many": ("    ref.add(1, 2)", 'Too many positional arguments for "__call__"'),
    "no_such_endpoint": ("    ref.subtract(1)", 'Actor "Counter" has no endpoint "subtract"'),
    "not_an_endpoint": ("    ref.helper()", 'Actor "Counter" has no endpoint "helper"'),
    "result_type": ("    x: Promise[str] = ref.add(1)", 'expression has type "Promise[int]"'),
    "unresolved": ("    ref.keep(ref.add(1))", 'incompatible type "Promise[int]"; expected "int"'),
    "list_item": ('    ref.total([1, "2"])', 'List item 1 has incompatible type "str"'),
    "other_module": ("    node.ping(1)", 'Too many arguments for "__call__" of "EndpointRef"'),
    "override": ('    sub.add("1")', 'Argument 1 to "__call__" of "EndpointRef" has incom'),
}


def typecheck(tmp_path: Path, body: str) -> tuple[str, int]:
    """mypy's report and exit status on the header plus ``body``."""
    source = tmp_path / "calls.py"
    source.write_text(HEADER + textwrap.indent(textwrap.dedent(body), "    "))
    typecheck_root = tmp_path / "typecheck"
    typecheck_root.mkdir()
    (typecheck_root / "atoll").symlink_to(ROOT)
    config = tmp_path / "mypy.ini"
    config.write_text(
        "[mypy]\nstrict = True\nplugins = atoll.kernel.mypy_plugin\n"
        f"mypy_path = {typecheck_root}\ncache_dir = {tmp_path / 'cache'}\n"
        "follow_imports = silent\n"
    )
    out, err, status = mypy_api.run(["--config-file", str(config), str(source)])
    return out + err, status


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_good_actor_calls_type_check(tmp_path: Path) -> None:
    report, status = typecheck(tmp_path, GOOD)
    assert status == 0, report


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wrong_actor_calls_fail_to_type_check(tmp_path: Path) -> None:
    body = "\n".join(line for line, _ in BAD.values()) + "\n"
    report, status = typecheck(tmp_path, body)
    assert status == 1, report
    lines = report.splitlines()
    for row, (name, (_, expected)) in enumerate(BAD.items()):
        at = f"calls.py:{HEADER.count(chr(10)) + row + 1}:"
        assert any(at in line and expected in line for line in lines), (name, report)
