"""Push lanes (``transports/dataplane/lane.py``): token, delivery, acknowledgement, fallback.

Lanes serve host processes, which run asyncio; these tests run a listener and
a sender in one loop, over real TCP on loopback.
"""

from __future__ import annotations

import asyncio
import functools
import pickle
import struct
from collections.abc import AsyncIterator

import numpy as np
import pytest

from atoll.kernel import VirtualClock
from atoll.kernel.config import settings
from atoll.transports.dataplane import lane
from atoll.transports.testing import eventually

pytestmark = pytest.mark.anyio

TOKEN = b"t" * 32


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def listening() -> AsyncIterator[tuple[str, list[lane.LaneMessage]]]:
    got: list[lane.LaneMessage] = []
    address = await lane.serve("127.0.0.1", TOKEN)
    lane.register(7, got.append)
    try:
        yield address, got
    finally:
        lane.register(7, None)
        await lane.aclose()


def message(value: float, shape: tuple[int, ...] = (3,)) -> lane.LaneMessage:
    return lane.LaneMessage(7, ("k1", "k2"), "alice", 0, np.full(shape, value, np.float32))


async def test_frames_arrive_in_order_and_are_acknowledged(
    listening: tuple[str, list[lane.LaneMessage]],
) -> None:
    address, got = listening
    assert await lane.connect(address, TOKEN)
    lost: list[lane.LaneMessage] = []
    for i in range(50):
        assert lane.send(address, message(float(i)), lost.append)
    scalar = lane.LaneMessage(7, ("s",), "", 1, np.array(2.5, np.float64))
    assert lane.send(address, scalar, lost.append)
    await eventually(lambda: len(got) == 51, "51 frames delivered", every=0.001)
    assert [float(m.array[0]) for m in got[:50]] == [float(i) for i in range(50)]
    assert got[0].keys == ("k1", "k2") and got[0].owner == "alice"
    assert got[50].array.shape == () and float(got[50].array) == 2.5  # 0-d stays 0-d
    assert not got[0].array.flags.writeable
    link = lane._links[address]
    await eventually(lambda: not link.unacked, "every frame acknowledged", every=0.001)
    assert lost == []


async def test_a_wrong_token_is_refused_and_nothing_is_delivered(
    listening: tuple[str, list[lane.LaneMessage]],
) -> None:
    address, got = listening
    refused = lane.stats["refused"]
    assert await lane.connect(address, b"w" * 32)
    lost: list[lane.LaneMessage] = []
    assert lane.send(address, message(1.0), lost.append)
    await eventually(lambda: lost, "the unacknowledged frame handed back", every=0.001)
    assert got == [] and lane.stats["refused"] == refused + 1


async def test_a_closed_lane_is_not_used_and_a_new_one_opens(
    listening: tuple[str, list[lane.LaneMessage]],
) -> None:
    address, got = listening
    assert await lane.connect(address, TOKEN)
    link = lane._links[address]
    lost: list[lane.LaneMessage] = []
    link.close()  # closes before any acknowledgement can come back
    await eventually(lambda: link.closed, "the lane closed", every=0.001)
    assert not lane.send(address, message(1.0), lost.append)  # no lane: push by call
    assert await lane.connect(address, TOKEN)  # a new one opens
    assert lane.send(address, message(2.0), lost.append)
    await eventually(lambda: len(got) == 1, "delivered on the new lane", every=0.001)


async def test_hostile_frames_close_only_their_connection(
    listening: tuple[str, list[lane.LaneMessage]],
) -> None:
    address, got = listening
    host, _, port = address.rpartition(":")
    for garbage in (
        struct.pack("!IQ", 1 << 20, 0),  # a header too big
        struct.pack("!IQ", 4, lane.MAX_BODY + 1),  # a body too big
        struct.pack("!IQ", 4, 0) + b"\x80\x05JJ",  # a header that does not unpickle
    ):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(struct.pack("!4sH", lane.MAGIC, len(TOKEN)) + TOKEN + garbage)
        await writer.drain()
        assert await reader.read() == b""  # closed by the listener
        writer.close()
    assert await lane.connect(address, TOKEN)  # the listener still serves
    assert lane.send(address, message(3.0), lambda m: None)
    await eventually(lambda: len(got) == 1, "a good frame still delivered", every=0.001)


