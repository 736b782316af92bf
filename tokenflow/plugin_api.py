"""The whole plugin surface: everything a stage, backend, scheduler, KV tier or eviction policy may use.

A plugin imports from here (and the public `tokenflow` package) only; every other module is internal
and may change. Plugins register factories in entry-point groups, exactly as tokenflow's built-ins do
in its own `pyproject.toml`; the registry gives each the kind of the contract its object satisfies.

Extension points (each contract is documented on its class), one entry-point group per kind:

- `tokenflow.stages` — `RequestStage`: your middleware on the request path, `async handle(request,
  call_next)`, optional `async start(ctx)` / `async stop()`. Listed by name in the `request_stages`
  setting, run in that order after the engine's admission (queue bounds, circuit breaker) and before its
  response cache, tokenizing and prefetching, which are not plugins. (`ResponseTier` is the deprecated
  base of a stage that answered from its own response store.)
- `tokenflow.schedulers` — `Scheduler` (the `scheduler` setting): owns the waiting and running queues and
  every request's scheduling state (`schedule`, `update_from_output`, `finish`, ...); optional
  `RecoveringScheduler` hooks for device out-of-memory. `StaticScheduler` adds `take_batch` for static
  backends.
- `tokenflow.kv_pools` — `KVPool` (the `kv_pool` setting): the KV block pool's books, built by the paged
  backend through `factory(config, num_blocks=, block_size=, model_key=, kv=)`.
- `tokenflow.kv_tiers` — `KVTier` (the `kv_tiers` setting): a tier below the pool, built on `BlockTier`
  (load jobs, write-behind, value checks); `encode_block` / `decode_block` the block codec it stores
  (MAC'd, never pickled). A tier that keeps whole responses implements `ResponseStore` too.
- `tokenflow.backends` — `StepBackend` (one step at a time) or `StaticBackend` (whole batches).
- `tokenflow.eviction_policies` — `EvictionPolicy`: which cached block the pool gives up first.
- Observers — `EngineObserver`: `on_step` and `on_request_end`, registered in `ctx.observers`.

Every factory is `factory(config: EngineConfig) -> object` (the pool's takes its sizes too). At start
each stage gets the `EngineContext`: settings, tokenizer, model facts, and the engine's parts as typed
attributes (`ctx.pool`, `ctx.scheduler`, `ctx.observers`). Request-scoped state of a plugin lives in a
`RequestSlot` it owns.
"""

from __future__ import annotations

from typing import Any

from tokenflow.config import EngineConfig
from tokenflow.errors import (
    ConfigError,
    DeadlineExceeded,
    EngineClosed,
    EngineError,
    InvalidRequest,
    ModelLoadError,
    Overloaded,
    PluginError,
    TokenflowError,
)
from tokenflow.kv.block_hash import BlockKey, block_keys, prefix_root
from tokenflow.kv.eviction import EvictionPolicy
from tokenflow.kv.tiers.base import BlockTier
from tokenflow.kv.tiers.disk_store import (
    CorruptEntry,
    decode_block,
    decode_frame,
    encode_block,
    encode_frame,
    mac_key,
    read_block,
)
from tokenflow.output.stored_responses import ResponseStore
from tokenflow.params import Chunk, Completion, SamplingParams, TokenLogprob, Usage
from tokenflow.protocols import (
    Batcher,
    EngineContext,
    EngineObserver,
    KVPool,
    KVTier,
    ModelBackend,
    NextStage,
    PrefixHit,
    RequestStage,
    ScheduledChunk,
    Scheduler,
    StaticBackend,
    StaticScheduler,
    StepBackend,
    StepOutput,
    StepPlan,
    StepResult,
    TokenItem,
    TokenSink,
    notify_request_end,
)
from tokenflow.request import Request, RequestSlot, RequestStatus
from tokenflow.stages.response_tier import (
    ResponseTier,
    StoredResponse,
    decode_response,
    replay,
    response_key,
    wants_cached_response,
)

__all__ = (
    "Batcher", "BlockKey", "BlockTier", "Chunk", "Completion", "ConfigError", "CorruptEntry", "DeadlineExceeded",
    "EngineClosed", "EngineConfig", "EngineContext", "EngineError", "EngineObserver", "EvictionPolicy",
    "InvalidRequest", "KVPool", "KVTier", "ModelBackend", "ModelLoadError", "NextStage", "Overloaded", "PluginError",
    "PrefixHit", "Request", "RequestSlot", "RequestStage", "RequestStatus", "ResponseStore", "ResponseTier",
    "SamplingParams",
    "ScheduledChunk", "Scheduler", "StaticBackend", "StaticScheduler", "StepBackend", "StepOutput", "StepPlan",
    "StepResult", "StoredResponse", "TokenItem", "TokenLogprob", "TokenSink", "TokenflowError", "Usage",
    "block_keys", "completion_body", "decode_block", "decode_frame", "decode_response", "encode_block",
    "encode_frame", "error_body", "mac_key", "notify_request_end", "parse_request", "prefix_root", "read_block",
    "replay", "response_key", "retry_after_s", "wants_cached_response",
)

# The OpenAI body helpers need the `server` extra (starlette): imported on first use.
def completion_body(done: Completion, **kwargs: Any) -> dict[str, Any]:
    """The OpenAI response body of a finished request (`tokenflow.serve.openai_app.completion_body`)."""
    from tokenflow.serve.openai_app import completion_body as build

    return build(done, **kwargs)


def error_body(exc: TokenflowError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body of a typed engine error."""
    from tokenflow.serve.openai_app import error_body as build

    return build(exc)


def parse_request(body: Any, chat: bool) -> tuple[Any, dict[str, Any]]:
    """`(prompt or messages, Engine keywords)` of an OpenAI request body; `InvalidRequest` if malformed."""
    from tokenflow.serve.openai_app import parse_request as parse

    return parse(body, chat)


def retry_after_s(exc: Overloaded) -> int:
    """The `Retry-After` seconds of an `Overloaded`."""
    from tokenflow.serve.openai_app import retry_after_s as seconds

    return seconds(exc)
