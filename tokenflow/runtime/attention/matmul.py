"""bf16 attention on CPU as plain bf16 matrix products (used instead of SDPA there).

Why: on CPUs with bf16 matrix instructions, torch's fused CPU attention kernel in bf16 runs far
below the bf16 GEMM peak, so two batched matmuls around an fp32 softmax do the same work faster
for prefill chunks and batched decodes (a lone decode pays for the extra ops per call).

The arithmetic is transformers' own eager attention in bf16 (scores scaled and masked in bf16,
softmax in fp32, probabilities rounded to bf16), so the logits equal eager's bit for bit. GQA: the G query
heads that share a KV head become G * rows query rows of one product against it.
Long chunks are cut into query tiles that only read the keys their rows can see, so the
causal half of the scores is never computed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenflow.runtime.cpu.native_kernels import NativeKernels

__all__ = ("QUERY_TILE", "decode_attention", "prefill_attention")

QUERY_TILE = 128  # query rows per product in prefill: bounds the scores buffer, skips masked keys


def _probabilities(scores: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Eager attention's middle, in place on the bf16 `scores`: scale and mask in bf16, softmax in fp32."""
    scores.mul_(scale)
    if mask is not None:
        scores.add_(mask)
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)


def decode_attention(
    q: torch.Tensor,  # [n, KVH, G, D]: one query per sequence, G heads per KV head
    k: torch.Tensor,  # [n, KVH, L, D]
    v: torch.Tensor,  # [n, KVH, L, D]
    mask: torch.Tensor | None,  # [n, 1, 1, L] additive (0 / -inf) in q's dtype; None: every key is seen
    scale: float,
) -> torch.Tensor:
    """Single-token attention of `n` sequences over their (padded) contexts; returns `[n, KVH, G, D]`."""
    k = k.contiguous()  # one copy: the products are far slower on the strided gather view
    v = v.contiguous()
    probs = _probabilities(torch.matmul(q, k.transpose(-1, -2)), scale, mask)  # [n, KVH, G, L]
    return torch.matmul(probs, v)


def prefill_attention(
    q: torch.Tensor,  # [t, H, D]: the chunk's queries, at positions start .. start + t - 1
    k: torch.Tensor,  # [KVH, L, D]: keys of positions 0 .. L - 1 (L = start + t)
    v: torch.Tensor,  # [KVH, L, D]
    mask: torch.Tensor | None,  # [t, L] additive causal mask (0 / -inf) of the chunk, in q's dtype
    scale: float,
    native: NativeKernels | None = None,  # its one-pass causal softmax replaces `_probabilities` and `mask`
) -> torch.Tensor:
    """Causal attention of one chunk over its sequence's keys; returns `[t, H, D]`.

    `mask` may be None only with `native`."""
    if native is None and mask is None:
        raise ValueError("prefill_attention needs the causal mask unless the native softmax applies it")
    t, num_heads, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    start = kv_len - t
    out = q.new_empty(t, num_heads, head_dim)
    for lo in range(0, t, QUERY_TILE):
        hi = min(t, lo + QUERY_TILE)
        rows, seen = hi - lo, start + hi  # keys past the tile's last position are masked for all its rows
        # [KVH, G * rows, D]: query heads of one KV head, row-major per head
        q_tile = q[lo:hi].view(rows, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q_tile = q_tile.reshape(num_kv_heads, group * rows, head_dim)
        scores = torch.bmm(q_tile, k[:, :seen].transpose(1, 2))  # [KVH, G * rows, seen]
        if native is not None:
            probs = native.causal_softmax_(scores, rows, start + lo, scale)
        else:
            scores = scores.view(num_kv_heads, group, rows, seen)
            probs = _probabilities(scores, scale, mask[lo:hi, :seen]).view(num_kv_heads, group * rows, seen)
        tile = torch.bmm(probs, v[:, :seen])  # [KVH, G * rows, D]
        out[lo:hi] = tile.view(num_heads, rows, head_dim).transpose(0, 1)
    return out
