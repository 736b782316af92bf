"""Whole responses of deterministic requests, replayed instead of recomputed.

A request is deterministic when it is greedy (`temperature=0`) or carries a
`seed`: the same prompt, parameters and model then give the same tokens, so
the completion can be stored once and served again. The key covers the model
fingerprint, the prompt (text, token ids or chat messages) and every
sampling parameter that shapes the output (not `priority`, `timeout`,
`deadline` or `cache_response`). Entries live in memory (`cachetools.TTLCache`)
and, with a disk tier, on disk as msgspec JSON (never pickle); a disk entry
that does not decode is dropped.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import cachetools
import msgspec

from tokenflow.params import Chunk
from tokenflow.request import Request

__all__ = ("ResponseCache", "StoredResponse", "response_key")

log = logging.getLogger("tokenflow")

_NOT_IN_KEY = frozenset({"priority", "timeout", "deadline", "cache_response"})


class StoredResponse(msgspec.Struct):
    prompt_token_ids: list[int] | None
    chunks: list[Chunk]


def response_key(model_key: bytes, request: Request) -> str | None:
    """The cache key of `request`, or None when it is not deterministic (or its prompt does not encode)."""
    params = request.params
    if params.temperature != 0.0 and params.seed is None:
        return None
    fields = {k: v for k, v in msgspec.structs.asdict(params).items() if k not in _NOT_IN_KEY}
    prompt: Any = (
        {"messages": request.messages} if request.messages is not None
        else {"text": request.prompt} if request.prompt is not None
        else {"tokens": request.prompt_token_ids}
    )
    try:
        encoded = msgspec.json.encode([model_key.hex(), prompt, fields])
    except (TypeError, msgspec.EncodeError):
        return None
    return hashlib.blake2b(encoded, digest_size=20).hexdigest()


class ResponseCache:
    """Memory (TTL) in front of an optional disk store with `get_response` / `put_response`."""

    def __init__(self, size: int, ttl_s: float) -> None:
        self.memory: cachetools.TTLCache[str, bytes] = cachetools.TTLCache(maxsize=size, ttl=ttl_s)
        self.memory_hits = 0
        self.disk_hits = 0
        self.misses = 0
        self.stores = 0

    def get_memory(self, key: str) -> StoredResponse | None:
        raw = self.memory.get(key)
        if raw is None:
            return None
        self.memory_hits += 1
        return msgspec.json.decode(raw, type=StoredResponse)

    def decode_disk(self, key: str, raw: bytes | None) -> StoredResponse | None:
        """A disk entry, checked by decoding it; promoted to memory."""
        if raw is None:
            return None
        try:
            stored = msgspec.json.decode(raw, type=StoredResponse)
        except msgspec.DecodeError as exc:
            log.warning("response cache: dropping undecodable disk entry %s: %s", key, exc)
            return None
        if not stored.chunks or stored.chunks[-1].finish_reason is None:
            return None
        self.disk_hits += 1
        self.memory[key] = raw
        return stored

    def encode(self, key: str, request: Request, chunks: list[Chunk]) -> bytes:
        raw = msgspec.json.encode(StoredResponse(request.prompt_token_ids, chunks))
        self.memory[key] = raw
        self.stores += 1
        return raw

    def stats(self) -> dict[str, Any]:
        return {
            "response_cache_memory_hits": self.memory_hits,
            "response_cache_disk_hits": self.disk_hits,
            "response_cache_misses": self.misses,
            "response_cache_stores": self.stores,
            "response_cache_entries": len(self.memory),
        }
