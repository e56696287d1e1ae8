"""A new user's first hour (issue 36): what went wrong says what to do.

Each test here is one of the issue's findings, tried as a new user tried it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from atoll.schedulers import Dispatch, Event, Submit

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _python(code: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, with ``env`` changed (None: unset)."""
    environment = dict(os.environ)
    for name, value in env.items():
        if value is None:
            environment.pop(name, None)
        else:
            environment[name] = value
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
        close_fds=False,
    )


def _first_block(page: Path) -> str:
    """The first Python code block of a docs page."""
    found = re.search(r"```python\n(.*?)```", page.read_text(), re.S)
    assert found is not None, f"{page} has no python block"
    return found.group(1)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_programs_page_example_runs_on_a_cpu_only_machine_as_it_is() -> None:
    """``docs/programs.md`` asks for 8 JAX devices in one process: with no
    XLA flag set, atoll asks JAX for that many CPU devices before it starts."""
    done = _python(_first_block(DOCS / "programs.md"), XLA_FLAGS=None, JAX_PLATFORMS="cpu")
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_too_few_jax_devices_says_which_flag_gives_more() -> None:
    code = (
        "import anyio, atoll\n"
        "from atoll.devices.jax import JaxDevice\n"
        "async def main():\n"
        "    async with atoll.local_cluster(1, 2, 4, device_cls=JaxDevice):\n"
        "        pass\n"
        "anyio.run(main)\n"
    )
    flags = "--xla_force_host_platform_device_count=2"  # the user's own count: kept
    done = _python(code, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "BadClusterSpec: JaxDevice: 8 devices asked for, 2 exist" in last
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in last


def _raises_value_error(x: object) -> object:
    raise ValueError("a bad batch: 7 rows")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("transport", ["inproc", "capnp"])
@pytest.mark.timeout(120)
async def test_an_error_raised_on_a_host_keeps_its_type(transport: str) -> None:
    """A user function that raises ``ValueError`` in a computation, in this
    process or in a host process: ``except ValueError`` catches it, and it is
    a ``RemoteActorError`` too, with the traceback from where it was raised."""
    import numpy as np

    import atoll
    from atoll.devices import Computation
    from atoll.kernel import RemoteActorError

    bad = Computation("bad", _raises_value_error)
    async with atoll.local_cluster(1, 1, 1, transport=transport) as cluster:
        with pytest.raises(ValueError, match="a bad batch") as caught:
            await cluster.fetch(cluster.run(bad, 0, [np.ones(3)]))
    assert isinstance(caught.value, RemoteActorError)
    assert "_raises_value_error" in caught.value.remote_traceback


def test_a_type_this_process_does_not_have_stays_a_plain_box() -> None:
    from atoll.kernel import RemoteActorError

    error = RemoteActorError("host0", "run", "not_imported_here.BadThing", "no", "tb")
    assert type(error) is RemoteActorError
    typed = RemoteActorError("host0", "run", "builtins.KeyError", "k", "tb")
    assert isinstance(typed, KeyError) and str(typed).startswith("host0.run raised")


class _Half:
    """A policy that breaks the contract: it dispatches a gang to its first
    device only (or, with ``cause_off``, names the wrong event as cause)."""

    def __init__(self, cause_off: int = 0) -> None:
        self.seq, self.cause_off = 0, cause_off

    def handle(self, event: Event) -> list[Dispatch]:
        if not isinstance(event, Submit):
            return []
        self.seq += 1
        cause = event.event_id + self.cause_off
        devices = event.devices if self.cause_off else event.devices[:1]
        return [Dispatch(cause, event.gang_id, device, self.seq) for device in devices]

    def validate(self) -> None:
        pass

    def clients(self) -> dict[str, dict[str, float]]:
        return {}


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize(
    ("name", "rule"),
    [("test-half", "a gang's devices are all dispatched in one answer"), ("test-cause", "cause")],
)
@pytest.mark.timeout(60)
async def test_a_policy_that_breaks_the_contract_fails_the_run_and_names_the_rule(
    name: str, rule: str
) -> None:
    import numpy as np

    import atoll
    from atoll.devices import Computation
    from atoll.schedulers import PolicyError, register_scheduler

    register_scheduler("test-half", _Half)
    register_scheduler("test-cause", lambda: _Half(cause_off=1))
    step = Computation("step", np.negative, 1e6)
    async with atoll.local_cluster(1, 2, 1, push=True, scheduler=name) as cluster:
        assert await cluster.controller.set_compile(True)
        first = cluster.run(step, 0, [np.ones(2)])
        second = cluster.run(step, 1, [first])  # one run over devices 0 and 1
        with pytest.raises(PolicyError, match=rf"scheduler '{name}' broke its contract") as caught:
            await cluster.fetch(second)
        assert rule in str(caught.value)
        with pytest.raises(PolicyError, match="runs nothing more"):  # and later ones at once
            await cluster.fetch(cluster.run(step, 0, [np.ones(2)]))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("transport", ["inproc", "capnp"])
@pytest.mark.timeout(60)
async def test_asking_for_more_devices_than_exist_reads_as_the_callers_mistake(
    transport: str,
) -> None:
    import atoll
    from atoll.kernel import RemoteActorError, UsageError

    async with atoll.local_cluster(1, 1, 4, transport=transport) as cluster:
        with pytest.raises(UsageError, match=r"99 devices are not free") as caught:
            await cluster.devices(99)
    assert not isinstance(caught.value, RemoteActorError)
    assert "traceback" not in str(caught.value)
    assert "ask for at most 4" in str(caught.value)


def test_a_cluster_file_whose_token_is_not_hex_says_so(tmp_path: Path) -> None:
    from atoll.kernel import AtollError
    from atoll.transports.capnp import ClusterFile

    bad = tmp_path / "cluster.json"
    bad.write_text('{"address": "capnp://127.0.0.1:1", "token": "not-hex"}')
    with pytest.raises(AtollError, match="its token is not hexadecimal"):
        ClusterFile.read(bad)


def test_atoll_up_help_explains_every_option_with_its_default() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "atoll.cli", "up", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        close_fds=False,
    )
    text = " ".join(done.stdout.split())
    for option, default in [
        ("--scheduler", "share"),
        ("--device", "sim"),
        ("--islands", "1"),
        ("--devices-per-host", "4"),
    ]:
        after = text.split(f"{option} ", 2)[-1]  # past the usage line
        assert f"(default: {default})" in after.split(" --")[0], (option, after[:200])


