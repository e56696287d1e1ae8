"""One cluster spec for both launchers: every option works, or fails clearly."""

from __future__ import annotations

import pytest

import atoll
from atoll.devices import CostModel
from atoll.kernel import VirtualClock
from atoll.runtime import BadClusterSpec, ClusterSpec
from atoll.schedulers import FifoPolicy, register_scheduler


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"islands": 0}, "islands must be a positive integer"),
        ({"hosts_per_island": 1.5}, "hosts_per_island"),
        ({"devices_per_host": True}, "devices_per_host"),
        ({"store_bytes": 0}, "store_bytes"),
        ({"rpc_latency_s": -1.0}, "rpc_latency_s"),
        ({"remote_hosts": 3}, "remote_hosts must be between 0 and 2"),
        ({"device_cls": int}, "device_cls must be a Device class"),
        ({"scheduler": {5: "fifo"}}, "islands \\[5\\], which do not exist"),
    ],
)
def test_bad_options_are_refused_with_the_option_named(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(BadClusterSpec, match=message):
        ClusterSpec(**options)  # type: ignore[arg-type]


def test_spec_errors_are_atoll_errors_and_value_errors() -> None:
    assert issubclass(BadClusterSpec, atoll.AtollError)
    assert issubclass(BadClusterSpec, ValueError)


def test_an_unknown_policy_is_named_at_once() -> None:
    with pytest.raises(KeyError, match="no scheduler named 'nope'"):
        ClusterSpec(scheduler="nope")


def test_the_topology_and_policies_come_from_the_spec() -> None:
    spec = ClusterSpec(2, 2, 3, scheduler={1: "fifo"})
    assert spec.hosts == 4 and spec.policies == {0: "share", 1: "fifo"}  # share: the default
    assert [spec.topology.island_of_host(h) for h in range(4)] == [0, 0, 1, 1]
    assert spec.topology.on_host(3) == [9, 10, 11]


def test_hosts_split_evenly_into_islands() -> None:
    assert ClusterSpec.of_hosts(6, 3).hosts_per_island == 2
    with pytest.raises(BadClusterSpec, match="5 hosts do not split evenly into 2 islands"):
        ClusterSpec.of_hosts(5, 2)


def test_remote_hosts_are_started_elsewhere() -> None:
    spec = ClusterSpec.of_hosts(4, remote_hosts=1)
    assert spec.local_hosts == 3
    spec.check_for("capnp")
    with pytest.raises(BadClusterSpec, match="remote_hosts needs host processes"):
        spec.check_for("inproc")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"clock": VirtualClock()}, "wall-clock time"),
        ({"rpc_latency_s": 0.001}, "the hops are real"),
    ],
)
def test_in_process_only_options_are_refused_over_capnp(
    options: dict[str, object], message: str
) -> None:
    spec = ClusterSpec(**options)  # type: ignore[arg-type]
    spec.check_for("inproc")
    with pytest.raises(BadClusterSpec, match=message):
        spec.check_for("capnp")
    with pytest.raises(BadClusterSpec, match="transport must be"):
        spec.check_for("smoke-signals")


@pytest.mark.anyio
async def test_local_cluster_refuses_before_starting_anything() -> None:
    with pytest.raises(BadClusterSpec, match="wall-clock"):
        async with atoll.local_cluster(transport="capnp", clock=VirtualClock()):
            pass  # pragma: no cover


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # host processes: pycapnp is asyncio-only


@pytest.mark.anyio
async def test_store_bytes_and_per_island_policies_reach_host_processes() -> None:
    register_scheduler("fifo-too", FifoPolicy)
    async with atoll.local_cluster(
        2,
        1,
        1,
        transport="capnp",
        store_bytes=1 << 20,
        scheduler={1: "fifo-too"},
        cost=CostModel(),
    ) as cluster:
        usage = await cluster.store_usage()
        assert [u["capacity"] for u in usage] == [1 << 20, 1 << 20]
        assert await cluster.controller.policies() == {0: "share", 1: "fifo-too"}
