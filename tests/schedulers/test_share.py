"""The proportional-share island policy, driven directly: no actors, no network.

A small discrete-event island runs what the policy dispatches: every device
runs its shards in arrival order, and a gang starts only when it is at the
head of *every* one of its devices (a collective's barrier). If the island
ever holds shards but can start none, two devices disagreed on an order: a
deadlock, which the simulation reports.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import defaultdict, deque

import pytest

from atoll.schedulers import (
    DEFAULT_POLICY,
    Completed,
    Dispatch,
    PolicyError,
    SharePolicy,
    Submit,
    get_scheduler,
)

WEIGHTS = {"w1": 1.0, "w2": 2.0, "w4": 4.0, "w8": 8.0}


class Island:
    """Runs a policy's dispatches on ``devices`` simulated devices."""

    def __init__(self, policy: SharePolicy, devices: int) -> None:
        self.policy = policy
        self.queues: dict[int, deque[str]] = {d: deque() for d in range(devices)}
        self.last_seq: dict[int, int] = {}
        self.gang_seq: dict[str, int] = {}
        self.gangs: dict[str, Submit] = {}
        self.running: list[tuple[float, int, str]] = []  # (end, tiebreak, gang)
        self.busy_devices: set[int] = set()
        self.now = 0.0
        self.device_time: defaultdict[str, float] = defaultdict(float)
        self.order: dict[str, list[str]] = {}  # client -> its gangs, as dispatched
        self.events = itertools.count()
        self.ties = itertools.count()

    def submit(self, gang: Submit) -> None:
        self.gangs[gang.gang_id] = gang
        self.apply(self.policy.handle(gang))

    def apply(self, instructions: list[Dispatch]) -> None:
        for batch_gang in dict.fromkeys(i.gang_id for i in instructions):
            shards = [i for i in instructions if i.gang_id == batch_gang]
            gang = self.gangs[batch_gang]
            assert sorted(i.device for i in shards) == sorted(set(gang.devices)), "split gang"
            assert len({i.seq for i in shards}) == 1, "one gang, one position"
            self.gang_seq[batch_gang] = shards[0].seq
            self.order.setdefault(gang.client, []).append(batch_gang)
        for instruction in instructions:
            device = instruction.device
            assert instruction.seq > self.last_seq.get(device, -1), "a device saw seq go back"
            self.last_seq[device] = instruction.seq
            self.queues[device].append(instruction.gang_id)
        self.start()

    def start(self) -> None:
        """Start every gang that heads all of its (idle) devices."""
        heads = {q[0] for d, q in self.queues.items() if q and d not in self.busy_devices}
        for gang_id in sorted(heads, key=self.gang_seq.__getitem__):
            devices = set(self.gangs[gang_id].devices)
            if all(self.queues[d] and self.queues[d][0] == gang_id for d in devices):
                if devices & self.busy_devices:
                    continue
                for d in devices:
                    self.queues[d].popleft()
                self.busy_devices |= devices
                end = self.now + self.gangs[gang_id].cost
                heapq.heappush(self.running, (end, next(self.ties), gang_id))

    def step(self) -> None:
        """Finish the next gang; report it device by device."""
        if not self.running:
            stuck = {d: list(q) for d, q in self.queues.items() if q}
            assert not stuck, f"deadlock: {stuck}"
            return
        end, _, gang_id = heapq.heappop(self.running)
        gang = self.gangs[gang_id]
        devices = sorted(set(gang.devices))
        self.device_time[gang.client] += gang.cost * len(devices)
        self.now = end
        self.busy_devices -= set(devices)
        out: list[Dispatch] = []
        for d in devices:
            out += self.policy.handle(Completed(next(self.events), gang_id, d))
        self.apply(out)
        self.start()


def random_gang(rng: random.Random, client: str, n: int, devices: int, wide: bool) -> Submit:
    width = rng.randint(1, devices) if wide else 1
    chosen = tuple(rng.sample(range(devices), width))
    return Submit(0, f"{client}-{n}", chosen, client, WEIGHTS.get(client, 1.0), 1.0)


def keep_busy(
    island: Island, rng: random.Random, clients: list[str], backlog: int, wide: bool
) -> None:
    """Top every client up to ``backlog`` gangs not finished (closed loop)."""
    for client in clients:
        have = island.policy.outstanding(client)
        for _ in range(backlog - have):
            island.submit(random_gang(rng, client, len(island.gangs), len(island.queues), wide))


def shares(counts: dict[str, float], clients: list[str]) -> dict[str, float]:
    total = sum(counts[c] for c in clients)
    return {c: counts[c] / total for c in clients}


