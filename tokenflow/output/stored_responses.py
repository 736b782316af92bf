"""Whole responses of deterministic requests, stored and replayed instead of recomputed: the key, the
stored form, the replay, and the `ResponseStore` contract of a tier that keeps them (disk, Redis).

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

import hashlib
import logging
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import msgspec

from tokenflow.params import Chunk
from tokenflow.protocols import notify_request_end
from tokenflow.request import Request, RequestStatus

__all__ = (
    "ResponseStore", "StoredResponse", "decode_response", "recorded_response", "replay", "response_key",
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
        adapter = request.adapter.key.hex() if request.adapter is not None else None  # by content, not name
        encoded = msgspec.json.encode([serving_key.hex(), prompt, fields, adapter])
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


@runtime_checkable
class ResponseStore(Protocol):
    """A KV tier that also keeps whole responses (the disk tier, Redis): the engine's response cache asks
    it after its memory, in `kv_tiers` order. `name` prefixes the stats of its hits; `might_answer(key)`
    (event loop, no I/O) says whether a lookup is worth it now (False while the store is down);
    `lookup_response` returns the checked entry or None; `store_response` (event loop) hands slow work to
    a thread."""

    name: str

    def might_answer(self, key: str) -> bool: ...
    async def lookup_response(self, key: str) -> StoredResponse | None: ...
    def store_response(self, key: str, stored: StoredResponse) -> None: ...
