"""One layer's paged attention over a packed step, its variants chosen once when the runner loads.

What differs between machines and settings is decided at load, not tested per layer per step: how the new
K/V reach the cache (a native call, or the cache's own write, which quantises for an int8 cache), how a
group of decode rows attends (`NativeDecode` / `NativeInt8Decode` read the blocks in place;
`GatheredDecode` gathers them and runs bf16 matrix products or SDPA), and how a prefill segment attends
(`NativePrefill` / `NativeInt8Prefill` over the cache; `GatheredPrefill` over its gathered blocks or its
own keys). `LayerAttention.__call__` is what the HF attention function and the fused layers call for each
layer: write, then the step's pieces in packed order (decode groups, prefill segments, sliding-window and
top-k chunks), or the fixed-shape decode of a CUDA-graph step, or (`cuda_attention="triton"`) every row in one
Triton kernel (`attention.triton_varlen`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenflow.kv.kv_cache import KVCache
from tokenflow.runtime.attention.matmul import decode_attention, prefill_attention
from tokenflow.runtime.attention.model_window import window_decode, window_prefill
from tokenflow.runtime.attention.sliding import sliding_attention
from tokenflow.runtime.attention.snapkv import key_scores
from tokenflow.runtime.attention.static_decode import static_decode_attention
from tokenflow.runtime.attention.topk import topk_attention, update_key_bounds
from tokenflow.runtime.attention.triton_varlen import varlen_attention
from tokenflow.runtime.cpu.native_kernels import NativeKernels
from tokenflow.runtime.gpu.triton_pointwise import TritonPointwise

if TYPE_CHECKING:
    from tokenflow.runtime.attention.paged import DecodeGroup, PagedAttentionMetadata, PrefillSegment

__all__ = ("GatheredDecode", "GatheredPrefill", "LayerAttention", "NativeDecode", "NativeInt8Decode",
           "NativeInt8Prefill", "NativePrefill", "choose_attention", "masked_gqa_attention")

# (q [n, KVH, G, D], cache, layer, group, scale) -> [n, H, D]
DecodeAttention = Callable[[torch.Tensor, KVCache, int, "DecodeGroup", float], torch.Tensor]
# (q_rows [T, H, D], k_new, v_new [T, KVH, D], cache, layer, segment, scale) -> [t, H, D]
PrefillAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, KVCache, int, "PrefillSegment", float],
                            torch.Tensor]


# -- decode groups ----------------------------------------------------------------------------------
class NativeDecode:
    """The C kernel over the group's blocks in place, each row to its own length (no gather, no padding)."""

    def __init__(self, native: NativeKernels) -> None:
        self.native = native

    def __call__(self, q: torch.Tensor, cache: KVCache, layer: int, grp: DecodeGroup, scale: float) -> torch.Tensor:
        n = q.shape[0]
        assert grp.lengths is not None
        return self.native.decode(q, cache.k_slots[layer], cache.v_slots[layer], grp.block_ids.view(n, grp.max_blocks),
                                  grp.lengths, grp.kv_len, cache.block_size, scale).view(n, -1, q.shape[-1])


class NativeInt8Decode(NativeDecode):
    """The C kernel over an int8 cache, dequantising the keys and values as it reads them."""

    def __call__(self, q: torch.Tensor, cache: KVCache, layer: int, grp: DecodeGroup, scale: float) -> torch.Tensor:
        n = q.shape[0]
        assert grp.lengths is not None
        out = self.native.decode_int8(
            q, cache.k_slots[layer], cache.v_slots[layer], cache.k_scale_slots[layer], cache.v_scale_slots[layer],
            grp.block_ids.view(n, grp.max_blocks), grp.lengths, grp.kv_len, cache.block_size, scale)
        return out.view(n, -1, q.shape[-1])


class GatheredDecode:
    """The group's blocks gathered, padded to its longest context, then one bf16 matmul attention
    (`matmul`, bf16 on CPU) or one SDPA with the padding mask."""

    def __init__(self, matmul: bool) -> None:
        self.matmul = matmul

    def __call__(self, q: torch.Tensor, cache: KVCache, layer: int, grp: DecodeGroup, scale: float) -> torch.Tensor:
        n, num_kv_heads, _, head_dim = q.shape
        shape = (n, grp.max_blocks * cache.block_size, num_kv_heads, head_dim)
        k_blocks, v_blocks = cache.gather(layer, grp.block_ids)
        k = k_blocks.view(shape)[:, : grp.kv_len].transpose(1, 2)  # [n, KVH, kv_len, D] views of the gathered blocks
        v = v_blocks.view(shape)[:, : grp.kv_len].transpose(1, 2)
        if self.matmul:
            out = decode_attention(q, k, v, grp.mask, scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=grp.mask, scale=scale)  # [n, KVH, G, D]
        return out.reshape(n, -1, head_dim)  # a view unless the kernel's layout differs


