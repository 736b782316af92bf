"""A request's state inside the engine and the collector that hands its
output from the step loop to the caller's task.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio

from tokenflow.params import Chunk, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher

    from tokenflow.output.detokenizer import IncrementalDetokenizer
    from tokenflow.output.stops import StopStringMatcher

__all__ = ("OutputCollector", "Request", "RequestSlot", "RequestStatus", "Wakeup")

T = TypeVar("T")

_ids = itertools.count()
_DEFAULT_MAX_TOKENS = 128  # a Request built outside the engine (tests, tools); the engine resolves its own


class RequestStatus(enum.Enum):
    ADMITTING = "admitting"  # on the request path (stages)
    WAITING = "waiting"  # queued for the batcher
    RUNNING = "running"  # has KV blocks / is in a batch
    FINISHED = "finished"


class OutputCollector:
    """Single-consumer mailbox between the step loop and one caller.

    The step loop `put`s chunks without waiting; when the caller lags, pending
    chunks merge into one so memory stays bounded by the output itself.
    """

    def __init__(self) -> None:
        self._pending: Chunk | None = None
        self._replay: list[Chunk] = []
        self._error: BaseException | None = None
        self._ready = anyio.Event()
        self.wakeup: Wakeup | None = None  # also told of every chunk: one reader of several requests' collectors

    def put(self, chunk: Chunk) -> None:
        if self._pending is None:
            self._pending = chunk
        else:
            merged = self._pending
            merged.text += chunk.text
            merged.token_ids.extend(chunk.token_ids)
            if chunk.logprobs is not None:
                merged.logprobs = (merged.logprobs or []) + chunk.logprobs
            merged.finish_reason = chunk.finish_reason
            merged.stop_reason = chunk.stop_reason
            merged.usage = chunk.usage
        self._signal()

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._signal()

    def preload(self, chunks: Sequence[Chunk]) -> None:
        """Queue finished chunks to be handed out one by one (a replayed response)."""
        self._replay = list(chunks)
        self._signal()

    def _signal(self) -> None:
        self._ready.set()
        if self.wakeup is not None:
            self.wakeup.set()

    def take(self) -> Chunk | None:
        """The next chunk if one is here (merged if several arrived), else None; raises the request's error."""
        if self._replay:
            return self._replay.pop(0)
        if self._pending is not None:
            chunk, self._pending = self._pending, None
            return chunk
        if self._error is not None:
            raise self._error
        return None

    async def get(self) -> Chunk:
        """Next chunk (merged if several arrived); raises the request's error."""
        while (chunk := self.take()) is None:
            await self._ready.wait()
            self._ready = anyio.Event()
        return chunk


class Wakeup:
    """A reusable event: set by any of several collectors, waited for by their one reader."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = anyio.Event()


@dataclass(eq=False)
class Request:
    """One generation request. Stages read and fill it on the request path;
    the batcher and model stage advance it in the step loop.

    Invariant: `num_computed_tokens <= len(all_token_ids)`; the KV cache holds
    exactly the first `num_computed_tokens` tokens in `block_table`, or, once `kv_compression` dropped
    `num_dropped_tokens` of the prompt's, `num_kv_tokens` of them (the kept prompt positions, then the rest).
    """

    params: SamplingParams
    prompt: str | None = None
    messages: Sequence[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival_time: float = 0.0
    deadline: float | None = None
    status: RequestStatus = RequestStatus.ADMITTING
    # The token budget: `params.max_tokens`, or the engine's default, resolved against the context at enqueue.
    max_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()  # `params.stop_token_ids` as a set, built once
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # with params.prompt_logprobs: one entry per prompt token scored so far (None for the first)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])
    num_computed_tokens: int = 0
    # kv_compression: prompt tokens whose K/V were dropped; the cache holds `num_kv_tokens` of the computed ones
    num_dropped_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Prefix caching: keys of the full blocks hashed so far, how many of the table's blocks are
    # registered in the pool, prompt tokens served from cache, blocks loaded ahead and held for it.
    block_keys: list[Any] = field(default_factory=list)
    num_committed_blocks: int = 0
    num_cached_tokens: int = 0
    pinned_blocks: list[int] = field(default_factory=list)
    num_trimmed_blocks: int = 0  # sliding attention: leading table entries already freed (-1)
    num_preemptions: int = 0
    created_at: float = field(default_factory=time.monotonic)  # on the same clock as first_token_time
    first_token_time: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    collector: OutputCollector = field(default_factory=OutputCollector)
    generator: torch.Generator | None = None  # a seeded request's own (`runtime.sampler.make_generator`)
    detokenizer: IncrementalDetokenizer | None = None  # set by the output processor before it runs
    stop_matcher: StopStringMatcher | None = None
    constraint: LLMatcher | None = None  # structured output: the grammar state its tokens have reached
    tools: list[dict[str, Any]] | None = None  # chat: the tools the template shows (tool_choice "none": None)
    tool_choice: str | dict[str, Any] | None = None  # set with tools: how the output is read back
    adapter: Any = None  # the LoRA adapter (`runtime.lora.LoraAdapter`) `params.lora` names, resolved at admission
    response_record: list[Chunk] | None = None  # chunks emitted so far, kept for a response tier to store
    num_prefix_queried_tokens: int = 0  # prompt tokens already counted in the prefix cache's hit rate
    # Plugin state: one entry per `RequestSlot` (typed by the slot), never a free string-keyed dict.
    slots: dict[RequestSlot[Any], Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.max_tokens:
            self.max_tokens = self.params.max_tokens or _DEFAULT_MAX_TOKENS
        if not self.stop_token_ids and self.params.stop_token_ids:
            self.stop_token_ids = frozenset(self.params.stop_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids or ())

    @property
    def all_token_ids(self) -> list[int]:
        return (self.prompt_token_ids or []) + self.output_token_ids

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose K/V the block table holds (fewer than computed once compressed)."""
        return self.num_computed_tokens - self.num_dropped_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


class RequestSlot(Generic[T]):
    """Request-scoped state of one stage, typed: `slot.set(request, value)`, `slot.get(request)`.

    A stage makes its own slot (`self._started = RequestSlot[float]()`); slots of different stages
    never collide because the slot object itself is the key."""

    __slots__ = ("name",)

    def __init__(self, name: str = "") -> None:
        self.name = name  # for debugging only

    def get(self, request: Request, default: T | None = None) -> T | None:
        return request.slots.get(self, default)

    def set(self, request: Request, value: T) -> None:
        request.slots[self] = value

    def pop(self, request: Request, default: T | None = None) -> T | None:
        return request.slots.pop(self, default)

    def __repr__(self) -> str:
        return f"RequestSlot({self.name!r})"
