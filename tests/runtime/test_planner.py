"""The dispatch planner, driven directly: no actors, no cluster, no event loop.

The last tests check that the controller really uses it: a plan is made once
per graph and reused, and dropped when one of its slices is released.
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any

import numpy as np
import pytest

import atoll
from atoll.devices import Aval, Computation
from atoll.devices._device import _release_points
from atoll.devices._plan import MADE_HERE, PUSHED_IN
from atoll.kernel import AtollError, VirtualClock
from atoll.runtime import Allocation, GraphBuilder, SliceSpec, Topology
from atoll.runtime.control.planner import PlanCache, compile_gangs, compile_plan, plan
from atoll.runtime.graph import Graph

AVAL = Aval((4,), "float32")
TOPOLOGY = Topology.even(islands=1, hosts_per_island=2, devices_per_host=4)
LEFT = Allocation(0, (0, 1), 0, "me")  # host 0
ALSO_LEFT = Allocation(1, (0, 1), 0, "me")  # the same devices, another slice
RIGHT = Allocation(2, (4, 5, 6, 7), 0, "me")  # host 1
PLACEMENT = {a.slice_id: a for a in (LEFT, ALSO_LEFT, RIGHT)}
ADDRESSES = ["capnp://127.0.0.1:1", "capnp://127.0.0.1:2"]


def spec(alloc: Allocation) -> SliceSpec:
    return SliceSpec(alloc.slice_id, (len(alloc.devices),), ("x",))


def three_nodes(kernel: Any = "k") -> Graph:
    """x -> a (left) -> b (left again, same devices) -> c (right, reads a and b)."""
    builder = GraphBuilder()
    x = builder.input(AVAL)
    (a,) = builder.add(kernel, spec(LEFT), [x], [AVAL], "a")
    (b,) = builder.add(kernel, spec(ALSO_LEFT), [a], [AVAL], "b")
    (c,) = builder.add(kernel, spec(RIGHT), [a, b], [AVAL], "c")
    return builder.build([c])


def test_gangs_get_their_devices_island_and_leader_host() -> None:
    made = plan(three_nodes(), PLACEMENT, TOPOLOGY, ["", ""], push=False)
    assert [g.devices for g in made.gangs] == [(0, 1), (0, 1), (4, 5, 6, 7)]
    assert [g.leader_host for g in made.gangs] == [0, 0, 1]
    assert {g.island for g in made.gangs} == {0}


def test_an_input_made_on_the_same_devices_is_resident() -> None:
    made = plan(three_nodes(), PLACEMENT, TOPOLOGY, ["", ""], push=False)
    assert [g.resident for g in made.gangs] == [(False,), (True,), (False, False)]


def test_without_push_nothing_is_pushed() -> None:
    made = plan(three_nodes(), PLACEMENT, TOPOLOGY, ["", ""], push=False)
    assert all(not any(g.pushed) and not g.push for g in made.gangs)


def test_with_push_each_output_goes_once_to_each_reader_host() -> None:
    made = plan(three_nodes(), PLACEMENT, TOPOLOGY, ADDRESSES, push=True)
    a, b, c = made.gangs
    assert [g.pushed for g in made.gangs] == [(False,), (True,), (True, True)]
    # a's output goes to host 0 (for b) and host 1 (for c): one push per host
    assert sorted((p.host, p.readers) for p in a.push) == [(0, ((1, 0),)), (1, ((2, 0),))]
    assert [(p.host, p.readers) for p in b.push] == [(1, ((2, 1),))]
    assert c.push == ()


def test_compiled_an_output_its_own_leader_reads_next_stays_where_it_is() -> None:
    """a -> b on device 0: b takes a's output as it is, with no push; c on
    device 4 (host 1) still gets a and b pushed."""
    kernel = Computation("k", np.negative)
    one = {0: Allocation(0, (0,), 0, "me"), 1: Allocation(1, (0,), 0, "me")}
    placement = {**one, 2: Allocation(2, (4,), 0, "me")}
    builder = GraphBuilder()
    x = builder.input(AVAL)
    (a,) = builder.add(kernel, SliceSpec(0, (1,), ("x",)), [x], [AVAL], "a")
    (b,) = builder.add(kernel, SliceSpec(1, (1,), ("x",)), [a], [AVAL], "b")
    (c,) = builder.add(kernel, SliceSpec(2, (1,), ("x",)), [a, b], [AVAL], "c")
    graph = builder.build([c])
    made = plan(graph, placement, TOPOLOGY, ADDRESSES, push=True)
    compiled = compile_plan(made, graph, 1, ADDRESSES, [None, None])
    assert compiled is not None
    first, second = compiled.programs[0].gangs
    assert second.inputs == (MADE_HERE,) and second.local == ((0, 0),)
    assert [t.keys for t in first.push] == [("2/0",)]  # to c on host 1 only, not to b
    [last] = compiled.programs[4].gangs
    assert last.inputs == (PUSHED_IN, PUSHED_IN) and last.local == ()
    assert _release_points(compiled.programs[0]) == [[], [0, 1]]  # a: once b took it


def test_intermediates_are_freed_after_their_last_reader() -> None:
    made = plan(three_nodes(), PLACEMENT, TOPOLOGY, ["", ""], push=False)
    assert dict(made.frees) == {
        atoll.runtime.ValueRef(0, 0): (1, 2),
        atoll.runtime.ValueRef(1, 0): (2,),
    }
    assert all(ref.node >= 0 for ref, _ in made.frees)  # program inputs are the caller's


def test_each_host_gets_its_part_in_graph_order() -> None:
    made = plan(three_nodes(), PLACEMENT, TOPOLOGY, ["", ""], push=False)
    assert made.hosts[0].gangs == ((0, (0, 1)), (1, (0, 1)))
    assert made.hosts[1].gangs == ((2, (4, 5, 6, 7)),)
    assert made.slices == {0, 1, 2}


def test_a_gang_over_two_hosts_is_split_between_them() -> None:
    wide = Allocation(3, (2, 3, 4, 5), 0, "me")
    builder = GraphBuilder()
    (out,) = builder.add("k", spec(wide), [builder.input(AVAL)], [AVAL])
    made = plan(builder.build([out]), {3: wide}, TOPOLOGY, ["", ""], push=False)
    assert made.hosts[0].gangs == ((0, (2, 3)),)
    assert made.hosts[1].gangs == ((0, (4, 5)),)


def test_placement_errors_are_clear() -> None:
    with pytest.raises(AtollError, match="no slice 0"):
        plan(three_nodes(), {}, TOPOLOGY, ["", ""], push=False)
    shrunk = {**PLACEMENT, 0: Allocation(0, (0,), 0, "me")}
    with pytest.raises(AtollError, match="changed size"):
        plan(three_nodes(), shrunk, TOPOLOGY, ["", ""], push=False)


class _OneHostKernel:
    single_host = True


def test_in_one_process_a_jax_node_stays_on_one_host() -> None:
    wide = Allocation(3, (2, 3, 4, 5), 0, "me")
    builder = GraphBuilder()
    (out,) = builder.add(_OneHostKernel(), spec(wide), [builder.input(AVAL)], [AVAL], "jaxy")
    graph = builder.build([out])
    with pytest.raises(AtollError, match="jaxy: in an in-process cluster"):
        plan(graph, {3: wide}, TOPOLOGY, ["", ""], push=False)
    plan(graph, {3: wide}, TOPOLOGY, ADDRESSES, push=False)  # host processes: allowed


def test_a_run_stamps_gang_ids_and_inbox_keys_from_its_epoch() -> None:
    graph = three_nodes()
    made = plan(graph, PLACEMENT, TOPOLOGY, ["", "capnp://127.0.0.1:2"], push=True)
    host_refs = ["ref0", "ref1"]
    compiled = compile_plan(made, graph, 1, ["", "capnp://127.0.0.1:2"], host_refs)
    assert compiled is not None and compiled.island == 0 and compiled.parts == ()
    a, b = compiled.programs[0].gangs
    [c] = compiled.programs[4].gangs
    tasks = [a.task(7, 0, 0), b.task(7, 0, 0), c.task(7, 1, 4)]
    assert [t.gang_id for t in tasks] == ["c7/0", "c7/1", "c7/2"]
    assert tasks[2].inbox == ("c7/2/0", "c7/2/1") and tasks[0].inbox == (None,)
    assert [t.inbox_host for t in tasks] == [-1, -1, 1]  # b takes a's output where it is
    [to_host] = tasks[0].push
    assert to_host.host is None and to_host.address == "capnp://127.0.0.1:2"  # dialled
    assert to_host.keys == ("c7/2/0",)
    assert tasks[1].resident == (True,) and tasks[2].outputs == (AVAL,)


class _Collective:
    collective = True


def test_a_collective_gang_compiles_and_its_shards_meet_at_the_islands_barrier() -> None:
    wide = Allocation(3, (0, 1, 2, 3), 0, "me")  # host 0
    builder = GraphBuilder()
    (x,) = builder.add("k", spec(LEFT), [builder.input(AVAL)], [AVAL], "x")
    (out,) = builder.add(_Collective(), spec(wide), [x], [AVAL], "sum")
    graph = builder.build([out])
    placement = {**PLACEMENT, 3: wide}
    compiled = compile_plan(
        plan(graph, placement, TOPOLOGY, ["", ""], True), graph, 1, ["", ""], []
    )
    assert compiled is not None and sorted(compiled.programs) == [0, 1, 2, 3]
    [entry] = compiled.programs[2].gangs
    assert entry.collective and entry.rendezvous is None  # the island names it when it installs
    assert entry.inputs == (MADE_HERE,)  # device 0 leads both: no push, and no wait elsewhere
    assert entry.task(5, 0, 2).collective and entry.task(5, 0, 2).gang_id == "c5/1"


def test_a_plan_over_two_islands_compiles_in_one_part_per_island() -> None:
    topology = Topology.even(islands=2, hosts_per_island=1, devices_per_host=2)
    near, far = Allocation(0, (0,), 0, "me"), Allocation(1, (2,), 1, "me")
    builder = GraphBuilder()
    (a,) = builder.add("k", spec(near), [builder.input(AVAL)], [AVAL], "a")
    (b,) = builder.add("k", spec(far), [a], [AVAL], "b")
    graph = builder.build([a, b])
    made = plan(graph, {0: near, 1: far}, topology, ["", ""], push=True)
    compiled = compile_plan(made, graph, 9, ["", ""], ["h0", "h1"])
    assert compiled is not None and compiled.island == -1
    assert [(p.island, sorted(p.programs)) for p in compiled.by_island()] == [(0, [0]), (1, [2])]
    assert compiled.outputs == ((0, 0, 0), (1, 0, 2))
    assert compiled.programs[2].gangs[0].inputs == (PUSHED_IN,)  # a pushes across islands
    assert all(p.plan_id == 9 for p in compiled.by_island())


def test_a_gang_over_two_hosts_reading_a_value_made_elsewhere_goes_gang_by_gang() -> None:
    wide = Allocation(3, (2, 3, 4, 5), 0, "me")  # hosts 0 and 1
    builder = GraphBuilder()
    (x,) = builder.add("k", spec(LEFT), [builder.input(AVAL)], [AVAL], "x")
    (out,) = builder.add("k", spec(wide), [x], [AVAL], "wide")
    graph = builder.build([out])
    made = plan(graph, {**PLACEMENT, 3: wide}, TOPOLOGY, ADDRESSES, push=True)
    assert compile_plan(made, graph, 1, ADDRESSES, [None, None]) is None  # host 1 needs x
    first, second = compile_gangs(made, graph, itertools.count(4), lambda d: d // 4)
    assert (first.plan_id, second.plan_id) == (4, 5)
    [entry] = second.programs[4].gangs
    assert entry.inputs == (0,) and entry.keep == (True,) and entry.push == ()
    assert second.programs[4].inputs == (0,)  # every shard is sent the producer's promise
    assert second.outputs == ((1, 0, 2),) and first.outputs == ((0, 0, 0),)


def test_the_cache_hits_by_graph_and_options_and_forgets_released_slices() -> None:
    cache, graph = PlanCache(), three_nodes()
    made = plan(graph, PLACEMENT, TOPOLOGY, ["", ""], push=False)
    assert cache.get(graph, "opts") is None
    cache.put(graph, "opts", made)
    assert cache.get(graph, "opts") is made
    assert cache.get(graph, "other") is None
    again = pickle.loads(pickle.dumps(graph))  # as it arrives from a client once more
    assert again is not graph and cache.get(again, "opts") is made  # equal: the same plan
    assert (cache.hits, cache.misses) == (2, 2)
    assert cache.invalidate_slice(99) == 0 and len(cache) == 1
    assert cache.invalidate_slice(2) == 1 and cache.get(graph, "opts") is None


def test_a_graph_that_cannot_be_hashed_is_cached_as_the_object_itself() -> None:
    cache, graph = PlanCache(), three_nodes(kernel=["unhashable"])
    made = plan(graph, PLACEMENT, TOPOLOGY, ["", ""], push=False)
    cache.put(graph, (), made)
    assert cache.get(graph, ()) is made
    assert cache.get(three_nodes(kernel=["unhashable"]), ()) is None  # equal, but not it


def test_the_cache_keeps_the_most_recently_used() -> None:
    cache = PlanCache(capacity=2)
    graphs = [three_nodes(kernel=f"k{i}") for i in range(3)]
    made = plan(graphs[0], PLACEMENT, TOPOLOGY, ["", ""], push=False)
    cache.put(graphs[0], (), made)
    cache.put(graphs[1], (), made)
    assert cache.get(graphs[0], ()) is made  # now the most recent
    cache.put(graphs[2], (), made)
    assert cache.get(graphs[1], ()) is None and cache.get(graphs[0], ()) is made


STEP = Computation("step", lambda a: a + 1, flops=1e9)


@pytest.mark.anyio
async def test_the_controller_plans_once_and_replans_after_a_release() -> None:
    async with atoll.local_cluster(1, 2, 2, clock=VirtualClock()) as cluster:
        first = await cluster.devices(2)
        builder = GraphBuilder()
        (y,) = builder.add(STEP, first, [builder.input(AVAL)], [AVAL])
        graph = builder.build([y])
        for _ in range(3):
            out = await cluster.fetch(cluster.run_graph(graph, [np.arange(4.0, dtype="f4")])[0])
            assert out.tolist() == [1, 2, 3, 4]
        stats = await cluster.controller.plan_stats()
        assert (stats["plans"], stats["misses"], stats["hits"]) == (1, 1, 2)
        await cluster.release(first)
        assert (await cluster.controller.plan_stats())["plans"] == 0
        with pytest.raises(AtollError, match="no slice"):
            await cluster.fetch(cluster.run_graph(graph, [np.zeros(4, "f4")])[0])
