"""`ModelWorker`: the one owner of everything that runs on the model thread.

The step loop plans on the event loop and hands each plan to `step(plan)`; the worker runs it on the model
thread and returns plain data (`StepOutput`): the KV compression copies the scheduler planned, the forward
(the backend), the sampler, the grammar masks of constrained rows (filled on the mask thread beside the
forward), the redraws of tokens a grammar refused, the argmax after each draft token and its repair under
a grammar, the prompt logprobs, and the CPU thread count the core-sharing policy chose. The static `hf`
backend samples through the same sampler (`run_batch`). Device out-of-memory comes back as
`DeviceOutOfMemory`, so the step loop needs no torch: this class is the seam where another executor
(several processes, a remote device) would plug in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import anyio
import anyio.to_thread
import torch

from tokenflow.errors import InvalidRequest
from tokenflow.protocols import (
    AheadSkipped,
    CompressingBackend,
    CompressJob,
    DeviceOutOfMemory,
    DeviceTokens,
    EmbeddingBackend,
    GreedyTokens,
    PendingTokens,
    RowFailure,
    SamplerOutput,
    ScheduledChunk,
    ShrinkableBackend,
    StaticBackend,
    StepBackend,
    StepOutput,
    StepPlan,
    WarmingBackend,
)
from tokenflow.request import Request
from tokenflow.runtime.cpu.core_share import CoreSharing
from tokenflow.runtime.loader import LoadedModel
from tokenflow.runtime.model_thread import ModelJob, ModelThread
from tokenflow.runtime.pooling import Pooling, pool
from tokenflow.runtime.sampler import Sampler, SamplingRow, row_of, tokens_output
from tokenflow.structured.bitmask import MaskFiller, StepMasks, fill_masks, masked_first
from tokenflow.structured.drafts import masked_draft_argmax

if TYPE_CHECKING:
    from llguidance import LLMatcher

__all__ = ("REJECTION_TRIES", "ModelWorker")

log = logging.getLogger("tokenflow")

# Fresh draws a refused constrained row gets before its mask is filled (see `Sampler.redraw_rejecting`).
REJECTION_TRIES = 16

# on_tokens(list of (request, token_id, logprob), list of (request, why it drew no token)), from the model thread
StaticTokens = Callable[[list[tuple[Request, int, Any]], list[tuple[Request, RowFailure]]], None]


class ModelWorker:
    def __init__(self, backend: StepBackend | StaticBackend, loaded: LoadedModel, model_thread: ModelThread,
                 cores: CoreSharing | None = None) -> None:
        self.backend = backend
        self.model_thread = model_thread
        self.static = bool(getattr(backend, "static", False))
        self.sampler = Sampler(loaded.vocab_size, loaded.eos_token_ids)
        self.masks = MaskFiller(loaded.vocab_size)  # structured outputs' token masks, beside the forward pass
        self.cores = cores  # CPU: the thread count as other work takes and gives back cores
        self._threads = cores.threads if cores is not None else 0
        self.num_masked_resamples = 0  # constrained tokens drawn again under their mask (the grammar refused one)
        self.num_rejection_settled = 0  # ... of which fresh unconstrained draws settled, without a mask
        self.num_greedy_head_steps = 0  # steps whose tokens the backend gave without logits (GreedyTokens)
        self.last_forward_ms = 0.0
        self._last_tokens: dict[Request, int] = {}  # the last step's token per request: an ahead plan's inputs
        self._device_rows: dict[Request, int] = {}  # ... or, where they stayed on the device, its row of each
        # its own thread for waiting on such tokens: on the shared pool, callers' blocking calls could take every
        # thread and stop the steps that would end them
        self._arrivals = anyio.CapacityLimiter(1)

    # -- called on the event loop ------------------------------------------------------------
    async def step(self, plan: StepPlan) -> StepOutput:
        """Run `plan` on the model thread; `DeviceOutOfMemory` when the device ran out of memory."""
        return await self.result(self.submit(plan))

    def submit(self, plan: StepPlan) -> ModelJob:
        """Queue `plan` on the model thread now (behind a step still running: an ahead plan, whose `AheadInput`
        tokens the step before draws); `await result(job)` for its output."""
        if self.cores is not None:
            self._threads = self.cores.poll()
        return self.model_thread.submit(self._execute, plan)

    async def result(self, job: ModelJob) -> StepOutput:
        """A submitted step's output; `DeviceOutOfMemory` when the device ran out of memory, `AheadSkipped` when
        an ahead plan lacked a token from the step before. A step whose tokens are still on their way from the
        device is waited for on a helper thread, while the model thread queues the next one."""
        try:
            output = cast(StepOutput, await self.model_thread.result(job))
            if output.pending is not None:
                output.sampled = await anyio.to_thread.run_sync(output.pending, limiter=self._arrivals)
                output.pending = None
            return output
        except torch.OutOfMemoryError as exc:
            raise DeviceOutOfMemory(str(exc)) from exc

    @property
    def runs_ahead(self) -> bool:
        """Whether the backend takes ahead plans (`AheadInput` chunks): the paged backend does."""
        return bool(getattr(self.backend, "runs_ahead", False))

    async def run_batch(self, batch: list[Request], on_tokens: StaticTokens) -> None:
        """A static backend's whole batch, sampled by this worker's sampler; `on_tokens` reports each step."""
        backend = cast(StaticBackend, self.backend)
        await self.model_thread.run(backend.run_batch, batch, self.sampler, on_tokens)

    async def shrink_kv(self, num_blocks: int) -> bool:
        """Free the KV memory past `num_blocks` (False: the backend cannot)."""
        if not isinstance(self.backend, ShrinkableBackend):
            return False
        await self.model_thread.run(self.backend.shrink_kv, num_blocks)
        return True

    async def embed(self, inputs: list[list[int]], pooling: Pooling) -> list[list[float]]:
        """Each token-id list's pooled final hidden states, on the model thread between steps (prefill only,
        no KV kept); `EmbeddingBackend` backends only."""
        backend = self.backend
        if not isinstance(backend, EmbeddingBackend):
            raise InvalidRequest(f"the {type(backend).__name__} backend computes no embeddings (use `paged`)",
                                 field="input")

        def run() -> list[list[float]]:
            return [pool(backend.hidden_states(ids), pooling).tolist() for ids in inputs]

        try:
            return await self.model_thread.run(run)
        except torch.OutOfMemoryError as exc:
            raise DeviceOutOfMemory(str(exc)) from exc

    def warmup_batch_sizes(self) -> list[int]:
        return list(self.backend.warmup_batch_sizes()) if isinstance(self.backend, WarmingBackend) else [1]

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "num_masked_resamples": self.num_masked_resamples,
            "num_rejection_settled": self.num_rejection_settled,
            "num_greedy_head_steps": self.num_greedy_head_steps,
            "forward_time_ms": round(self.last_forward_ms, 2),
        }
        if self.cores is not None:
            stats.update(self.cores.stats())
        stats.update(self.backend.stats())
        return stats

    # -- on the model thread ---------------------------------------------------------------------
    def _execute(self, plan: StepPlan) -> StepOutput:
        """Forward + sample (+ the argmax after each draft token). Constrained rows' masks are filled on the
        mask worker while the forward pass runs. An ahead plan's inputs are the tokens the step before drew."""
        last_tokens, self._last_tokens = self._last_tokens, {}  # a failed step leaves none for the plan behind it
        device_rows, self._device_rows = self._device_rows, {}
        for chunk in plan.chunks:
            if chunk.ahead is not None:
                token = last_tokens.get(chunk.request)
                if token is not None:
                    chunk.ahead.token = token
                elif chunk.request in device_rows:  # the backend takes it there, without waiting for it
                    chunk.ahead.device_row = device_rows[chunk.request]
                else:
                    raise AheadSkipped(f"the step before drew no token for {chunk.request.request_id}")
        if self._threads and self._threads != torch.get_num_threads():
            torch.set_num_threads(self._threads)
        compressed = [self._compress(job) for job in plan.compressions]
        if not plan.chunks:
            return StepOutput(SamplerOutput([], None), [], compressed=compressed)
        sampling = [c for c in plan.chunks if c.samples]  # read once: the event loop may move requests on after
        output = self._forward_and_sample(plan, sampling)
        output.compressed = compressed
        output.forward_ms = self.last_forward_ms
        if output.pending is not None:
            self._device_rows = {c.request: j for j, c in enumerate(sampling)}
            return output
        sampled = output.sampled
        self._last_tokens = {c.request: sampled.token_ids[j] for j, c in enumerate(sampling)
                             if j not in sampled.failed and not c.draft}
        return output

    def _compress(self, job: CompressJob) -> bool:
        """kv_compression of one prompt (the backend's `compress_kv`); False (logged) when it failed."""
        from tokenflow.runtime.paged_runner import SeqChunk

        request = job.request
        start = job.length - job.window
        window = SeqChunk(request.all_token_ids[start:job.length], start, list(request.block_table), False)
        try:
            if not isinstance(self.backend, CompressingBackend):
                raise TypeError(f"{type(self.backend).__name__} has no compress_kv")
            self.backend.compress_kv(window, job.table, job.keep, job.sinks)
        except Exception:
            log.exception("kv_compression failed for %s; it keeps its whole prompt", request.request_id)
            return False
        return True

    def _forward_and_sample(self, plan: StepPlan, sampling: list[ScheduledChunk]) -> StepOutput:
        """`sampling`: the plan's chunks that sample, in order."""
        backend = cast(StepBackend, self.backend)
        constrained = [(j, c.request.constraint) for j, c in enumerate(sampling) if c.request.constraint is not None]
        lazy = [(j, m) for j, m in constrained if not masked_first(sampling[j].request.params)]
        filling = self.masks.start([(j, m) for j, m in constrained if masked_first(sampling[j].request.params)])
        t0 = time.perf_counter()
        try:
            logits = backend.execute(plan)
        finally:
            masks = filling.result() if filling is not None else None  # never leave the worker mid-fill
        self.last_forward_ms = (time.perf_counter() - t0) * 1e3
        rows = [row_of(c.request) for c in sampling]
        if isinstance(logits, PendingTokens):  # drawn on the device, still on their way (`StepOutput.pending`)
            self.sampler.forget_draws()
            pending = logits
            return StepOutput(SamplerOutput([], None), [[] for _ in rows],
                              pending=lambda: tokens_output(pending.wait()))
        if isinstance(logits, GreedyTokens | DeviceTokens):  # tokens the backend settled without logits
            if isinstance(logits, GreedyTokens):
                self.num_greedy_head_steps += 1
            return StepOutput(self.sampler.greedy_output(logits), [[] for _ in rows])
        if not any(c.draft or c.num_prompt_logits for c in plan.chunks):  # the common case: a row per sample
            if not rows:
                return StepOutput(SamplerOutput(token_ids=[], logprobs=None), [])
            return StepOutput(self._sample(logits, rows, masks, lazy), [[] for _ in rows])
        return self._sample_drafts_and_prompts(plan, sampling, logits, rows, masks, lazy)

    def _sample_drafts_and_prompts(self, plan: StepPlan, sampling: list[ScheduledChunk], logits: torch.Tensor,
                                   rows: list[SamplingRow], masks: StepMasks | None,
                                   lazy: list[tuple[int, LLMatcher]]) -> StepOutput:
        """A step with draft tokens to verify or prompt tokens to score: each chunk's rows of logits are
        split into those, and the row of its known token, which is sampled."""
        first: list[int] = []  # each sampling chunk's row of logits for its known token
        after_draft: list[list[int]] = []
        scored: list[tuple[Request, int, list[dict[int, float]]]] = []
        row = 0
        for c in plan.chunks:
            count = c.num_logit_rows
            if c.num_prompt_logits:
                scored.append((c.request, c.request.num_computed_tokens,
                               self._prompt_logprobs(logits[row:row + c.num_prompt_logits], c)))
            if c.samples:
                known = row + count - 1 - len(c.draft)
                first.append(known)
                draft_rows = logits[known + 1:known + 1 + len(c.draft), : self.sampler.vocab_size]
                after_draft.append(draft_rows.argmax(-1).tolist() if c.draft else [])
            row += count
        sampled = self._sample(logits[first], rows, masks, lazy) if rows else SamplerOutput([], None)
        for j, c in enumerate(sampling):  # a constrained draft: the chain it accepts must be the grammar's
            matcher = c.request.constraint
            if c.draft and matcher is not None and j not in sampled.failed:
                after_draft[j], repaired = masked_draft_argmax(
                    matcher, sampled.token_ids[j], c.draft, after_draft[j],
                    logits[first[j] + 1:first[j] + 1 + len(c.draft)], self.sampler.vocab_size)
                self.num_masked_resamples += repaired
        return StepOutput(sampled, after_draft, scored)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], masks: StepMasks | None,
                lazy: list[tuple[int, LLMatcher]]) -> SamplerOutput:
        """Sample every row; then the `lazy` constrained rows whose token their grammar refuses are drawn
        again (see `masked_first`): first a few fresh unconstrained draws, then, for the rows none of those
        settles, under their mask."""
        sampled = self.sampler.sample(logits, rows, masks)
        refused = [(j, m) for j, m in lazy
                   if j not in sampled.failed and (m.is_error() or not m.validate_tokens([sampled.token_ids[j]]))]
        if not refused:
            return sampled
        self.num_masked_resamples += len(refused)
        redrawn = [(j, m) for j, m in refused if self.sampler.redrawable(j)]  # the common case: drawn at random
        matcher_of = dict(redrawn)
        settled = self.sampler.redraw_rejecting([j for j, _ in redrawn], rows,
                                                lambda j, t: matcher_of[j].validate_tokens([t]) == 1, REJECTION_TRIES)
        for j, token in settled.items():
            sampled.token_ids[j] = token
        self.num_rejection_settled += len(settled)
        redrawn = [(j, m) for j, m in redrawn if j not in settled]
        sampled_again = [(j, m) for j, m in refused if not self.sampler.redrawable(j)]  # greedy rows
        for group, redraw in ((redrawn, True), (sampled_again, False)):  # redraw first: `sample` forgets the draw
            if not group:
                continue
            picked = [j for j, _ in group]
            group_masks = fill_masks([(k, m) for k, (_, m) in enumerate(group)], self.sampler.vocab_size)
            again = (self.sampler.redraw(picked, rows, group_masks) if redraw
                     else self.sampler.sample(logits[picked], [rows[j] for j in picked], group_masks))
            for k, j in enumerate(picked):
                sampled.token_ids[j] = again.token_ids[k]
                if k in again.failed:
                    sampled.failed[j] = again.failed[k]
        return sampled

    def _prompt_logprobs(self, logits: torch.Tensor, chunk: ScheduledChunk) -> list[dict[int, float]]:
        """For each row (position p), the log-probability of prompt token p + 1 and of the top
        `prompt_logprobs` tokens there, from the raw logits (as vLLM's prompt_logprobs)."""
        request = chunk.request
        start = request.num_computed_tokens
        targets = torch.tensor(request.all_token_ids[start + 1:start + 1 + logits.shape[0]], device=logits.device)
        logprobs = torch.log_softmax(logits[:, : self.sampler.vocab_size].float(), dim=-1)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
        width = request.params.prompt_logprobs or 0
        top_v, top_i = logprobs.topk(width, dim=-1) if width else (None, None)
        out = []
        for j, token in enumerate(targets.tolist()):
            entry = {token: chosen[j]}
            if top_i is not None and top_v is not None:
                entry.update(zip(top_i[j].tolist(), top_v[j].tolist(), strict=True))
                entry[token] = chosen[j]
            out.append(entry)
        return out
