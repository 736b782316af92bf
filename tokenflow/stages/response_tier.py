"""Whole responses of deterministic requests, replayed instead of recomputed.

A request is deterministic when it is greedy (`temperature=0`) or carries a
`seed`: the same prompt, parameters and model then give the same tokens, so
the completion can be stored once and served again. The key covers the
serving fingerprint (`serving_key`: the model's weights, the tokenizer's
whole vocabulary and merges, the chat template, the context length, the EOS
ids and the settings that shape a prompt or its length), the prompt (text,
token ids or chat messages) and every sampling parameter that shapes the
output (not `priority`, `timeout`, `deadline` or `cache_response`). Entries
live in memory (`cachetools.TTLCache`) and, with a disk or shared tier, in
its store as msgspec JSON inside a MAC'd frame (never pickle); an entry that
does not check or decode is dropped.
"""

from __future__ import annotations

import abc
import hashlib
import logging
from collections.abc import Iterable
from typing import Any

import cachetools
import msgspec

from tokenflow.params import Chunk
from tokenflow.protocols import EngineContext, NextStage, notify_request_end
from tokenflow.request import Request, RequestSlot, RequestStatus

__all__ = (
    "ResponseCache", "ResponseTier", "StoredResponse", "decode_response", "recorded_response", "replay", "response_key",
    "serving_key", "start_recording", "wants_cached_response",
)

log = logging.getLogger("tokenflow")

_NOT_IN_KEY = frozenset({"priority", "timeout", "deadline", "cache_response"})
# Engine settings that change an answer for the same request (a prompt's rendering or its default length).
# Settings that change answers without changing the KV blocks' keys (kv_compression keeps shared prefix blocks whole).
_ANSWER_SETTINGS = ("default_max_tokens", "clamp_max_tokens", "allow_special_tokens_in_chat", "kv_compression",
                    "kv_compression_ratio", "kv_compression_min_tokens", "kv_compression_window")


class StoredResponse(msgspec.Struct):
    prompt_token_ids: list[int] | None
    chunks: list[Chunk]


def serving_key(
    model_key: bytes, tokenizer: Any, max_model_len: int, eos_token_ids: Iterable[int], config: Any = None
) -> bytes:
    """A fingerprint of everything besides the request that shapes a response (blocking: the
    tokenizer is serialised whole, so run it once, off the event loop)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else msgspec.json.encode(sorted(tokenizer.get_vocab().items()))
    h = hashlib.blake2b(model_key, digest_size=16, person=b"tokenflow-serve")
    h.update(hashlib.blake2b(vocab.encode() if isinstance(vocab, str) else vocab).digest())
    h.update(msgspec.json.encode({
        "chat_template": getattr(tokenizer, "chat_template", None),
        "max_model_len": max_model_len,
        "eos": sorted(eos_token_ids),
        "settings": {name: getattr(config, name, None) for name in _ANSWER_SETTINGS},
    }))
    return h.digest()


def response_key(serving_key: bytes, request: Request) -> str | None:
    """The cache key of `request` under a `serving_key`, or None when it is not deterministic (or its
    prompt does not encode)."""
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
        encoded = msgspec.json.encode([serving_key.hex(), prompt, fields])
    except (TypeError, msgspec.EncodeError):
        return None
    return hashlib.blake2b(encoded, digest_size=20).hexdigest()


def wants_cached_response(request: Request, default: bool) -> bool:
    """The request's `cache_response`, else the engine's `response_cache` setting."""
    wanted = request.params.cache_response
    return default if wanted is None else wanted


def start_recording(request: Request) -> None:
    """Keep a copy of every chunk the request emits, for `recorded_response` when it completes."""
    if request.response_record is None:
        request.response_record = []


def recorded_response(request: Request) -> StoredResponse | None:
    """The completed request as a stored response; None unless it was recorded and ended normally."""
    chunks = request.response_record
    if not chunks or request.finish_reason not in ("stop", "length"):
        return None
    return StoredResponse(request.prompt_token_ids, chunks)


def decode_response(raw: bytes) -> StoredResponse | None:
    """A stored response's JSON, checked: None (logged) when it does not decode or is incomplete."""
    try:
        stored = msgspec.json.decode(raw, type=StoredResponse)
    except msgspec.DecodeError as exc:
        log.warning("response cache: dropping an undecodable entry: %s", exc)
        return None
    if not stored.chunks or stored.chunks[-1].finish_reason is None:
        return None
    return stored


def replay(request: Request, stored: StoredResponse, observers: list[Any]) -> None:
    """Finish `request` with a stored response: its chunks are streamed as they were; no model step."""
    request.prompt_token_ids = stored.prompt_token_ids
    request.output_token_ids = [t for c in stored.chunks for t in c.token_ids]
    request.finish_reason = stored.chunks[-1].finish_reason
    request.status = RequestStatus.FINISHED
    request.collector.preload(stored.chunks)
    notify_request_end(observers, request, "cached")


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
