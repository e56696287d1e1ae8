"""How the hot values of a run travel over Cap'n Proto (issue 34).

A buffer handle pickles as its fields, its small value as bytes (any dtype
comes back as it went); a local actor's capability is made once per
connection and its endpoint names go with its first send only, the far
side keeping them by actor id; values that travel aside (actors, promises)
still come back inside pickled values.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from atoll.devices import BufferHandle, CostModel, Host, SimDevice
from atoll.kernel import ActorRef, ActorSystem, Promise
from atoll.kernel.lowlevel import channel_of
from atoll.transports.capnp import capnp_runtime
from atoll.transports.capnp._codec import decode, encode
from atoll.transports.capnp._peer import Peer
from atoll.transports.capnp._schema import schema

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # pycapnp runs on asyncio


def _round_trip(peer: Peer, value: object) -> object:
    message = schema.Value.new_message()
    encode(peer, message, value)
    return decode(peer, message.as_reader())


@pytest.mark.parametrize(
    "value",
    [
        np.arange(3, dtype=np.float32),
        np.ones((2, 2), dtype=ml_dtypes.bfloat16),
        np.array([True, False]),
        np.array(5, dtype=np.int64),
        None,
    ],
    ids=["float32", "bfloat16", "bool", "scalar", "none"],
)
async def test_a_handle_comes_back_with_its_value_and_dtype(value: np.ndarray | None) -> None:
    async with capnp_runtime(), ActorSystem("wire") as system:
        host = system.spawn(Host, 0, 0, [0], SimDevice, CostModel(), name="host0")
        array = np.zeros(1, np.float32) if value is None else value
        handle = BufferHandle.of("host0:1", array, host, 0, 0, 0, "capnp://127.0.0.1:1")
        if value is None:
            handle = dataclasses.replace(handle, value=None)
        back = _round_trip(Peer("wire"), [handle])
        assert isinstance(back, list) and isinstance(back[0], BufferHandle)
        got = back[0]
        assert [getattr(got, f) for f in _FIELDS[2:]] == [getattr(handle, f) for f in _FIELDS[2:]]
        assert got.id == handle.id and got.host.id == host.id
        if value is None:
            assert got.value is None
        else:
            assert got.value is not None and got.value.dtype == value.dtype
            np.testing.assert_array_equal(got.value, value)
            assert not got.value.flags.writeable


_FIELDS = ("id", "host", "host_id", "device_id", "shape", "dtype", "nbytes", "island", "address")


async def test_an_actor_s_endpoint_names_go_once_per_connection() -> None:
    async with capnp_runtime(), ActorSystem("wire") as system:
        host = system.spawn(Host, 0, 0, [0], SimDevice, CostModel(), name="host0")
        peer = Peer("wire")
        first, second = schema.Value.new_message(), schema.Value.new_message()
        encode(peer, first, host)
        encode(peer, second, host)
        assert len(first.actor.endpoints) > 10 and len(second.actor.endpoints) == 0
        assert first.actor.cap is not None
        refs = [decode(peer, m.as_reader()) for m in (first, second)]
        for ref in refs:
            assert isinstance(ref, ActorRef)
            endpoints = channel_of(ref).endpoints
            assert endpoints is not None and "free_many" in endpoints


async def test_actors_and_promises_inside_a_pickled_value_travel_aside() -> None:
    async with capnp_runtime(), ActorSystem("wire") as system:
        host = system.spawn(Host, 0, 0, [0], SimDevice, CostModel(), name="host0")
        done: Promise[int] = Promise("done")
        done.set_result(3)
        back = _round_trip(Peer("wire"), {"where": (host, done), "n": {1, 2}})
        assert isinstance(back, dict)
        ref, value = back["where"]
        assert isinstance(ref, ActorRef) and ref.id == host.id
        assert value == 3 and back["n"] == {1, 2}
