"""`attention="topk"`: block-sparse decode attention that reads only the blocks likely to matter (Quest).

The KV cache keeps, per layer, block and KV head, the elementwise minimum and
maximum of the block's keys (`KVCache.track_key_bounds`), updated as tokens
are written. For a decode query q, `sum_d max(q_d * min_d, q_d * max_d)` is
an upper bound of q.k for every key k in the block, so the blocks with the
largest bounds are the ones that can carry the most attention weight. Each
KV head (its group of query heads taking the largest bound) keeps the
`topk_budget // block_size` best blocks, always including the sink blocks
(the first `sink_tokens`) and the two most recent blocks, and attends
exactly over those: dropped blocks get no weight at all (they are never
read, not masked after the softmax).

Prefill chunks stay dense: Quest is a decode method, and a prompt's queries
need most of their context anyway. A decode whose context fits in the
budget is dense too, so a budget at least the context gives exactly dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenflow.kv.kv_cache import KVCache

__all__ = ("TopkDecode", "topk_attention", "update_key_bounds")

RECENT_BLOCKS = 2


@dataclass(slots=True)
class TopkDecode:
    """One decode row whose context is longer than the budget."""

    row: int  # packed row of its query
    block_ids: torch.Tensor  # [nb] long: the sequence's blocks covering its context
    context: int  # tokens in the context (its query's position + 1)
    keep_blocks: int  # blocks attended per KV head
    sink_blocks: int


def update_key_bounds(cache: KVCache, layer: int, slot_mapping: torch.Tensor, k_new: torch.Tensor) -> None:
    """Fold the step's new keys `[T, KVH, D]` into their blocks' minima and maxima."""
    blocks = slot_mapping // cache.block_size
    fresh = blocks[slot_mapping % cache.block_size == 0]  # a block's first token: forget what it held before
    k_min, k_max = cache.k_min[layer], cache.k_max[layer]
    if fresh.numel():
        k_min.index_fill_(0, fresh, float("inf"))
        k_max.index_fill_(0, fresh, float("-inf"))
    index = blocks[:, None, None].expand_as(k_new)
    k_min.scatter_reduce_(0, index, k_new, "amin")
    k_max.scatter_reduce_(0, index, k_new, "amax")


def topk_attention(q: torch.Tensor, cache: KVCache, layer: int, seq: TopkDecode, scaling: float) -> torch.Tensor:
    """Attention of one decode query `q [H, D]` over its best blocks; returns `[H, D]`."""
    num_heads, head_dim = q.shape
    kv_heads = cache.num_kv_heads
    bs = cache.block_size
    qg = q.view(kv_heads, num_heads // kv_heads, head_dim)  # [KVH, G, D]
    k_min = cache.k_min[layer][seq.block_ids]  # [nb, KVH, D]
    k_max = cache.k_max[layer][seq.block_ids]
    bound = torch.maximum(qg[None] * k_min[:, :, None], qg[None] * k_max[:, :, None]).sum(-1).amax(-1)  # [nb, KVH]
    nb = bound.shape[0]
    bound[: seq.sink_blocks] = float("inf")
    bound[max(nb - RECENT_BLOCKS, 0):] = float("inf")
    chosen = bound.topk(min(seq.keep_blocks, nb), dim=0).indices.sort(dim=0).values  # [k, KVH] block indexes
    heads = torch.arange(kv_heads, device=q.device)[None, :]
    ids = seq.block_ids[chosen]  # [k, KVH]
    k = cache.k[layer][ids, :, heads]  # [k, KVH, bs, D]
    v = cache.v[layer][ids, :, heads]
    k = k.permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)  # [KVH, k * bs, D]
    v = v.permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)
    positions = (chosen.T[:, :, None] * bs + torch.arange(bs, device=q.device)).reshape(kv_heads, -1)
    mask = (positions < seq.context)[:, None, :]  # [KVH, 1, k * bs]: the last block is partly filled
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scaling)  # [KVH, G, D]
    return out.reshape(num_heads, head_dim)
