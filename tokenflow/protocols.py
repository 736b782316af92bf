"""The contracts between the engine and its parts (re-exported, with the rest of the plugin surface, by
`tokenflow.plugin_api`).

The registry decides a plugin's kind by the protocol its object satisfies, so a third-party stage needs
nothing from tokenflow but these method names. Each protocol lists what the engine really calls.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tokenflow.errors import EngineError, InvalidRequest

if TYPE_CHECKING:
    import torch

    from tokenflow.config import EngineConfig
    from tokenflow.params import TokenLogprob
    from tokenflow.request import Request

__all__ = (
    "OPTIONAL_HOOKS",
    "AheadInput",
    "AheadScheduler",
    "AheadSkipped",
    "Batcher",
    "CompressJob",
    "CompressingBackend",
    "DeviceOutOfMemory",
    "DeviceTokens",
    "EmbeddingBackend",
    "EngineContext",
    "EngineObserver",
    "GreedyTokens",
    "KVPool",
    "KVTier",
    "ModelBackend",
    "NextStage",
    "PendingTokens",
    "PrefixHit",
    "RecoveringScheduler",
    "RequestStage",
    "RowFailure",
    "SamplerOutput",
    "ScheduledChunk",
    "Scheduler",
    "ShrinkableBackend",
    "ShrinkablePool",
    "StaticBackend",
    "StaticScheduler",
    "StepBackend",
    "StepOutput",
    "StepPlan",
    "StepResult",
    "TieredPool",
    "TokenItem",
    "TokenSink",
    "WarmingBackend",
    "hooks_missing",
    "notify_request_end",
)

NextStage = Callable[["Request"], Awaitable[None]]


@dataclass
class EngineContext:
    """What the engine hands every stage at start: settings, model facts, and its parts as typed attributes.

    `pool` is set by a paged backend when it loads (None with a static backend); `scheduler` is the
    `batcher` stage; both are set before any stage's `start` runs.
    """

    config: EngineConfig
    tokenizer: Any  # the HF fast tokenizer of the model
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    model_key: bytes = b""  # fingerprint of the model's weights, dtype and block size (cache keys)
    serving_key: bytes = b""  # model_key plus tokenizer, chat template, context, EOS ids (response cache keys)
    pool: KVPool | None = None
    scheduler: Scheduler | StaticScheduler | None = None
    observers: list[EngineObserver] = field(default_factory=list)  # told about steps and request ends
    # set by a paged backend when every layer of the model attends to its last `model_window` tokens only: the
    # scheduler frees the blocks behind it (Mistral's and Qwen2's own windows)
    model_window: int | None = None


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
    `await call_next(request)` to pass it on (or raise a `TokenflowError` to refuse it).
    Optional: `async start(ctx)`, `async stop()` (at `aclose`), `stats() -> dict`."""

    async def handle(self, request: Request, call_next: NextStage) -> None: ...


# -- one step: plan, output, result ------------------------------------------------------------
@dataclass
class AheadInput:
    """A decode planned while the step before it still runs (async scheduling): its input is the token that
    step samples, which the model worker fills in as `token` on the model thread, and the request's position
    and block table as they were planned, since the event loop updates the request itself meanwhile."""

    position: int
    block_table: list[int]
    token: int = -1
    device_row: int = -1  # else: the row of the step before whose token, still on the device, is the input


@dataclass
class ScheduledChunk:
    """`num_tokens` new tokens of `request` to compute this step.

    With a draft (n-gram speculation, `tokenflow.scheduler.ngram`) the chunk is the request's last
    known token followed by `draft`, and `num_tokens` counts both. With `ahead`, a one-token decode
    planned before the previous step's token was known (`AheadInput`).
    """

    request: Request
    num_tokens: int
    draft: list[int] = field(default_factory=list)
    ahead: AheadInput | None = None

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's known tokens."""
        if self.ahead is not None:  # a decode: it samples, however far the event loop has updated the request
            return True
        return self.request.num_computed_tokens + self.num_tokens - len(self.draft) == self.request.num_tokens

    @property
    def num_prompt_logits(self) -> int:
        """Positions of this chunk whose logits score a prompt token (the request asked for
        `prompt_logprobs`): position p scores prompt token p + 1. They are the chunk's first rows."""
        request = self.request
        if request.params.prompt_logprobs is None or self.draft or self.ahead is not None:
            return 0
        start = request.num_computed_tokens
        return max(0, min(start + self.num_tokens, request.num_prompt_tokens - 1) - start)

    @property
    def num_logit_rows(self) -> int:
        """Logits rows the forward keeps for this chunk, its last ones: every row when it scores prompt
        tokens, else one per sampled position (the known token and each draft token), else none."""
        if self.num_prompt_logits:
            return self.num_tokens
        return 1 + len(self.draft) if self.samples else 0