# -- prefill segments -------------------------------------------------------------------------------
class NativePrefill:
    """One C kernel call per segment over the cache (the runner gives every segment its table): no gather,
    no mask."""

    def __init__(self, native: NativeKernels) -> None:
        self.native = native

    def __call__(self, q_rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: KVCache, layer: int,
                 seg: PrefillSegment, scale: float) -> torch.Tensor:
        assert seg.block_ids is not None
        return self.native.prefill(q_rows[seg.q_start : seg.q_end], cache.k_slots[layer], cache.v_slots[layer],
                                   seg.block_ids, cache.block_size, seg.start_pos, scale)


class NativeInt8Prefill(NativePrefill):
    """The C kernel over an int8 cache (its fp32 form, dequantising as it packs the keys)."""

    def __call__(self, q_rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: KVCache, layer: int,
                 seg: PrefillSegment, scale: float) -> torch.Tensor:
        assert seg.block_ids is not None
        return self.native.prefill_int8(
            q_rows[seg.q_start : seg.q_end], cache.k_slots[layer], cache.v_slots[layer], cache.k_scale_slots[layer],
            cache.v_scale_slots[layer], seg.block_ids, cache.block_size, seg.start_pos, scale)


class GatheredPrefill:
    """Against the chunk's own keys (a chunk that starts its sequence) or its gathered blocks: bf16 matmul
    attention (`matmul`; its softmax in one C pass, `softmax`, when the segment needs no mask), else SDPA,
    causal or with the segment's mask."""

    def __init__(self, matmul: bool, softmax: NativeKernels | None) -> None:
        self.matmul = matmul
        self.softmax = softmax

    def __call__(self, q_rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: KVCache, layer: int,
                 seg: PrefillSegment, scale: float) -> torch.Tensor:
        num_heads, head_dim = q_rows.shape[1], q_rows.shape[2]
        num_kv_heads = k_new.shape[1]
        if seg.block_ids is None:  # chunk starts the sequence: its own keys are the whole context
            k = k_new[seg.q_start : seg.q_end].transpose(0, 1).unsqueeze(0)  # [1, KVH, t, D]
            v = v_new[seg.q_start : seg.q_end].transpose(0, 1).unsqueeze(0)
        else:
            shape = (1, seg.block_ids.shape[0] * cache.block_size, num_kv_heads, head_dim)
            k_blocks, v_blocks = cache.gather(layer, seg.block_ids)
            k = k_blocks.view(shape)[:, : seg.kv_len].transpose(1, 2)  # [1, KVH, kv_len, D] views of the blocks
            v = v_blocks.view(shape)[:, : seg.kv_len].transpose(1, 2)
        if self.matmul:
            softmax = self.softmax if seg.mask is None else None  # its softmax masks by position
            return prefill_attention(q_rows[seg.q_start : seg.q_end], k[0], v[0], seg.mask, scale, softmax)
        q = q_rows[seg.q_start : seg.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, t, D]
        group = num_heads // num_kv_heads
        if seg.mask is not None and group > 1 and q.device.type == "cuda":  # no fused kernel takes both
            return masked_gqa_attention(q, k, v, seg.mask, scale)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scale, enable_gqa=group > 1,
        )  # [1, H, t, D]
        return out[0].transpose(0, 1)  # [t, H, D]


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


