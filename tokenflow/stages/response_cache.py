"""The response cache: the engine's own stage that answers repeated deterministic requests without the model.

A deterministic request (greedy, or seeded) that opted in (`response_cache=True`, or per request
`cache_response`) is looked up by its key (`output/stored_responses.py`: the serving fingerprint, the
prompt and every parameter that shapes the output) in memory (a TTL LRU of msgspec JSON), then in each KV
tier that keeps responses (`ResponseStore`: the disk tier, Redis), in `kv_tiers` order. A hit is replayed
chunk by chunk and never reaches the model (a tier's hit is promoted to memory); a miss is recorded and,
when it completes, stored in memory and in every such tier. It runs after the caller's own middleware
(`request_stages`), so a stage that rewrites prompts (redaction) changes the key too.
"""

from __future__ import annotations

import logging
from typing import Any

import cachetools
import msgspec

from tokenflow.config import EngineConfig
from tokenflow.output.stored_responses import (
    ResponseStore,
    StoredResponse,
    recorded_response,
    replay,
    response_key,
    start_recording,
    wants_cached_response,
)
from tokenflow.protocols import EngineContext, NextStage
from tokenflow.request import Request, RequestSlot

__all__ = ("ResponseCacheStage",)

log = logging.getLogger("tokenflow")


class ResponseCacheStage:
    """Request stage and engine observer (it stores a response when its request completes)."""

    def __init__(self, config: EngineConfig, stores: list[ResponseStore]) -> None:
        self.default = config.response_cache
        self.memory: cachetools.TTLCache[str, bytes] = cachetools.TTLCache(
            maxsize=config.response_cache_size, ttl=config.response_cache_ttl_s)
        self.stores = stores
        self.serving_key = b""
        self.observers: list[Any] = []
        self._store_under = RequestSlot[str]("response key to store under")  # a miss: store it here when done
        self.memory_hits = 0
        self.misses = 0
        self.stores_made = 0
        self.store_hits = {store.name: 0 for store in stores}

    async def start(self, ctx: EngineContext) -> None:
        self.serving_key = ctx.serving_key or ctx.model_key
        self.observers = ctx.observers
        ctx.observers.append(self)

    async def handle(self, request: Request, call_next: NextStage) -> None:
        key = response_key(self.serving_key, request) if wants_cached_response(request, self.default) else None
        if key is not None:
            stored = await self._lookup(key)
            if stored is not None:
                replay(request, stored, self.observers)
                return
            self.misses += 1
            start_recording(request)
            self._store_under.set(request, key)
        await call_next(request)

    async def _lookup(self, key: str) -> StoredResponse | None:
        raw = self.memory.get(key)
        if raw is not None:
            self.memory_hits += 1
            return msgspec.json.decode(raw, type=StoredResponse)
        for store in self.stores:
            if not store.might_answer(key):
                continue
            stored = await store.lookup_response(key)
            if stored is not None:
                self.store_hits[store.name] += 1
                self.memory[key] = msgspec.json.encode(stored)  # promoted
                return stored
        return None

    # -- the observer ------------------------------------------------------------------------------
    def on_step(self, duration_s: float, ok: bool) -> None:
        pass

    def on_request_end(self, request: Request, outcome: str) -> None:
        key = self._store_under.pop(request)
        stored = recorded_response(request) if key is not None and outcome == "completed" else None
        if stored is None:
            return
        self.stores_made += 1
        self.memory[key] = msgspec.json.encode(stored)
        for store in self.stores:
            try:
                store.store_response(key, stored)
            except Exception:  # a store's fault never reaches the caller, who already has the answer
                log.exception("response cache: %s could not store a response", store.name)

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "response_cache_memory_hits": self.memory_hits,
            "response_cache_misses": self.misses,
            "response_cache_stores": self.stores_made,
            "response_cache_entries": len(self.memory),
        }
        stats.update({f"{name}_response_hits": hits for name, hits in self.store_hits.items()})
        return stats
