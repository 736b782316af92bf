"""`SyncEngine`: the engine for code that is not async, or runs on another thread or event loop.

An `Engine` serves the event loop that started it (its events and tasks belong to that loop), and a call
from anywhere else raises `WrongEventLoop` at once. Sync code uses a `SyncEngine` instead, either

- `tokenflow.SyncEngine("smollm2-135m", **settings)`: an engine on a thread and event loop of its own
  (as vLLM's `LLM` class is for offline use), closed by `close()` or a `with` block; or
- `engine.portal()`: a bridge to an engine an async app already runs, for its other threads (a Django
  view, a Celery task, a sync test beside an async server).

Every call runs on the engine's loop through an anyio `BlockingPortal` and blocks its thread until the
result is there; `stream` is an iterator of chunks. Interrupting a waiting call (Ctrl-C) or leaving a
`for` over a stream early aborts the request on the engine, as cancelling it would.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from tokenflow.errors import WrongEventLoop
from tokenflow.params import Chunk, Completion, SamplingParams

__all__ = ("SyncEngine",)

T = TypeVar("T")


class SyncEngine:
    """Blocking `generate` / `chat` / `stream` / `stream_chat` / `tokenize` / `detokenize` / `stats`."""

    def __init__(self, model: str | None = None, *, config_file: str | None = None, **settings: Any) -> None:
        """Start an engine on a new thread with its own event loop; the settings are `Engine`'s."""
        from anyio.from_thread import start_blocking_portal

        from tokenflow.engine import Engine

        self._portal_cm: Any = start_blocking_portal(name="tokenflow-sync-engine")
        portal = self._portal_cm.__enter__()
        try:
            engine = Engine(model, config_file=config_file, **settings)
            portal.call(engine.start)
        except BaseException as exc:
            self._portal_cm.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._setup(engine, portal, engine._home_thread)

    @classmethod
    def bridge(cls, engine: Any, portal: Any, home_thread: int) -> SyncEngine:
        """A SyncEngine over an engine running on another thread's loop (`Engine.portal()`)."""
        bridge = cls.__new__(cls)
        bridge._portal_cm = None
        bridge._setup(engine, portal, home_thread)
        return bridge

    def _setup(self, engine: Any, portal: Any, home_thread: int) -> None:
        self.engine = engine
        self._portal = portal
        self._home_thread = home_thread

    # -- the calls -----------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, **kwargs: Any
                 ) -> Completion:
        return self._call(self.engine.generate, prompt, params, **kwargs)

    def chat(self, messages: Sequence[dict[str, Any]], params: SamplingParams | None = None, **kwargs: Any
             ) -> Completion:
        return self._call(self.engine.chat, messages, params, **kwargs)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, **kwargs: Any
               ) -> Iterator[Chunk]:
        return self._iterate(lambda: self.engine.stream(prompt, params, **kwargs))

    def stream_chat(self, messages: Sequence[dict[str, Any]], params: SamplingParams | None = None,
                    **kwargs: Any) -> Iterator[Chunk]:
        return self._iterate(lambda: self.engine.stream_chat(messages, params, **kwargs))

    def tokenize(self, prompt: str | Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
        return self._call(self.engine.tokenize, prompt, **kwargs)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self._call(self.engine.detokenize, token_ids)

    def embed(self, inputs: Any, **kwargs: Any) -> list[list[float]]:
        return self._call(self.engine.embed, inputs, **kwargs)

    def stats(self) -> dict[str, Any]:
        return self._call(self._stats)

    async def _stats(self) -> dict[str, Any]:
        return self.engine.stats()

    # -- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Close the engine and its thread (a bridge from `Engine.portal()` leaves its engine running)."""
        cm, self._portal_cm = self._portal_cm, None
        if cm is None:
            return
        try:
            self._portal.call(self.engine.aclose)
        finally:
            cm.__exit__(None, None, None)

    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- through the portal ----------------------------------------------------------------
    def _check_thread(self) -> None:
        if threading.get_ident() == self._home_thread:
            raise WrongEventLoop("this thread runs the engine's event loop: a blocking call here would wait "
                                 "for itself; `await engine.generate(...)` instead")

    def _call(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any, **kwargs: Any) -> T:
        """`await fn(*args, **kwargs)` on the engine's loop; an interrupted wait cancels it there."""
        self._check_thread()

        async def run() -> T:
            return await fn(*args, **kwargs)

        future = self._portal.start_task_soon(run)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt while waiting: the request is aborted, not orphaned
            raise

    def _iterate(self, open_stream: Callable[[], AsyncIterator[Chunk]]) -> Iterator[Chunk]:
        """The stream `open_stream()` makes on the engine's loop, one chunk per blocking step."""
        self._check_thread()

        async def opened() -> AsyncIterator[Chunk]:
            return open_stream()  # the request is made (and checked) on the engine's loop

        stream = self._call(opened)  # raises here, at the call, for a request refused up front
        return self._chunks(stream)

    def _chunks(self, stream: Any) -> Iterator[Chunk]:
        try:
            while True:
                try:
                    yield self._call(stream.__anext__)
                except StopAsyncIteration:
                    return
        finally:  # left early (break, an exception, garbage): the request is aborted on the engine
            with contextlib.suppress(Exception):  # the engine or its loop is already gone
                self._call(stream.aclose)
