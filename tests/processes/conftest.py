"""Tests that start processes: ``atoll up``, host processes, node processes,
clients of their own. They run on asyncio (Cap'n Proto's event loop); a
test that reaches a cluster from trio, through the bridge, says so itself."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
