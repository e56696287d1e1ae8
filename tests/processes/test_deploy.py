"""Running off loopback: network namespaces joined by a bridge, and hosts that
join from elsewhere with nothing but the controller's address.

The namespace test needs Linux, root and ``ip`` (iproute2); it skips, saying
why, anywhere else. Four namespaces hang off one bridge: the controller's,
two hosts' and a client's, each with an address of its own, and every
process behaves as if on a machine of its own (``ATOLL_MACHINE_ID``), so bulk
bytes really cross the (virtual) wire. Interface counters in the root
namespace tell which way they went.
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest

from atoll.transports.processes import stop_processes

HELPERS = '''
import jax.numpy as jnp


def make_big(x):
    """32 MiB made on a host."""
    return jnp.full((8 << 20,), x[0], dtype=jnp.float32)


def total(x):
    return jnp.sum(x, dtype=jnp.float32).reshape(1)


def layer(x):
    return jnp.tanh(x) * 2.0


def head(x):
    return jnp.sum(x, axis=-1)
'''

CLIENT = """
import asyncio, json, sys, numpy as np, atoll
from atoll.devices import Computation
from deploy_helpers import head, layer, make_big, total


async def main():
    async with atoll.connect(sys.argv[1]) as client:
        cluster = await client.cluster()
        seed = cluster.put(np.full(4, 3.0, dtype=np.float32), 0)
        big = cluster.run(Computation("big", make_big, 1e6), 0, [seed])  # on host 0
        await big
        print("made", flush=True)
        sys.stdin.readline()  # the test reads the counters now
        summed = await cluster.fetch(cluster.run(Computation("sum", total, 1e6), 1, [big]))
        print("sum", summed[0], flush=True)
        first, second = await cluster.devices(1), await cluster.devices(1)  # hosts 0, 1
        f, g = first.jit(layer), second.jit(head)

        @atoll.program
        def program(x):
            return g(f(x))  # the activation goes from host 0 to host 1

        x = np.ones((2, 4), dtype=np.float32)
        print("program", json.dumps((await cluster.run(program, x)).tolist()), flush=True)
        print("hosts", [r["address"] for r in await client.status() if r["kind"] == "host"])


asyncio.run(main())
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, close_fds=False)


def _netns_unavailable() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs ip (iproute2)"
    probe = f"atoll-probe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        return f"ip netns add fails here: {exc.stderr.decode().strip()}"
    _ip("netns", "del", probe)
    return None


@contextmanager
def _network(names: list[str]) -> Iterator[dict[str, str]]:
    """A bridge in the root namespace and one namespace per name, each with
    a veth on the bridge; yields name -> its address (10.Y.0.N/24)."""
    tag, subnet = secrets.token_hex(2), 64 + secrets.randbelow(128)
    bridge = f"atb{tag}"
    made: list[str] = []
    addresses = {}
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for n, name in enumerate(names, start=1):
            ns, outside, inside = f"atoll-{tag}-{name}", f"at{tag}{name[:4]}", "eth0"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside, "netns", ns)
            _ip("link", "set", outside, "master", bridge, "up")
            address = f"10.{subnet}.0.{n}"
            for command in (
                ["addr", "add", f"{address}/24", "dev", inside],
                ["link", "set", inside, "up"],
                ["link", "set", "lo", "up"],
            ):
                _ip("-n", ns, *command)
            addresses[name] = address
            addresses[f"{name}:ns"] = ns
            addresses[f"{name}:veth"] = outside
        yield addresses
    finally:
        for ns in made:
            with suppress(subprocess.CalledProcessError):
                _ip("netns", "del", ns)  # its veth ends go with it
        with suppress(subprocess.CalledProcessError):
            _ip("link", "del", bridge)


def _bytes(veth: str) -> int:
    """Bytes through a veth's root-namespace end, both ways."""
    stats = Path("/sys/class/net") / veth / "statistics"
    return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())


