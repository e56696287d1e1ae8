"""Pins the public API: changing it must be a decision, not an accident."""

from __future__ import annotations

import atoll
import atoll.kernel


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
            "VirtualClock",
            "VirtualSlice",
            "WallClock",
            "__version__",
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
            "Promise",
            "RemoteActorError",
            "TransportError",
            "VirtualClock",
            "WaitCounter",
            "WallClock",
            "all_settled",
            "as_promise",
            "count_waits",
            "endpoint",
            "failed",
            "first_settled",
            "flatten",
            "forward",
            "resolve_actor_class",
            "then",
            "value_of",
            "wait_idle",
        ]
    )
    for name in atoll.kernel.__all__:
        assert hasattr(atoll.kernel, name), name


def test_names_that_left_the_kernel_are_deprecated_aliases() -> None:
    import pytest

    import atoll.devices

    for name in ("ObjectStore", "BufferMissing"):
        with pytest.warns(DeprecationWarning, match=f"atoll.devices.{name}"):
            assert getattr(atoll.kernel, name) is getattr(atoll.devices, name)


def test_every_error_is_an_atoll_error() -> None:
    errors = [getattr(atoll.kernel, n) for n in atoll.kernel.__all__]
    for error in errors:
        if isinstance(error, type) and issubclass(error, Exception):
            assert issubclass(error, atoll.kernel.AtollError), error


def test_import_atoll_stays_lean() -> None:
    import subprocess
    import sys

    code = "import atoll, sys; print('capnp' in sys.modules, 'jax' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, close_fds=False
    )
    assert done.stdout.split() == ["False", "False"], done.stderr
