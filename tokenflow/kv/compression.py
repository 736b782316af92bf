"""`kv_compression="snapkv"`: after a long prompt's prefill, its K/V shrinks to about 1/ratio.

Runs on the event loop after each step: the requests whose prompt that step finished get fresh blocks for
their kept positions, the backend scores the prompt's keys and copies the kept ones on the model thread
(`PagedModelRunner.compress`, `runtime.attention.snapkv`), then the request's block table is swapped. The
full prompt blocks it held stay in the prefix cache as the uncompressed prefix, which other requests
share as before; the compacted blocks are the request's own (never committed, so never served to
another request). From then on the cache holds `num_kv_tokens` of its `num_computed_tokens` tokens;
positions keep counting the dropped ones (`SeqChunk.position_offset`). A preempted request recomputes what it
had computed and is compressed again. Compression that cannot run (no free blocks, a model error) leaves
the request uncompressed.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

from tokenflow.request import Request, RequestStatus

if TYPE_CHECKING:
    from tokenflow.config import EngineConfig
    from tokenflow.protocols import StepPlan
    from tokenflow.runtime.worker import ModelWorker

__all__ = ("PromptCompressor",)

log = logging.getLogger("tokenflow")


class PromptCompressor:
    def __init__(self, config: EngineConfig, pool: Any, worker: ModelWorker) -> None:
        self.ratio = config.kv_compression_ratio
        self.min_tokens = config.kv_compression_min_tokens
        self.window = config.kv_compression_window
        self.sinks = config.sink_tokens
        self.pool = pool
        self.worker = worker
        self.num_compressed = 0
        self.tokens_dropped = 0
        self._failed: weakref.WeakSet[Request] = weakref.WeakSet()  # not tried again

    def keep(self, num_prompt_tokens: int) -> int:
        """Prompt positions a compressed prompt keeps: 1/ratio of them, never fewer than the sinks and window."""
        return max(int(-(-num_prompt_tokens // self.ratio)), self.sinks + self.window + 1)

    def due(self, plan: StepPlan) -> list[Request]:
        """Requests long enough to compress whose prompt is computed (by this step, or by the recompute
        of a preempted one, which may have computed its outputs so far too) and not yet compressed."""
        return [c.request for c in plan.chunks
                if c.request.status is RequestStatus.RUNNING and c.request.num_dropped_tokens == 0
                and c.request.num_prompt_tokens >= self.min_tokens and c.request not in self._failed
                and c.request.num_computed_tokens >= c.request.num_prompt_tokens
                and self.keep(c.request.num_computed_tokens) < c.request.num_computed_tokens]

    async def run(self, plan: StepPlan) -> None:
        for request in self.due(plan):
            await self._compress(request)

    async def _compress(self, request: Request) -> None:
        from tokenflow.runtime.paged_runner import SeqChunk

        length = request.num_computed_tokens
        keep = self.keep(length)
        needed = self.pool.blocks_needed(keep)
        if not self.pool.can_allocate(needed):
            return  # no room for the compact copy now: it stays whole
        table = self.pool.allocate(needed)
        start = length - self.window
        window = SeqChunk(request.all_token_ids[start:length], start, list(request.block_table), False)
        try:
            await self.worker.compress_kv(window, table, keep, self.sinks)
        except Exception:
            log.exception("kv_compression failed for %s; it keeps its whole prompt", request.request_id)
            self.pool.free(table)
            self._failed.add(request)
            return
        if request.status is not RequestStatus.RUNNING:  # aborted meanwhile: its old table is released as usual
            self.pool.free(table)
            return
        self.pool.replace_table(request, table)
        request.num_dropped_tokens = length - keep
        self.num_compressed += 1
        self.tokens_dropped += length - keep

    def stats(self) -> dict[str, int]:
        return {"kv_compressed_requests": self.num_compressed, "kv_compression_tokens_dropped": self.tokens_dropped}
