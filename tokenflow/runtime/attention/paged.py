"""Paged attention for unmodified transformers models.

`paged_attention_forward` is registered in `transformers.AttentionInterface` under
`ATTENTION_NAME`. The model calls it once per layer with the RoPE'd `query [1, H, T, D]`,
`key`/`value [1, KVH, T, D]` of the packed step and, in `kwargs`, everything it was given as
extra forward keywords: that is how the step's `PagedAttentionMetadata` reaches it (keyword
`META_KWARG`). All index tensors and masks are built once per step by the runner, so the 30
calls per step do no host-side planning, no `.item()` and no device syncs.

Packed token order (the runner guarantees it): first the decode rows (one query token per
sequence), group after group, then each prefill segment as a contiguous range.

Per layer:
1. write the step's new K/V into the cache at `slot_mapping` (one `index_copy_` each, or one native call);
2. decodes, group by group (the runner groups decodes of similar context length): gather the
   group's blocks at once, padded to its longest context, and run ONE SDPA over all of them
   with an additive padding mask; GQA is handled by viewing the `G = H / KVH` query heads of a
   KV head as G query rows (no `repeat_kv`);
3. each prefill segment: one SDPA against its own context (the chunk's own keys when it starts
   at position 0, else its gathered blocks) with a causal mask offset by its start position.

bf16 on CPU (`PagedAttentionMetadata.matmul_attention`) runs steps 2 and 3 as bf16 matrix
products instead of SDPA (`tokenflow.runtime.attention.matmul`: faster there); where its C kernels
build (`tokenflow.runtime.cpu.native_kernels`), step 2 reads the blocks in place, without the gather,
and step 3 does its softmax in one pass. Where the prefill kernel builds for the cache's dtype (fp32;
bf16 with AVX512-BF16), step 3 is one kernel call per segment over the cache instead
(`NativeKernels.prefill`, `PagedAttentionMetadata.native_prefill`): no gather, no mask.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tokenflow.kv.kv_cache import KVCache
from tokenflow.runtime.attention.matmul import decode_attention, prefill_attention
from tokenflow.runtime.attention.sliding import SlidingSegment, sliding_attention
from tokenflow.runtime.attention.snapkv import key_scores
from tokenflow.runtime.attention.static_decode import StaticDecode, static_decode_attention
from tokenflow.runtime.attention.topk import TopkDecode, topk_attention, update_key_bounds
from tokenflow.runtime.cpu.native_kernels import NativeKernels

__all__ = (
    "ATTENTION_NAME",
    "META_KWARG",
    "DecodeGroup",
    "PagedAttentionMetadata",
    "PrefillSegment",
    "UnsupportedAttentionFeature",
    "attend",
    "masked_gqa_attention",
    "paged_attention_forward",
    "register",
    "sdpa_backends",
)

ATTENTION_NAME = "tokenflow_paged"
META_KWARG = "tokenflow_meta"

# Keywords models pass down that carry nothing the attention must honour.
_HARMLESS_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions"})


class UnsupportedAttentionFeature(NotImplementedError):
    """The model asked the attention for a feature this implementation does not have.

    Ignoring it would give silently wrong logits, so the call fails instead; the runner's
    load-time self-check turns this into `ModelLoadError`.
    """


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Single-token queries of several sequences, attended in one batched SDPA.

    Their blocks are gathered together, padded to the group's longest context; the runner
    groups decodes of similar lengths so that padding stays small.
    """

    q_start: int  # first packed row of the group
    q_end: int  # one past its last packed row
    block_ids: torch.Tensor  # [rows * max_blocks] long, each row padded with block 0
    max_blocks: int
    kv_len: int  # longest context in the group; gathered keys are sliced to it
    # [rows, 1, 1, kv_len] bool, True = attend (additive, model dtype, with matmul attention); None: contexts all equal
    mask: torch.Tensor | None
    lengths: torch.Tensor | None = None  # [rows] long context lengths, for the native kernel (then no mask)


@dataclass(frozen=True, slots=True)
class PrefillSegment:
    """One multi-token chunk of one sequence inside the packed step."""

    q_start: int  # first packed row of the chunk
    q_end: int  # one past its last packed row
    start_pos: int  # tokens of this sequence already in the cache before the chunk
    kv_len: int  # start_pos + chunk length: keys the last row sees
    block_ids: torch.Tensor | None  # [ceil(kv_len / block_size)] long; None when start_pos == 0
    # [q_len, kv_len] additive (0 / -inf) in model dtype; None: plain causal (with matmul attention, only
    # when the native kernels' softmax masks by position)
    mask: torch.Tensor | None


