"""`attention="sliding"`: a window of recent tokens plus attention sinks (StreamingLLM).

Each query at position p attends to the first `sinks` tokens of its sequence
and to the `window` most recent tokens (positions p - window + 1 .. p).
Blocks wholly between the sinks and the window are freed by the batcher as
the window moves (`BlockPool.trim`), so a sequence's KV memory stays flat.

Positions (the StreamingLLM rule). StreamingLLM numbers tokens by their
place in the cache, not in the text, so no query-key distance ever exceeds
what the model was trained on. RoPE scores depend only on the distance
between query and key, and the window is contiguous, so window keys already
have the cache distances as stored (rotated at their text positions by the
model's own layers). Only the sinks are far: the query is rotated back by
`delta = p - (sinks + window - 1)` for the sink columns, which gives each
sink exactly its in-cache distance `sinks + window - 1 - j`. So generation
continues past the trained context with the distances StreamingLLM uses,
while the cache keeps keys as the model wrote them.

A chunk whose whole context fits in the window takes the dense path, so a
window at least the context length gives exactly the dense outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenflow.kv.kv_cache import KVCache

__all__ = ("SlidingSegment", "build_segment", "rotate_back", "sliding_attention")


@dataclass(slots=True)
class SlidingSegment:
    """Rows `q_start:q_end` of the packed batch: one sequence's tokens at positions `start..`."""

    q_start: int
    q_end: int
    block_ids: torch.Tensor  # [n] long: the sink blocks, then the window's blocks
    num_sink_slots: int  # leading gathered slots that are sink positions (< sinks)
    mask: torch.Tensor  # [t, n * block_size] bool: True = attend
    delta: torch.Tensor | None  # [t] float: how far each query is rotated back for the sink columns


def build_segment(
    q_start: int, start: int, num_tokens: int, block_table: list[int], block_size: int, window: int, sinks: int,
    device: torch.device,
) -> SlidingSegment:
    """The gather list, mask and sink rotation of queries at positions `start .. start+num_tokens-1`."""
    end = start + num_tokens
    sink_blocks = -(-sinks // block_size)
    first = max(start - window + 1, 0) // block_size  # the first query's window starts in this block
    gathered = [*range(min(sink_blocks, len(block_table))), *range(max(first, sink_blocks), -(-end // block_size))]
    ids = [block_table[b] for b in gathered]
    offsets = torch.arange(block_size, device=device)
    key_pos = (torch.tensor(gathered, device=device)[:, None] * block_size + offsets).reshape(-1)
    q_pos = torch.arange(start, end, device=device)
    seen = (key_pos[None, :] <= q_pos[:, None]) & (
        (key_pos[None, :] < sinks) | (key_pos[None, :] > q_pos[:, None] - window)
    )
    delta = (q_pos - (sinks + window - 1)).clamp_min(0)
    return SlidingSegment(
        q_start=q_start,
        q_end=q_start + num_tokens,
        block_ids=torch.tensor(ids, dtype=torch.long, device=device),
        num_sink_slots=min(sinks, sink_blocks * block_size),
        mask=seen,
        delta=delta.float() if bool((delta > 0).any()) else None,
    )


def rotate_back(q: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE-rotate queries `q [t, H, D]` by `-delta[t]` positions (HF's rotate-half layout)."""
    return _rotate(q, -delta, inv_freq)


def _rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE-rotate `x [t, H, D]` by `delta[t]` positions."""
    freqs = delta[:, None] * inv_freq[None, :].to(delta.device)  # [t, D/2]
    angle = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [t, 1, D]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin


def _one_query(
    q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, seg: SlidingSegment, scaling: float,
    inv_freq: torch.Tensor | None,
) -> torch.Tensor:
    """A decode: with one query the sink keys can be rotated forward instead (same scores), so it is one
    SDPA call over the gathered keys, as fast as a dense decode of the window's length."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_blocks.shape[2]
    k = k_blocks.reshape(-1, kv_heads, head_dim)  # [n, KVH, D]
    v = v_blocks.reshape(-1, kv_heads, head_dim)
    if seg.delta is not None and seg.num_sink_slots:
        if inv_freq is None:
            raise RuntimeError("sliding attention past the window needs the model's RoPE frequencies")
        s = seg.num_sink_slots
        k = torch.cat((_rotate(k[:s], seg.delta.expand(s), inv_freq), k[s:]))
    group = num_heads // kv_heads
    out = torch.nn.functional.scaled_dot_product_attention(
        q[0].reshape(kv_heads, group, head_dim),  # the G heads sharing a KV head as G query rows
        k.transpose(0, 1), v.transpose(0, 1), attn_mask=seg.mask, scale=scaling,
    )  # [KVH, G, D]
    return out.reshape(1, num_heads, head_dim)


def sliding_attention(
    q: torch.Tensor, cache: KVCache, layer: int, seg: SlidingSegment, scaling: float, inv_freq: torch.Tensor | None
) -> torch.Tensor:
    """Attention of queries `q [t, H, D]` over the segment's sink and window keys; returns `[t, H, D]`."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    k_blocks, v_blocks = cache.gather(layer, seg.block_ids)
    kv_heads = k_blocks.shape[2]
    if q.shape[0] == 1:
        return _one_query(q, k_blocks, v_blocks, seg, scaling, inv_freq)
    k = k_blocks.reshape(-1, kv_heads, head_dim).repeat_interleave(num_heads // kv_heads, dim=1)  # [n, H, D]
    v = v_blocks.reshape(-1, kv_heads, head_dim).repeat_interleave(num_heads // kv_heads, dim=1)
    scores = torch.einsum("thd,nhd->htn", q, k) * scaling  # [H, t, n]
    if seg.delta is not None and seg.num_sink_slots:
        if inv_freq is None:
            raise RuntimeError("sliding attention past the window needs the model's RoPE frequencies")
        s = seg.num_sink_slots
        q_back = rotate_back(q, seg.delta, inv_freq)
        scores[:, :, :s] = torch.einsum("thd,nhd->htn", q_back, k[:s]) * scaling
    scores = scores.masked_fill(~seg.mask[None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.einsum("htn,nhd->thd", probs, v)
