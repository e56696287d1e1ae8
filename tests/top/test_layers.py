"""The layer rule: imports point one way, down the stack (``docs/architecture.md``).

kernel, then transports, then devices, then schedulers, then runtime, then
the top (cli, examples, benchmarks, and the ``atoll`` facade itself). A
module may import from its own layer or any layer below it, never above;
imports under ``TYPE_CHECKING`` and inside functions count too. Beside the
stack stand packages that only the top uses (``SIDE``): the partitioner, a
placement optimizer, imports nothing but the kernel, and no layer imports it. Only the
kernel touches the kernel's private modules and the private members of its
promises and references; transports use ``atoll.kernel.lowlevel``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["kernel", "transports", "devices", "schedulers", "runtime"]
TOP = len(LAYERS)  # cli, examples, benchmarks, the facade
SIDE = {"partition": {"kernel"}}  # beside the stack: the layers each may import
SKIP = {"tests", ".venv", ".typecheck", "build", "dist"}
PRIVATE_KERNEL_MEMBERS = re.compile(
    r"(?<!self)\._(channel|pipe|answer|canceller|resolve|reject|follow|copy_from)\b"
)
# Cycles allowed on purpose, each with its reason.
ALLOWED_CYCLES = {
    # a promise pipelines calls to the actor it will resolve to, and a call to
    # an actor returns a promise: one concept split over two files
    frozenset({"atoll.kernel._actor", "atoll.kernel._promise"}),
}


def modules() -> Iterator[tuple[str, Path]]:
    """Every module of the package: its dotted name and its file."""
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if parts[0] in SKIP or parts[0].startswith("."):
            continue
        names = ["atoll", *parts[:-1]]
        if parts[-1] != "__init__.py":
            names.append(parts[-1].removesuffix(".py"))
        yield ".".join(names), path


def layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return TOP
    return LAYERS.index(parts[1])


def imported(module: str, path: Path, typing: bool = True) -> Iterator[tuple[int, str]]:
    """(line, absolute module) for every import of an atoll module in ``path``
    (without those under ``if TYPE_CHECKING:`` when ``typing`` is False),
    including those by name: ``importlib.import_module("atoll.x")``."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), str(path))
    for node in _walk(tree, typing):
        by_name = _imported_by_name(node, module) if isinstance(node, ast.Call) else None
        if isinstance(node, ast.Call) and by_name and by_name.split(".")[0] == "atoll":
            yield node.lineno, by_name
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "atoll":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(package, node.module, node.level)
            if base.split(".")[0] != "atoll":
                continue
            yield node.lineno, base
            for alias in node.names:  # ``from . import x`` may name a submodule
                yield node.lineno, f"{base}.{alias.name}"


def _imported_by_name(node: ast.Call, module: str) -> str | None:
    """The module a call ``import_module(...)`` or ``__import__(...)`` names:
    a string, or an f-string that starts from ``__name__``."""
    if not node.args:
        return None
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if called not in ("import_module", "__import__"):
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values:
        first = arg.values[0]
        if isinstance(first, ast.FormattedValue) and ast.unparse(first.value) == "__name__":
            rest = arg.values[1] if len(arg.values) > 1 else None
            tail = rest.value if isinstance(rest, ast.Constant) else ""
            return module + str(tail).split("{")[0].rstrip(".")
    return None


def _walk(node: ast.AST, typing: bool) -> Iterator[ast.AST]:
    yield node
    for child in ast.iter_child_nodes(node):
        if not typing and isinstance(child, ast.If) and ast.unparse(child.test) == "TYPE_CHECKING":
            continue
        yield from _walk(child, typing)


def _absolute(package: str, name: str | None, level: int) -> str:
    if level == 0:
        return name or ""
    parts = package.split(".")
    base = parts[: len(parts) - level + 1]
    return ".".join([*base, name] if name else base)


def known(name: str, names: set[str]) -> str | None:
    """The module ``name`` refers to (an attribute import names its module)."""
    while name and name not in names:
        name = name.rpartition(".")[0]
    return name or None


MODULES = dict(modules())


def test_the_walk_sees_every_layer() -> None:
    for name in [*LAYERS, *SIDE]:
        assert f"atoll.{name}" in MODULES
    assert "atoll.cli" in MODULES and "atoll.runtime.control.planner" in MODULES


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    mine, side = layer(module), SIDE.get(package(module))
    upward = []
    for line, target in imported(module, MODULES[module]):
        found = known(target, set(MODULES))
        if found is None or package(found) == package(module):
            continue
        if side is not None and package(found) not in side:
            upward.append(f"line {line}: {found} ({package(module)} imports only {side})")
        elif side is None and package(found) in SIDE and mine < TOP:
            upward.append(f"line {line}: {found} (only the top may import it)")
        elif side is None and layer(found) > mine:
            upward.append(f"line {line}: {found} ({LAYERS[mine]} may not import it)")
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("atoll.kernel")))
def test_only_the_kernel_touches_its_privates(module: str) -> None:
    path = MODULES[module]
    bad = [
        f"line {line}: {target}"
        for line, target in imported(module, path)
        if target.startswith("atoll.kernel.") and target.split(".")[2].startswith("_")
    ]
    text = path.read_text()
    bad += [f"private member {m.group(0)}" for m in PRIVATE_KERNEL_MEMBERS.finditer(text)]
    assert not bad, "\n".join(bad)