@pytest.mark.parametrize(
    ("devices", "wide"), [(1, False), (4, True)], ids=["one-device", "gangs-over-4"]
)
def test_shares_converge_to_the_weights(devices: int, wide: bool) -> None:
    """(Single-device gangs pinned at random over several devices converge
    less closely: a heavy client's head waits for its device while the
    others use the rest, which is work conservation doing its job.)"""
    rng = random.Random(7)
    island = Island(SharePolicy(depth=2), devices=devices)
    clients = list(WEIGHTS)
    for step in range(6000):
        keep_busy(island, rng, clients, backlog=16, wide=wide)
        island.step()
        if step == 200:  # the first gangs went before any completion, in FIFO order
            island.device_time.clear()
    island.policy.validate()
    got = shares(island.device_time, clients)
    due = {c: w / sum(WEIGHTS.values()) for c, w in WEIGHTS.items()}
    for client in clients:
        assert got[client] == pytest.approx(due[client], rel=0.01), (got, due)


def test_every_device_sees_one_island_wide_order_and_each_client_its_own_fifo() -> None:
    rng = random.Random(3)
    island = Island(SharePolicy(depth=3), devices=4)
    submitted: dict[str, list[str]] = {}
    for n in range(3000):
        client = rng.choice(list(WEIGHTS))
        gang = random_gang(rng, client, n, 4, wide=True)
        submitted.setdefault(client, []).append(gang.gang_id)
        island.submit(gang)  # the Island checks seq order per device and whole gangs
        if rng.random() < 0.7:
            island.step()
    while island.running or any(island.queues.values()):
        island.step()
    island.policy.validate()
    assert island.order == submitted  # FIFO within every client, and everything ran


def test_an_idle_client_gives_its_share_to_the_others() -> None:
    rng = random.Random(11)
    island = Island(SharePolicy(depth=2), devices=1)
    clients = list(WEIGHTS)
    for _ in range(2000):
        keep_busy(island, rng, clients, backlog=4, wide=False)
        island.step()
    before = island.now
    island.device_time.clear()
    rest = ["w1", "w2", "w4"]  # w8, the largest, stops submitting
    for _ in range(3000):
        keep_busy(island, rng, rest, backlog=4, wide=False)
        island.step()
    assert island.now - before == pytest.approx(3000)  # the device never idled
    late = island.device_time
    assert late["w8"] <= 2 * island.policy.depth  # only what it had queued
    got = shares(late, rest)
    for client in rest:
        assert got[client] == pytest.approx(WEIGHTS[client] / 7, rel=0.05), got


def test_a_returning_client_banks_no_credit() -> None:
    policy = SharePolicy(depth=1)
    island = Island(policy, devices=1)
    rng = random.Random(5)
    for _ in range(500):
        keep_busy(island, rng, ["w1"], backlog=3, wide=False)
        island.step()
    island.device_time.clear()
    for _ in range(400):  # w8 was away all that time; it does not get it all now
        keep_busy(island, rng, ["w1", "w8"], backlog=3, wide=False)
        island.step()
    got = shares(island.device_time, ["w1", "w8"])
    assert got["w8"] == pytest.approx(8 / 9, rel=0.05), got


def test_one_client_alone_is_gang_fifo() -> None:
    policy = SharePolicy(depth=1)
    out = []
    for n in range(10):
        out += policy.handle(Submit(n, f"g{n}", (0, 1), "solo"))
    assert [(i.gang_id, i.seq) for i in out[::2]] == [(f"g{n}", n) for n in range(10)]
    assert policy.clients()["solo"]["running"] == 10  # all sent at once, not held


def test_a_flooder_cannot_push_a_newcomer_back_more_than_the_depth() -> None:
    policy = SharePolicy(depth=2)
    assert policy.dispatches_on_submit
    sent = policy.handle(Submit(0, "other0", (0,), "other"))
    sent += policy.handle(Submit(1, "flood0", (0,), "flood"))
    assert len(sent) == 2  # nothing was shared until now: both go at once
    policy.handle(Completed(2, "other0", 0))  # two clients present: devices stay shallow
    assert not policy.dispatches_on_submit
    for n in range(1, 100):
        sent += policy.handle(Submit(n + 2, f"flood{n}", (0,), "flood"))
    assert [i.gang_id for i in sent] == ["other0", "flood0", "flood1"]
    assert policy.handle(Submit(200, "other1", (0,), "other")) == []  # the device is full
    released = policy.handle(Completed(201, "flood0", 0))
    assert [i.gang_id for i in released] == ["other1"]  # ahead of 98 flood gangs
    policy.validate()


def test_weights_follow_the_latest_submit() -> None:
    policy = SharePolicy()
    policy.handle(Submit(0, "a", (0,), "x", 2.0))
    policy.handle(Submit(1, "b", (0,), "x", 5.0))
    assert policy.clients()["x"]["weight"] == 5.0


def test_share_rejects_nonsense() -> None:
    policy = SharePolicy()
    with pytest.raises(PolicyError, match="no devices"):
        policy.handle(Submit(1, "a", ()))
    with pytest.raises(PolicyError, match="weight must be > 0"):
        policy.handle(Submit(2, "a", (0,), "c", 0.0))
    policy.handle(Submit(3, "a", (0,)))
    with pytest.raises(PolicyError, match="already submitted"):
        policy.handle(Submit(4, "a", (1,)))
    with pytest.raises(PolicyError, match="not running"):
        policy.handle(Completed(5, "a", 3))
    with pytest.raises(PolicyError, match="depth"):
        SharePolicy(depth=0)


