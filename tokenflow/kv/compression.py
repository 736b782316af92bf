"""`kv_compression="snapkv"`: after a long prompt's prefill, its K/V shrinks to about 1/ratio.

The scheduler decides and commits, the model worker copies. When a running request's prompt is computed
(by its last prefill chunk, or by the recompute of a preempted one), the scheduler gives it fresh blocks
for its kept positions and plans a `CompressJob` instead of its next chunk. The worker scores the
prompt's keys and copies the kept ones on the model thread before the step's forward
(`PagedModelRunner.compress`, `runtime.attention.snapkv`); after the step the scheduler swaps the request's
block table (`update_from_output`), so it stays the only writer of scheduling state. The full prompt
blocks the request held stay in the prefix cache as the uncompressed prefix, which other requests share as
before; the compacted blocks are the request's own (never committed, so never served to another
request). From then on the cache holds `num_kv_tokens` of its `num_computed_tokens` tokens; positions keep
counting the dropped ones (`SeqChunk.position_offset`). A preempted request recomputes what it had
computed and is compressed again. Compression that cannot run (no free blocks now: tried again next step;
a model error: never again) leaves the request uncompressed.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from tokenflow.request import Request, RequestStatus

if TYPE_CHECKING:
    from tokenflow.config import EngineConfig

__all__ = ("PromptCompression",)


class PromptCompression:
    """Which requests to compress and how far (the scheduler's rules), and the counts `stats()` reports."""

    def __init__(self, config: EngineConfig) -> None:
        self.ratio = config.kv_compression_ratio
        self.min_tokens = config.kv_compression_min_tokens
        self.window = config.kv_compression_window
        self.sinks = config.sink_tokens
        self.num_compressed = 0
        self.tokens_dropped = 0
        self.failed: weakref.WeakSet[Request] = weakref.WeakSet()  # a model error: not tried again

    def keep(self, num_prompt_tokens: int) -> int:
        """Prompt positions a compressed prompt keeps: 1/ratio of them, never fewer than the sinks and window."""
        return max(int(-(-num_prompt_tokens // self.ratio)), self.sinks + self.window + 1)

    def due(self, request: Request) -> bool:
        """Long enough, its prompt computed, not compressed yet (nor failed)."""
        return (request.status is RequestStatus.RUNNING and request.num_dropped_tokens == 0
                and request.num_prompt_tokens >= self.min_tokens and request not in self.failed
                and request.num_computed_tokens >= request.num_prompt_tokens
                and self.keep(request.num_computed_tokens) < request.num_computed_tokens)

    def stats(self) -> dict[str, int]:
        return {"kv_compressed_requests": self.num_compressed, "kv_compression_tokens_dropped": self.tokens_dropped}
