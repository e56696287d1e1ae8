"""The host object store: refcounts, owners and back-pressure."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from atoll.devices import BufferMissing, ObjectStore
from atoll.kernel import AtollError, Promise, wait_idle

pytestmark = pytest.mark.anyio


def test_refcounts_and_owners() -> None:
    store = ObjectStore("h0")
    a = store.put(np.ones(4, np.float32), owner="alice")
    b = store.put(np.ones(2, np.float64), owner="bob")
    assert store.used_bytes == 32
    store.incref(a)
    assert not store.decref(a)
    assert store.decref(a)
    with pytest.raises(BufferMissing):
        store.get(a)
    assert store.free_owner("bob") == 1 and store.used_bytes == 0
    with pytest.raises(BufferMissing):
        store.decref(b)


def test_a_buffer_dropped_after_its_computation_failed_says_why() -> None:
    """A reader that comes after the failed future was dropped gets the
    computation's error, not BufferMissing; a buffer merely freed does not."""
    store = ObjectStore("h0")
    ready: Promise[None] = Promise("computed")
    failed_id = store.put(np.ones(4, np.float32), owner="alice", ready=ready)
    freed_id = store.put(np.ones(4, np.float32), owner="alice")
    ready.set_exception(ValueError("the kernel failed"))
    store.decref(failed_id)
    store.decref(freed_id)
    store.check_owner(failed_id, "alice")
    assert isinstance(store.failure(failed_id), ValueError)
    pending = store.pending(failed_id)
    assert pending is not None and isinstance(pending.exception(), ValueError)
    with pytest.raises(ValueError, match="the kernel failed"):
        store.get(failed_id)
    with pytest.raises(BufferMissing):
        store.decref(failed_id)  # nothing is held for it
    with pytest.raises(BufferMissing):
        store.get(freed_id)
    assert store.used_bytes == 0


def test_stored_arrays_are_read_only() -> None:
    store = ObjectStore("h0")
    source = np.zeros(3)
    held = store.get(store.put(source))
    assert np.shares_memory(held, source) and not held.flags.writeable


async def test_reserve_waits_for_room_then_resumes() -> None:
    store = ObjectStore("h0", capacity_bytes=64)
    first = store.put(np.zeros(8))  # 64 bytes: full
    admitted: list[str] = []

    async def writer() -> None:
        await store.reserve(32)
        admitted.append(store.put(np.zeros(4), reserved=True))

    async with anyio.create_task_group() as tg:
        tg.start_soon(writer)
        await wait_idle()
        assert admitted == []  # blocked: the store is full
        store.decref(first)
    assert len(admitted) == 1 and store.used_bytes == 32
    with pytest.raises(AtollError, match="never fit"):
        await store.reserve(65)


def test_an_inbox_closed_by_a_failure_leaves_nothing_behind() -> None:
    store = ObjectStore("h0")
    store.fail("k1", AtollError("producer failed"))
    store.abandon("k1")  # the reader gave up after the failure came in
    assert store.pending_arrivals() == 0
    store.redirect("k2", "the producer's handle")
    store.take("k2")
    store.fail("k2", AtollError("late notice"))  # after the reader took it: dropped
    assert store.pending_arrivals() == 0


def test_a_push_landing_after_its_inbox_was_settled_is_freed() -> None:
    store = ObjectStore("h0")
    store.fail("k", AtollError("producer failed"))
    store.take("k")
    buffer_id = store.put(np.ones(4, np.float32), owner="o")
    store.deliver("k", "pushed", buffer_id)  # too late: its reference is dropped
    assert len(store) == 0 and store.pending_arrivals() == 0


def test_a_key_given_up_on_stays_closed_through_every_notice() -> None:
    store = ObjectStore("h0")
    store.abandon("k")
    store.redirect("k", "handle")
    store.fail("k", AtollError("then a failure"))
    buffer_id = store.put(np.ones(4, np.float32), owner="o")
    store.deliver("k", "pushed", buffer_id)
    assert len(store) == 0 and store.pending_arrivals() == 0


@pytest.mark.parametrize("settle", ["fail", "redirect", "deliver"])
def test_a_second_copy_on_a_settled_untaken_inbox_is_freed(settle: str) -> None:
    """A lane's push sent again by call, or one landing after its inbox was
    failed or redirected but before its reader took it: dropped at once."""
    store = ObjectStore("h0")
    if settle == "fail":
        store.fail("k", AtollError("producer failed"))
    elif settle == "redirect":
        store.redirect("k", "the producer's handle")
    else:
        store.deliver("k", "first copy", store.put(np.ones(4, np.float32), owner="o"))
    late = store.put(np.ones(4, np.float32), owner="o")
    store.deliver("k", "second copy", late)
    assert late not in store._entries
    store.take("k")
    assert len(store) == (1 if settle == "deliver" else 0)  # the first copy, its reader's


def test_a_buffer_that_comes_back_before_its_old_copy_went_replaces_it() -> None:
    """A moved buffer (``runtime/control/elastic.py``) handed over from this store
    and moved back here before its old copy was dropped: the new copy takes
    its place, and what was handed over no longer points away."""
    store = ObjectStore("h")
    old = store.put(np.arange(4.0), "alice", place=0)
    store.moved_out[old] = "elsewhere"
    again = store.put(np.arange(4.0) + 1, "alice", place=1, buffer_id=old)
    assert again == old and old not in store.moved_out
    assert store.place_of(old) == 1 and len(store) == 1
    np.testing.assert_array_equal(store.get(old), np.arange(4.0) + 1)
    with pytest.raises(AtollError, match="already in store"):
        store.put(np.zeros(2), "alice", buffer_id=old)  # not handed over: refused
