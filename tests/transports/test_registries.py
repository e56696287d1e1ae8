"""The transport and scheduler registries: built-ins in code, plugins by entry point.

atoll registers its own transports and policies in code and publishes no entry
point; the ``atoll.transports`` and ``atoll.schedulers`` groups are for other
packages. Plugins are faked here by replacing ``entry_points`` in the module
that reads them, with real :class:`EntryPoint` objects that load real classes.
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType

import pytest

from atoll.schedulers import FifoPolicy, _protocol, get_scheduler, scheduler_names
from atoll.transports import InprocTransport, _base, get_transport, transport_names


def install_plugins(
    monkeypatch: pytest.MonkeyPatch, registry: ModuleType, group: str, plugins: dict[str, str]
) -> None:
    """Make ``registry`` see ``plugins`` (name -> "module:attr") in ``group``.

    The registry's table is copied first, so what the plugins add is gone
    after the test.
    """
    found = [EntryPoint(name, value, group) for name, value in plugins.items()]

    def fake_entry_points(group: str) -> list[EntryPoint]:
        return [ep for ep in found if ep.group == group]

    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def test_built_ins_are_not_published_as_entry_points() -> None:
    schedulers = {ep.name for ep in entry_points(group="atoll.schedulers")}
    transports = {ep.name for ep in entry_points(group="atoll.transports")}
    assert not schedulers & {"fifo", "bounded-fifo"}
    assert not transports & {"inproc", "capnp"}
    assert {"fifo"} <= set(scheduler_names())
    assert {"inproc", "capnp"} <= set(transport_names())


def test_a_plugin_policy_loads_from_its_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    plugins = {"plugin-fifo": "atoll.schedulers:FifoPolicy", "fifo": "atoll.schedulers:Event"}
    install_plugins(monkeypatch, _protocol, "atoll.schedulers", plugins)
    assert "plugin-fifo" in scheduler_names()
    assert isinstance(get_scheduler("plugin-fifo"), FifoPolicy)
    assert isinstance(get_scheduler("fifo"), FifoPolicy)  # a name registered in code wins


def test_a_plugin_transport_loads_from_its_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    plugins = {"plugin": "atoll.transports:InprocTransport"}
    install_plugins(monkeypatch, _base, "atoll.transports", plugins)
    assert "plugin" in transport_names()
    assert isinstance(get_transport("plugin://somewhere"), InprocTransport)


def test_capnp_is_registered_but_imported_on_first_use() -> None:
    code = (
        "import sys; from atoll.transports import get_transport, transport_names\n"
        "print('capnp' in transport_names(), 'capnp' in sys.modules)\n"
        "print(type(get_transport('capnp://127.0.0.1:1')).__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, close_fds=False
    )
    assert done.stdout.split() == ["True", "False", "CapnpTransport"], done.stderr
