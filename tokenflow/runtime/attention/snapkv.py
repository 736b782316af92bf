"""`kv_compression="snapkv"`: which prompt positions' K/V to keep (SnapKV).

After a long prompt's prefill its last `window` tokens are run once more as a scoring step, and for each
layer and KV head every prompt position gets the attention weight the window's queries give it (summed
over the window and over the query heads sharing that KV head). Smoothed over neighbouring positions
(a max pool, so a phrase survives with its neighbours), the best positions are kept, always with the
first `sinks` positions and the last `window` (the window that wrote the question stays whole). The
engine then copies each (layer, head)'s kept K/V, in position order, into fresh blocks
(`KVCache.copy_positions`); RoPE is already in the stored keys, so kept keys keep their distances.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ("POOL", "key_scores", "select_positions")

POOL = 7  # positions a score is smoothed over (SnapKV's kernel size)


def key_scores(q_rows: torch.Tensor, keys: torch.Tensor, scale: float, start: int) -> torch.Tensor:
    """Attention weight each key gets from the queries, summed per KV head: `[kv_heads, len(keys)]`.

    q_rows: `[t, H, D]` queries at cache positions start .. start + t - 1; keys: `[e, KVH, D]` (e >= start + t).
    """
    t, num_heads, head_dim = q_rows.shape
    e, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    q = q_rows.float().reshape(t, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [KVH, G, t, D]
    q = q.reshape(num_kv_heads, group * t, head_dim)
    scores = q @ keys.float().permute(1, 2, 0) * scale  # [KVH, G * t, e]
    rows = (torch.arange(t, device=q.device) + start).repeat(group)  # each row's position
    scores.masked_fill_(torch.arange(e, device=q.device)[None, :] > rows[:, None], float("-inf"))
    return scores.softmax(-1).sum(1)  # [KVH, e]


def select_positions(scores: torch.Tensor, keep: int, sinks: int, window: int) -> torch.Tensor:
    """The `keep` positions each KV head keeps, ascending: `[kv_heads, keep]` long, from `scores [kv_heads, n]`."""
    _, n = scores.shape
    if keep >= n:
        return torch.arange(n, device=scores.device).expand(scores.shape[0], n).clone()
    pooled = F.max_pool1d(scores[None].float(), POOL, stride=1, padding=POOL // 2)[0]
    pooled[:, : min(sinks, n)] = float("inf")
    pooled[:, max(n - window, 0):] = float("inf")
    return pooled.topk(keep, dim=1).indices.sort(dim=1).values
