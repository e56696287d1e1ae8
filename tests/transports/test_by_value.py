"""User functions travel by value, and remote errors arrive whole (Cap'n Proto).

A function from the user's script (``__main__``), a lambda or a closure cannot
be imported by a host process, so the codec pickles exactly those by value
(cloudpickle); everything else still pickles by reference. The functions sent
here are local on purpose: this module is imported by path (importlib mode),
so a host could not import anything defined at its top level.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import atoll
from atoll.devices import Computation
from atoll.kernel import ActorRef, ActorSystem, BadCall, NodeActor, RemoteActorError
from atoll.transports.capnp import CapnpTransport, capnp_runtime
from atoll.transports.capnp._codec import _Pickler
from atoll.transports.capnp._peer import Peer
from atoll.transports.testing import NodeProcess

pytestmark = pytest.mark.anyio
CONF = "atoll.transports.conformance"
TOKEN = b"by-value-token"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # pycapnp is asyncio-only


@asynccontextmanager
async def node_process() -> AsyncIterator[ActorRef[NodeActor]]:
    """A node in a child process, and this process connected to it."""
    process = NodeProcess(TOKEN)
    try:
        async with capnp_runtime(), ActorSystem("client") as system:
            connection = await CapnpTransport(TOKEN).connect(process.address, system)
            try:
                yield connection.node
            finally:
                await connection.aclose()
    finally:
        assert process.stop() == 0, process.stderr()


async def run_on_host(fn: Callable[..., Any], x: np.ndarray) -> np.ndarray:
    """``fn(x)`` computed on device 0, held by a host process."""
    async with atoll.local_cluster(1, 1, 1, transport="capnp") as cluster:
        ref = await cluster.put(x, 0)
        out = cluster.run(Computation("fn", fn), 0, [ref])
        result: np.ndarray = await cluster.fetch(out)
        return result


def pickled(value: Any) -> bytes:
    data = io.BytesIO()
    _Pickler(data, []).dump(value)
    return data.getvalue()


# -- what travels by value ------------------------------------------------------
def test_only_what_cannot_be_imported_travels_by_value() -> None:
    def closure(a: int) -> int:
        return a + 1

    assert b"_byvalue" not in pickled(Computation("add", np.add))
    assert b"_byvalue" not in pickled((os.path.join, Computation, 3.0))
    for fn in (lambda a: a + 1, closure):
        data = pickled(Computation("fn", fn))
        assert b"_byvalue" in data
        assert pickle.loads(data).fn(1) == 2


async def test_lambda_and_closures_run_on_a_host() -> None:
    offset = np.array([10.0, 20.0, 30.0], np.float32)

    def helper(a: np.ndarray) -> np.ndarray:
        return a * 2 + offset  # a closure over an array and nothing global

    x = np.arange(3, dtype=np.float32)
    assert (await run_on_host(lambda a: a + 1, x)).tolist() == [1.0, 2.0, 3.0]
    assert (await run_on_host(lambda a: helper(a), x)).tolist() == [10.0, 22.0, 34.0]


def test_a_main_function_runs_on_a_host(tmp_path: Path) -> None:
    """The honest case: the function and a class it uses live in ``__main__``."""
    script = tmp_path / "user_script.py"
    script.write_text(
        textwrap.dedent(
            """
            import anyio
            import numpy as np

            import atoll
            from atoll.devices import Computation


            class Scale:
                def __init__(self, k):
                    self.k = k

                def __call__(self, a):
                    return a * self.k


            def step(a):
                return Scale(3)(a) + 1


            async def main():
                async with atoll.local_cluster(1, 1, 1, transport="capnp") as cluster:
                    x = await cluster.put(np.arange(3, dtype=np.float32), 0)
                    y = cluster.run(Computation("step", step), 0, [x])
                    print("result", (await cluster.fetch(y)).tolist())


            anyio.run(main)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=50, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "result [1.0, 4.0, 7.0]" in done.stdout


async def test_a_closure_keeps_its_actor_references() -> None:
    async with node_process() as remote:
        counter = await remote.spawn(f"{CONF}:Counter")
        echo = await remote.spawn(f"{CONF}:Echo")
        back = await echo.echo(lambda: counter)  # there and back, by value both ways
        assert await back().add(5) == 5
        assert await counter.add(1) == 6


