"""`ModelThread`: one OS thread for every torch call of the model stage.

Why one thread: on the CPU, torch's OpenMP runtime keeps a team of helper
threads for each thread that runs a parallel op. anyio's worker pool hands
each call to whichever worker is idle, so model work spread over several
workers leaves more OpenMP threads than cores, and libgomp then throttles
its spin-waits: every parallel region pays a sleep and a wake-up. So the
engine loads the model, builds the KV cache and runs every step on this one
thread (`run`), and nothing else in the engine runs large torch ops (see
`KVCache.read_block`).

The thread is an anyio worker thread kept for the engine's lifetime, so
results come back to the event loop through `anyio.from_thread` (asyncio and
trio alike), and the callbacks a static backend makes from inside a step
(`anyio.from_thread.run_sync`) keep working.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread

__all__ = ("ModelJob", "ModelThread")

T = TypeVar("T")


class ModelJob:
    """One call queued on the model thread, and its outcome once `done` is set."""

    __slots__ = ("args", "done", "fn", "ok", "value")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.done = anyio.Event()
        self.ok = False
        self.value: Any = None


class ModelThread:
    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[ModelJob | None] = queue.SimpleQueue()
        self.thread_id: int | None = None
        self.native_id: int | None = None  # the OS's id of the thread (schedstat, `CoreSharing`)

    async def serve(self) -> None:
        """Host the thread until `close()`; run this as a background task."""
        await anyio.to_thread.run_sync(self._work)

    def close(self) -> None:
        """Let the thread end after the job it is running (if any)."""
        self._jobs.put(None)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the model thread. Cancelling the caller does not stop a job once started."""
        return await self.result(self.submit(fn, *args))

    def submit(self, fn: Callable[..., Any], *args: Any) -> ModelJob:
        """Queue `fn(*args)` on the model thread now; `await result(job)` for its value. Jobs run in the order
        they were submitted (the step loop queues a step planned ahead behind the running one)."""
        job = ModelJob(fn, args)
        self._jobs.put(job)
        return job

    @staticmethod
    async def result(job: ModelJob) -> Any:
        """The value of a submitted job once it ran (its exception raised here)."""
        await job.done.wait()
        if not job.ok:
            raise job.value
        return job.value

    def _work(self) -> None:
        self.thread_id = threading.get_ident()
        self.native_id = threading.get_native_id()
        while (job := self._jobs.get()) is not None:
            try:
                job.value, job.ok = job.fn(*job.args), True
            except BaseException as exc:  # handed to the awaiting caller
                job.value = exc
            try:
                anyio.from_thread.run_sync(job.done.set)
            except RuntimeError:  # the event loop is gone
                return
