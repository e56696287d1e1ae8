"""The inbox state machine (``devices/_inbox.py``), driven with no actor."""

from __future__ import annotations

import random
from collections import Counter

from atoll.devices._inbox import (
    Abandoned,
    Drop,
    Failed,
    Forget,
    Inboxes,
    InboxEvent,
    Landed,
    Redirected,
    Reject,
    Settle,
    Taken,
)

BOOM = RuntimeError("producer failed")


def test_a_landing_settles_the_reader_and_a_second_copy_is_dropped() -> None:
    inboxes = Inboxes()
    assert inboxes.handle(Landed("k", "b1", "v")) == [Settle("k", "v")]
    assert inboxes.handle(Landed("k", "b2", "v")) == [Drop("b2")]  # a lane resent by call
    assert inboxes.handle(Failed("k", BOOM)) == []  # it landed after all
    assert inboxes.landed("k") == "b1"
    assert inboxes.handle(Taken("k")) == [Forget("k")]  # the reader owns b1 now
    assert inboxes.handle(Landed("k", "b3", "v")) == [Drop("b3")]  # closed
    assert inboxes.landed("k") is None


def test_the_first_answer_wins() -> None:
    inboxes = Inboxes()
    assert inboxes.handle(Redirected("r", "handle")) == [Settle("r", "handle")]
    assert inboxes.handle(Failed("r", BOOM)) == []
    assert inboxes.handle(Landed("r", "b", "v")) == [Drop("b")]  # after a redirect
    assert inboxes.handle(Failed("f", BOOM)) == [Reject("f", BOOM)]
    assert inboxes.handle(Redirected("f", "handle")) == []


def test_a_reader_that_gives_up_first_frees_what_lands_later() -> None:
    inboxes = Inboxes()
    assert inboxes.handle(Abandoned("k")) == [Forget("k")]
    assert inboxes.abandoned == 1
    assert inboxes.handle(Landed("k", "b", "v")) == [Drop("b")]  # and the key closes
    assert inboxes.abandoned == 0
    assert inboxes.handle(Landed("k", "b2", "v")) == [Drop("b2")]
    assert inboxes.handle(Failed("k", BOOM)) == []


def test_giving_up_after_a_landing_frees_it_at_once() -> None:
    inboxes = Inboxes()
    inboxes.handle(Landed("k", "b", "v"))
    assert inboxes.handle(Abandoned("k")) == [Forget("k"), Drop("b")]
    assert inboxes.abandoned == 0  # closed: nothing more comes
    assert inboxes.handle(Redirected("k", "h")) == []
    inboxes.handle(Failed("f", BOOM))
    assert inboxes.handle(Abandoned("f")) == [Forget("f")]
    assert inboxes.abandoned == 0


def test_only_the_latest_settled_keys_are_remembered() -> None:
    inboxes = Inboxes(settled_kept=2)
    for key in ("a", "b", "c"):
        inboxes.handle(Taken(key))
    assert inboxes.handle(Landed("c", "x", "v")) == [Drop("x")]
    assert inboxes.handle(Landed("a", "y", "v")) == [Settle("a", "v")]  # forgotten: open again


def test_the_log_keeps_the_latest_events_in_order() -> None:
    inboxes = Inboxes(log_kept=3)
    events: list[InboxEvent] = [Landed("k", "b", 1), Taken("k"), Failed("j", BOOM), Abandoned("j")]
    for event in events:
        inboxes.handle(event)
    assert list(inboxes.log) == [("Taken", "k"), ("Failed", "j"), ("Abandoned", "j")]


def test_any_order_of_notices_frees_every_buffer_once_and_settles_each_reader_once() -> None:
    """Random notices over a few keys: each landed buffer ends dropped
    exactly once, or owned by the reader that took it, or still waiting to
    be taken; a reader's promise settles at most once, and only while it is
    held; a taken or abandoned key is never settled again."""
    rng = random.Random(7)
    for trial in range(300):
        inboxes = Inboxes(settled_kept=1000)
        keys = [f"k{i}" for i in range(3)]
        dropped: Counter[str] = Counter()
        settled: Counter[str] = Counter()
        done: set[str] = set()
        taken: dict[str, str] = {}
        landed: list[str] = []
        for step in range(12):
            key = rng.choice(keys)
            event = _random_event(rng, key, f"b{trial}.{step}")
            if isinstance(event, Landed):
                landed.append(event.buffer_id)
            if isinstance(event, Taken) and (held := inboxes.landed(key)) is not None:
                taken[key] = held
            for instruction in inboxes.handle(event):
                if isinstance(instruction, Drop):
                    dropped[instruction.buffer_id] += 1
                elif isinstance(instruction, (Settle, Reject)):
                    assert instruction.key not in done, (trial, step, event)
                    settled[instruction.key] += 1
            if isinstance(event, (Taken, Abandoned)):
                done.add(key)
        assert all(n == 1 for n in settled.values()), settled
        assert all(n == 1 for n in dropped.values()), dropped
        kept = set(taken.values()) | {b for k in keys if (b := inboxes.landed(k)) is not None}
        assert set(dropped).isdisjoint(kept)
        assert set(dropped) | kept == set(landed), (trial, landed, dropped, kept)


def _random_event(rng: random.Random, key: str, buffer_id: str) -> InboxEvent:
    kind = rng.choice(["land", "land", "redirect", "fail", "take", "abandon"])
    if kind == "land":
        return Landed(key, buffer_id, buffer_id)
    if kind == "redirect":
        return Redirected(key, "producer's handle")
    if kind == "fail":
        return Failed(key, BOOM)
    return Taken(key) if kind == "take" else Abandoned(key)