@dataclass(slots=True)
class PagedAttentionMetadata:
    """Everything the attention needs about one step, built once per step by the runner."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot (block * block_size + offset) per packed token
    num_tokens: int
    max_context: int  # longest context in the step (positions seen by its last query + 1)
    decodes: tuple[DecodeGroup, ...]  # packed first, in row order
    prefills: tuple[PrefillSegment, ...]  # packed after the decodes, in row order
    sliding: tuple[SlidingSegment, ...] = ()  # attention="sliding" chunks past the window, packed last
    rope_inv_freq: torch.Tensor | None = None  # for re-rotating queries against sink keys
    topk: tuple[TopkDecode, ...] = ()  # attention="topk" decodes past the budget, packed last
    matmul_attention: bool = False  # decodes and prefills as bf16 matmuls, not SDPA (bf16 on CPU)
    native: NativeKernels | None = None  # C kernels: decode groups with `lengths` (bf16, fp32), prefill softmax (bf16)
    native_prefill: bool = False  # prefill segments through `native.prefill` (each has its block_ids)
    calls: list[int] | None = None  # when a list, each call appends module.layer_idx (self-check)
    static_decode: StaticDecode | None = None  # a decode-only step of fixed shapes (CUDA graphs): nothing else
    # kv_compression's scoring step: when a list, each layer appends the attention its (single) prefill segment's
    # queries give every key, `[kv_heads, kv_len]` (`runtime.kv_compression.key_scores`)
    key_scores: list[torch.Tensor] | None = None


def sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Where SDPA may run for a paged step. On CUDA: flash, memory-efficient or math, never cuDNN's,
    which builds an execution plan for every new shape: a paged step's key lengths change every step."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def masked_gqa_attention(
    q: torch.Tensor,  # [1, H, t, D]
    k: torch.Tensor,  # [1, KVH, e, D]
    v: torch.Tensor,  # [1, KVH, e, D]
    mask: torch.Tensor,  # [t, e] additive
    scale: float,
) -> torch.Tensor:
    """Masked attention with grouped KV heads as one SDPA without GQA (CUDA's fused kernels take a mask
    or GQA, not both): the G query heads of a KV head become G * t query rows against it, the mask
    repeated per head. Returns `[t, H, D]`."""
    _, num_heads, t, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    rows = q.reshape(1, num_kv_heads, group * t, head_dim)
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask.repeat(group, 1), scale=scale)
    return out.reshape(num_heads, t, head_dim).transpose(0, 1)  # the fused kernels may return another layout


def register() -> None:
    """Make `ATTENTION_NAME` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def _check_kwargs(module: torch.nn.Module, meta: PagedAttentionMetadata, kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        if value is None or name in _HARMLESS_KWARGS:
            if name == "output_attentions" and value:
                raise UnsupportedAttentionFeature("paged attention cannot return attention weights")
            continue
        if name == "sliding_window":
            # A window at least as long as every context in the step masks nothing.
            if value >= meta.max_context:
                continue
            raise UnsupportedAttentionFeature(
                f"sliding_window={value} (context {meta.max_context}) is not implemented by paged attention"
            )
        if name == "is_causal" and value:
            continue
        raise UnsupportedAttentionFeature(
            f"{type(module).__name__} passed attention argument {name}={value!r}, "
            "which paged attention does not implement"
        )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D], RoPE applied
    key: torch.Tensor,  # [1, KVH, T, D]
    value: torch.Tensor,  # [1, KVH, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Write this layer's new K/V into the paged cache and attend over it; returns `([1, T, H, D], None)`."""
    meta: PagedAttentionMetadata | None = kwargs.pop(META_KWARG, None)
    if meta is None:
        raise RuntimeError(
            f"attention '{ATTENTION_NAME}' called without '{META_KWARG}': this model is bound to a "
            "PagedModelRunner; call it through PagedModelRunner.execute"
        )
    if kwargs:
        _check_kwargs(module, meta, kwargs)
    if attention_mask is not None:
        raise UnsupportedAttentionFeature(f"{type(module).__name__} built its own attention mask")
    if dropout:
        raise UnsupportedAttentionFeature("attention dropout > 0 (is the model in training mode?)")
    if not getattr(module, "is_causal", True):
        raise UnsupportedAttentionFeature(f"{type(module).__name__} is not causal")
    q_rows = query[0].transpose(0, 1)  # [T, H, D]
    k_new = key[0].transpose(0, 1)  # [T, KVH, D]
    v_new = value[0].transpose(0, 1)  # [T, KVH, D]
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    return attend(module.layer_idx, q_rows, k_new, v_new, meta, scale).unsqueeze(0), None  # [1, T, H, D]


