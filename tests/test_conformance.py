"""The transport conformance suite, run over every transport available here.

Each entry of ``HARNESSES`` builds a :class:`Harness` on one transport; every
check of the suite runs against each of them, unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import pytest

from atoll.kernel import ActorSystem, wait_idle
from atoll.transports import get_transport
from atoll.transports.conformance import CHECKS, Harness

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def inproc_harness() -> AsyncIterator[Harness]:
    transport = get_transport("inproc")
    async with ActorSystem("server") as server, ActorSystem("client") as client:
        listener = await transport.serve(server)
        connection = await transport.connect(listener.address, client)
        yield Harness(connection.node, wait_idle)
        await connection.aclose()
        await listener.aclose()


HARNESSES: dict[str, Callable[[], AbstractAsyncContextManager[Harness]]] = {
    "inproc": inproc_harness,
}


@pytest.fixture(params=["inproc", "capnp"])
async def harness(request: pytest.FixtureRequest, anyio_backend: str) -> AsyncIterator[Harness]:
    if request.param == "capnp" and anyio_backend != "asyncio":
        pytest.skip("pycapnp runs on asyncio; trio reaches it through the bridge")
    async with HARNESSES[request.param]() as built:
        yield built


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
async def test_transport_conforms(
    harness: Harness, check: Callable[[Harness], Awaitable[None]]
) -> None:
    await check(harness)


@asynccontextmanager
async def capnp_harness() -> AsyncIterator[Harness]:
    from atoll.transports.capnp import CapnpTransport, capnp_runtime

    transport = CapnpTransport(token=b"conformance")
    async with (
        capnp_runtime(),
        ActorSystem("server") as server,
        ActorSystem("client") as client,
    ):
        listener = await transport.serve(server)
        connection = await transport.connect(listener.address, client)
        try:
            yield Harness(connection.node, wait_idle)
        finally:
            await connection.aclose()
            await listener.aclose()


HARNESSES["capnp"] = capnp_harness
