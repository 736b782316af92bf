"""Every decoder layer of a decode step in one native call (`decode_layers` in cpu_kernels.c).

Why: a decode step of a small model is short, and driving its ten kernels per layer from Python (their
arguments, checks and output tensors) cost ~4 ms of a ~24 ms 16-sequence bf16 step of SmolLM2-135M while
the second OpenMP thread waited. The C loop makes the same calls in the same order as the fused Python
loop (`tokenflow.runtime.fused_layers`), so its output is the same bit for bit; it runs only for the
steps that loop would run entirely through those kernels: decode rows only, the few-rows kernel for every
linear, native attention over a plain (not quantised) cache.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenflow.kv.kv_cache import KVCache
from tokenflow.runtime.attention.paged import PagedAttentionMetadata
from tokenflow.runtime.cpu.few_rows_linear import FEW_ROWS, FewRowsLinear, FewRowsWeight
from tokenflow.runtime.cpu.native_kernels import NativeKernels

__all__ = ("DecodeLayerWeights", "NativeDecodeLayers")


class _PackedWeight(ctypes.Structure):
    _fields_ = (("weight", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("n_pad", ctypes.c_int64))


class _DecodeLayer(ctypes.Structure):
    _fields_ = (("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", _PackedWeight),
                ("o", _PackedWeight), ("gate_up", _PackedWeight), ("down", _PackedWeight),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("scale", ctypes.c_float))


@dataclass(frozen=True, slots=True)
class DecodeLayerWeights:
    """One layer's weights as the C loop reads them: its norms' weights and its four few-rows linears."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: FewRowsLinear
    o: FewRowsLinear
    gate_up: FewRowsLinear
    down: FewRowsLinear
    scale: float
    q_norm: torch.Tensor | None = None  # [head_dim] per-head norms' weights (Qwen3), both or neither
    k_norm: torch.Tensor | None = None


def _packed(weight: FewRowsWeight) -> _PackedWeight:
    bias = weight.bias.data_ptr() if weight.bias is not None else None
    return _PackedWeight(weight.packed.data_ptr(), bias, weight.n, weight.n_pad)


def _address(tensor: torch.Tensor | None) -> int | None:
    return tensor.data_ptr() if tensor is not None else None


class NativeDecodeLayers:
    """The C loop over a fused decoder's layers, for the decode steps it takes (`run`)."""

    def __init__(self, native: NativeKernels, layers: Sequence[DecodeLayerWeights], eps: float, hidden: int,
                 inter: int, dtype: torch.dtype) -> None:
        self.native = native
        self.layers = list(layers)
        self.eps, self.hidden, self.inter, self.dtype = eps, hidden, inter, dtype
        self.qkv_width = self.layers[0].qkv.weight.n
        self._structs: ctypes.Array[_DecodeLayer] | None = None
        self._cache_key: tuple[int, int] = (0, -1)
        # decode steps only: the few-rows kernel on AMX tiles past a few bf16 rows, as the Python loop's decode steps
        self._linear_address = ctypes.cast(self.layers[0].qkv.kernels.tiles_function, ctypes.c_void_p).value

    def _layer_structs(self, cache: KVCache) -> ctypes.Array[_DecodeLayer]:
        """The layer table, rebuilt when the cache's tensors are not the ones it points at."""
        key = (id(cache), cache.version)
        if self._structs is None or key != self._cache_key:
            structs = (_DecodeLayer * len(self.layers))()
            for i, layer in enumerate(self.layers):
                structs[i] = _DecodeLayer(
                    layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), _address(layer.q_norm),
                    _address(layer.k_norm), _packed(layer.qkv.weight),
                    _packed(layer.o.weight), _packed(layer.gate_up.weight), _packed(layer.down.weight),
                    cache.k_slots[i].data_ptr(), cache.v_slots[i].data_ptr(), layer.scale)
            self._structs, self._cache_key = structs, key
        return self._structs

    def takes(self, h: torch.Tensor, meta: PagedAttentionMetadata) -> bool:
        """Whether the step is one the C loop runs exactly as the Python loop would: decode rows only, in one
        group read by the native kernel, over a plain cache, with the few-rows kernel enabled."""
        t = h.shape[0]
        cache = meta.kv_cache
        if not (t <= FEW_ROWS and h.dtype == self.dtype and meta.native is self.native and len(meta.decodes) == 1
                and not (meta.prefills or meta.sliding or meta.topk) and meta.static_decode is None
                and meta.key_scores is None and meta.calls is None and not cache.quantized
                and not cache.track_key_bounds and cache.k_slots[0].dtype == h.dtype):
            return False
        group = meta.decodes[0]
        return (group.lengths is not None and group.q_start == 0 and group.q_end == t
                and self.layers[0].qkv.enabled)

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: PagedAttentionMetadata) -> None:
        """Every layer on the step's hidden rows `h [t, hidden]` (contiguous), in place; `cos`, `sin` `[t, D]`
        contiguous. The caller checked `takes`."""
        t = h.shape[0]
        cache = meta.kv_cache
        group = meta.decodes[0]
        heads = cache.num_kv_heads * self.native.group
        size = h.element_size()
        widths = 2 * self.hidden + self.qkv_width + heads * self.native.head_dim + 3 * self.inter
        work = torch.empty(t * widths * size, dtype=torch.uint8)
        scratch = torch.empty(t * heads * (2 * self.native.head_dim + 2 * group.kv_len + 2), dtype=torch.float32)
        status = self.native.decode_layers(
            self._layer_structs(cache), len(self.layers), self._linear_address, h.dtype == torch.bfloat16,
            h.data_ptr(), t, self.hidden, self.inter, cache.num_kv_heads, self.eps, cos.data_ptr(), sin.data_ptr(),
            meta.slot_mapping.data_ptr(), group.block_ids.data_ptr(), group.max_blocks, group.lengths.data_ptr(),
            group.kv_len, cache.block_size, work.data_ptr(), scratch.data_ptr(),
        )
        if status != 0:  # the shapes were checked when the loop was built: a kernel refusing them is a bug
            raise RuntimeError(f"decode_layers failed (status {status})")
