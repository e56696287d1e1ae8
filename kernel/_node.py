"""The node actor: what a transport exposes of a process to its peers.

Every process that serves actors to others runs one :class:`NodeActor`. A peer
that connects gets a reference to it and nothing else; from there it spawns
actors by class path and looks up named ones. Spawning returns an
:class:`ActorRef`, so ``node.spawn(...).method(...)`` pipelines.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._actor import Actor, ActorRef, Directive, endpoint
from ._clock import wait_idle
from ._errors import AtollError, NotAnActor

__all__ = ["NodeActor", "resolve_actor_class"]


def resolve_actor_class(target: str | type[Actor]) -> type[Actor]:
    """Turn ``"package.module:ClassName"`` (or a class) into an Actor class."""
    if isinstance(target, type):
        cls: object = target
    else:
        module_name, sep, attr = target.partition(":")
        if not sep or not module_name or not attr:
            raise AtollError(f"actor class must be 'module:Class', got {target!r}")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise AtollError(f"cannot import actor class {target!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise NotAnActor(f"{target!r} is not an Actor subclass")
    return cls


class NodeActor(Actor):
    """Spawns and finds actors in this process on behalf of remote peers."""

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name

    @endpoint
    def ping(self) -> str:
        return self.node_name

    @endpoint
    def spawn(
        self, target: str | type[Actor], *args: Any, name: str | None = None, **kwargs: Any
    ) -> ActorRef[Any]:
        """Start a child actor of this node; returns its reference."""
        return self.ctx.spawn(resolve_actor_class(target), *args, name=name, **kwargs)

    @endpoint
    async def settle(self) -> None:
        """Return once every task of this process is blocked (for test harnesses
        that drive a node in another process, as ``wait_idle`` does locally)."""
        await wait_idle()

    @endpoint
    def lookup(self, name: str) -> ActorRef[Any]:
        """A running actor's reference, by the name it was spawned with."""
        for ref in self.ctx.children:
            if ref.name in (name, f"{self.ctx.name}/{name}"):
                return ref
        raise AtollError(f"no actor named {name!r} on node {self.node_name!r}")

    def on_child_failed(self, child: ActorRef[Any], error: BaseException) -> Directive:
        return Directive.STOP  # one peer's broken actor must not take the node down
