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

:meth:`CapnpBridge.enter` bridges any asyncio async context manager and the
objects it gives, whole: it enters the context on the loop thread and yields a
:class:`Bridged` proxy. That is how ``atoll.connect`` serves trio apps: the
client, its cluster handle, promises and outputs are all proxies. Calling a
method of a proxy sends the call to the loop thread and returns at once (a
proxy of its result: a promise can be passed to the next call before it
settles, as on asyncio); awaiting a proxy waits there for the value. Plain
values (numbers, strings, numpy arrays, plain dataclasses, containers of
those) cross back as they are; anything else stays on the loop thread, which
alone creates, uses and drops it, and trio gets another proxy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import inspect
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from typing import Any

import numpy as np
import trio

from ...kernel import ActorRef, ActorSystem, Promise
from ._transport import CapnpTransport, capnp_runtime

__all__ = ["Bridged", "BridgedRef", "CapnpBridge"]


class CapnpBridge:
    """An asyncio thread that owns a capnp connection on behalf of trio code."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="atoll-capnp-bridge", daemon=True
        )
        self._refs: dict[int, Any] = {}  # actor refs, and any object a Bridged stands for
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

    @classmethod
    @asynccontextmanager
    async def enter(
        cls, make: Callable[[], AbstractAsyncContextManager[Any]]
    ) -> AsyncIterator[Bridged]:
        """Enter ``make()`` (an asyncio async context manager) on a loop thread
        of its own, from trio; yields what it gives, as a :class:`Bridged`."""
        bridge = cls()
        bridge._thread.start()
        try:
            handle = await bridge._wait(bridge._submit(bridge._open_context(make)))
            yield Bridged(bridge, _done(handle))
        finally:
            await bridge.aclose()

    async def _open_context(self, make: Callable[[], AbstractAsyncContextManager[Any]]) -> int:
        ready: asyncio.Future[int] = self._loop.create_future()
        self._stop = asyncio.Event()
        self._main = asyncio.ensure_future(self._hold_context(make, ready))
        return await ready

    async def _hold_context(
        self, make: Callable[[], AbstractAsyncContextManager[Any]], ready: asyncio.Future[int]
    ) -> None:
        assert self._stop is not None
        try:
            async with make() as value:
                try:
                    ready.set_result(self._keep(value))
                    await self._stop.wait()
                finally:  # inside the context: its objects go before it closes
                    self._refs.clear()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    def _later(self, op: Callable[[], Any], keep: bool = True) -> concurrent.futures.Future[Any]:
        """Run ``op()`` on the loop thread, after everything sent before it.

        A coroutine it returns is run to its end there. The future gives the
        result's handle (``keep``), or the result itself if it is plain.
        """
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def settle(value: Any) -> None:
            if not future.done():
                future.set_result(self._keep(value) if keep else _exported(self, value))

        def start() -> None:
            try:
                value = op()
            except BaseException as exc:
                future.set_exception(exc)
                return
            if not inspect.iscoroutine(value):
                settle(value)
                return
            task = self._loop.create_task(value, context=contextvars.Context())
            task.add_done_callback(finish)

        def finish(task: asyncio.Task[Any]) -> None:
            if task.cancelled():
                future.cancel()
            elif task.exception() is not None:
                future.set_exception(task.exception())
            else:
                settle(task.result())

        self._loop.call_soon_threadsafe(start, context=contextvars.Context())
        return future

    async def _wait(self, future: concurrent.futures.Future[Any]) -> Any:
        """Wait (from trio) for a future the loop thread settles; its result."""
        if not future.done():
            token = trio.lowlevel.current_trio_token()
            done = trio.Event()
            future.add_done_callback(lambda _: token.run_sync_soon(done.set))
            await done.wait()
        self.calls += 1
        return future.result()

    def _object(self, value: Any) -> Any:
        """On the loop thread: ``value`` with every :class:`Bridged` in it replaced
        by the object it stands for."""
        if isinstance(value, Bridged):
            if not value._future.done():
                raise RuntimeError("await a bridged coroutine's result before passing it on")
            return self._refs[value._future.result()]
        if isinstance(value, list | tuple):
            return type(value)(self._object(v) for v in value)
        if isinstance(value, dict):
            return {k: self._object(v) for k, v in value.items()}
        return value

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


# -- whole objects over the bridge --------------------------------------------------
_PLAIN = (type(None), bool, int, float, complex, str, bytes, np.ndarray, np.generic)


def _plain(value: Any) -> bool:
    """Whether ``value`` may cross to the trio thread as it is: it holds no
    capnp object, actor or promise (plain data, containers and dataclasses
    of plain data)."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, list | tuple | frozenset | set):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return all(_plain(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