def test_the_root_is_only_a_facade() -> None:
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert top == ["__init__.py", "cli.py"]
    assert (ROOT / "py.typed").exists()


def test_no_import_cycles_between_modules() -> None:
    """Package ``__init__`` files re-export their own modules; any other cycle
    (through imports at module level or in functions; type-only imports under
    TYPE_CHECKING do not count) means two modules that cannot be read apart."""
    names = set(MODULES)
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for _, target in imported(module, path, typing=False):
            found = known(target, names)
            if found and found != module and not _reexport(module, found):
                edges[module].add(found)
    for pair in ALLOWED_CYCLES:
        first, second = sorted(pair)
        edges[second].discard(first)
    cycle = _find_cycle(edges)
    assert cycle is None, " -> ".join(cycle or [])


def test_no_import_cycles_inside_the_device_layer_even_for_types() -> None:
    """Inside ``devices/`` type-only imports count too: a module that only
    talks to hosts names their interface (``devices/_host_api.py``), not the
    host's module, which imports it."""
    names = {m for m in MODULES if m.startswith("atoll.devices.")}
    edges: dict[str, set[str]] = {m: set() for m in names}
    for module in names:
        for _, target in imported(module, MODULES[module], typing=True):
            found = known(target, names)
            if found and found != module and not _reexport(module, found):
                edges[module].add(found)
    cycle = _find_cycle(edges)
    assert cycle is None, " -> ".join(cycle or [])


def _reexport(importer: str, target: str) -> bool:
    """An edge between a package and its own modules, either way."""
    return target.startswith(importer + ".") or importer.startswith(target + ".")


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_an_import_by_name_counts_as_an_import(tmp_path: Path) -> None:
    """``importlib.import_module("atoll.devices")`` in the kernel is seen."""
    source = tmp_path / "mod.py"
    source.write_text(
        "import importlib\n"
        "def later():\n"
        "    return importlib.import_module('atoll.devices'), "
        "importlib.import_module(f'{__name__}.sub')\n"
    )
    found = [target for _, target in imported("atoll.kernel.mod", source)]
    assert found == ["atoll.devices", "atoll.kernel.mod.sub"]


# The runtime's rooms, by where their code runs (docs/architecture.md): the
# modules directly under runtime/ are shared by every room; a room may import
# (at run time: type-only imports do not count) the shared modules, its own,
# and the rooms it stands on. The client's and the controller's rooms stand
# side by side: neither needs the other to run.
ROOMS_MAY = {
    "client": set(),
    "control": set(),
    "tools": {"client", "control"},
    "deploy": {"client", "control", "tools"},
}


def room(module: str) -> str | None:
    """A runtime module's room ("" for a shared one), None outside the runtime."""
    parts = module.split(".")
    if parts[:2] != ["atoll", "runtime"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in ROOMS_MAY else ""


def test_every_runtime_module_is_in_a_room_or_shared() -> None:
    rooms = {room(m) for m in MODULES if m.startswith("atoll.runtime.")}
    assert rooms == {"", *ROOMS_MAY}, rooms
    shared = sorted(m for m in MODULES if room(m) == "")
    assert "atoll.runtime.graph" in shared and "atoll.runtime.runlanes" in shared


@pytest.mark.parametrize("module", sorted(m for m in MODULES if room(m)))
def test_rooms_import_only_the_rooms_they_stand_on(module: str) -> None:
    mine = room(module)
    assert mine
    wrong = []
    for line, target in imported(module, MODULES[module], typing=False):
        found = known(target, set(MODULES)) or ""
        theirs = room(found)
        if theirs and theirs != mine and theirs not in ROOMS_MAY[mine]:
            wrong.append(f"line {line}: {found} (the {mine} room does not stand on {theirs})")
    assert not wrong, "\n".join(wrong)


def test_shared_runtime_modules_import_no_room() -> None:
    wrong = [
        f"{module} line {line}: {target}"
        for module in sorted(m for m in MODULES if room(m) == "" and m != "atoll.runtime")
        for line, target in imported(module, MODULES[module], typing=False)
        if room(known(target, set(MODULES)) or "")
    ]
    assert not wrong, "\n".join(wrong)


def test_the_device_layer_reaches_jax_only_by_name() -> None:
    """Nothing in ``devices/`` outside ``devices/jax/`` imports the JAX
    backend at run time: simulated clusters never load it."""
    wrong = [
        f"{module} line {line}: {target}"
        for module in sorted(MODULES)
        if module.startswith("atoll.devices") and not module.startswith("atoll.devices.jax")
        for line, target in imported(module, MODULES[module], typing=False)
        if (known(target, set(MODULES)) or "").startswith("atoll.devices.jax")
    ]
    assert not wrong, "\n".join(wrong)
