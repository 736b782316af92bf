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

Which variant of each step runs is chosen once, when the runner loads (`attention/layer.py`):
bf16 on CPU runs steps 2 and 3 as bf16 matrix products instead of SDPA
(`tokenflow.runtime.attention.matmul`: faster there); where its C kernels build
(`tokenflow.runtime.cpu.native_kernels`), step 2 reads the blocks in place, without the gather, and
step 3 does its softmax in one pass. Where the prefill kernel builds for the cache's dtype (fp32; bf16
with AVX512-BF16), step 3 is one kernel call per segment over the cache instead: no gather, no mask.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tokenflow.kv.kv_cache import KVCache
from tokenflow.runtime.attention.layer import masked_gqa_attention
from tokenflow.runtime.attention.sliding import SlidingSegment
from tokenflow.runtime.attention.static_decode import StaticDecode
from tokenflow.runtime.attention.topk import TopkDecode
from tokenflow.runtime.attention.triton_varlen import VarlenStep
from tokenflow.runtime.cpu.native_kernels import NativeKernels

if TYPE_CHECKING:
    from tokenflow.runtime.attention.layer import LayerAttention

__all__ = (
    "ATTENTION_NAME",
    "META_KWARG",
    "DecodeGroup",
    "PagedAttentionMetadata",
    "PrefillSegment",
    "UnsupportedAttentionFeature",
    "masked_gqa_attention",
    "paged_attention_forward",
    "register",
    "sdpa_backends",
)

ATTENTION_NAME = "tokenflow_paged"
META_KWARG = "tokenflow_meta"

# Keywords models pass down that carry nothing the attention must honour.
# output_router_logits: MoE decoders pass their layer's kwargs on to attention; the router's logits are
# recorded from the MoE blocks, never from attention
_HARMLESS_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions",
                              "output_router_logits"})


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
    attention: LayerAttention | None = None  # the variants the runner chose at load (`attention/layer.py`)
    native: NativeKernels | None = None  # C kernels: decode groups with `lengths` (bf16, fp32), the C decode loop
    calls: list[int] | None = None  # when a list, each call appends module.layer_idx (self-check)
    static_decode: StaticDecode | None = None  # a decode-only step of fixed shapes (CUDA graphs): nothing else
    # kv_compression's scoring step: when a list, each layer appends the attention its (single) prefill segment's
    # queries give every key, `[kv_heads, kv_len]` (`runtime.attention.snapkv.key_scores`)
    key_scores: list[torch.Tensor] | None = None
    varlen: VarlenStep | None = None  # cuda_attention="triton": every row in one kernel per layer (not with the above)


def sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Where SDPA may run for a paged step. On CUDA: flash, memory-efficient or math, never cuDNN's,
    which builds an execution plan for every new shape: a paged step's key lengths change every step."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def register() -> None:
    """Make `ATTENTION_NAME` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def _check_kwargs(module: torch.nn.Module, meta: PagedAttentionMetadata,
                  kwargs: dict[str, Any]) -> tuple[int | None, float | None]:
    """The layer's own sliding window (None where it masks nothing in this step) and logit soft-cap; refuses
    any other argument it cannot honour."""
    window: int | None = None
    softcap: float | None = None
    for name, value in kwargs.items():
        if value is None or name in _HARMLESS_KWARGS:
            if name == "output_attentions" and value:
                raise UnsupportedAttentionFeature("paged attention cannot return attention weights")
            continue
        if name == "sliding_window":
            # a window at least as long as every context in the step masks nothing
            window = int(value) if value < meta.max_context else None
            continue
        if name == "softcap":
            softcap = float(value)
            continue
        if name == "is_causal" and value:
            continue
        raise UnsupportedAttentionFeature(
            f"{type(module).__name__} passed attention argument {name}={value!r}, "
            "which paged attention does not implement"
        )
    return window, softcap


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
    window, softcap = _check_kwargs(module, meta, kwargs) if kwargs else (None, None)
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
    assert meta.attention is not None
    out = meta.attention(module.layer_idx, q_rows, k_new, v_new, meta, scale, window, softcap)
    return out.unsqueeze(0), None  # [1, T, H, D]