@dataclass
class CompressJob:
    """kv_compression: before the step's forward, score the last `window` of `request`'s first `length`
    computed tokens and copy the `keep` prompt positions they attend to most (with `sinks`) into `table`,
    blocks the scheduler allocated; the scheduler swaps the request's table after the step."""

    request: Request
    table: list[int]
    length: int
    keep: int
    window: int
    sinks: int


@dataclass
class StepPlan:
    """One step of work: chunks to compute, KV compressions to run first, and requests the scheduler gave
    up on."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    rejected: list[tuple[Request, Exception]] = field(default_factory=list)
    compressions: list[CompressJob] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class AheadSkipped(Exception):
    """An ahead plan (`AheadInput`) did not run: the step before it drew no token for one of its requests (that
    step failed, or one of its rows did). Not a failure: the step loop schedules afresh."""


class DeviceOutOfMemory(Exception):
    """The device ran out of memory in a step (`torch.OutOfMemoryError`, as the model worker reports it to
    the step loop, which then makes the next step smaller)."""


@dataclass(frozen=True, slots=True)
class RowFailure:
    """Why a row drew no token. `model_fault`: its raw logits were not finite (else its parameters made
    every token impossible or non-finite)."""

    reason: str
    model_fault: bool

    def error(self) -> Exception:
        """The error its request fails with: an engine fault, or the caller's parameters."""
        if self.model_fault:
            return EngineError(f"sampling failed: {self.reason}")
        return InvalidRequest(f"sampling failed: {self.reason}", field="params")


@dataclass(slots=True)
class SamplerOutput:
    """One token per sampling row of a step (plain data: the sampler fills it on the model thread)."""

    token_ids: list[int]  # a failed row's entry is meaningless
    logprobs: list[TokenLogprob | None] | None  # None when no row asked; else one entry per row
    failed: dict[int, RowFailure] = field(default_factory=dict)  # row -> why it drew no token


@dataclass(frozen=True, slots=True)
class GreedyTokens:
    """A step's tokens from a backend that took an `argmax_only` plan without logits: each sampling row's
    largest logit (the first of ties), as the sampler's argmax picks it; -1 where the row's logits were not
    finite."""

    token_ids: list[int]


class PendingTokens:
    """A step's tokens drawn on the device whose copy to the host is still under way (with async scheduling, the
    next step is queued on the device before they arrive and takes them as its inputs there: `AheadInput.device_row`).
    `wait()` blocks until they arrived and returns them."""

    __slots__ = ("wait",)

    def __init__(self, wait: Callable[[], DeviceTokens]) -> None:
        self.wait = wait


