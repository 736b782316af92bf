"""Every row of a packed step (decodes and prefill chunks alike) in one Triton kernel per layer, reading the
keys through each sequence's block table in place (`cuda_attention="triton"`, steps not replayed from graphs).

Why: the torch path runs one SDPA per decode group and per prefill chunk, each after gathering that chunk's
blocks into a contiguous copy (and a mask for a chunk with context): on a GPU a mixed step's attention is a
few kernels and a copy of the context per segment per layer. Here it is one launch per layer whatever the
step holds, with the step's shape in three small device tensors (`VarlenStep`): vLLM's unified attention.
A program takes one (sequence, tile of its queries, KV head); the tile's queries times the KV head's G query
heads are the rows of its products, so a key block is read once per KV head. Products run on tensor cores in
TF32 (exact for Q.K^T of bf16 inputs; P.V rounds the probabilities to TF32, finer than SDPA's bf16), in IEEE
fp32 for an fp32 model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenflow.runtime.gpu.triton_launch import power_of_two, triton_kernels

__all__ = ("VarlenStep", "varlen_attention", "varlen_step")

_TILE_ROWS = 64  # query rows (tokens x grouped heads) per program: a prefill chunk's tile
_MIN_ROWS = 16  # tl.dot's smallest tile: a decode's one token, padded
_KEYS = 32  # keys per iteration


@dataclass(frozen=True, slots=True)
class VarlenStep:
    """The packed step's sequences, in packed row order."""

    query_start: torch.Tensor  # [S + 1] int32: sequence i's rows are query_start[i]:query_start[i + 1]
    seq_lens: torch.Tensor  # [S] int32: keys of sequence i once this step's rows are written (context + rows)
    block_table: torch.Tensor  # [S, max_blocks] int32: sequence i's blocks (padded with 0, never read)
    max_rows: int  # the longest sequence's rows in this step (the grid's query tiles)


def varlen_step(rows: list[tuple[int, int, list[int]]], block_size: int, device: torch.device) -> VarlenStep:
    """From each sequence's (rows in the step, keys after it, block table), in packed order."""
    starts = [0]
    for count, _, _ in rows:
        starts.append(starts[-1] + count)
    used = [-(-keys // block_size) for _, keys, _ in rows]
    width = max(used)
    table = [blocks[:n] + [0] * (width - n) for (_, _, blocks), n in zip(rows, used)]
    return VarlenStep(
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([keys for _, keys, _ in rows], dtype=torch.int32, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
        max_rows=max(count for count, _, _ in rows),
    )


def varlen_attention(
    q_rows: torch.Tensor,  # [T, H, D] RoPE applied, the step's rows in packed order
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], this step's K/V already written
    v_cache: torch.Tensor,
    step: VarlenStep,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every row over its own sequence's keys; returns `[T, H, D]` in the query's dtype."""
    _, num_heads, head_dim = q_rows.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    group_pad = power_of_two(group)
    # a tile of as many tokens as fill _TILE_ROWS rows, fewer when no sequence has that many (decode-only steps)
    block_q = max(_MIN_ROWS // group_pad, min(_TILE_ROWS // group_pad, power_of_two(step.max_rows)), 1)
    if q_rows.stride(2) != 1 or q_rows.stride(1) != head_dim:  # rows may be strided (views of a QKV projection)
        q_rows = q_rows.contiguous()
    out = torch.empty(q_rows.shape, dtype=q_rows.dtype, device=q_rows.device)
    sequences = step.seq_lens.shape[0]
    grid = (sequences, -(-step.max_rows // block_q), kv_heads)
    triton_kernels().paged_varlen_attention[grid](
        q_rows, k_cache, v_cache, out, step.block_table, step.seq_lens, step.query_start,
        scale, q_rows.stride(0), step.block_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        DIM_PAD=max(16, power_of_two(head_dim)), BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_N=_KEYS,
        PRECISION="ieee" if q_rows.dtype == torch.float32 else "tf32",
    )
    return out
