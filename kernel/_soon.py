"""Which event loop runs here, for code that may run outside any task: a
function run once the loop's current turn is over (asyncio or trio), and
anyio told the library in a plain callback of an asyncio loop. What the
kernel's own parts (the actor cell) and :mod:`atoll.kernel.lowlevel` share."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

import sniffio

from ._alarm import running_asyncio_loop

__all__ = ["call_soon", "library_said", "on_trio"]


def call_soon(fn: Callable[[], object]) -> None:
    """Run ``fn()`` on this event loop once the current turn is over (before
    it waits for I/O again): asyncio's ``call_soon``, trio's ``run_sync_soon``."""
    loop = running_asyncio_loop()
    if loop is not None:  # asyncio's own test first: sniffio asks for the task
        loop.call_soon(fn)
        return
    if on_trio():
        import trio

        trio.lowlevel.current_trio_token().run_sync_soon(fn)
        return
    asyncio.get_running_loop().call_soon(fn)


def on_trio() -> bool:
    """Whether this code runs under trio (else asyncio: also in a plain
    callback of an asyncio loop, where sniffio finds no task to ask)."""
    try:
        return sniffio.current_async_library() == "trio"
    except sniffio.AsyncLibraryNotFoundError:
        return False


@contextlib.contextmanager
def library_said() -> Iterator[None]:
    """Within it, anyio knows the library even in a plain callback of an
    asyncio loop (a promise settled by a timer or a socket's read), where
    no task answers sniffio's question: so a cancel scope can be made, or a
    task started in a task group, from such a callback."""
    if (
        sniffio.thread_local.name is None
        and sniffio.current_async_library_cvar.get() is None
        and running_asyncio_loop() is not None
        and asyncio.current_task() is None
    ):
        said = sniffio.current_async_library_cvar.set("asyncio")
        try:
            yield
        finally:
            sniffio.current_async_library_cvar.reset(said)
    else:
        yield
