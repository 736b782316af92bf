"""Engine-owned background tasks: work that serves many callers never runs in one caller's task.

A caller's cancellation (asyncio's `task.cancel()`, `asyncio.wait_for`, an anyio or trio cancel scope)
must end that caller's request and nothing else, so work shared between requests (the step loop, the
tokenizer's batches, the model thread's host) runs in tasks the engine owns. An anyio task group would
have to be exited by the task that entered it, which breaks apps (and test fixtures) that open and close
the engine in different tasks; so each runs as an asyncio task or a trio system task, stopped from any
task with `stop()`.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

__all__ = ("BackgroundTask", "current_event_loop", "serve_portal", "spawn")


class BackgroundTask:
    """A task running `fn()` until it returns or `stop()` cancels it."""

    def __init__(self, fn: Callable[[], Awaitable[None]]) -> None:
        self._fn = fn
        self._scope = anyio.CancelScope()
        self._done = anyio.Event()
        self.handle: Any = None

    async def main(self) -> None:
        try:
            with self._scope:
                await self._fn()
        finally:
            self._done.set()

    async def stop(self) -> None:
        self._scope.cancel()
        await self._done.wait()

    async def wait(self) -> None:
        await self._done.wait()


def spawn(fn: Callable[[], Awaitable[None]], name: str) -> BackgroundTask:
    """Start `fn()` as a task of the running event loop (asyncio or trio) that no caller owns."""
    import asyncio

    task = BackgroundTask(fn)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio: trio
        import trio

        task.handle = trio.lowlevel.spawn_system_task(task.main, name=name)
    else:
        task.handle = loop.create_task(task.main(), name=name)
    return task


def current_event_loop() -> object | None:
    """The running event loop (an asyncio loop, or trio's token for its run), or None in sync code: what
    an engine compares with the loop that started it."""
    import asyncio

    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")  # a trio run has imported it
    if trio is None:
        return None
    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:
        return None


async def serve_portal(ready: Callable[[Any], None]) -> None:
    """Host an anyio `BlockingPortal` on this loop until cancelled; `ready(portal)` is told of it. Other
    threads run coroutines on this loop through it (`tokenflow.SyncEngine`)."""
    from anyio.from_thread import BlockingPortal

    async with BlockingPortal() as portal:
        ready(portal)
        await anyio.sleep_forever()