def _in(ns: str, args: list[str], env: dict[str, str], **popen: Any) -> subprocess.Popen[str]:
    """``python ARGS`` in network namespace ``ns`` (``ip netns exec`` execs it)."""
    command = ["ip", "netns", "exec", ns, sys.executable, *args]
    process: subprocess.Popen[str] = subprocess.Popen(
        command, env=env, text=True, close_fds=False, **popen
    )
    return process


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_controller_hosts_and_client_in_four_network_namespaces(tmp_path: Path) -> None:
    why = _netns_unavailable()
    if why is not None:
        pytest.skip(f"network-namespace test skipped: {why}")
    (tmp_path / "deploy_helpers.py").write_text(HELPERS)
    (tmp_path / "client.py").write_text(CLIENT)
    cluster_file = tmp_path / "cluster.json"
    env = dict(os.environ, ATOLL_MACHINE_ID="per-process", ATOLL_TOKEN="7e" * 16)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"  # one JAX device per host
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]).rstrip(":")
    with _network(["ctl", "h0", "h1", "cli"]) as net:
        processes: list[subprocess.Popen[str]] = []
        try:
            up_args = ["-m", "atoll.cli", "up", "--hosts", "0", "--remote-hosts", "2"]
            up_args += ["--devices-per-host", "1", "--host", net["ctl"], "--port", "7077"]
            # JAX devices; the first host to join serves their runtime's coordinator
            up_args += ["--device", "jax", "--jax-coordinator", f"{net['h0']}:7078"]
            up_args += ["--cluster-file", str(cluster_file)]
            up = _in(net["ctl:ns"], up_args, env, stdout=subprocess.PIPE)
            processes.append(up)
            assert up.stdout is not None
            assert "from the controller" in up.stdout.readline()  # the JAX runtime
            assert "listening at" in up.stdout.readline()
            for host in ("h0", "h1"):  # in join order: host 0, then host 1
                join = ["-m", "atoll.cli", "host", "--join", f"capnp://{net['ctl']}:7077"]
                join += ["--cluster-file", str(cluster_file)]
                join += ["--listen", f"capnp://{net[host]}:0"]
                joined = _in(net[f"{host}:ns"], join, env, stdout=subprocess.PIPE)
                processes.append(joined)
                assert joined.stdout is not None
                assert f"atoll host {len(processes) - 2} joined" in joined.stdout.readline()
            assert "cluster up" in up.stdout.readline()

            client = _in(
                net["cli:ns"],
                [str(tmp_path / "client.py"), str(cluster_file)],
                env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            processes.append(client)
            assert client.stdin is not None and client.stdout is not None
            assert client.stdout.readline().strip() == "made"
            before = {name: _bytes(net[f"{name}:veth"]) for name in ("ctl", "h0", "h1")}
            client.stdin.write("\n")
            client.stdin.flush()
            said, summed = client.stdout.readline().split()
            assert said == "sum" and float(summed) == 3.0 * (8 << 20)
            said, values = client.stdout.readline().split(" ", 1)
            expected = 4 * 2 * math.tanh(1.0)  # head(layer(ones((2, 4))))
            assert said == "program"
            assert json.loads(values) == pytest.approx([expected, expected], rel=1e-5)
            moved = {name: _bytes(net[f"{name}:veth"]) - before[name] for name in before}
            assert moved["h0"] > (32 << 20) and moved["h1"] > (32 << 20), moved  # host to host
            assert moved["ctl"] < (4 << 20), moved  # not through the controller
            hosts = client.stdout.readline()
            assert net["h0"] in hosts and net["h1"] in hosts  # each serves on its own address
            assert client.wait(30) == 0
        finally:
            stop_processes(processes, 60)  # all at once: JAX hosts leave their runtime together


def spread_sum(x: Any) -> Any:
    """A reduction over a mesh that spans both hosts."""
    return jnp.sum(x, axis=0)


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.timeout(180)
async def test_a_joining_host_gets_the_jax_runtime_from_the_controller(tmp_path: Path) -> None:
    """``atoll host --join`` with no JAX flags still joins the hosts' JAX
    runtime: a gang over both hosts runs as one SPMD program."""
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import atoll

    cluster_file = tmp_path / "cluster.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env["ATOLL_TOKEN"] = "4c" * 16
    up_args = ["-m", "atoll.cli", "up", "--hosts", "1", "--remote-hosts", "1", "--device", "jax"]
    up_args += ["--devices-per-host", "2", "--cluster-file", str(cluster_file)]
    up = subprocess.Popen(
        [sys.executable, *up_args], env=env, stdout=subprocess.PIPE, text=True, close_fds=False
    )
    assert up.stdout is not None
    joiner = None
    try:
        lines = iter(up.stdout)
        hint = next(line for line in lines if "JAX runtime" in line)
        assert "from the controller" in hint
        address = next(line for line in lines if "listening at" in line)
        address = address.split("listening at ")[1].split(";")[0]
        join = ["host", "--join", address, "--cluster-file", str(cluster_file)]
        joiner = subprocess.Popen(  # nothing but the address and the cluster file
            [sys.executable, "-m", "atoll.cli", *join],
            env={k: v for k, v in env.items() if k != "ATOLL_TOKEN"},
            stdout=subprocess.DEVNULL,
            close_fds=False,
        )
        next(line for line in lines if "cluster up" in line)
        async with atoll.connect(cluster_file) as client:
            cluster = await client.cluster()
            both = await cluster.devices(4, mesh_shape=(2, 2), axis_names=("a", "b"))
            f = both.jit(spread_sum, in_specs=(P("a", "b"),), out_specs=P("b"))
            x = np.arange(16.0, dtype=np.float32).reshape(4, 4)
            np.testing.assert_allclose(await cluster.run(f, x), x.sum(axis=0))
            stats = await cluster.device_stats()
            assert [s.computations for s in stats] == [1, 1, 1, 1]  # every shard, both hosts
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        up.stdout.close()
        if joiner is not None:
            joiner.wait(30)
