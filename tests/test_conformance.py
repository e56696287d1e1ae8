"""The transport conformance suite, run over every transport available here."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from atoll.kernel import ActorSystem, wait_idle
from atoll.transports import get_transport
from atoll.transports.conformance import CHECKS, Harness

pytestmark = pytest.mark.anyio


@pytest.fixture
async def inproc_harness() -> AsyncIterator[Harness]:
    transport = get_transport("inproc")
    async with ActorSystem("server") as server, ActorSystem("client") as client:
        listener = await transport.serve(server)
        connection = await transport.connect(listener.address, client)
        yield Harness(connection.node, wait_idle)
        await connection.aclose()
        await listener.aclose()


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
async def test_inproc(inproc_harness: Harness, check: Callable[[Harness], Awaitable[None]]) -> None:
    await check(inproc_harness)
