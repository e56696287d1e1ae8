"""Shared fixtures: every async test runs on asyncio and on trio; other machines."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    backend: str = request.param
    return backend


@pytest.fixture(autouse=True)
def _collector_per_test() -> Iterator[None]:
    """Each test starts with the collector as the process had it: a test
    that runs mypy in-process leaves its thresholds raised (200,000), and a
    later test whose buffers are freed by the collector would wait for ever."""
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    yield
    gc.set_threshold(*threshold)
    if enabled:
        gc.enable()


@pytest.fixture(autouse=True)
def _settings_per_test() -> Iterator[None]:
    """Each test reads the settings (``atoll.kernel.config``) from the
    environment as it finds it, once, as a process does at its start."""
    from atoll.kernel import config

    config.reset()
    yield
    config.reset()


@pytest.fixture
def other_machines(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every process (this one and the hosts started from here) a machine of its
    own: large arrays between them take the bulk byte stream, not shared memory."""
    from atoll.kernel import config
    from atoll.transports.dataplane import shm

    monkeypatch.setenv("ATOLL_MACHINE_ID", "per-process")
    config.reset()
    shm.machine_id.cache_clear()
    yield
    monkeypatch.delenv("ATOLL_MACHINE_ID")
    config.reset()
    shm.machine_id.cache_clear()
