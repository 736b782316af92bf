"""Decode attention read through the block table in place: a Triton kernel for fixed-shape (CUDA graph) steps.

Why: the gathered path (`static_decode.py`) copies every row's context-bucket of blocks into one padded
tensor per layer, then SDPA reads it again with a mask: three passes over the K/V and three kernels. This
kernel reads each row's blocks where they lie, to the row's own length (vLLM's paged attention, the
flash-decoding split): one program per (row, KV head, split of the row's blocks) keeps a running softmax over
its blocks in fp32; with several splits a second kernel merges their partial sums. The `G` query heads of a
KV head are one program's rows, so each block is read once per KV head (GQA).

Shapes stay fixed per (batch, context) bucket: the split count is a function of the bucket alone
(`decode_splits`), so a captured graph replays the same launches. Decode attention is bound by memory, so
the products are fp32 sums of broadcast products, not tensor-core dots (which need 16 query rows).

Triton is imported when a kernel is first launched (`gpu.triton_launch`).
"""

from __future__ import annotations

import torch

from tokenflow.runtime.gpu.triton_launch import power_of_two, triton_kernels

__all__ = ("MIN_BLOCKS_PER_SPLIT", "decode_splits", "paged_decode_attention")

MIN_BLOCKS_PER_SPLIT = 4  # fewer blocks per program leave the merge more work than the split saves


def decode_splits(rows: int, kv_heads: int, blocks: int, programs: int) -> int:
    """Splits of each row's `blocks` so that about `programs` programs run (twice the GPU's SMs fill it),
    each over at least `MIN_BLOCKS_PER_SPLIT` blocks."""
    wanted = -(-programs // (rows * kv_heads))
    return max(1, min(wanted, blocks // MIN_BLOCKS_PER_SPLIT))


def paged_decode_attention(
    q_rows: torch.Tensor,  # [rows, H, D], RoPE applied
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [rows, blocks] ids; a row's entries past its length are never read
    lengths: torch.Tensor,  # [rows] keys each row attends to (>= 1)
    scale: float,
    splits: int = 1,
) -> torch.Tensor:
    """Each row's query against its first `lengths[row]` keys, read through its row of `block_table`;
    returns `[rows, H, D]` in the query's dtype."""
    rows, num_heads, head_dim = q_rows.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    blocks = block_table.shape[1]
    blocks_per_split = -(-blocks // splits)
    splits = -(-blocks // blocks_per_split)  # none empty by construction
    dim_pad = power_of_two(head_dim)
    kernels = triton_kernels()
    if q_rows.stride(2) != 1 or q_rows.stride(1) != head_dim:  # rows may be strided (views of a QKV projection)
        q_rows = q_rows.contiguous()
    out = torch.empty(q_rows.shape, dtype=q_rows.dtype, device=q_rows.device)
    merged = splits == 1
    parts = 0 if merged else rows * splits * num_heads
    acc = torch.empty(max(parts * dim_pad, 1), dtype=torch.float32, device=q_rows.device)
    maxes = torch.empty(max(parts, 1), dtype=torch.float32, device=q_rows.device)
    sums = torch.empty(max(parts, 1), dtype=torch.float32, device=q_rows.device)
    kernels.paged_decode_split[(rows, kv_heads, splits)](
        q_rows, k_cache, v_cache, block_table, lengths, out, acc, maxes, sums,
        scale, q_rows.stride(0), block_table.stride(0), blocks_per_split, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=power_of_two(group), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK_PAD=power_of_two(block_size), MERGED=merged,
    )
    if not merged:
        kernels.paged_decode_merge[(rows, num_heads)](
            out, acc, maxes, sums, splits,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, DIM_PAD=dim_pad, SPLITS_PAD=power_of_two(splits),
        )
    return out
