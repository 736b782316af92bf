"""Static batches for the `hf` backend: a batch runs to completion, so its requests should be of
similar prompt length (padding is wasted compute)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from tokenflow.request import Request

__all__ = ("length_bucket", "take_bucketed_batch")


def length_bucket(num_tokens: int, edges: Sequence[int]) -> int:
    """The smallest edge holding `num_tokens` (its own length past the last edge)."""
    i = bisect.bisect_left(edges, num_tokens)
    return edges[i] if i < len(edges) else num_tokens


def take_bucketed_batch(waiting: list[Request], edges: Sequence[int], limit: int) -> list[Request]:
    """Remove and return the queue's head plus the waiting requests of its length bucket (at most `limit`)."""
    if not waiting:
        return []
    bucket = length_bucket(waiting[0].num_prompt_tokens, edges)
    batch = [r for r in waiting if length_bucket(r.num_prompt_tokens, edges) == bucket][:limit]
    for request in batch:
        waiting.remove(request)
    return batch
