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

Triton is imported when a kernel is first built, not at import: the package is optional (CUDA only), and
its interpreter (`TRITON_INTERPRET=1`), which the CPU tests run, is chosen when a kernel is decorated.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

__all__ = ("MIN_BLOCKS_PER_SPLIT", "decode_splits", "paged_decode_attention", "triton_available")

MIN_BLOCKS_PER_SPLIT = 4  # fewer blocks per program leave the merge more work than the split saves


def triton_available() -> bool:
    """Whether the `triton` package is installed (it ships with CUDA builds of torch)."""
    return importlib.util.find_spec("triton") is not None


def decode_splits(rows: int, kv_heads: int, blocks: int, programs: int) -> int:
    """Splits of each row's `blocks` so that about `programs` programs run (twice the GPU's SMs fill it),
    each over at least `MIN_BLOCKS_PER_SPLIT` blocks."""
    wanted = -(-programs // (rows * kv_heads))
    return max(1, min(wanted, blocks // MIN_BLOCKS_PER_SPLIT))


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, lengths_ptr, out_ptr, acc_ptr, max_ptr, sum_ptr,
        scale, table_stride, blocks_per_split, block_stride, slot_stride, head_stride,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, MERGED: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        splits = tl.num_programs(2)
        length = tl.load(lengths_ptr + row)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        n = tl.arange(0, BLOCK_SIZE)
        heads = kv_head * GROUP + g
        live = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + (row * NUM_HEADS + heads)[:, None] * HEAD_DIM + d[None, :], mask=live, other=0.0)
        q = q.to(tl.float32) * scale
        running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        first = split * blocks_per_split
        last = tl.minimum(first + blocks_per_split, tl.cdiv(length, BLOCK_SIZE))
        dims = (d < HEAD_DIM)[None, :]
        for b in range(first, last):
            block = tl.load(table_ptr + row * table_stride + b).to(tl.int64)
            at = block * block_stride + n[:, None] * slot_stride + kv_head * head_stride + d[None, :]
            keys = (b * BLOCK_SIZE + n) < length  # the block's slots past the length may hold anything: not read
            k = tl.load(k_ptr + at, mask=keys[:, None] & dims, other=0.0).to(tl.float32)  # [BLOCK_SIZE, DIM_PAD]
            v = tl.load(v_ptr + at, mask=keys[:, None] & dims, other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_SIZE]
            scores = tl.where(keys[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # finite: a block holds a key below length
            probs = tl.exp(scores - new_max[:, None])
            rescale = tl.exp(running_max - new_max)
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            acc = acc * rescale[:, None] + tl.sum(probs[:, :, None] * v[None, :, :], axis=1)
            running_max = new_max
        if MERGED:  # one split: the row's whole context, normalised here
            out = acc / running_sum[:, None]
            at_out = (row * NUM_HEADS + heads)[:, None] * HEAD_DIM + d[None, :]
            tl.store(out_ptr + at_out, out.to(out_ptr.dtype.element_ty), mask=live)
        else:
            part = (row * splits + split) * NUM_HEADS + heads  # [GROUP_PAD]
            tl.store(acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=(g < GROUP)[:, None])
            tl.store(max_ptr + part, running_max, mask=g < GROUP)
            tl.store(sum_ptr + part, running_sum, mask=g < GROUP)

    @triton.jit
    def merge_kernel(
        out_ptr, acc_ptr, max_ptr, sum_ptr, splits,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, DIM_PAD)
        part = (row * splits + s) * NUM_HEADS + head  # [SPLITS_PAD]
        present = s < splits
        maxes = tl.load(max_ptr + part, mask=present, other=float("-inf"))
        top = tl.max(maxes, axis=0)
        weights = tl.where(present, tl.exp(maxes - top), 0.0)  # an empty split (past the length) weighs 0
        total = tl.sum(tl.load(sum_ptr + part, mask=present, other=0.0) * weights, axis=0)
        acc = tl.load(acc_ptr + part[:, None] * DIM_PAD + d[None, :], mask=present[:, None], other=0.0)
        out = tl.sum(acc * weights[:, None], axis=0) / total
        tl.store(out_ptr + (row * NUM_HEADS + head) * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty),
                 mask=d < HEAD_DIM)

    return split_kernel, merge_kernel


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


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
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton decode kernel needs a power-of-two block size, not {block_size}")
    group = num_heads // kv_heads
    blocks = block_table.shape[1]
    blocks_per_split = -(-blocks // splits)
    splits = -(-blocks // blocks_per_split)  # none empty by construction
    dim_pad = _power_of_two(head_dim)
    split_kernel, merge_kernel = _kernels()
    q_rows = q_rows.contiguous()
    out = torch.empty_like(q_rows)
    merged = splits == 1
    parts = 0 if merged else rows * splits * num_heads
    acc = torch.empty(max(parts * dim_pad, 1), dtype=torch.float32, device=q_rows.device)
    maxes = torch.empty(max(parts, 1), dtype=torch.float32, device=q_rows.device)
    sums = torch.empty(max(parts, 1), dtype=torch.float32, device=q_rows.device)
    split_kernel[(rows, kv_heads, splits)](
        q_rows, k_cache, v_cache, block_table, lengths, out, acc, maxes, sums,
        scale, block_table.stride(0), blocks_per_split, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=_power_of_two(group), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, MERGED=merged,
    )
    if not merged:
        merge_kernel[(rows, num_heads)](
            out, acc, maxes, sums, splits,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, DIM_PAD=dim_pad, SPLITS_PAD=_power_of_two(splits),
        )
    return out