# -- the layer ---------------------------------------------------------------------------------------
class LayerAttention:
    def __init__(self, decode: DecodeAttention, prefill: PrefillAttention,
                 native_write: NativeKernels | TritonPointwise | None) -> None:
        self.decode = decode
        self.prefill = prefill
        self.native_write = native_write  # K/V written by one native call (a float cache), else the cache's own

    def __call__(
        self,
        layer: int,
        q_rows: torch.Tensor,  # [T, H, D], RoPE applied
        k_new: torch.Tensor,  # [T, KVH, D]
        v_new: torch.Tensor,  # [T, KVH, D]
        meta: PagedAttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Write this layer's new K/V into the cache, attend; returns `[T, H, D]` in packed order. With the
        model's own `window` or logit `softcap` (its transformers modules pass them), torch ops
        (`model_window.py`)."""
        if meta.calls is not None:
            meta.calls.append(layer)
        cache = meta.kv_cache
        self._write(cache, layer, meta.slot_mapping, k_new, v_new)
        if window is not None or softcap is not None:
            return self._windowed(layer, q_rows, k_new, v_new, meta, scale, window, softcap)
        if meta.static_decode is not None:
            return static_decode_attention(q_rows, cache, layer, meta.static_decode, scale)
        if meta.varlen is not None and meta.key_scores is None:
            return varlen_attention(q_rows, cache.k[layer], cache.v[layer], meta.varlen, scale)
        num_heads, head_dim = q_rows.shape[1], q_rows.shape[2]
        num_kv_heads = k_new.shape[1]
        pieces: list[torch.Tensor] = []  # each [rows, H, D], in packed order
        for grp in meta.decodes:  # one query per sequence: the G heads of a KV head become G query rows
            q = q_rows[grp.q_start : grp.q_end].reshape(-1, num_kv_heads, num_heads // num_kv_heads, head_dim)
            pieces.append(self.decode(q, cache, layer, grp, scale))
        if meta.key_scores is not None:
            meta.key_scores.append(_prompt_key_scores(q_rows, cache, layer, meta.prefills[0], scale))
        pieces += [self.prefill(q_rows, k_new, v_new, cache, layer, seg, scale) for seg in meta.prefills]
        pieces += [sliding_attention(q_rows[sl.q_start : sl.q_end], cache, layer, sl, scale, meta.rope_inv_freq)
                   for sl in meta.sliding]
        pieces += [topk_attention(q_rows[sparse.row], cache, layer, sparse, scale).unsqueeze(0)
                   for sparse in meta.topk]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)

    @staticmethod
    def _windowed(layer: int, q_rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                  meta: PagedAttentionMetadata, scale: float, window: int | None, softcap: float | None
                  ) -> torch.Tensor:
        if meta.static_decode is not None or meta.sliding or meta.topk or meta.key_scores is not None:
            from tokenflow.runtime.attention.paged import UnsupportedAttentionFeature  # paged imports this module

            raise UnsupportedAttentionFeature(
                "a model's own sliding window or logit soft-capping runs without CUDA graphs, attention='sliding' "
                "or 'topk' and kv_compression")
        cache = meta.kv_cache
        num_heads, head_dim = q_rows.shape[1], q_rows.shape[2]
        num_kv_heads = k_new.shape[1]
        pieces = [window_decode(q_rows[grp.q_start : grp.q_end].reshape(-1, num_kv_heads, num_heads // num_kv_heads,
                                                                           head_dim),
                                cache, layer, grp, scale, window, softcap) for grp in meta.decodes]
        pieces += [window_prefill(q_rows, k_new, v_new, cache, layer, seg, scale, window, softcap)
                   for seg in meta.prefills]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)

    def _write(self, cache: KVCache, layer: int, slots: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        native = self.native_write
        if native is None or not native.write_kv(cache.k_slots[layer], cache.v_slots[layer], slots, k_new, v_new):
            cache.write(layer, slots, k_new, v_new)
        if cache.track_key_bounds:
            update_key_bounds(cache, layer, slots, k_new)


def _prompt_key_scores(q_rows: torch.Tensor, cache: KVCache, layer: int, seg: PrefillSegment,
                       scale: float) -> torch.Tensor:
    """kv_compression's scoring step: the attention its single segment's queries give every key."""
    assert seg.block_ids is not None  # a scoring step is a chunk after the prompt's start
    num_kv_heads, head_dim = cache.num_kv_heads, cache.head_dim
    k_blocks, _ = cache.gather(layer, seg.block_ids)
    keys = k_blocks.reshape(-1, num_kv_heads, head_dim)[: seg.kv_len]  # [kv_len, KVH, D]
    return key_scores(q_rows[seg.q_start : seg.q_end], keys, scale, seg.start_pos)


def choose_attention(cache: KVCache, native: NativeKernels | None, *, matmul: bool,
                     native_prefill: bool, write: TritonPointwise | None = None) -> LayerAttention:
    """The variants for this cache, machine and dtype (the runner decides `matmul` and `native_prefill`;
    `write`: the GPU's K/V write kernel, where there is no native one)."""
    decode: DecodeAttention
    prefill: PrefillAttention
    if native is not None:
        decode = NativeInt8Decode(native) if cache.quantized else NativeDecode(native)
    else:
        decode = GatheredDecode(matmul)
    if native_prefill and native is not None:
        prefill = NativeInt8Prefill(native) if cache.quantized else NativePrefill(native)
    else:
        prefill = GatheredPrefill(matmul, native if matmul else None)
    return LayerAttention(decode, prefill, None if cache.quantized else (native or write))
