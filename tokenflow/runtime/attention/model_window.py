"""Attention of a layer with the model's own sliding window and/or logit soft-capping (Mistral, Qwen2 with
`use_sliding_window`, Gemma 2 and 3 sliding layers; Gemma 2's `attn_logit_softcapping`), as transformers
computes it: each query sees the keys at positions (q - window, q], scores scaled, soft-capped
(`tanh(s / cap) * cap`), masked, softmax in fp32.

Torch ops over the gathered blocks (the native kernels have neither feature); blocks the scheduler freed
behind the window (table entries -1) are read as block 0 and masked away. The fused CPU layers never run
these models, so this is the transformers-modules path only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenflow.kv.kv_cache import KVCache

if TYPE_CHECKING:
    from tokenflow.runtime.attention.paged import DecodeGroup, PrefillSegment

__all__ = ("window_decode", "window_prefill")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """`q [..., KVH, G, t, D]` against `k, v [..., KVH, 1, e, D]` where `allowed [..., 1, 1, t, e]`."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """`[len(q_pos), len(k_pos)]` bool: causal, and within the window when there is one."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed


def window_decode(q: torch.Tensor, cache: KVCache, layer: int, grp: DecodeGroup, scale: float,
                  window: int | None, softcap: float | None) -> torch.Tensor:
    """One query per row, `q [n, KVH, G, D]`; returns `[n, H, D]`."""
    n, kv_heads, group, head_dim = q.shape
    k_blocks, v_blocks = cache.gather(layer, grp.block_ids.clamp_min(0))
    shape = (n, grp.max_blocks * cache.block_size, kv_heads, head_dim)
    k = k_blocks.view(shape)[:, : grp.kv_len].transpose(1, 2).unsqueeze(2)  # [n, KVH, 1, kv_len, D]
    v = v_blocks.view(shape)[:, : grp.kv_len].transpose(1, 2).unsqueeze(2)
    if grp.lengths is not None:
        lengths = grp.lengths.to(q.device)
    elif grp.mask is None:
        lengths = torch.full((n,), grp.kv_len, device=q.device)
    else:
        mask = grp.mask.reshape(n, grp.kv_len)
        lengths = (mask if mask.dtype == torch.bool else mask == 0).sum(-1)
    k_pos = torch.arange(grp.kv_len, device=q.device)
    allowed = _visible(lengths - 1, k_pos, window)  # [n, kv_len]: row i's query is at position length_i - 1
    out = _attend(q.unsqueeze(3), k, v, allowed[:, None, None, None, :], scale, softcap)  # [n, KVH, G, 1, D]
    return out.reshape(n, kv_heads * group, head_dim)


def window_prefill(q_rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: KVCache, layer: int,
                   seg: PrefillSegment, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """One chunk's queries `q_rows[seg.q_start : seg.q_end]` over its sequence; returns `[t, H, D]`."""
    q = q_rows[seg.q_start : seg.q_end]
    t, heads, head_dim = q.shape
    kv_heads = k_new.shape[1]
    if seg.block_ids is None:  # the chunk starts its sequence: its own keys are the context
        k, v = k_new[seg.q_start : seg.q_end], v_new[seg.q_start : seg.q_end]
    else:
        k_blocks, v_blocks = cache.gather(layer, seg.block_ids.clamp_min(0))
        k = k_blocks.reshape(-1, kv_heads, head_dim)[: seg.kv_len]
        v = v_blocks.reshape(-1, kv_heads, head_dim)[: seg.kv_len]
    k = k.transpose(0, 1).unsqueeze(1)  # [KVH, 1, e, D]
    v = v.transpose(0, 1).unsqueeze(1)
    q = q.view(t, kv_heads, heads // kv_heads, head_dim).permute(1, 2, 0, 3)  # [KVH, G, t, D]
    q_pos = torch.arange(seg.start_pos, seg.start_pos + t, device=q.device)
    allowed = _visible(q_pos, torch.arange(k.shape[2], device=q.device), window)
    out = _attend(q, k, v, allowed, scale, softcap)  # [KVH, G, t, D]
    return out.permute(2, 0, 1, 3).reshape(t, heads, head_dim)
