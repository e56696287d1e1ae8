"""The whole client on asyncio and on trio, against a real ``atoll up``.

Under trio, ``atoll.connect`` runs the client on an asyncio loop thread
(pycapnp's RPC runs only there) and hands out proxies with the same methods
(``transports/capnp/bridge.py``); these tests run unchanged on both.
"""

# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import atoll
from atoll.devices import Computation
from atoll.examples.demo import affine
from atoll.kernel import RemoteActorError

from .clusters import atoll_up

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
README = Path(__file__).resolve().parents[2] / "README.md"
STEP = Computation("affine", affine, flops=1e6)


def fails(x: np.ndarray) -> np.ndarray:
    raise ValueError(f"no good: {x.shape}")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    """``atoll up``: 2 host processes of 4 JAX devices; its cluster file and environment."""
    yield from _up(tmp_path_factory, "jax")


@pytest.fixture(scope="module")
def up_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    """The same with simulated devices (the README's cluster)."""
    yield from _up(tmp_path_factory, "sim")


def _up(factory: pytest.TempPathFactory, device: str) -> Iterator[tuple[Path, dict[str, str]]]:
    runtime = factory.mktemp("xdg")
    with atoll_up(["--hosts", "2", "--device", device], XDG_RUNTIME_DIR=str(runtime)) as process:
        assert process.stdout is not None
        for line in process.stdout:
            if "cluster up" in line:
                break
        yield runtime / "atoll" / "cluster.json", dict(os.environ, XDG_RUNTIME_DIR=str(runtime))


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # trio: through the bridge
@pytest.mark.slow
async def test_chain_fetch_status_and_errors(up: tuple[Path, dict[str, str]]) -> None:
    cluster_file, _ = up
    async with atoll.connect(cluster_file) as client:
        cluster = await client.cluster()
        assert cluster.owner.startswith("client#")  # plain attributes read as they are
        handle = cluster.put(np.arange(4, dtype=np.float32), 0)
        for device in [0, 4, 1, 5]:  # hosts 0, 1, 0, 1: each input still a promise
            handle = cluster.run(STEP, device, [handle])
        expected = np.arange(4, dtype=np.float32)
        for _ in range(4):
            expected = affine(expected)
        np.testing.assert_allclose(await cluster.fetch(handle), expected, rtol=1e-6)
        assert (await handle).shape == (4,)  # a handle, usable again
        rows = await client.status()
        assert [r["alive"] for r in rows if r["kind"] == "host"] == [True, True]
        with pytest.raises(RemoteActorError, match="no good"):
            await cluster.fetch(cluster.run(Computation("fails", fails, 1e6), 4, [np.ones(2)]))
        stats = await cluster.device_stats()
        assert sum(s.computations for s in stats) >= 4


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # trio: through the bridge
async def test_programs_and_chained_outputs(up: tuple[Path, dict[str, str]]) -> None:
    cluster_file, _ = up
    async with atoll.connect(cluster_file) as client:
        cluster = await client.cluster()
        a, b = await cluster.devices(2, axis_names=("b",)), await cluster.devices(1)
        layer = a.jit(lambda x: jnp.tanh(x) * 2.0, name="layer")
        head = b.jit(lambda x: x.sum(axis=-1), name="head")

        @atoll.program
        def model(x: Any) -> Any:
            return head(layer(x))

        x = np.arange(12.0, dtype=np.float32).reshape(4, 3)
        first = cluster.run(model, x)
        again = cluster.run(head, first.refs)  # chained: no fetch in between
        np.testing.assert_allclose(await first, (np.tanh(x) * 2).sum(-1), rtol=1e-5)
        np.testing.assert_allclose(await again, (np.tanh(x) * 2).sum(-1).sum(), rtol=1e-5)
        async with cluster.recording() as log:
            await cluster.run(model, x)
        ran = [e for e in log.document["traceEvents"] if e.get("cat") == "gang"]
        assert {e["name"] for e in ran} == {"layer", "head"}
        assert {e["args"]["program"] for e in ran} == {"model"}
        await cluster.release(a)


def _readme_example() -> str:
    blocks: list[str] = re.findall(r"```py\n(.*?)```", README.read_text(), flags=re.S)
    [block] = [b for b in blocks if "atoll.connect(" in b]
    return block


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_readme_connect_example(up_sim: tuple[Path, dict[str, str]], backend: str) -> None:
    code = _readme_example()
    if backend == "trio":
        code = code.replace("asyncio.run(main())", "import trio\ntrio.run(main)")
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=up_sim[1],
        capture_output=True,
        text=True,
        timeout=60,
        close_fds=False,
    )
    assert done.returncode == 0, done.stderr
    assert "[-0. -1. -2. -3.]" in done.stdout


class _Thing:
    """Lives on the bridge's loop thread in the test below."""

    def __init__(self) -> None:
        self.name = "thing"
        self.items = [np.arange(3.0), {"a": 1}]  # plain data

    @property
    def children(self) -> list[_Thing]:  # not plain: stays on the loop thread
        return [_Thing.__new__(_Thing)]

    def sync(self, x: int) -> int:
        return x + 1

    async def slow(self, x: int) -> int:
        import asyncio

        await asyncio.sleep(0)  # really on asyncio
        return x * 2

    def fail(self) -> None:
        raise ValueError("as it should")

    def other(self) -> _Thing:
        return _Thing()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_the_bridge_proxies_whole_objects() -> None:
    from contextlib import asynccontextmanager

    from atoll.transports.capnp.bridge import Bridged, CapnpBridge

    @asynccontextmanager
    async def make() -> Any:
        yield _Thing()

    async with CapnpBridge.enter(make) as thing:
        assert thing.name == "thing"  # plain attributes read as they are
        assert await thing.sync(1) == 2
        assert await thing.slow(thing.sync(2)) == 6  # a pending result passed on
        np.testing.assert_array_equal(thing.items[0], np.arange(3.0))
        other = await thing.other()
        assert isinstance(other, Bridged) and other.name == "thing"
        assert await thing.children[0].sync(5) == 6  # indexed and called over there
        with pytest.raises(ValueError, match="as it should"):
            await thing.fail()
        with pytest.raises(TypeError, match="cannot be iterated"):
            list(thing.children)
