"""The `batcher` stage: the scheduler, who runs each step and what each step changed.

Step-level scheduling (the `paged` backend) follows one rule, as in vLLM v1:
there are no prefill and decode phases; every step each running request's
computed tokens catch up towards its known tokens within a token budget
(`max_batch_tokens`) and a sequence budget (`max_num_seqs`). Running requests
go first (a decode costs one token, a long prompt continues in chunks), then
waiting requests are admitted in queue order (`queue_key`: priority with
aging, then arrival, each prompt token counting as a little later arrival)
while budget and KV blocks last, and while KV use stays under the high
watermark (above it new prefills wait, so running requests
can grow). When blocks run out, the latest-arrived request of the lowest
priority is preempted by recomputation (the request asking for blocks
yields itself when it is that one: a worse-placed request never evicts a
better one): its blocks are dropped and it rejoins the queue at its place,
keeping its generated tokens; the sequence limit drops to what fit and
grows back one per step once KV use is under the low watermark.

With prefix caching, admission first asks the pool for the request's cached
prefix (`lookup_prefix`, a query): shared blocks need no compute and no new
memory, and the request takes them (`take_prefix`) only once it fits. A
request whose prefix is still loading from the disk tier waits and the ones
behind it go first, so the scheduler prefers requests whose prefix is resident.

After each step `update_from_output` advances every chunk's computed tokens,
keeps the verified part of each draft and hands the sampled tokens to the
output processor one by one, finishing the requests that end: the scheduler
is the only part that changes scheduling state.

With `kv_compression`, a running request whose long prompt is computed gets
blocks for its kept positions and a `CompressJob` in the plan instead of its
next chunk; the worker copies before the forward and `update_from_output`
swaps the block table (`kv/compression.py`).

With `speculative_tokens`, a decoding greedy request (while at most
`speculative_max_seqs` run) gets a draft of guessed next tokens from n-gram
lookup in its own context (`tokenflow.scheduler.ngram`), scheduled with
its last token in the same chunk, when budget and free blocks allow.

Static batching (the `hf` backend, `static.py`) takes a batch of waiting
requests from one prompt-length bucket so padding stays small.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from typing import Any

from tokenflow.config import DEFAULT_BATCH_TOKENS, EngineConfig
from tokenflow.errors import InvalidRequest
from tokenflow.kv.compression import PromptCompression
from tokenflow.protocols import (
    AheadInput,
    CompressJob,
    EngineContext,
    KVPool,
    ScheduledChunk,
    StepOutput,
    StepPlan,
    StepResult,
    TokenItem,
    TokenSink,
)
from tokenflow.request import Request, RequestStatus
from tokenflow.runtime.sampler import has_penalty
from tokenflow.scheduler.ngram import accepted_tokens, can_speculate, propose_draft
from tokenflow.scheduler.static import take_bucketed_batch
from tokenflow.structured.drafts import valid_draft

__all__ = ("BucketingBatcher", "Scheduler", "create")


def _order(request: Request) -> tuple[int, float]:
    """Rank for preemption: the largest (lowest priority, latest arrival) goes first."""
    return (request.params.priority, request.arrival_time)


class Scheduler:
    """Continuous batching over the paged KV cache (and static batches for the `hf` backend)."""

    def __init__(self, config: EngineConfig) -> None:
        self.max_batch_tokens: int = config.max_batch_tokens or DEFAULT_BATCH_TOKENS["cpu"]
        self.max_num_seqs = config.max_num_seqs  # hard limit; lowered for good after a device OOM
        self._limits_before_oom: tuple[int, int] | None = None  # (seqs, tokens) when an OOM streak began
        self.seq_limit = config.max_num_seqs  # adaptive: drops to what fits after a preemption, regrows
        self.aging_s = config.priority_aging_s
        self.token_wait_s = config.prompt_token_wait_s
        self.window = config.attention_policy.window  # sliding: blocks behind it are freed
        self.sink_tokens = config.attention_policy.sink_tokens
        self.high_watermark = config.kv_high_watermark
        self.low_watermark = config.kv_low_watermark
        self.speculative_tokens = config.speculative_tokens
        self.speculative_max_seqs = config.speculative_max_seqs
        self.bucket_edges = sorted(config.length_buckets)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.pool: KVPool | None = None  # when the backend is paged
        self.max_model_len = 0
        self.num_preemptions = 0
        self.num_paused_admissions = 0
        self.admission_paused = False
        self.last_schedule_us = 0.0
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.num_tokens_taken = 0
        # kv_compression: a long prompt's K/V compacted after its prefill (a job in the plan, committed here)
        self.compression = PromptCompression(config) if config.kv_compression else None

    async def start(self, ctx: EngineContext) -> None:
        self.pool = ctx.pool
        self.max_model_len = ctx.max_model_len
        if self.window is None and ctx.model_window is not None:  # the model's own window: no sinks
            self.window, self.sink_tokens = ctx.model_window, 0

    @property
    def kv(self) -> KVPool:
        """The KV pool: step scheduling runs only with a paged backend, which has one."""
        assert self.pool is not None, "step scheduling needs a paged backend's KV pool"
        return self.pool

    def queue_key(self, request: Request) -> float | tuple[int, float]:
        """Place in the waiting queue. With aging, one priority level is worth `priority_aging_s`
        seconds of waiting: a request that waited that much longer passes a better-priority one, so
        a flood of higher-priority work delays a request by a bounded time, never forever. Each of its
        tokens counts as `prompt_token_wait_s` later arrival: of a burst, the short prompts start first
        (shortest-first lowers every short request's wait and the median time to first token; the long
        ones wait a bounded time more)."""
        arrival = request.arrival_time + self.token_wait_s * request.num_tokens
        if self.aging_s is None:
            return (request.params.priority, arrival)
        return request.params.priority * self.aging_s + arrival

    # -- queue -------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue `request` (the `breaker` stage bounds the queue before it gets here)."""
        if self.pool is not None:
            # A request that could never fit would be preempted forever: refuse it now.
            longest = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
            needed = self.pool.blocks_needed(longest)
            if self.window is not None:  # sliding: sinks + window + one step's chunk, however long it runs
                held = self.pool.blocks_needed(self.sink_tokens) + self.pool.blocks_needed(self.window) + 1
                needed = min(needed, held + self.pool.blocks_needed(self.max_batch_tokens))
            if needed > self.pool.num_blocks:
                raise InvalidRequest(
                    f"prompt + max_tokens need {needed} KV blocks but the whole pool has "
                    f"{self.pool.num_blocks}; lower max_tokens or enlarge the KV cache",
                    field="max_tokens",
                )
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=self.queue_key)

    def finish(self, request: Request) -> None:
        """Forget a finished or aborted request and release its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, request: Request) -> None:
        if self.pool is not None:
            self.pool.release(request)  # empties its block table

    # -- step-level scheduling (paged) ------------------------------------
    def schedule(self) -> StepPlan:
        started = time.perf_counter()
        plan = StepPlan()
        budget = self.max_batch_tokens
        scheduled: set[int] = set()
        speculate = self.speculative_tokens > 0 and len(self.running) <= self.speculative_max_seqs
        for request in sorted(self.running, key=_order):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            self.kv.commit(request)  # blocks filled by the last step become shareable
            if self.window is not None:  # sliding attention: blocks behind the window are never read again
                self.kv.trim(request, request.num_computed_tokens - self.window + 1, self.sink_tokens)
            if self.compression is not None and self.compression.due(request):
                job = self._compression_job(request)
                if job is not None:  # this step compacts its prompt; it decodes on from the next
                    plan.compressions.append(job)
                    continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            draft = self._draft(request, budget) if speculate and num_new == 1 else []
            num_new += len(draft)
            if not self._reserve(request, num_new, plan, scheduled):
                continue
            plan.chunks.append(ScheduledChunk(request, num_new, draft))
            scheduled.add(id(request))
            budget -= num_new
        pool = self.kv
        if self.seq_limit < self.max_num_seqs and pool.num_used < self.low_watermark * pool.num_blocks:
            self.seq_limit += 1  # memory is easy again: let the batch grow back, one sequence per step
        limit = min(self.max_num_seqs, self.seq_limit)
        high = self.high_watermark * pool.num_blocks
        self.admission_paused = False
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < limit:
            request = self.waiting[i]
            hit = pool.lookup_prefix(request)
            if hit is None:
                i += 1  # its cached prefix is loading from a lower tier: the next ones go first
                continue
            num_new = min(request.num_tokens - hit.num_tokens, budget)
            needed = pool.blocks_needed(hit.num_tokens + num_new) - len(hit.blocks)
            # Above the high watermark new prefills wait, so running requests have room to grow. Taking
            # the hit moves its unreferenced blocks from cached to used, so they count on both sides.
            paused = bool(self.running) and pool.num_used + hit.num_cached + needed > high
            if paused or not pool.can_allocate(needed + hit.num_cached):
                if paused:
                    self.admission_paused = True
                    self.num_paused_admissions += 1
                    break
                if self._unpin_waiting(keep=request):
                    continue  # the queue's pins are cached blocks now: look this request up again
                if not self.running and not plan.chunks:
                    # Nothing holds a block and it still does not fit (a pool plugin that lost track of
                    # its blocks): fail it rather than hang.
                    self.waiting.pop(i)
                    plan.rejected.append((request, InvalidRequest(
                        f"request needs {needed} KV blocks but only {self.kv.num_free} exist", field="prompt")))
                    continue
                break
            self.waiting.pop(i)
            pool.take_prefix(request, hit)  # a partial block hit gives the request its next block too
            request.block_table.extend(pool.allocate(pool.blocks_needed(request.num_computed_tokens + num_new)
                                                     - len(request.block_table)))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.chunks.append(ScheduledChunk(request, num_new))
            scheduled.add(id(request))
            budget -= num_new
        self.last_schedule_us = (time.perf_counter() - started) * 1e6
        return plan

    def schedule_ahead(self, plan: StepPlan) -> StepPlan | None:
        """The next decode step, planned while `plan` runs (`async_scheduling`): each request of `plan` that
        decodes on computes the token `plan` is drawing (an `AheadInput`, which the worker fills in) at the
        position after it, with a block reserved for it now. None when the next step needs `schedule()`:
        `plan` is not all plain one-token decodes, requests wait for admission (they join one step later, not
        never), a request's next sampling depends on the token being drawn (grammar, penalties, min_tokens,
        logit_bias), or a block is short (preemption is `schedule()`'s). A request whose token from `plan` is
        its last by length is left out; one that stops on EOS or a stop string computes one token that is
        dropped. Reads `plan`'s requests as `plan` left them: `update_from_output(plan)` comes after."""
        if (self.waiting or plan.compressions or not plan.chunks or self.speculative_tokens
                or self.window is not None or self.compression is not None or self.pool is None):
            return None
        ahead = StepPlan()
        for chunk in plan.chunks:
            request = chunk.request
            if chunk.num_tokens != 1 or chunk.draft or not chunk.samples or not _plain_decode(request):
                return None
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted meanwhile
            if (len(request.output_token_ids) + 1 >= request.max_tokens
                    or request.num_tokens + 1 >= self.max_model_len):
                continue  # the token `plan` draws is its last
            position = request.num_computed_tokens + 1  # `plan` computes the one before
            needed = self.kv.blocks_needed(position + 1) - len(request.block_table)
            if needed > 0:
                if not self.kv.can_allocate(needed):
                    return None  # the blocks taken so far stay with their requests, which need them next
                request.block_table.extend(self.kv.allocate(needed))
            self.kv.commit(request)  # blocks that steps before `plan` filled become shareable
            ahead.chunks.append(ScheduledChunk(request, 1, ahead=AheadInput(position, list(request.block_table))))
        return ahead if ahead.chunks else None

    def _unpin_waiting(self, keep: Request | None = None) -> bool:
        """Drop every queued request's pinned tier blocks but `keep`'s: they become cached blocks, which
        allocation may evict, and each request finds what is left of its prefix when it is admitted.
        A shortage is never a failure while the queue holds blocks. True when a pin was dropped."""
        dropped = False
        for other in self.waiting:
            if other is not keep and other.pinned_blocks:
                self._release(other)
                dropped = True
        return dropped

    def _compression_job(self, request: Request) -> CompressJob | None:
        """Blocks for the kept positions of `request`'s prompt and the job that fills them; None when the
        pool has no room now (it is tried again next step)."""
        assert self.compression is not None
        length = request.num_computed_tokens
        keep = self.compression.keep(length)
        needed = self.kv.blocks_needed(keep)
        if not self.kv.can_allocate(needed):
            return None
        return CompressJob(request, self.kv.allocate(needed), length, keep, self.compression.window,
                           self.compression.sinks)

    def _commit_compression(self, job: CompressJob, ran: bool) -> None:
        """After the step: swap the request's block table for the compacted one, or give that one back."""
        assert self.compression is not None
        request = job.request
        if not ran:
            self.compression.failed.add(request)
        if not ran or request.status is not RequestStatus.RUNNING or request.num_computed_tokens != job.length:
            self.kv.free(job.table)  # failed, or preempted or ended meanwhile: its old table goes as usual
            return
        self.kv.replace_table(request, job.table)
        request.num_dropped_tokens = job.length - job.keep
        self.compression.num_compressed += 1
        self.compression.tokens_dropped += job.length - job.keep

    def _draft(self, request: Request, budget: int) -> list[int]:
        """Guessed next tokens of a decoding request (n-gram lookup in its context), within the step's
        token budget and its token limits. A draft only takes blocks while a free block per running
        request remains, so that drafts do not push the other requests' decodes into preemption."""
        params = request.params
        num_out = len(request.output_token_ids)
        if not can_speculate(params, num_out):
            return []
        room = min(self.speculative_tokens, budget - 1, request.max_tokens - num_out - 1,
                   self.max_model_len - request.num_tokens)
        draft = propose_draft(request.all_token_ids, room)
        if request.constraint is not None:
            draft = valid_draft(request.constraint, draft)
        if draft:
            needed = self.kv.blocks_needed(request.num_kv_tokens + 1 + len(draft)) - len(request.block_table)
            if needed > 0 and not self.kv.can_allocate(needed + len(self.running)):
                return []
        return draft

    def _reserve(self, request: Request, num_new: int, plan: StepPlan, scheduled: set[int]) -> bool:
        """Give `request` blocks for `num_new` more tokens, preempting others if needed."""
        needed = self.kv.blocks_needed(request.num_kv_tokens + num_new) - len(request.block_table)
        if needed > 0 and not self.kv.can_allocate(needed):
            self._unpin_waiting()  # queued prefixes give way before a running request is preempted
        while needed > 0 and not self.kv.can_allocate(needed):
            victim = self._pick_victim()
            if victim is None or victim is request:  # it is the worst placed itself: it yields
                self._preempt(request, plan)
                return False
            if id(victim) in scheduled:
                plan.chunks = [c for c in plan.chunks if c.request is not victim]
                scheduled.discard(id(victim))
            self._preempt(victim, plan)
        if needed > 0:
            request.block_table.extend(self.kv.allocate(needed))
        return True

    def _pick_victim(self) -> Request | None:
        candidates = [r for r in self.running if r.status is RequestStatus.RUNNING]
        if not candidates:
            return None
        # Lowest priority (largest value) first, then the latest arrival.
        return max(candidates, key=_order)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.num_dropped_tokens = 0  # a compressed prompt is recomputed whole (and compressed again)
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=self.queue_key)  # back in its place: near the front
        self.seq_limit = max(1, len(self.running))  # as many as fit; regrows below the low watermark
        plan.preempted.append(request)

    def shrink(self, plan: StepPlan) -> bool:
        """Make the next step smaller after the device ran out of memory on `plan`.

        Preempts the worse-placed half of the plan's requests (they recompute later); a plan of
        one chunk halves the token budget instead. Returns False when nothing can shrink: that
        request cannot run even alone (see `oom_gave_up`).
        """
        if self._limits_before_oom is None:
            self._limits_before_oom = (self.max_num_seqs, self.max_batch_tokens)
        requests = [c.request for c in plan.chunks if c.request.status is RequestStatus.RUNNING]
        if len(requests) > 1:
            keep = len(requests) // 2
            for victim in sorted(requests, key=_order)[keep:]:
                self._preempt(victim, StepPlan())
            self.max_num_seqs = min(self.max_num_seqs, max(keep, 1))  # the device fits no more
            return True
        floor = self.pool.block_size if self.pool is not None else 1
        if self.max_batch_tokens > floor:
            self.max_batch_tokens = max(self.max_batch_tokens // 2, floor)
            return True
        return False

    def vacate_blocks_from(self, num_blocks: int) -> int:
        """Preempt every running request that holds a KV block at or past `num_blocks`, and drop waiting
        requests' pins there, so that the pool can give those ids up (`truncate`) after the device
        ran out of memory repeatedly. Returns how many requests were preempted."""
        assert self.pool is not None
        holders = [r for r in self.running if any(b >= num_blocks for b in r.block_table)]
        for request in holders:
            self._preempt(request, StepPlan())
        for request in self.waiting:
            if any(b >= num_blocks for b in request.pinned_blocks):
                self._release(request)  # its prefix is looked up again at admission
        return len(holders)

    def oom_recovered(self) -> None:
        """A step ran after out-of-memory shrinking: the smaller limits are what the device fits."""
        self._limits_before_oom = None

    def oom_gave_up(self) -> None:
        """The request that ran out of memory alone has failed: it, not the batch, was too big, so the
        limits the shrinking took away for it come back."""
        if self._limits_before_oom is not None:
            self.max_num_seqs, self.max_batch_tokens = self._limits_before_oom
            self._limits_before_oom = None

    # -- after a step ------------------------------------------------------
    def update_from_output(self, plan: StepPlan, output: StepOutput, sink: TokenSink) -> StepResult:
        """Advance each chunk's computed tokens, keep the verified part of each draft, and hand the
        sampled tokens to `sink`; finish the requests that end."""
        result = StepResult()
        for job, ran in zip(plan.compressions, output.compressed, strict=True):
            self._commit_compression(job, ran)
        items: list[TokenItem] = []
        sampled = output.sampled
        j = 0  # index of the sampling chunk
        for chunk in plan.chunks:
            request = chunk.request
            samples = chunk.samples  # read before the request advances
            # Draft positions count as computed only as their tokens are taken (in accept_tokens).
            request.num_computed_tokens += chunk.num_tokens - len(chunk.draft)
            if not samples:
                continue
            failure = sampled.failed.get(j)
            if failure is not None:
                result.failed.append((request, failure.error()))
            else:
                logprob = sampled.logprobs[j] if sampled.logprobs is not None else None
                tokens = [sampled.token_ids[j]]
                if chunk.draft:
                    tokens = accepted_tokens(tokens[0], chunk.draft, output.draft_argmax[j])
                    self.num_draft_tokens += len(chunk.draft)
                    self.num_accepted_draft_tokens += len(tokens) - 1
                # Every taken token but the last was also a draft position: its K/V is in the cache.
                items.extend((request, token, logprob if k == 0 else None, k < len(tokens) - 1)
                             for k, token in enumerate(tokens))
            j += 1
        taken = self.num_tokens_taken
        result.finished = self.accept_tokens(items, sink)
        result.num_tokens = self.num_tokens_taken - taken
        return result

    def accept_tokens(self, items: Sequence[TokenItem], sink: TokenSink) -> list[Request]:
        """Hand each taken token to `sink` in order, skipping requests that ended meanwhile (aborted
        during the step, or ended by an earlier token of their draft); finish those `sink` ends."""
        finished: list[Request] = []
        for request, token, logprob, in_cache in items:
            if request.status is RequestStatus.FINISHED:
                continue
            self.num_tokens_taken += 1
            if in_cache:
                request.num_computed_tokens += 1
            if sink.append(request, token, logprob):
                self.finish(request)
                finished.append(request)
        return finished

    # -- static batching (hf) ----------------------------------------------
    def take_batch(self) -> list[Request]:
        """The oldest request of the best priority, plus waiting requests of its length bucket."""
        batch = take_bucketed_batch(self.waiting, self.bucket_edges, self.max_num_seqs)
        for request in batch:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        return batch

    def stats(self) -> dict[str, Any]:
        return {
            "num_waiting": len(self.waiting),
            "num_running": len(self.running),
            "num_preemptions": self.num_preemptions,
            "max_num_seqs_effective": min(self.max_num_seqs, self.seq_limit),
            "admission_paused": self.admission_paused,
            "num_paused_admissions": self.num_paused_admissions,
            "kv_usage": round(self.pool.num_used / self.pool.num_blocks, 4) if self.pool is not None else 0.0,
            "max_batch_tokens_effective": self.max_batch_tokens,
            "schedule_us": round(self.last_schedule_us, 1),
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            **(self.compression.stats() if self.compression is not None else {}),
        }


def _plain_decode(request: Request) -> bool:
    """Whether the request's next sampling reads nothing that the token still being drawn changes: no grammar
    to advance, no penalties, min_tokens mask or logit_bias (which the ahead plan's rows would need as of that
    token), no prompt logprobs."""
    params = request.params
    return (request.constraint is None and not has_penalty(params) and not params.min_tokens
            and not params.logit_bias and params.prompt_logprobs is None)


BucketingBatcher = Scheduler  # the old name


def create(config: EngineConfig) -> Scheduler:
    return Scheduler(config)
