"""Deprecated: `ResponseTier`, the base of a request stage that answered from its own store of whole
responses. The engine's response cache (`stages/response_cache.py`) now asks every KV tier that keeps
responses (`ResponseStore`, in `kv_tiers`); a tier implements `might_answer`, `lookup_response` and
`store_response` instead. Kept, with the stored-response helpers re-exported from
`output/stored_responses.py`, so plugins written against it keep working for this release.
"""

from __future__ import annotations

import abc
import logging
from typing import Any

import cachetools
import msgspec

from tokenflow.output.stored_responses import (
    ResponseStore,
    StoredResponse,
    decode_response,
    recorded_response,
    replay,
    response_key,
    serving_key,
    start_recording,
    wants_cached_response,
)
from tokenflow.protocols import EngineContext, NextStage
from tokenflow.request import Request, RequestSlot

__all__ = (
    "ResponseCache", "ResponseStore", "ResponseTier", "StoredResponse", "decode_response", "recorded_response",
    "replay", "response_key", "serving_key", "start_recording", "wants_cached_response",
)

log = logging.getLogger("tokenflow")


class ResponseCache:
    """Memory (TTL) in front of an optional disk store with `get_response` / `put_response`."""

    def __init__(self, size: int, ttl_s: float) -> None:
        self.memory: cachetools.TTLCache[str, bytes] = cachetools.TTLCache(maxsize=size, ttl=ttl_s)
        self.memory_hits = 0
        self.disk_hits = 0

    def get_memory(self, key: str) -> StoredResponse | None:
        raw = self.memory.get(key)
        if raw is None:
            return None
        self.memory_hits += 1
        return msgspec.json.decode(raw, type=StoredResponse)

    def decode_disk(self, key: str, raw: bytes | None) -> StoredResponse | None:
        """A disk entry, checked by decoding it; promoted to memory."""
        stored = None if raw is None else decode_response(raw)
        if stored is None:
            return None
        self.disk_hits += 1
        self.memory[key] = raw
        return stored

    def encode(self, key: str, stored: StoredResponse) -> bytes:
        raw = msgspec.json.encode(stored)
        self.memory[key] = raw
        return raw

    def stats(self) -> dict[str, Any]:
        return {
            "response_cache_memory_hits": self.memory_hits,
            "response_cache_disk_hits": self.disk_hits,
            "response_cache_entries": len(self.memory),
        }


class ResponseTier(abc.ABC):
    """A request stage that answers deterministic requests from a store of whole responses (the disk
    tier, a plugin's shared store): the lookup, replay, recording and storing are here; a subclass
    says how to `lookup_response` and `store_response`.

    Call `start_responses(ctx)` from `start`: it registers the stage as an observer, since a response
    is stored when its request completes (`on_request_end`)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.serving_key = b""
        self.observers: list[Any] = []
        self.response_hits = 0
        self.response_misses = 0
        self.response_stores = 0
        self._store_under = RequestSlot[str]("response key to store under")  # a miss here: store it here

    def start_responses(self, ctx: EngineContext) -> None:
        self.serving_key = ctx.serving_key or ctx.model_key
        self.observers = ctx.observers
        ctx.observers.append(self)

    @abc.abstractmethod
    async def lookup_response(self, key: str) -> StoredResponse | None:
        """The stored response under `key`, checked; None on a miss (or when the store is unavailable)."""

    @abc.abstractmethod
    def store_response(self, key: str, stored: StoredResponse) -> None:
        """Keep `stored` under `key`; called on the event loop, so hand slow work to a thread."""

    def might_answer(self, key: str) -> bool:
        """Event loop, no I/O: whether looking `key` up is worth it (e.g. False while a store is down)."""
        return True

    async def handle(self, request: Request, call_next: NextStage) -> None:
        key = response_key(self.serving_key, request) if wants_cached_response(
            request, self.config.response_cache) else None
        if key is not None and self.might_answer(key):
            stored = await self.lookup_response(key)
            if stored is not None:
                self.response_hits += 1
                replay(request, stored, self.observers)
                return
            self.response_misses += 1
            start_recording(request)
            self._store_under.set(request, key)
        await call_next(request)

    def on_step(self, duration_s: float, ok: bool) -> None:  # noqa: B027 (an observer needs it; nothing to do)
        pass

    def on_request_end(self, request: Request, outcome: str) -> None:
        key = self._store_under.pop(request)
        stored = recorded_response(request) if key is not None and outcome == "completed" else None
        if stored is not None:
            self.response_stores += 1
            self.store_response(key, stored)