@dataclass(frozen=True, slots=True)
class DeviceTokens:
    """A step's tokens drawn on the model's device with each row's own parameters and uniform
    (`runtime.device_sampler`), so only the ids came back (and the logprobs rows asked for); -1 where the
    row's logits were not finite."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None  # as `SamplerOutput.logprobs`


@dataclass
class StepOutput:
    """What the model thread returns for a step: one sampled token per sampling chunk, and for each
    sampling chunk the argmax after each of its draft tokens."""

    sampled: SamplerOutput
    draft_argmax: list[list[int]]
    # requests asking for prompt_logprobs: (first prompt position scored, one entry per position)
    prompt_logprobs: list[tuple[Request, int, list[dict[int, float]]]] = field(default_factory=list)
    compressed: list[bool] = field(default_factory=list)  # per `plan.compressions`: whether its copy ran
    forward_ms: float = 0.0  # the backend's forward, as the worker timed it
    # Steps chained on the device: `sampled` once the tokens' copy to the host ran (blocking; `ModelWorker.result`
    # calls it off the model thread, which meanwhile queues the next step on the device)
    pending: Callable[[], SamplerOutput] | None = None


# (request, token, logprob, in_cache): a taken token, and whether its K/V is already in the cache
# (an accepted draft token, computed in the step that verified it).
TokenItem = tuple["Request", int, "TokenLogprob | None", bool]


@dataclass
class StepResult:
    """What `update_from_output` did: requests that ended normally (the scheduler already finished
    them), requests whose row could not be sampled (to fail with the error), tokens taken."""

    finished: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    num_tokens: int = 0


class TokenSink(Protocol):
    """Where a scheduler hands each taken token (the engine's output processor): it records the token,
    emits its text, and says whether the request is done (EOS, stop token or string, length)."""

    def append(self, request: Request, token_id: int, logprob: TokenLogprob | None) -> bool: ...


# -- the scheduler ----------------------------------------------------------------------------
@runtime_checkable
class Scheduler(Protocol):
    """The step loop's scheduler (the `batcher` setting, kind `loop`): the only part that changes a
    request's scheduling state (queues, status, block table, computed tokens). Called on the event
    loop only, between steps: requests never change while a step runs.

    - `add(request)`: queue a tokenized request, or raise `InvalidRequest` (it can never fit: prompt +
      `max_tokens` beyond the whole KV pool). Never blocks.
    - `schedule() -> StepPlan`: the next step's chunks under `max_batch_tokens` and `max_num_seqs`. For
      every chunk, the request's `block_table` covers `num_kv_tokens + chunk.num_tokens` tokens
      (blocks from `ctx.pool`). A request given up on for good goes to `plan.rejected` with its error;
      a preempted one to `plan.preempted`, after its blocks were released and `num_computed_tokens`
      reset to 0 (its tokens are kept: it recomputes). A chunk may carry a `draft` of guessed tokens
      (blocks reserved for them too).
    - `update_from_output(plan, output, sink) -> StepResult`: after the step ran: advance
      `num_computed_tokens`, keep the verified part of each draft, hand each taken token to `sink`
      (in order, stopping at the one that ends the request), and finish the requests that ended.
    - `finish(request)`: the request ended (any way, including an abort during a step): drop it and
      release its blocks. Must accept requests in any state, once.
    - `has_work()`; `stats() -> dict` (merged into `Engine.stats()`); `waiting` and `running`: the
      queues, for admission control and for failing everyone when the engine dies.
    - Optional: `shrink(plan) -> bool` (the device ran out of memory on `plan`: make the next step
      smaller), `async start(ctx)`.
    """

    waiting: Sequence[Request]
    running: Sequence[Request]

    def add(self, request: Request) -> None: ...
    def schedule(self) -> StepPlan: ...
    def update_from_output(self, plan: StepPlan, output: StepOutput, sink: TokenSink) -> StepResult: ...
    def finish(self, request: Request) -> None: ...
    def has_work(self) -> bool: ...
    def stats(self) -> dict[str, Any]: ...


@runtime_checkable
class StaticScheduler(Protocol):
    """A scheduler for static backends (`hf`): whole batches run to completion.

    `take_batch()` moves waiting requests to running and returns them; `accept_tokens(items, sink)`
    takes each step's tokens as `update_from_output` does and returns the requests that finished
    (already finished by the scheduler). The rest is as `Scheduler`'s.
    """

    waiting: Sequence[Request]
    running: Sequence[Request]

    def add(self, request: Request) -> None: ...
    def take_batch(self) -> list[Request]: ...
    def accept_tokens(self, items: Sequence[TokenItem], sink: TokenSink) -> list[Request]: ...
    def finish(self, request: Request) -> None: ...
    def has_work(self) -> bool: ...
    def stats(self) -> dict[str, Any]: ...


Batcher = Scheduler  # the old name


# -- backends -----------------------------------------------------------------------------------
@runtime_checkable
class ModelBackend(Protocol):
    """Runs the model (entry-point group `tokenflow.backends`). `load` runs on the model thread; a paged
    backend builds the KV pool there and sets `ctx.pool`."""

    def load(self, ctx: EngineContext, model: Any) -> None: ...
    def stats(self) -> dict[str, Any]: ...


class StepBackend(ModelBackend, Protocol):
    """A backend the step loop drives one step at a time (`static = False`, e.g. `paged`).

    `execute` runs in a worker thread and returns the logits of the plan's sampling chunks in plan
    order: one row each, plus, for a chunk with a `draft`, one row per draft token (the logits after
    it), so that the scheduler can verify the draft. For a plan that reads nothing of its logits but each
    row's argmax (`tokenflow.runtime.sampler.argmax_only`) it may return the rows' tokens instead
    (`GreedyTokens`), and for a plan whose rows the device sampler takes (`device_sampler.device_rows`), the
    tokens drawn on the device (`DeviceTokens`). Optional: `warmup_batch_sizes() -> list[int]`.
    """

    static: bool

    def execute(self, plan: StepPlan) -> torch.Tensor | GreedyTokens | DeviceTokens: ...


class StaticBackend(ModelBackend, Protocol):
    """A backend that runs a whole batch to completion (`static = True`, e.g. `hf`).

    `run_batch` runs on the model thread, draws every token with `sampler` (the model worker's: one
    owner of sampling for every backend) and reports each step's tokens through `on_tokens(items,
    failed)`: `(request, token, logprob)` per live row, and `(request, RowFailure)` for rows that could
    not be sampled; it stops a row once its request is finished.
    """

    static: bool

    def run_batch(self, requests: Sequence[Request], sampler: Any, on_tokens: Callable[..., None]) -> None: ...


# -- KV tiers -------------------------------------------------------------------------------------
@runtime_checkable
class KVTier(Protocol):
    """A tier below the KV pool (entry-point group `tokenflow.kv_tiers`, listed in the `kv_tiers` setting):
    the disk tier, a plugin's shared store. Build it on `BlockTier` (load jobs, write-behind, value
    checks): it provides everything here but `start` and `stop`.

    - `async start(ctx)`: attach to `ctx.pool` (`BlockTier.attach`) or stay off; `async stop()`: flush.
    - `prefetch(request) -> bool`: start loading a queued request's prefix (the engine calls it as the
      request is queued, with `prefetch=True`); the pool calls `begin_load` and `poll` itself.
    - `stats() -> dict`, merged into `Engine.stats()`.
    A tier that also keeps whole responses implements `ResponseStore` (`output/stored_responses.py`).
    """

    name: str

    async def start(self, ctx: EngineContext) -> None: ...
    async def stop(self) -> None: ...
    def prefetch(self, request: Request) -> bool: ...
    def begin_load(self, request: Request, keys: list[Any]) -> bool: ...
    def poll(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...


# -- the KV pool ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefixHit:
    """The resident cached prefix of a request: its `blocks` (in order) and how many of them are
    unreferenced now (taking them moves them from cached to used). `partial` (block, rows): a
    resident block whose first rows continue the prefix after `blocks`; `take_prefix` copies them
    into the request's next block, and `num_tokens` counts them."""

    blocks: list[int]
    num_tokens: int
    num_cached: int = 0
    partial: tuple[int, int] | None = None


@runtime_checkable
class KVPool(Protocol):
    """The KV block pool (entry-point group `tokenflow.kv_pools`, the `kv_pool` setting; `token_pool` is the
    prefix cache), built by the paged backend with `factory(config, num_blocks=, block_size=, model_key=,
    kv=)`. Everything here is called by the built-in scheduler; a pool that lacks any of it is refused when
    it is registered, naming what is missing.

    The scheduler reserves blocks with `can_allocate` / `allocate` / `free`; admits a request with
    `lookup_prefix` (a query: the resident prefix it may share, or None while a lower tier loads it)
    then, once it fits, `take_prefix` (references those blocks and starts the request after them, at
    `request.num_computed_tokens`; a partial hit also gives the request its next block, holding the
    copied rows: the scheduler allocates what the block table still lacks);
    reports computed blocks with `commit` and returns everything with `release` (its block table and the
    blocks a tier restored for it while it was queued). `trim` frees the blocks sliding attention no
    longer reads; `replace_table` swaps in a kv-compressed copy. `num_used` / `num_free` are counts of
    referenced and free blocks (cached ones are neither).

    Tiers below the pool (`KVTier`) need a `TieredPool`; device out-of-memory recovery a `ShrinkablePool`.
    """

    num_blocks: int
    block_size: int
    num_used: int
    num_free: int

    def can_allocate(self, n: int) -> bool: ...
    def allocate(self, n: int) -> list[int]: ...
    def free(self, block_ids: Any) -> None: ...
    def blocks_needed(self, num_tokens: int) -> int: ...
    def lookup_prefix(self, request: Request) -> PrefixHit | None: ...
    def take_prefix(self, request: Request, hit: PrefixHit) -> None: ...
    def commit(self, request: Request) -> None: ...
    def release(self, request: Request) -> None: ...
    def trim(self, request: Request, keep_from: int, sink_tokens: int) -> int: ...
    def replace_table(self, request: Request, table: list[int]) -> None: ...
    def stats(self) -> dict[str, Any]: ...


# -- optional hooks: each set is all or nothing, checked once when its plugin is loaded ------------------
@runtime_checkable
class TieredPool(Protocol):
    """A pool KV tiers can sit below (`token_pool`): `prefix_caching` and `kv` (the `KVCache`), the tiers in
    order (`lower_tiers`), listeners told of evicted and filled blocks (`(block, key)`, on the event loop),
    `restore(key, data, request)` to install a loaded block (pinned for a queued request), and the
    queries tiers use: `prefix_keys(request)`, `resident_prefix(keys)`, `hashed_blocks()`,
    `hottest_blocks()` (what to write first when the engine closes)."""

    prefix_caching: bool
    kv: Any
    lower_tiers: list[Any]
    evict_listeners: list[Any]
    commit_listeners: list[Any]

    def restore(self, key: Any, data: Any, request: Request | None) -> bool: ...
    def prefix_keys(self, request: Request) -> list[Any]: ...
    def resident_prefix(self, keys: list[Any]) -> list[int]: ...
    def hashed_blocks(self) -> Any: ...
    def hottest_blocks(self) -> list[tuple[int, Any]]: ...


@runtime_checkable
class ShrinkablePool(Protocol):
    """A pool that can give up the ids from `num_blocks` on after repeated device out-of-memory (their
    holders preempted first, cached blocks evicted); without it the pool keeps its size."""

    def truncate(self, num_blocks: int) -> None: ...


@runtime_checkable
class RecoveringScheduler(Protocol):
    """A scheduler that makes steps smaller after the device ran out of memory: `shrink(plan) -> bool`
    (False: that request cannot run even alone), `oom_recovered()` (a step ran after shrinking),
    `oom_gave_up()` (the request that failed alone took the shrinking with it), and
    `vacate_blocks_from(num_blocks) -> int` (preempt the holders of blocks past it, for a pool shrink).
    Without these a step that runs out of memory fails its requests."""

    def shrink(self, plan: StepPlan) -> bool: ...
    def oom_recovered(self) -> None: ...
    def oom_gave_up(self) -> None: ...
    def vacate_blocks_from(self, num_blocks: int) -> int: ...


@runtime_checkable
class AheadScheduler(Protocol):
    """A scheduler that plans the next decode step while the current one runs (`async_scheduling`):
    `schedule_ahead(plan) -> StepPlan | None`, called on the event loop right after `plan` was handed to the
    model thread and before its output is known. Each chunk of the plan it returns is a one-token decode of a
    request in `plan` with an `AheadInput`, blocks already reserved; None when the next step needs the full
    `schedule()` (requests waiting, a request whose next step depends on the token being drawn, no free
    block). It must not change what `update_from_output(plan, ...)` will read."""

    def schedule_ahead(self, plan: StepPlan) -> StepPlan | None: ...


@runtime_checkable
class ShrinkableBackend(Protocol):
    """A backend that frees the KV memory of blocks from `num_blocks` on (model thread)."""

    def shrink_kv(self, num_blocks: int) -> None: ...


@runtime_checkable
class CompressingBackend(Protocol):
    """A backend that runs `kv_compression` copies (model thread): score `window`'s keys over the blocks of
    its table, copy the `keep` kept prompt positions (and `sinks`) into `table`."""

    def compress_kv(self, window: Any, table: list[int], keep: int, sinks: int) -> None: ...


@runtime_checkable
class EmbeddingBackend(Protocol):
    """A backend that computes one sequence's final hidden states, `[len, hidden]` fp32 on the CPU, with no KV
    kept (model thread): what `Engine.embed` pools."""

    def hidden_states(self, token_ids: list[int]) -> Any: ...


@runtime_checkable
class WarmingBackend(Protocol):
    """A backend that names the decode batch sizes worth a warm-up (`warmup=True`); else one."""

    def warmup_batch_sizes(self) -> list[int]: ...


# The optional hook sets of each plugin kind (the registry's kind names).
OPTIONAL_HOOKS: dict[str, tuple[type, ...]] = {
    "memory": (TieredPool, ShrinkablePool),
    "loop": (RecoveringScheduler, AheadScheduler),
    "backend": (ShrinkableBackend, CompressingBackend, WarmingBackend, EmbeddingBackend),
}


def hooks_missing(obj: Any, protocol: type) -> list[str]:
    """The members of `protocol` that `obj` lacks, when it has some of them (a partial set: most likely a
    misspelled hook, which would otherwise never be called); [] when it has all or none."""
    members = [n for n in dir(protocol) if not n.startswith("_")] + list(getattr(protocol, "__annotations__", {}))
    members = sorted(set(members))
    have = [n for n in members if hasattr(obj, n)]
    return [n for n in members if not hasattr(obj, n)] if have and len(have) < len(members) else []
