"""Decode attention of fixed shapes, for steps replayed from CUDA graphs (`runtime.decode_graphs`).

A graph replays the same kernels on the same buffers, so nothing about a step may change the shapes
or the Python path: every row of a batch bucket gathers the same number of blocks (the context
bucket) from its row of a padded block table, and a mask built once per step from each row's length
hides the keys past it. GQA as in the dynamic path: the G query heads of a KV head are G query rows.
With `kernel="triton"` (`cuda_attention="triton"`), a Triton kernel reads each row's blocks in place to its own
length instead (`attention.triton_decode`): no gather, no mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from tokenflow.kv.kv_cache import KVCache
from tokenflow.runtime.attention.triton_decode import paged_decode_attention

__all__ = ("StaticDecode", "static_decode_attention")


@dataclass(frozen=True, slots=True)
class StaticDecode:
    """One token per row for every row of the step; shapes fixed by the (batch, context) bucket."""

    block_table: torch.Tensor  # [rows, blocks] long: each row's blocks, padded with the scratch block
    lengths: torch.Tensor  # [rows] long: the keys each row attends to
    mask: torch.Tensor | None  # [rows, 1, 1, blocks * block_size] bool, True = attend (key position < row length)
    kernel: Literal["gathered", "triton"] = "gathered"
    splits: int = 1  # triton: programs per (row, KV head), each over a share of the bucket's blocks


def static_decode_attention(
    q_rows: torch.Tensor,  # [rows, H, D], RoPE applied
    cache: KVCache,
    layer: int,
    step: StaticDecode,
    scale: float,
) -> torch.Tensor:
    """Attend each row's query over its blocks; returns `[rows, H, D]`."""
    if step.kernel == "triton":
        return paged_decode_attention(q_rows, cache.k[layer], cache.v[layer], step.block_table, step.lengths,
                                      scale, step.splits)
    assert step.mask is not None
    rows, num_heads, head_dim = q_rows.shape
    num_kv_heads = cache.num_kv_heads
    blocks = step.block_table.shape[1]
    flat = step.block_table.reshape(-1)
    shape = (rows, blocks * cache.block_size, num_kv_heads, head_dim)
    k = cache.k[layer].index_select(0, flat).view(shape).transpose(1, 2)  # [rows, KVH, L, D]
    v = cache.v[layer].index_select(0, flat).view(shape).transpose(1, 2)
    q = q_rows.reshape(rows, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [rows, KVH, G, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask, scale=scale)  # [rows, KVH, G, D]
    return out.reshape(rows, num_heads, head_dim)