class _Handle:
    """A future's result that names a kept object (not a plain value)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle


def _exported(bridge: CapnpBridge, value: Any) -> Any:
    return value if _plain(value) else _Handle(bridge._keep(value))


def _done(handle: int) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(handle)
    return future


class Bridged:
    """A trio-side proxy of an object that lives on the bridge's loop thread.

    ``proxy.method(*args)`` sends the call and returns a proxy of its result
    at once; ``await proxy`` gives the value (awaiting it there first if it is
    a promise, a coroutine or another awaitable); ``proxy.attribute`` reads a
    plain attribute as it is; ``async with proxy`` enters it there. Proxies
    passed as arguments stand for their objects again on the other side.
    """

    __slots__ = ("__weakref__", "_bridge", "_future")

    def __init__(self, bridge: CapnpBridge, future: concurrent.futures.Future[Any]) -> None:
        self._bridge = bridge
        self._future = future  # settles to the handle of the object in bridge._refs

    def _send(self, op: Callable[[Any], Any]) -> Bridged:
        """``op(the object)`` on the loop thread, in order; a proxy of its result."""
        bridge, future = self._bridge, self._future
        return Bridged(bridge, bridge._later(lambda: op(bridge._refs[future.result()])))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if self._future.done() and self._future.exception() is None:
            target = self._bridge._refs.get(self._future.result())
            if callable(getattr(type(target), name, None)):
                return self._method(name)  # one hop per call, not two
            value = getattr(target, name)  # a plain attribute or property: read it here
            if _plain(value):
                return value
        return self._send(lambda target: getattr(target, name))

    def _method(self, name: str) -> Callable[..., Bridged]:
        bridge = self._bridge

        def call(*args: Any, **kwargs: Any) -> Bridged:
            return self._send(
                lambda target: getattr(target, name)(
                    *bridge._object(args), **bridge._object(kwargs)
                )
            )

        return call

    def __call__(self, *args: Any, **kwargs: Any) -> Bridged:
        bridge = self._bridge
        return self._send(lambda target: target(*bridge._object(args), **bridge._object(kwargs)))

    def __getitem__(self, key: Any) -> Bridged:
        return self._send(lambda target: target[self._bridge._object(key)])

    def __iter__(self) -> Any:
        # without this, iteration would fall back to __getitem__ and never end
        raise TypeError("a bridged value cannot be iterated: index it (proxy[0]) or await it")

    def __await__(self) -> Any:
        return self._value().__await__()

    async def _value(self) -> Any:
        bridge = self._bridge
        handle = await bridge._wait(self._future)
        result = await bridge._wait(bridge._later(lambda: _settled(bridge._refs[handle]), False))
        if isinstance(result, _Handle):
            return Bridged(bridge, _done(result.handle))
        return result

    async def __aenter__(self) -> Any:
        return await self._send(lambda target: target.__aenter__())

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._send(lambda target: target.__aexit__(*exc_info))

    def __repr__(self) -> str:
        if self._future.done() and self._future.exception() is None:
            return f"Bridged({self._bridge._refs.get(self._future.result())!r})"
        return "Bridged(<pending>)"

    def __del__(self) -> None:
        bridge, future = self._bridge, self._future
        if bridge._thread.is_alive() and not bridge._loop.is_closed():
            future.add_done_callback(lambda f: _forget_later(bridge, f))


def _forget_later(bridge: CapnpBridge, future: concurrent.futures.Future[Any]) -> None:
    if future.exception() is None and not bridge._loop.is_closed():
        with suppress(RuntimeError):  # the loop closed meanwhile
            bridge._loop.call_soon_threadsafe(bridge._forget, future.result())


async def _settled(value: Any) -> Any:
    """On the loop thread: the value of ``value``, awaited if it is awaitable."""
    while inspect.isawaitable(value):
        value = await value
    return value
