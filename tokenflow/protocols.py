"""The contracts a stage or backend plugin implements.

The registry decides a plugin's kind by the protocol its object satisfies, so
a third-party stage needs nothing from tokenflow but these method names.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from tokenflow.config import EngineConfig
    from tokenflow.request import Request

__all__ = (
    "Batcher",
    "EngineContext",
    "EngineObserver",
    "KVPool",
    "ModelBackend",
    "NextStage",
    "RequestStage",
    "ScheduledChunk",
    "StaticBackend",
    "StepBackend",
    "StepPlan",
    "notify_request_end",
)

NextStage = Callable[["Request"], Awaitable[None]]


@dataclass
class EngineContext:
    """What the engine hands every stage at start: settings and shared objects."""

    config: EngineConfig
    tokenizer: Any  # the HF fast tokenizer of the model
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    model_key: bytes = b""  # fingerprint of the model's weights, dtype and block size (cache keys)
    serving_key: bytes = b""  # model_key plus tokenizer, chat template, context, EOS ids (response cache keys)
    shared: dict[str, Any] = field(default_factory=dict)  # stage name -> stage, for cooperation
    observers: list[EngineObserver] = field(default_factory=list)  # told about steps and request ends


class EngineObserver(Protocol):
    """Optional hooks a stage registers in `EngineContext.observers` at start.

    Called on the event loop. `outcome` is one of "completed", "aborted",
    "deadline", "failed" (an `EngineError`), "rejected" (refused after admission) or
    "cached" (answered from the response cache without reaching the model).
    """

    def on_step(self, duration_s: float, ok: bool) -> None: ...
    def on_request_end(self, request: Request, outcome: str) -> None: ...


def notify_request_end(observers: Sequence[EngineObserver], request: Request, outcome: str) -> None:
    """Tell every observer; one that raises is logged and the others still hear of it."""
    for observer in observers:
        try:
            observer.on_request_end(request, outcome)
        except Exception:
            logging.getLogger("tokenflow").exception("observer %r failed in on_request_end", observer)


@runtime_checkable
class RequestStage(Protocol):
    """A middleware on the request path: inspect or change the request, then
    `await call_next(request)` to pass it on (or raise to refuse it)."""

    async def handle(self, request: Request, call_next: NextStage) -> None: ...


@dataclass
class ScheduledChunk:
    """`num_tokens` new tokens of `request` to compute this step.

    With a draft (n-gram speculation, `tokenflow.scheduler.ngram`) the chunk is the request's last
    known token followed by `draft`, and `num_tokens` counts both.
    """

    request: Request
    num_tokens: int
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's known tokens."""
        return self.request.num_computed_tokens + self.num_tokens - len(self.draft) == self.request.num_tokens


@dataclass
class StepPlan:
    """One step of work: chunks to compute, and requests the batcher gave up on."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    rejected: list[tuple[Request, Exception]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@runtime_checkable
class Batcher(Protocol):
    """The step loop's scheduler: the contract a third-party batcher implements.

    Called only on the event loop, between steps; requests are never mutated
    while a step runs.

    - `add(request)`: queue a tokenized request, or raise `InvalidRequest`
      (it can never fit: prompt + `max_tokens` beyond the whole KV pool) or
      `Overloaded` (queue full). Never blocks.
    - `schedule() -> StepPlan`: the next step's chunks under `max_batch_tokens`
      and `max_num_seqs`. For every returned chunk the request's `block_table`
      covers `num_computed_tokens + chunk.num_tokens` tokens (blocks taken from
      `EngineContext.shared["block_pool"]`, a `KVPool`). A request it gives up
      on for good goes to `plan.rejected` with its error (the loop fails it);
      a request it preempts goes to `plan.preempted` after it has released
      its blocks and reset `num_computed_tokens` to 0 (its tokens are kept: it
      recomputes). The loop then advances `num_computed_tokens` of every chunk
      and appends the sampled token of chunks that reach the end. A chunk may
      carry a `draft` of guessed next tokens (greedy requests only, blocks
      reserved for them too): the loop keeps the verified part of it and
      advances `num_computed_tokens` by the tokens kept.
    - `finish(request)`: the request ended (finished, aborted, failed); drop
      it and release its blocks. Must accept requests in any state, once.
    - `take_batch()`: the static variant (`hf`): requests to run to completion.
    - `has_work()`: anything waiting or running; `stats()`: numbers for `Engine.stats()`.
    - Optional: `shrink(plan) -> bool` (the device ran out of memory on `plan`:
      make the next step smaller), `start(ctx)`.

    The default (`batcher`, `stages/batcher.py`) never starves a request:
    queue order is priority with aging, then arrival, and a preemption
    victim is always the lowest priority, latest arrival.
    """

    def add(self, request: Request) -> None: ...
    def finish(self, request: Request) -> None: ...
    def schedule(self) -> StepPlan: ...
    def take_batch(self) -> list[Request]: ...
    def has_work(self) -> bool: ...
    def stats(self) -> dict[str, Any]: ...


@runtime_checkable
class ModelBackend(Protocol):
    """Runs the model. `paged` backends implement `execute(plan)` and return the
    logits of the sampling chunks; static backends implement `run_batch`."""

    def load(self, ctx: EngineContext, model: Any) -> None: ...
    def stats(self) -> dict[str, Any]: ...


class StepBackend(ModelBackend, Protocol):
    """A backend the step loop drives one step at a time (`static = False`, e.g. `paged`).

    `execute` runs in a worker thread and returns the logits of the plan's sampling chunks in plan
    order: one row each, plus, for a chunk with a `draft`, one row per draft token (the logits after
    it), so that the loop can verify the draft.
    """

    static: bool

    def execute(self, plan: StepPlan) -> torch.Tensor: ...


class StaticBackend(ModelBackend, Protocol):
    """A backend that runs a whole batch to completion (`static = True`, e.g. `hf`).

    `run_batch` runs in a worker thread and reports each step's tokens through `on_tokens`;
    it stops a row once its request is finished.
    """

    static: bool

    def run_batch(self, requests: Sequence[Request], on_tokens: Callable[..., None]) -> None: ...


@runtime_checkable
class KVPool(Protocol):
    """The KV block pool (a `memory` stage, e.g. `token_pool`), built by the paged backend with
    `factory(config, num_blocks=, block_size=, model_key=, kv=)`.

    The batcher reserves blocks with `can_allocate`/`allocate`, admits a request with
    `match_prefix` (shared cached blocks; False means "wait, its prefix is loading"),
    reports computed blocks with `commit` and returns everything with `release`.

    Tiers below the pool (the disk tier, a plugin's shared remote tier) build on
    `tokenflow.kv.tiers.base.BlockTier` and use the `token_pool`'s public hooks:
    `lower_tiers` (asked in order for a prefix past the resident blocks),
    `evict_listeners` and `commit_listeners` (`(block, key)`, on the event loop),
    `kv.read_block` / `kv.write_block`, `restore(key, data, request)`,
    `prefix_keys(request)`, `resident_prefix(keys)`, `hashed_blocks()`.
    """

    def can_allocate(self, n: int) -> bool: ...
    def allocate(self, n: int) -> list[int]: ...
    def free(self, block_ids: Any) -> None: ...
    def blocks_needed(self, num_tokens: int) -> int: ...
    def match_prefix(self, request: Request) -> bool: ...
    def commit(self, request: Request) -> None: ...
    def release(self, request: Request) -> None: ...
    def stats(self) -> dict[str, Any]: ...
