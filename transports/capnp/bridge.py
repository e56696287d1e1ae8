"""Reach a Cap'n Proto cluster from trio (or any non-asyncio code).

pycapnp's RPC runs only on asyncio, and every capnp object must live and die
on the thread of its loop. :class:`CapnpBridge` therefore runs an asyncio loop
in a thread of its own, holding the connection and every remote reference. The
other side (a trio app) holds only :class:`BridgedRef` handles: plain ids, no
capnp objects. Values cross the thread boundary as ordinary Python objects; an
actor reference in a result comes back as another :class:`BridgedRef`.

Each call costs a hop into the loop thread and back (see docs/transport.md
for the measured cost). Pipelining still happens on the asyncio side: a chain
written with :meth:`BridgedRef.chain` is sent in one go.

Usage (trio)::

    async with CapnpBridge.connect("capnp://127.0.0.1:7000", token) as node:
        counter = await node.spawn("my.module:Counter")
        await counter.add(1)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager, suppress
from typing import Any

import trio

from ...kernel import ActorRef, ActorSystem, Promise
from ._transport import CapnpTransport, capnp_runtime

__all__ = ["BridgedRef", "CapnpBridge"]


class CapnpBridge:
    """An asyncio thread that owns a capnp connection on behalf of trio code."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="atoll-capnp-bridge", daemon=True
        )
        self._refs: dict[int, ActorRef[Any]] = {}
        self._ids = itertools.count()
        self._stop: asyncio.Event | None = None
        self._main: Any = None
        self.calls = 0

    @classmethod
    @asynccontextmanager
    async def connect(cls, address: str, token: bytes) -> AsyncIterator[BridgedRef]:
        """Connect (from trio); yields the remote node as a :class:`BridgedRef`."""
        bridge = cls()
        bridge._thread.start()
        try:
            node_id = await bridge._run(bridge._open, address, token)
            yield BridgedRef(bridge, node_id, "node")
        finally:
            await bridge.aclose()

    async def _open(self, address: str, token: bytes) -> int:
        ready: asyncio.Future[int] = self._loop.create_future()
        self._stop = asyncio.Event()
        self._main = asyncio.ensure_future(self._hold(address, token, ready))
        return await ready

    async def _hold(self, address: str, token: bytes, ready: asyncio.Future[int]) -> None:
        assert self._stop is not None
        try:
            async with capnp_runtime(), ActorSystem("bridge") as system:
                connection = await CapnpTransport(token).connect(address, system)
                try:
                    ready.set_result(self._keep(connection.node))
                    await self._stop.wait()
                finally:  # inside the runtime: capnp objects go before its loop
                    self._refs.clear()
                    await connection.aclose()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    def _keep(self, ref: ActorRef[Any]) -> int:
        handle = next(self._ids)
        self._refs[handle] = ref
        return handle

    async def _call(
        self, handle: int, endpoint: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        value = await getattr(self._refs[handle], endpoint)(*args, **kwargs)
        return self._export(value)

    async def _chain(self, handle: int, steps: list[tuple[str, tuple[Any, ...]]]) -> Any:
        promise: Any = self._refs[handle]
        for endpoint, args in steps:
            promise = getattr(promise, endpoint)(*args)
        assert isinstance(promise, Promise)
        return self._export(await promise)

    def _export(self, value: Any) -> Any:
        if isinstance(value, ActorRef):
            return _Exported(self._keep(value), value.name)
        if isinstance(value, list | tuple):
            return type(value)(self._export(v) for v in value)
        if isinstance(value, dict):
            return {k: self._export(v) for k, v in value.items()}
        return value

    def _forget(self, handle: int) -> None:
        self._refs.pop(handle, None)

    async def _run(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        """Run ``fn(*args)`` on the loop thread; wait for it from trio."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        future = self._submit(fn(*args))
        future.add_done_callback(lambda _: token.run_sync_soon(done.set))
        try:
            await done.wait()
        except trio.Cancelled:
            future.cancel()  # a trio timeout cancels the call on the loop thread too
            raise
        self.calls += 1
        return self._import(future.result())

    def _submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Start ``coro`` on the loop thread, in a clean context.

        (A task inheriting the caller's context would believe it runs under
        trio: sniffio keeps the current library in a context variable.)
        """
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def start() -> None:
            if future.cancelled():
                coro.close()
                return
            task = self._loop.create_task(coro, context=contextvars.Context())
            task.add_done_callback(lambda t: _copy(t, future))
            future.add_done_callback(
                lambda f: self._loop.call_soon_threadsafe(_cancel_if_cancelled, f, task)
            )

        self._loop.call_soon_threadsafe(start, context=contextvars.Context())
        return future

    def _import(self, value: Any) -> Any:
        if isinstance(value, _Exported):
            return BridgedRef(self, value.handle, value.name)
        if isinstance(value, list | tuple):
            return type(value)(self._import(v) for v in value)
        if isinstance(value, dict):
            return {k: self._import(v) for k, v in value.items()}
        return value

    async def aclose(self) -> None:
        """Close the connection and stop the loop thread."""
        if self._stop is not None:
            stop, self._stop = self._stop, None
            self._loop.call_soon_threadsafe(stop.set)
            main = self._main
            if main is not None:
                waiter = self._submit(_wait(main))
                await trio.to_thread.run_sync(waiter.result, 30)
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            await trio.to_thread.run_sync(self._thread.join, 30)
        if not self._loop.is_closed() and not self._thread.is_alive():
            self._loop.close()


def _cancel_if_cancelled(future: concurrent.futures.Future[Any], task: asyncio.Task[Any]) -> None:
    if future.cancelled() and not task.done():
        task.cancel()


def _copy(task: asyncio.Task[Any], future: concurrent.futures.Future[Any]) -> None:
    if future.done():
        return
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())


async def _wait(task: Any) -> None:
    with suppress(BaseException):
        await task


class _Exported:
    """An actor reference as it crosses into the non-asyncio thread."""

    __slots__ = ("handle", "name")

    def __init__(self, handle: int, name: str) -> None:
        self.handle, self.name = handle, name


class BridgedRef:
    """A remote actor, usable from trio: ``await ref.endpoint(*args)``."""

    def __init__(self, bridge: CapnpBridge, handle: int, name: str) -> None:
        self._bridge = bridge
        self._handle = handle
        self.name = name

    def __getattr__(self, endpoint: str) -> Callable[..., Coroutine[Any, Any, Any]]:
        if endpoint.startswith("_"):
            raise AttributeError(endpoint)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self._bridge._run(self._bridge._call, self._handle, endpoint, args, kwargs)

        return call

    async def chain(self, *steps: tuple[str, tuple[Any, ...]]) -> Any:
        """Send ``ref.a(*x).b(*y)...`` pipelined in one go; returns the last value."""
        return await self._bridge._run(self._bridge._chain, self._handle, list(steps))

    def __del__(self) -> None:
        bridge = self._bridge
        if bridge._thread.is_alive() and not bridge._loop.is_closed():
            bridge._loop.call_soon_threadsafe(bridge._forget, self._handle)