def test_dir_atoll_shows_the_public_names_only() -> None:
    import atoll

    shown = set(dir(atoll))
    assert not shown & {"Any", "importlib", "os"}
    assert {"local_cluster", "connect", "program", "partition"} <= shown


MODEL = """
import jax.numpy as jnp
from atoll.partition import from_jax


def mlp(x, w):
    return jnp.tanh(x @ w)


def build_graph():
    return from_jax(mlp, jnp.ones((8, 16)), jnp.ones((16, 4)))
"""


def test_atoll_partition_says_what_a_model_file_must_give(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from atoll.cli import main

    model = tmp_path / "my_model.py"
    model.write_text(MODEL)
    with pytest.raises(SystemExit, match=r"name the function that builds the graph.*OpGraph"):
        main(["partition", str(model)])
    with pytest.raises(SystemExit, match=r"has no function 'nope' \(it has: build_graph,"):
        main(["partition", f"{model}:nope"])
    picture = tmp_path / "p.png"
    args = ["partition", f"{model}:build_graph", "--chiplets", "2", "--method", "dp"]
    assert main([*args, "--picture", str(picture)]) == 0
    assert picture.is_file() and f"picture: {picture}" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(90)
async def test_a_call_after_atoll_down_says_the_cluster_was_stopped(tmp_path: Path) -> None:
    import anyio

    from atoll.kernel import HostLost
    from atoll.runtime.client.connect import connect
    from atoll.transports.testing import atoll_up

    cluster_file = tmp_path / "cluster.json"
    with atoll_up(cluster_file, "--hosts", "1", "--devices-per-host", "1"):
        async with connect(cluster_file) as client:
            cluster = await client.cluster("user")
            down = [sys.executable, "-m", "atoll.cli", "down", "--cluster-file", str(cluster_file)]
            await anyio.to_thread.run_sync(
                lambda: subprocess.run(down, check=True, timeout=60, capture_output=True)
            )
            with pytest.raises(HostLost, match=r"was stopped \(atoll down.*start it again"):
                with anyio.fail_after(30):
                    while True:  # until the link's end has been seen
                        await cluster.devices(1)
                        await anyio.sleep(0.05)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(90)
async def test_a_closure_that_cannot_travel_names_the_function_what_it_captures_and_the_fix() -> (
    None
):
    import threading

    import numpy as np

    import atoll
    from atoll.devices import Computation
    from atoll.kernel import BadCall

    lock = threading.Lock()

    def step(x: np.ndarray) -> np.ndarray:
        with lock:
            return x + 1

    async with atoll.local_cluster(1, 1, 1, transport="capnp") as cluster:
        with pytest.raises(BadCall) as caught:
            await cluster.fetch(cluster.run(Computation("step", step), 0, [np.ones(2)]))
    text = str(caught.value)
    assert "step" in text and "test_first_hour.py" in text and "captures 'lock'" in text
    assert "capture plain values" in text


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.timeout(60)
async def test_a_shape_the_mesh_cannot_split_is_refused_when_traced() -> None:
    import numpy as np
    from jax.sharding import PartitionSpec

    def P(*axes: str | None) -> PartitionSpec:
        return PartitionSpec(*axes)  # type: ignore[no-untyped-call]

    import atoll
    from atoll.devices.jax import JaxDevice
    from atoll.kernel import UsageError

    async with atoll.local_cluster(1, 1, 4, device_cls=JaxDevice) as cluster:
        four = await cluster.devices(4, mesh_shape=(4,), axis_names=("d",))
        layer = four.jit(lambda x, w: x @ w, in_specs=(P("d"), None), out_specs=P("d"))
        x, w = np.ones((7, 3), np.float32), np.ones((3, 5), np.float32)
        with pytest.raises(UsageError, match=r"argument 0 has shape \(7, 3\).*multiple of 4"):
            cluster.run(layer, x, w)  # at once: nothing was sent
        assert (await cluster.run(layer, np.ones((8, 3), np.float32), w)).shape == (8, 5)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_training_over_host_processes_prints_no_native_noise(tmp_path: Path) -> None:
    """JAX's coordination-service warnings and Gloo's connection lines stay
    quiet unless ``ATOLL_LOG`` asks for them; atoll's own lines remain."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATOLL_LOG", "TF_CPP_MIN_LOG_LEVEL")}
    args = ["run", "train_lm", "--config", "tiny", "--steps", "2", "--data-parallel", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "atoll.cli", *args, "--hosts", "2", "--no-reference"],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
        cwd=tmp_path,
        close_fds=False,
    )
    assert done.returncode == 0, done.stderr
    both = done.stdout + done.stderr
    assert "[Gloo]" not in both and "coordination_service" not in both, both
    assert "atoll host 1 joined" in done.stdout and "done: loss" in done.stdout
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_each_island_builds_its_policy_once_and_feeds_it_every_event() -> None:
    """Starting a cluster checks the scheduler's name without building a
    policy: the one instance per island is the one that sees the events."""
    import numpy as np

    import atoll
    from atoll.devices import Computation
    from atoll.schedulers import FifoPolicy, register_scheduler

    built: list[FifoPolicy] = []

    def factory() -> FifoPolicy:
        built.append(FifoPolicy())
        return built[-1]

    register_scheduler("test-counted", factory)
    async with atoll.local_cluster(2, 1, 1, scheduler="test-counted") as cluster:
        step = Computation("step", np.negative, 1e6)
        for device in (0, 1):
            await cluster.fetch(cluster.run(step, device, [np.ones(2)]))
    assert len(built) == 2  # one per island, none for the check
    assert all(policy._next_seq == 1 for policy in built)  # each saw its island's gang


def test_a_remote_type_that_cannot_be_mixed_in_stays_a_plain_box() -> None:
    """A box is built for any type: an ExceptionGroup (its own __new__), or a
    type that makes one of the box's attributes read-only, stays plain."""
    import sys

    from atoll.kernel import RemoteActorError

    class ReadOnlyMessage(Exception):
        @property
        def message(self) -> str:
            return "fixed"

    module = sys.modules[__name__]
    monkey = getattr(module, "ReadOnlyMessage", None)
    module.ReadOnlyMessage = ReadOnlyMessage  # type: ignore[attr-defined]
    try:
        for kind in ("builtins.ExceptionGroup", f"{__name__}.ReadOnlyMessage"):
            error = RemoteActorError("host0", "run", kind, "boom", "tb")
            assert type(error) is RemoteActorError and "boom" in str(error)
    finally:
        if monkey is None:
            del module.ReadOnlyMessage