# -- errors arrive whole -------------------------------------------------------
async def test_a_remote_error_arrives_with_its_whole_traceback() -> None:
    def inner(a: np.ndarray) -> np.ndarray:
        return a + 1 // 0

    def helper(a: np.ndarray) -> np.ndarray:
        return inner(a)

    with pytest.raises(RemoteActorError) as caught:
        await run_on_host(lambda a: helper(a), np.zeros(2, np.float32))
    error = caught.value
    assert error.exc_type == "builtins.ZeroDivisionError"
    assert error.message == "integer division or modulo by zero"
    line = inner.__code__.co_firstlineno + 1
    assert f'"{__file__}", line {line}, in inner' in error.remote_traceback
    assert "in helper" in error.remote_traceback
    assert "ZeroDivisionError" in str(error)


async def test_an_argument_that_cannot_be_unpickled_arrives_whole() -> None:
    driver = os.getpid()

    def refuse(pid: int) -> int:
        if os.getpid() != pid:
            raise RuntimeError("made to fail away from the driver")
        return 0

    class Stubborn:
        def __reduce__(self) -> tuple[Any, ...]:
            return refuse, (driver,)

    stubborn = Stubborn()
    with pytest.raises(BadCall) as caught:
        await run_on_host(lambda a: a + 0 * len([stubborn]), np.zeros(2, np.float32))
    error = caught.value
    assert error.exc_type == "builtins.RuntimeError"
    assert "could not be decoded: RuntimeError: made to fail away from the driver" in error.message
    assert "in refuse" in error.remote_traceback
    assert "RuntimeError: made to fail away from the driver" in error.remote_traceback


async def test_a_result_that_cannot_be_pickled_fails_the_caller() -> None:
    x = np.zeros(2, np.float32)
    async with atoll.local_cluster(1, 1, 1, transport="capnp") as cluster:
        ref = await cluster.put(x, 0)
        locked = cluster.run(Computation("lock", lambda a: threading.Lock()), 0, [ref])
        with pytest.raises(BadCall) as caught:
            await cluster.fetch(locked)  # the host holds a lock: it cannot send it
        error = caught.value
        assert "over the wire: cannot pickle '_thread.lock' object" in error.message
        assert error.exc_type == "builtins.TypeError"
        assert "cannot pickle" in error.remote_traceback
        fine = cluster.run(Computation("add", lambda a: a + 1), 0, [ref])
        assert (await cluster.fetch(fine)).tolist() == [1.0, 1.0]  # the link lives on


def test_capnp_text_with_a_traceback_is_kept_whole() -> None:
    description = (
        "remote exception: message = Traceback (most recent call last):\n"
        '  File "server.py", line 6, in read\n'
        "    helper()\n"
        "ZeroDivisionError: division by zero\n"
    )
    failure = Exception(description)
    failure.type, failure.description = "FAILED", description  # type: ignore[attr-defined]
    error = Peer("peer")._lost(failure)  # as a capnp.KjException carries it
    assert isinstance(error, RemoteActorError)
    assert error.exc_type == "builtins.ZeroDivisionError"
    assert error.message == "division by zero"
    assert 'File "server.py", line 6, in read' in error.remote_traceback


def test_a_function_is_pickled_by_value_once_while_it_lives() -> None:
    """cloudpickle runs once per function: later sends reuse its bytes, with
    the globals it read then (as a Ray remote function does)."""
    from atoll.transports.capnp import _byvalue

    scale = 2.0

    def times(x: float) -> float:
        return x * scale

    first = _byvalue.reduce(times, lambda obj: False)
    scale = 3.0  # a closure cell changed after the first send: not seen
    second = _byvalue.reduce(times, lambda obj: False)
    assert second[1][0] is first[1][0]
    assert _byvalue.load(*second[1])(1.0) == 2.0

    def again(x: float) -> float:  # a new function: pickled anew
        return x * scale

    assert _byvalue.load(*_byvalue.reduce(again, lambda obj: False)[1])(1.0) == 3.0