def test_share_is_registered_and_the_default() -> None:
    assert DEFAULT_POLICY == "share"
    assert isinstance(get_scheduler("share"), SharePolicy)


def test_clients_idle_for_a_horizon_are_forgotten() -> None:
    policy = SharePolicy(depth=1, horizon=4)
    policy.handle(Submit(0, "gone0", (0,), "gone"))
    policy.handle(Completed(1, "gone0", 0))
    for n in range(10):
        policy.handle(Submit(2 * n + 2, f"g{n}", (0,), "stays"))
        policy.handle(Completed(2 * n + 3, f"g{n}", 0))
    assert set(policy.clients()) == {"stays"}
    policy.validate()


def test_what_ran_before_sharing_started_is_owed_by_nobody() -> None:
    """Four clients start together: their first gangs go at once, in FIFO
    order, before any completion; from the first completion on, each gets
    its share at once, not after the heavy ones caught up."""
    rng = random.Random(2)
    island = Island(SharePolicy(depth=2), devices=1)
    clients = list(WEIGHTS)
    keep_busy(island, rng, clients, backlog=8, wide=False)  # 32 gangs, all sent
    for _ in range(32 + 2 * 150):
        keep_busy(island, rng, clients, backlog=8, wide=False)
        island.step()
        if island.now == 32:  # the gangs sent before sharing started have run
            island.device_time.clear()
    got = shares(island.device_time, clients)
    for client in clients:
        assert got[client] == pytest.approx(WEIGHTS[client] / 15, rel=0.05), got


def _deep_island(max_depth: int) -> tuple[SharePolicy, list[str]]:
    """Two clients sharing device 0 (depth 2 at first), each with 20 gangs
    queued; the gangs the policy dispatched, in order."""
    policy = SharePolicy(depth=2, max_depth=max_depth)
    sent = [i.gang_id for i in policy.handle(Submit(0, "a0", (0,), "a"))]
    sent += [i.gang_id for i in policy.handle(Submit(1, "b0", (0,), "b"))]
    policy.handle(Completed(2, "a0", 0))  # two clients present: devices stay shallow
    for n in range(1, 21):
        for client in "ab":
            sent += [i.gang_id for i in policy.handle(Submit(3 + n, f"{client}{n}", (0,), client))]
    return policy, sent


def test_a_device_that_runs_dry_while_work_waits_is_kept_deeper() -> None:
    """Each completion after which the device had nothing left to run (it
    runs ahead of its host, and says so) keeps it one gang deeper, up to
    ``max_depth``; completions that leave it busy change nothing."""
    policy, sent = _deep_island(max_depth=4)
    running = len(sent) - 1  # a0 completed
    events = itertools.count(100)
    for gang in sent[1:3]:  # the device still had work: no deeper
        running += len(policy.handle(Completed(next(events), gang, 0))) - 1
    assert running == 2
    done = set(sent[:3])
    for _ in range(4):  # it ran dry each time
        gang = next(g for g in policy_running(policy) if g not in done)
        done.add(gang)
        running += len(policy.handle(Completed(next(events), gang, 0, idle=True))) - 1
    assert running == 4  # 2, then one deeper per dry completion, up to max_depth


def policy_running(policy: SharePolicy) -> list[str]:
    """The gangs the policy has sent and not seen complete, oldest first."""
    return list(policy._left)


@pytest.mark.parametrize("widths", [(1,), (1, 1, 1, 2, 4)])
def test_with_heads_of_one_device_the_lowest_pass_with_room_is_what_the_scan_finds(
    widths: tuple[int, ...],
) -> None:
    rng = random.Random(7)
    policy = SharePolicy(depth=2)
    running: dict[str, set[int]] = {}
    checked, wide = 0, 0
    for event_id in range(1, 3000):
        if running and rng.random() < 0.45:
            gang = rng.choice(sorted(running))
            device = rng.choice(sorted(running[gang]))
            running[gang].discard(device)
            if not running[gang]:
                del running[gang]
            event: Completed | Submit = Completed(event_id, gang, device, rng.random() < 0.2)
        else:
            devices = tuple(rng.sample(range(4), rng.choice(widths)))
            client = f"c{rng.randrange(12)}"
            event = Submit(event_id, f"g{event_id}", devices, client, rng.choice([1.0, 3.0]))
        for dispatch in policy.handle(event):
            running.setdefault(dispatch.gang_id, set()).add(dispatch.device)
        policy.validate()  # (the heads by device, and how many are wide)
        wide += policy._wide_heads > 0
        full = set(policy._full)
        if policy._sharing and len(full) < len(policy._devices) and not policy._wide_heads:
            assert policy._lowest_with_room(full) == policy._scan(full)
            checked += 1
    assert checked > (500 if widths == (1,) else 0)
    assert (wide > 500) if widths != (1,) else not wide  # wide heads come and go: the scan
