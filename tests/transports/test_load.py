"""Back-pressure per connection at a node (issue 13, "Load").

Functional, not timed: the tests count answers and refusals and read the
node's counters (``Peer.calls_in``, ``answers_out``, ``holds``, ``refused``),
never a clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from atoll.kernel import ActorSystem, MailboxFull, Promise, VirtualClock, use_clock
from atoll.transports.capnp import CapnpTransport, _peer, capnp_runtime
from atoll.transports.capnp._peer import LaterServer, Peer
from atoll.transports.testing import NodeProcess, eventually

pytestmark = pytest.mark.anyio
CONF = "atoll.transports.conformance"
TOKEN = b"test-load-token"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def flooded() -> AsyncIterator[tuple[Any, Any, Any, list[Promise[Any]]]]:
    """A node bounded at 8 calls per connection, a client that has put 3,000
    calls on a latch there (``latch``), and another client: ``(listener,
    flooder, other, calls)``."""
    async with capnp_runtime(), ActorSystem("node") as served, ActorSystem("c") as mine:
        transport = CapnpTransport(TOKEN, max_calls=8)
        listener = await transport.serve(served)
        flooder = await transport.connect(listener.address, mine)
        other = await transport.connect(listener.address, mine)
        try:
            latch = await flooder.node.spawn(f"{CONF}:Latch", name="latch")
            yield listener, flooder, other, [latch.wait() for _ in range(3000)]
        finally:
            await flooder.aclose()
            await other.aclose()
            await listener.aclose()


async def tally(calls: list[Promise[Any]]) -> tuple[int, int]:
    """How many of ``calls`` were answered "go", and how many refused."""
    answered = refused = 0
    for call in calls:
        try:
            assert await call == "go"
            answered += 1
        except MailboxFull:
            refused += 1
    return answered, refused


async def test_a_flood_is_held_near_the_bound_and_loses_nothing() -> None:
    """3,000 calls at once, none answerable yet: the node stops reading that
    connection near the bound (one socket read past it) instead of taking them
    all in, while another client is served. Once they can be answered, each
    call is answered or refused (answers the client has not taken yet count
    against the bound too), every admitted one answered."""
    async with flooded() as (listener, _, other, calls):
        await eventually(lambda: any(p.held for p in listener.peers), "a hold", every=0.001)
        held = next(p for p in listener.peers if p.held)
        echo = await other.node.spawn(f"{CONF}:Echo")
        assert [await echo.echo(i) for i in range(20)] == list(range(20))
        admitted = held.calls_in
        assert admitted < 3000  # the rest wait unread, in TCP and in the client
        assert [await echo.echo(i) for i in range(20)] == list(range(20))
        assert held.held and held.calls_in == admitted  # nothing more was read
        await (await other.node.lookup("latch")).release("go")
        answered, refused = await tally(calls)
        assert answered + refused == 3000 and answered >= admitted
        assert held.holds >= 1 and held.refused == refused


async def test_a_hold_that_lasts_turns_into_refusals() -> None:
    """Calls that are not being answered (a latch) must not keep the socket
    unread for ever: after ``HOLD_S`` (of the node's clock) the node reads
    again, so the flooding client's own ping is answered (refused, beyond
    the bound), and the calls beyond the bound are refused; the admitted
    ones complete on release."""
    clock = VirtualClock(autojump=False)
    with use_clock(clock):
        async with flooded() as (listener, flooder, other, calls):
            await eventually(lambda: any(p.held for p in listener.peers), "a hold", every=0.001)
            held = next(p for p in listener.peers if p.held)
            clock.advance(_peer.HOLD_S - 0.001)
            assert held.held and not held.refusing  # not yet
            clock.advance(0.001)
            assert held.refusing
            with pytest.raises(MailboxFull, match="ATOLL_CONNECTION_CALLS"):
                await flooder.node.ping()
            admitted = held.calls_in
            await (await other.node.lookup("latch")).release("go")
            answered, refused = await tally(calls)
            assert answered + refused == 3000 and answered >= admitted and refused > 0
            assert isinstance(await flooder.node.ping(), str)  # served again


async def test_answers_not_taken_are_bounded_by_refusal() -> None:
    """Answers the far side has not let go of count against the bound; beyond
    it a call is refused (``MailboxFull``), and accepted again once one goes."""
    peer = Peer("test", max_calls=2)
    done: Promise[Any] = Promise("done")
    done.set_result(1)
    held = [LaterServer(done, peer, counted=True) for _ in range(2)]
    assert peer.answers_out == 2
    assert not peer.call_arrived()
    assert peer.refused == 1 and peer.calls_in == 0
    assert isinstance(peer.refusal("a"), MailboxFull)
    assert "ATOLL_CONNECTION_CALLS" in str(peer.refusal("a"))
    held.pop()
    assert peer.answers_out == 1
    assert peer.call_arrived()
    peer.call_answered()
    assert peer.calls_in == 0


async def test_a_flooding_client_is_answered_or_refused_and_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Against a node process with a small bound: every call of a 2,000-call
    burst is either answered or refused, the actor ran exactly the answered
    ones, and a well-behaved client on its own connection is served in full."""
    monkeypatch.setenv("ATOLL_CONNECTION_CALLS", "16")
    node = NodeProcess(TOKEN)
    try:
        async with capnp_runtime(), ActorSystem("client") as system:
            transport = CapnpTransport(TOKEN)
            flooder = await transport.connect(node.address, system)
            probe = await transport.connect(node.address, system)
            try:
                counter = await flooder.node.spawn(f"{CONF}:Counter")
                echo = await probe.node.spawn(f"{CONF}:Echo")
                calls = [counter.add(1) for _ in range(2000)]
                echoed = [await echo.echo(i) for i in range(50)]
                answered = refused = 0
                for call in calls:
                    try:
                        await call
                        answered += 1
                    except MailboxFull as exc:
                        assert "ATOLL_CONNECTION_CALLS" in str(exc)
                        refused += 1
                assert answered + refused == 2000 and answered >= 16
                assert await counter.add(0) == answered  # refused calls never ran
                assert echoed == list(range(50))
            finally:
                await flooder.aclose()
                await probe.aclose()
    finally:
        node.stop()