def attend(
    layer: int,
    q_rows: torch.Tensor,  # [T, H, D], RoPE applied
    k_new: torch.Tensor,  # [T, KVH, D]
    v_new: torch.Tensor,  # [T, KVH, D]
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One layer of paged attention for the packed step (the HF attention function and tokenflow's
    fused layers share it): write the new K/V into the cache, attend; returns `[T, H, D]`."""
    if meta.calls is not None:
        meta.calls.append(layer)
    cache = meta.kv_cache
    num_heads, head_dim = q_rows.shape[1], q_rows.shape[2]
    num_kv_heads = k_new.shape[1]
    group = num_heads // num_kv_heads
    kernels = meta.native
    if kernels is None or cache.quantized or not kernels.write_kv(
            cache.k_slots[layer], cache.v_slots[layer], meta.slot_mapping, k_new, v_new):
        cache.write(layer, meta.slot_mapping, k_new, v_new)
    if cache.track_key_bounds:
        update_key_bounds(cache, layer, meta.slot_mapping, k_new)
    if meta.static_decode is not None:
        return static_decode_attention(q_rows, cache, layer, meta.static_decode, scale)
    pieces: list[torch.Tensor] = []  # each [rows, H, D], in packed order

    for grp in meta.decodes:
        n = grp.q_end - grp.q_start
        # One query per sequence: the G heads sharing a KV head become G query rows against it.
        q = q_rows[grp.q_start : grp.q_end].reshape(n, num_kv_heads, group, head_dim)  # [n, KVH, G, D]
        if grp.lengths is not None and meta.native is not None and cache.quantized:
            out = meta.native.decode_int8(
                q, cache.k_slots[layer], cache.v_slots[layer], cache.k_scale_slots[layer], cache.v_scale_slots[layer],
                grp.block_ids.view(n, grp.max_blocks), grp.lengths, grp.kv_len, cache.block_size, scale,
            )
            pieces.append(out.view(n, num_heads, head_dim))
            continue
        if grp.lengths is not None and meta.native is not None:
            out = meta.native.decode(
                q, cache.k_slots[layer], cache.v_slots[layer], grp.block_ids.view(n, grp.max_blocks), grp.lengths,
                grp.kv_len, cache.block_size, scale,
            )
            pieces.append(out.view(n, num_heads, head_dim))
            continue
        shape = (n, grp.max_blocks * cache.block_size, num_kv_heads, head_dim)
        k_blocks, v_blocks = cache.gather(layer, grp.block_ids)
        # [n, KVH, kv_len, D] views of the gathered blocks
        k = k_blocks.view(shape)[:, : grp.kv_len].transpose(1, 2)
        v = v_blocks.view(shape)[:, : grp.kv_len].transpose(1, 2)
        if meta.matmul_attention:
            out = decode_attention(q, k, v, grp.mask, scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=grp.mask, scale=scale)  # [n, KVH, G, D]
        pieces.append(out.reshape(n, num_heads, head_dim))  # a view unless the kernel's layout differs

    if meta.key_scores is not None:
        seg = meta.prefills[0]
        assert seg.block_ids is not None  # a scoring step is a chunk after the prompt's start
        k_blocks, _ = cache.gather(layer, seg.block_ids)
        keys = k_blocks.reshape(-1, num_kv_heads, head_dim)[: seg.kv_len]  # [kv_len, KVH, D]
        meta.key_scores.append(key_scores(q_rows[seg.q_start : seg.q_end], keys, scale, seg.start_pos))

    for seg in meta.prefills:
        if meta.native_prefill and cache.quantized:  # the runner gave every segment its table
            assert meta.native is not None and seg.block_ids is not None
            pieces.append(meta.native.prefill_int8(
                q_rows[seg.q_start : seg.q_end], cache.k_slots[layer], cache.v_slots[layer],
                cache.k_scale_slots[layer], cache.v_scale_slots[layer], seg.block_ids, cache.block_size,
                seg.start_pos, scale,
            ))
            continue
        if meta.native_prefill:  # the runner gave every segment its table
            assert meta.native is not None and seg.block_ids is not None
            pieces.append(meta.native.prefill(
                q_rows[seg.q_start : seg.q_end], cache.k_slots[layer], cache.v_slots[layer], seg.block_ids,
                cache.block_size, seg.start_pos, scale,
            ))
            continue
        if seg.block_ids is None:  # chunk starts the sequence: its own keys are the whole context
            k = k_new[seg.q_start : seg.q_end].transpose(0, 1).unsqueeze(0)  # [1, KVH, t, D]
            v = v_new[seg.q_start : seg.q_end].transpose(0, 1).unsqueeze(0)
        else:
            shape = (1, seg.block_ids.shape[0] * cache.block_size, num_kv_heads, head_dim)
            k_blocks, v_blocks = cache.gather(layer, seg.block_ids)
            # [1, KVH, kv_len, D] views of the gathered blocks
            k = k_blocks.view(shape)[:, : seg.kv_len].transpose(1, 2)
            v = v_blocks.view(shape)[:, : seg.kv_len].transpose(1, 2)
        if meta.matmul_attention:
            native = meta.native if seg.mask is None else None  # its softmax masks by position
            pieces.append(prefill_attention(q_rows[seg.q_start : seg.q_end], k[0], v[0], seg.mask, scale, native))
            continue
        q = q_rows[seg.q_start : seg.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, t, D]
        if seg.mask is not None and group > 1 and q.device.type == "cuda":  # no fused kernel takes both
            pieces.append(masked_gqa_attention(q, k, v, seg.mask, scale))
            continue
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scale, enable_gqa=group > 1,
        )  # [1, H, t, D]
        pieces.append(out[0].transpose(0, 1))  # [t, H, D]

    for sl in meta.sliding:
        pieces.append(sliding_attention(q_rows[sl.q_start : sl.q_end], cache, layer, sl, scale, meta.rope_inv_freq))
    for sparse in meta.topk:
        pieces.append(topk_attention(q_rows[sparse.row], cache, layer, sparse, scale).unsqueeze(0))

    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces, dim=0)
