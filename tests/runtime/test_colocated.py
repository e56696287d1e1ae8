"""Colocated Python, part one (issue 37): a session's actors on the hosts.

``cluster.spawn(MyActor, ..., host=h)`` starts an actor of the user's class
in a host's process, beside its devices. Checked in one process (asyncio
and trio) and over host processes: its state, an error that reaches the
caller with its type and traceback while the actor goes on, supervision as
the caller asked (restart or stop), a session that ends stopping its actors,
and a killed host giving ``HostLost``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

import atoll
from atoll.kernel import Actor, ActorStopped, HostLost, UsageError, endpoint
from atoll.transports.testing import atoll_up

pytestmark = pytest.mark.anyio


class Tally(Actor):
    """A session's state kept on a host: a running total, and where it runs."""

    def __init__(self, start: int = 0) -> None:
        self.total = start

    @endpoint
    def add(self, n: int) -> int:
        if n < 0:
            raise ValueError(f"cannot add {n}: negative")
        self.total += n
        return self.total

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Fragile(Tally):
    """A tally that fails as a whole when an endpoint raises."""

    fail_on_error = True


async def test_a_host_actor_keeps_state_and_an_error_keeps_its_type() -> None:
    async with atoll.local_cluster(1, 2, 1) as cluster:
        tally = await cluster.spawn(Tally, 10, host=1)
        assert await tally.add(5) == 15
        with pytest.raises(ValueError, match="negative") as caught:
            await tally.add(-1)
        assert "in add" in caught.value.remote_traceback  # type: ignore[attr-defined]
        assert await tally.add(1) == 16  # it went on, its state intact
        on_device = await cluster.spawn(Tally, device=0)
        assert await on_device.add(2) == 2
        with pytest.raises(UsageError, match="no host 5"):
            await cluster.spawn(Tally, host=5)
        with pytest.raises(UsageError, match="restart' or 'stop"):
            await cluster.spawn(Tally, host=0, on_failure="escalate")


@pytest.mark.parametrize(("on_failure", "then"), [("restart", 1), ("stop", None)])
async def test_a_failed_host_actor_is_restarted_or_stopped_as_asked(
    on_failure: str, then: int | None
) -> None:
    async with atoll.local_cluster(1, 1, 1) as cluster:
        fragile = await cluster.spawn(Fragile, 100, host=0, on_failure=on_failure)
        assert await fragile.add(1) == 101
        with pytest.raises(ValueError):
            await fragile.add(-1)  # fails the actor
        if then is None:
            with pytest.raises(ActorStopped):
                await fragile.add(1)
        else:
            assert await fragile.add(1) == 101  # a fresh instance: its start value again
        tally = await cluster.spawn(Tally, host=0)  # the host went on
        assert await tally.add(3) == 3


async def test_a_session_that_ends_stops_its_actors_and_only_its_own() -> None:
    async with atoll.local_cluster(1, 1, 1) as cluster:
        other = cluster.client("other")
        theirs = await other.spawn(Tally, host=0)
        mine = await cluster.spawn(Tally, host=0)
        assert await theirs.add(1) == 1
        await other.close()
        with pytest.raises(ActorStopped):
            await theirs.add(1)
        assert await mine.add(2) == 2


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Path]:
    cluster_file = tmp_path / "cluster.json"
    with atoll_up(cluster_file, "--hosts", "2", "--devices-per-host", "1"):
        yield cluster_file


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # Cap'n Proto's own loop
@pytest.mark.timeout(120)
async def test_over_host_processes_a_class_travels_by_value_and_a_lost_host_says_so(
    up: Path,
) -> None:
    from atoll.runtime.client.connect import connect

    class Local(Actor):  # defined here: it travels by value (cloudpickle)
        def __init__(self) -> None:
            self.seen: list[str] = []

        @endpoint
        def see(self, word: str) -> list[str]:
            self.seen.append(word)
            return self.seen

        @endpoint
        def pid(self) -> int:
            return os.getpid()

    async with connect(up) as client:
        cluster = await client.cluster("colocated")
        first = await cluster.spawn(Local, host=0)
        second = await cluster.spawn(Local, host=1)
        assert await first.see("a") == ["a"] and await first.see("b") == ["a", "b"]
        pids = {await first.pid(), await second.pid(), os.getpid()}
        assert len(pids) == 3  # each in its host's process
        os.kill(await second.pid(), signal.SIGKILL)
        with pytest.raises(HostLost):
            for _ in range(100):
                await second.see("c")
        assert await first.see("c") == ["a", "b", "c"]  # the other host went on


async def test_an_actor_that_keeps_failing_is_stopped_and_its_host_goes_on() -> None:
    import numpy as np

    from atoll.devices import Computation

    async with atoll.local_cluster(1, 1, 1) as cluster:
        fragile = await cluster.spawn(Fragile, host=0, on_failure="restart")
        for _ in range(Fragile.max_restarts):  # each failure restarts it
            with pytest.raises(ValueError):
                await fragile.add(-1)
            assert await fragile.add(1) == 1  # a fresh instance
        with pytest.raises(ValueError):
            await fragile.add(-1)  # one failure past its restarts: stopped, not escalated
        with pytest.raises(ActorStopped):
            await fragile.add(1)
        out = cluster.run(Computation("neg", np.negative, 1e6), 0, [np.ones(2)])
        assert (await cluster.fetch(out) == -1).all()  # the host and its device went on
        assert await (await cluster.spawn(Tally, host=0)).add(2) == 2
