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
            "AtollError",
            "Cluster",
            "Directive",
            "Promise",
            "RemoteActorError",
            "VirtualClock",
            "WallClock",
            "__version__",
            "endpoint",
            "local_cluster",
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
            "BufferMissing",
            "Call",
            "CallCancelled",
            "Channel",
            "Clock",
            "Directive",
            "EndpointRef",
            "EndpointSpec",
            "Mailbox",
            "MailboxFull",
            "NoSuchEndpoint",
            "NodeActor",
            "ObjectStore",
            "Promise",
            "RemoteActorError",
            "TransportError",
            "VirtualClock",
            "WaitCounter",
            "WallClock",
            "count_waits",
            "endpoint",
            "resolve_actor_class",
            "wait_idle",
        ]
    )
    for name in atoll.kernel.__all__:
        assert hasattr(atoll.kernel, name), name


def test_every_error_is_an_atoll_error() -> None:
    errors = [getattr(atoll.kernel, n) for n in atoll.kernel.__all__]
    for error in errors:
        if isinstance(error, type) and issubclass(error, Exception):
            assert issubclass(error, atoll.kernel.AtollError), error