async def test_a_connection_that_shows_no_token_in_time_is_closed() -> None:
    """The hello deadline runs on the listener's clock: connections that
    have not shown the token when it passes are closed, the others serve."""
    clock = VirtualClock(autojump=False)
    got: list[lane.LaneMessage] = []
    address = await lane.serve("127.0.0.1", TOKEN, clock)
    lane.register(7, got.append)
    host, _, port = address.rpartition(":")
    refused, accepted = lane.stats["refused"], lane.stats["accepted"]
    try:
        silent = await asyncio.open_connection(host, int(port))
        partial = await asyncio.open_connection(host, int(port))
        partial[1].write(struct.pack("!4sH", lane.MAGIC, len(TOKEN)) + TOKEN[:5])  # half a hello
        assert await lane.connect(address, TOKEN)  # shows it
        assert lane.send(address, message(0.0), lambda m: None)
        await eventually(lambda: len(got) == 1, "a frame on the trusted lane")
        await eventually(lambda: lane.stats["accepted"] == accepted + 3, "three connections")
        clock.advance(lane.HELLO_TIMEOUT_S - 0.001)
        assert lane.stats["refused"] == refused  # not yet
        clock.advance(0.001)
        for reader, writer in (silent, partial):
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the listener
            writer.close()
        assert lane.stats["refused"] == refused + 2
        assert lane.send(address, message(1.0), lambda m: None)  # the one that showed it serves
        await eventually(lambda: len(got) == 2, "another frame on the trusted lane")
    finally:
        lane.register(7, None)
        await lane.aclose()


async def test_an_acknowledgement_waits_its_delay_on_the_listeners_clock() -> None:
    clock = VirtualClock(autojump=False)
    got: list[lane.LaneMessage] = []
    address = await lane.serve("127.0.0.1", TOKEN, clock)
    lane.register(7, got.append)
    try:
        assert await lane.connect(address, TOKEN)
        assert lane.send(address, message(1.0), lambda m: None)
        await eventually(lambda: len(got) == 1, "the frame delivered")
        link = lane._links[address]
        assert link.unacked  # the acknowledgement waits for its delay
        clock.advance(settings().lane_ack_s)
        await eventually(lambda: not link.unacked, "the frame acknowledged")
    finally:
        lane.register(7, None)
        await lane.aclose()


async def test_a_large_value_does_not_take_a_lane(
    listening: tuple[str, list[lane.LaneMessage]],
) -> None:
    address, _ = listening
    assert await lane.connect(address, TOKEN)
    big = message(0.0, (lane.MAX_BODY // 4 + 1,))
    assert not lane.send(address, big, lambda m: None)


async def test_no_lane_to_a_closed_port() -> None:
    assert not await lane.connect("127.0.0.1:9", TOKEN)


def test_only_dtypes_their_string_names_exactly_take_a_lane() -> None:
    assert lane.fits(np.zeros(3, np.float32)) and lane.fits(np.array(1, np.int64))
    assert not lane.fits(np.zeros(3, np.dtype([("a", np.int32), ("b", np.float32)])))
    assert not lane.fits(np.array([object()], dtype=object))
    assert not lane.fits(np.zeros(2, np.dtype("V2")))  # how bfloat16 spells itself


async def test_frames_cut_at_every_byte_still_arrive(
    listening: tuple[str, list[lane.LaneMessage]],
) -> None:
    address, got = listening
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    header = pickle.dumps((7, ("k",), "", 0, "<f4", (2,)))
    body = np.array([1.5, 2.5], np.float32).tobytes()
    hello = struct.pack("!4sH", lane.MAGIC, len(TOKEN)) + TOKEN
    data = hello + struct.pack("!IQ", len(header), len(body)) + header + body
    for i in range(len(data)):
        writer.write(data[i : i + 1])
        await writer.drain()
    await eventually(lambda: len(got) == 1, "the frame, whole", every=0.001)
    assert got[0].array.tolist() == [1.5, 2.5]
    assert struct.unpack("!Q", await reader.readexactly(8)) == (1,)  # acknowledged
    writer.close()


async def test_a_frame_for_a_host_not_there_is_handed_back(
    listening: tuple[str, list[lane.LaneMessage]],
) -> None:
    address, got = listening
    assert await lane.connect(address, TOKEN)
    lost: list[lane.LaneMessage] = []
    stray = lane.LaneMessage(99, ("k",), "", 0, np.zeros(1, np.float32))
    assert lane.send(address, stray, lost.append)
    await eventually(
        lambda: lost == [stray], "the stray frame handed back, unacknowledged", every=0.001
    )
    assert got == []


async def test_a_frame_for_a_host_that_stopped_here_is_said_quietly(
    listening: tuple[str, list[lane.LaneMessage]], caplog: pytest.LogCaptureFixture
) -> None:
    """A push still on its way as its reader's host stops (a cluster going
    down with work in flight) is not a warning; one for a host that never
    took frames here is. Either way the sender gets its frame back."""
    address, _ = listening
    lane.register(8, lambda _: None)
    lane.register(8, None)
    for host, level in ((8, "INFO"), (9, "WARNING")):
        caplog.clear()
        assert await lane.connect(address, TOKEN)
        lost: list[lane.LaneMessage] = []
        with caplog.at_level("INFO", "atoll.transports.dataplane.lane"):
            sent = lane.LaneMessage(host, ("k",), "", 0, np.zeros(1, np.float32))
            assert lane.send(address, sent, lost.append)
            await eventually(functools.partial(bool, lost), "the frame handed back", every=0.001)
        said = [r for r in caplog.records if "which is not here" in r.getMessage()]
        assert [r.levelname for r in said] == [level]
