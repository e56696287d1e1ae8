"""Pins the public API: changing it must be a decision, not an accident."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

import atoll
import atoll.kernel

PUBLIC_MODULES = [
    "atoll",
    "atoll.kernel",
    "atoll.transports",
    "atoll.transports.capnp",
    "atoll.devices",
    "atoll.schedulers",
    "atoll.partition",
    "atoll.runtime",
]


def test_top_level_api() -> None:
    assert sorted(atoll.__all__) == sorted(
        [
            "Actor",
            "ActorRef",
            "ActorStopped",
            "ActorSystem",
            "ArrayRef",
            "AtollError",
            "Cluster",
            "Directive",
            "Outputs",
            "Program",
            "Promise",
            "RemoteActorError",
            "ShardedRef",
            "VirtualClock",
            "VirtualSlice",
            "WallClock",
            "__version__",
            "colocated",
            "connect",
            "endpoint",
            "local_cluster",
            "program",
        ]
    )
    for name in atoll.__all__:
        assert hasattr(atoll, name), name


def test_kernel_api() -> None:
    assert sorted(atoll.kernel.__all__) == sorted(
        [
            "Actor",
            "ActorCancelled",
            "ActorContext",
            "ActorFailed",
            "ActorRef",
            "ActorStopped",
            "ActorSystem",
            "AtollError",
            "BadCall",
            "BadMailbox",
            "Call",
            "CallCancelled",
            "HostLost",
            "Channel",
            "Clock",
            "Directive",
            "EndpointRef",
            "EndpointSpec",
            "Mailbox",
            "MailboxFull",
            "NoSuchEndpoint",
            "NodeActor",
            "NotAnActor",
            "NotRunning",
            "Promise",
            "RemoteActorError",
            "Timer",
            "TransportError",
            "UsageError",
            "VirtualClock",
            "WaitCounter",
            "WallClock",
            "all_settled",
            "as_promise",
            "count_waits",
            "current_clock",
            "endpoint",
            "fail_after",
            "failed",
            "first_settled",
            "flatten",
            "forward",
            "log_failure",
            "move_on_after",
            "process_counters",
            "resolve_actor_class",
            "then",
            "use_clock",
            "value_of",
            "when_settled",
            "wait_idle",
        ]
    )
    for name in atoll.kernel.__all__:
        assert hasattr(atoll.kernel, name), name


def test_the_kernel_knows_nothing_of_devices() -> None:
    for name in ("ObjectStore", "BufferMissing"):
        assert not hasattr(atoll.kernel, name)


def public_errors(module: ModuleType) -> list[type[BaseException]]:
    """Every exception class a module exports in its ``__all__``."""
    found = [getattr(module, name) for name in module.__all__]
    return [e for e in found if isinstance(e, type) and issubclass(e, BaseException)]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_error_is_an_atoll_error(name: str) -> None:
    errors = public_errors(importlib.import_module(name))
    assert errors, f"{name} exports no error at all: is this test still looking?"
    for error in errors:
        assert issubclass(error, atoll.AtollError), f"{name}.{error.__name__}"


def test_errors_keep_their_builtin_bases() -> None:
    from atoll import devices, kernel, runtime, schedulers, transports

    expected: dict[type[BaseException], type[BaseException]] = {
        kernel.BadMailbox: ValueError,
        kernel.NotAnActor: TypeError,
        kernel.NotRunning: RuntimeError,
        transports.UnknownTransport: KeyError,
        devices.BufferMissing: KeyError,
        devices.DeviceError: RuntimeError,
        devices.UnsupportedKernel: TypeError,
        schedulers.UnknownScheduler: KeyError,
        schedulers.PolicyError: ValueError,
        runtime.BadClusterSpec: ValueError,
        runtime.NotAProgram: TypeError,
    }
    for error, builtin in expected.items():
        with pytest.raises(builtin):  # an old `except builtin:` still catches it
            raise error("message")
        assert str(error("message")) == "message", error  # no KeyError quotes


def test_unknown_names_read_well_and_are_caught_as_before() -> None:
    from atoll.schedulers import get_scheduler
    from atoll.transports import get_transport

    with pytest.raises(KeyError) as scheduler:
        get_scheduler("no-such-policy")
    with pytest.raises(KeyError) as transport:
        get_transport("nowhere://x")
    assert str(scheduler.value).startswith("no scheduler named 'no-such-policy'; known:")
    assert str(transport.value).startswith("no transport for 'nowhere'; known:")


def test_import_atoll_stays_lean() -> None:
    import subprocess
    import sys

    code = "import atoll, sys; print('capnp' in sys.modules, 'jax' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, close_fds=False
    )
    assert done.stdout.split() == ["False", "False"], done.stderr


def test_errors_cross_processes_intact() -> None:
    """Any atoll error pickles and comes back the same, whatever its ``__init__``."""
    import pickle

    from atoll import kernel

    errors = [
        kernel.ActorStopped("worker", "stopped"),
        kernel.CallCancelled("worker", "step", "gave up"),
        kernel.NoSuchEndpoint("worker", "nope"),
        kernel.MailboxFull("worker", 8),
        kernel.HostLost("connection to host 2 lost"),
        kernel.BadCall("bad", "builtins.TypeError", "tb"),
    ]
    for error in errors:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error)
        assert back.__dict__ == error.__dict__
