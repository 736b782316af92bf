"""A third-party scheduler plugin, written against `tokenflow.plugin_api` only: first come, first served,
no preemption, no drafts. The tests install it through an entry point and run the oracle with it."""

from __future__ import annotations

from typing import Any

from tokenflow.plugin_api import (
    EngineConfig,
    EngineContext,
    InvalidRequest,
    KVPool,
    Request,
    RequestStatus,
    ScheduledChunk,
    StepOutput,
    StepPlan,
    StepResult,
    TokenSink,
)


class FifoScheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.max_batch_tokens = config.max_batch_tokens
        self.max_num_seqs = config.max_num_seqs
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.pool: KVPool | None = None
        self.steps = 0

    async def start(self, ctx: EngineContext) -> None:
        if ctx.pool is None:
            raise InvalidRequest("the fifo scheduler needs a paged backend")
        self.pool = ctx.pool

    def add(self, request: Request) -> None:
        assert self.pool is not None
        if self.pool.blocks_needed(request.num_prompt_tokens + request.max_tokens) > self.pool.num_blocks:
            raise InvalidRequest("the request cannot fit the KV pool", field="max_tokens")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def schedule(self) -> StepPlan:
        assert self.pool is not None
        plan, budget = StepPlan(), self.max_batch_tokens
        for request in self.running:
            self.pool.commit(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new > 0 and self._reserve(request, num_new):
                plan.chunks.append(ScheduledChunk(request, num_new))
                budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hit = self.pool.lookup_prefix(request)
            if hit is None:
                break  # its prefix is loading: first come, first served, so everyone waits
            num_new = min(request.num_tokens - hit.num_tokens, budget)
            needed = self.pool.blocks_needed(hit.num_tokens + num_new) - len(hit.blocks)
            if not self.pool.can_allocate(needed + hit.num_cached):
                break
            self.waiting.pop(0)
            self.pool.take_prefix(request, hit)
            request.block_table.extend(self.pool.allocate(needed))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
        return plan

    def _reserve(self, request: Request, num_new: int) -> bool:
        assert self.pool is not None
        needed = self.pool.blocks_needed(request.num_computed_tokens + num_new) - len(request.block_table)
        if needed <= 0:
            return True
        if not self.pool.can_allocate(needed):
            return False  # no preemption here: it waits for blocks to come back
        request.block_table.extend(self.pool.allocate(needed))
        return True

    def update_from_output(self, plan: StepPlan, output: StepOutput, sink: TokenSink) -> StepResult:
        self.steps += 1
        result = StepResult()
        row = 0
        for chunk in plan.chunks:
            request = chunk.request
            samples = chunk.samples
            request.num_computed_tokens += chunk.num_tokens
            if not samples:
                continue
            failure = output.sampled.failed.get(row)
            logprob = output.sampled.logprobs[row] if output.sampled.logprobs is not None else None
            token = output.sampled.token_ids[row]
            row += 1
            if request.status is RequestStatus.FINISHED:
                continue  # aborted while the step ran
            if failure is not None:
                result.failed.append((request, failure.error()))
                continue
            result.num_tokens += 1
            if sink.append(request, token, logprob):
                self.finish(request)
                result.finished.append(request)
        return result

    def finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.pool is not None:
            self.pool.release(request)
        request.status = RequestStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict[str, Any]:
        return {"num_waiting": len(self.waiting), "num_running": len(self.running), "fifo_steps": self.steps}


def create(config: EngineConfig) -> FifoScheduler:
    return FifoScheduler(config)
