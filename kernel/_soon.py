"""Which event loop runs here, for code that may run outside any task: a
function run once the loop's current turn is over (asyncio or trio), and
whether this is a plain callback of an asyncio loop. What the kernel's own
parts (the actor cell) and :mod:`atoll.kernel.lowlevel` share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import sniffio

from ._alarm import running_asyncio_loop

__all__ = ["call_soon", "on_trio", "outside_tasks"]


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


def outside_tasks() -> bool:
    """Whether this code runs in a plain callback of an asyncio loop (a
    promise settled by a timer, a socket's read or another thread's post):
    no task runs it, so anyio cannot tell the library, and the context is
    the loop's own, not that of any actor's task."""
    return running_asyncio_loop() is not None and asyncio.current_task() is None
