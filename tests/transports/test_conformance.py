"""The transport conformance suite, run over every transport available here.

Each entry of ``HARNESSES`` builds a :class:`Harness` on one transport; every
check of the suite runs against each of them, unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Any

import anyio
import pytest

from atoll.kernel import ActorSystem, wait_idle
from atoll.kernel.lowlevel import detach_wait_counter
from atoll.transports import get_transport
from atoll.transports.conformance import CHECKS, Harness
from atoll.transports.testing import NodeProcess

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def transport_harness(name: str) -> AsyncIterator[Harness]:
    """Both ends in this process, over the registered transport ``name``."""
    transport = get_transport(name)  # one instance: both ends share its token
    async with (
        _runtime(name),
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


def _runtime(name: str) -> AbstractAsyncContextManager[Any]:
    if name == "inproc":
        return nullcontext()
    from atoll.transports.capnp import capnp_runtime

    return capnp_runtime()


HARNESSES: dict[str, Callable[[], AbstractAsyncContextManager[Harness]]] = {
    "inproc": lambda: transport_harness("inproc"),
    "capnp": lambda: transport_harness("capnp"),
}


@asynccontextmanager
async def capnp_process_harness() -> AsyncIterator[Harness]:
    """The far side in another OS process (one node process per module run)."""
    from atoll.transports.capnp import CapnpTransport, capnp_runtime

    node = _shared_node()
    async with capnp_runtime(), ActorSystem("client") as client:
        connection = await CapnpTransport(_NODE_TOKEN).connect(node.address, client)

        async def settle() -> None:
            async def far_side() -> None:
                detach_wait_counter()  # the harness's waits are not the check's
                await connection.node.settle()

            # Round trips may cause more round trips (a sender waiting for its
            # admission sends again): repeat until a round sends nothing new.
            while True:
                before = connection.peer.calls_sent
                await wait_idle()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(far_side)
                await wait_idle()
                if connection.peer.calls_sent == before + 1:  # only the settle call
                    return

        try:
            yield Harness(connection.node, settle)
        finally:
            await connection.aclose()


_NODE_TOKEN = b"conformance-process"
_NODES: list[NodeProcess] = []


def _shared_node() -> NodeProcess:
    if not _NODES or not _NODES[0].alive():
        _NODES[:] = [NodeProcess(_NODE_TOKEN)]
    return _NODES[0]


@pytest.fixture(scope="module", autouse=True)
def _stop_shared_node() -> Iterator[None]:
    yield
    for node in _NODES:
        node.stop()
    _NODES.clear()


HARNESSES["capnp-process"] = capnp_process_harness


@pytest.fixture(params=list(HARNESSES))
async def harness(request: pytest.FixtureRequest, anyio_backend: str) -> AsyncIterator[Harness]:
    if request.param != "inproc" and anyio_backend != "asyncio":
        pytest.skip("pycapnp runs on asyncio; trio reaches it through the bridge")
    async with HARNESSES[request.param]() as built:
        yield built


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
async def test_transport_conforms(
    harness: Harness,
    check: Callable[[Harness], Awaitable[None]],
) -> None:
    await check(harness)
