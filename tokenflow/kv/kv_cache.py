"""The paged KV memory: per layer, one K and one V tensor cut into blocks.

Layout, per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`, chosen for the CPU:
- writes: the model hands the new keys as `[1, kv_heads, T, head_dim]` whose memory is already
  `[T, kv_heads, head_dim]`, so a step's writes are one `index_copy_` of contiguous rows into the
  flat slot view `[num_blocks * block_size, kv_heads, head_dim]`;
- reads: `index_select` of whole blocks gives `[n, block_size, kv_heads, head_dim]`, which views as
  `[ctx, kv_heads, head_dim]` with no copy, and `transpose` makes the `[kv_heads, ctx, head_dim]`
  SDPA operand (inner dim contiguous, no further copy). Gathering whole blocks is far faster than
  gathering single slots.

The memory starts zeroed and only ever holds real K/V values: padded or stale slots that a
masked attention reads must be finite, or `0 * NaN` would poison the output.

`int8=True` (`kv_cache_dtype="int8"`): K and V are stored as int8, symmetric per token and KV head,
with the fp32 scales in `k_scale` / `v_scale` (`[num_blocks, block_size, kv_heads]` per layer):
68 bytes per token and head at head_dim 64 instead of bf16's 128. `write` quantises, `gather`
dequantises to the model's dtype (`dtype` stays the compute dtype); tiers move a block as int8 rows
of `head_dim` values followed by their scale's 4 bytes (`block_dtype`, `block_shape`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ("KVCache", "dequantize_int8", "quantize_int8")


class KVCache:
    """Per layer K and V tensors `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        track_key_bounds: bool = False,
        int8: bool = False,
    ) -> None:
        for name, v in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
        ):
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype  # what attention computes in (the model's dtype)
        self.quantized = int8
        self.storage_dtype = torch.int8 if int8 else dtype
        self.device = torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        dev = self.device
        store = self.storage_dtype
        # per layer: [num_blocks, block_size, kv_heads, head_dim]
        self.k: list[torch.Tensor] = [torch.zeros(shape, dtype=store, device=dev) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [torch.zeros(shape, dtype=store, device=dev) for _ in range(num_layers)]
        flat = (num_blocks * block_size, num_kv_heads, head_dim)
        # Views sharing the memory above, indexed by slot = block_id * block_size + offset.
        self.k_slots: list[torch.Tensor] = [t.view(flat) for t in self.k]  # [num_slots, kv_heads, head_dim]
        self.v_slots: list[torch.Tensor] = [t.view(flat) for t in self.v]  # [num_slots, kv_heads, head_dim]
        # int8: per layer [num_blocks, block_size, kv_heads] fp32 scales, and their slot views
        scales = (num_blocks, block_size, num_kv_heads)
        self.k_scale = [torch.zeros(scales, device=dev) for _ in range(num_layers)] if int8 else []
        self.v_scale = [torch.zeros(scales, device=dev) for _ in range(num_layers)] if int8 else []
        self.k_scale_slots = [t.view(flat[:2]) for t in self.k_scale]
        self.v_scale_slots = [t.view(flat[:2]) for t in self.v_scale]
        # Reused destinations of the per-layer block gathers: a fresh multi-MB tensor per gather
        # costs more in page faults than the copy itself on CPU.
        self._gather_k = torch.empty(0, dtype=dtype, device=dev)
        self._gather_v = torch.empty(0, dtype=dtype, device=dev)
        self.version = 0  # bumped when the tensors above are replaced (`truncate`)
        # attention="topk": per layer, block and KV head, the elementwise min / max of the block's keys.
        self.track_key_bounds = track_key_bounds
        bounds = (num_blocks, num_kv_heads, head_dim)
        self.k_min: list[torch.Tensor] = (
            [torch.full(bounds, float("inf"), dtype=dtype, device=dev) for _ in range(num_layers)]
            if track_key_bounds else [])
        self.k_max: list[torch.Tensor] = (
            [torch.full(bounds, float("-inf"), dtype=dtype, device=dev) for _ in range(num_layers)]
            if track_key_bounds else [])

    def truncate(self, num_blocks: int) -> None:
        """Keep blocks `[0, num_blocks)` and free the memory of the rest (the device ran out of memory
        repeatedly). One tensor at a time; on CUDA the kept part goes through host memory and the old
        tensor's memory goes back to the device before the new one is allocated, so the two never need
        device memory at once (the device is out of it by then) and the freed part is not left as
        fragments too small for a step's activations. Tensors and views change (`version` counts it):
        whatever captured them (CUDA graphs) must be dropped first."""
        if not 0 < num_blocks <= self.num_blocks:
            raise ValueError(f"cannot truncate a cache of {self.num_blocks} blocks to {num_blocks}")
        self._gather_k = torch.empty(0, dtype=self.dtype, device=self.device)
        self._gather_v = torch.empty(0, dtype=self.dtype, device=self.device)
        slots = num_blocks * self.block_size
        for tensors, views in ((self.k, self.k_slots), (self.v, self.v_slots), (self.k_scale, self.k_scale_slots),
                               (self.v_scale, self.v_scale_slots), (self.k_min, None), (self.k_max, None)):
            for layer in range(len(tensors)):
                kept = tensors[layer][:num_blocks]
                if self.device.type == "cuda":
                    kept = kept.cpu()
                    tensors[layer] = torch.empty(0, dtype=kept.dtype, device=self.device)  # the last references
                    if views is not None:
                        views[layer] = tensors[layer]
                    torch.cuda.empty_cache()  # the old tensor's segment, whole, back to the device
                tensors[layer] = kept.to(self.device) if self.device.type == "cuda" else kept.clone()
                if views is not None:
                    views[layer] = tensors[layer].view(slots, *tensors[layer].shape[2:])
        self.num_blocks = num_blocks
        self.version += 1

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `block_ids` in `layer`, each `[len(block_ids), block_size, kv_heads, head_dim]`.

        The results live in scratch buffers that the next `gather` overwrites: use them before.
        """
        shape = (block_ids.shape[0], self.block_size, self.num_kv_heads, self.head_dim)
        if self.quantized:  # fresh tensors: dequantising allocates anyway
            k, v = (dequantize_int8(codes.index_select(0, block_ids), scales.index_select(0, block_ids), self.dtype)
                    for codes, scales in self._stores(layer))
            return k, v
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        if self._gather_k.numel() < numel:
            self._gather_k = torch.empty(numel, dtype=self.dtype, device=self.device)
            self._gather_v = torch.empty(numel, dtype=self.dtype, device=self.device)
        k = self._gather_k[:numel].view(shape)
        v = self._gather_v[:numel].view(shape)
        torch.index_select(self.k[layer], 0, block_ids, out=k)
        torch.index_select(self.v[layer], 0, block_ids, out=v)
        return k, v

    def write(self, layer: int, slot_mapping: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store a step's new keys and values `[T, kv_heads, head_dim]` at `slot_mapping` (quantised when int8)."""
        if not self.quantized:
            self.k_slots[layer].index_copy_(0, slot_mapping, k_new)
            self.v_slots[layer].index_copy_(0, slot_mapping, v_new)
            return
        for new, codes, scales in ((k_new, self.k_slots[layer], self.k_scale_slots[layer]),
                                   (v_new, self.v_slots[layer], self.v_scale_slots[layer])):
            q, scale = quantize_int8(new)
            codes.index_copy_(0, slot_mapping, q)
            scales.index_copy_(0, slot_mapping, scale)

    def copy_positions(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy each KV head's own slots `src [kv_heads, n]` to the slots `dst [n]` (kv_compression's
        compaction; `dst` must not overlap any of `src`)."""
        heads = torch.arange(self.num_kv_heads, device=self.device)[:, None]
        stores = [(self.k_slots[layer], self.v_slots[layer])]
        if self.quantized:
            stores.append((self.k_scale_slots[layer], self.v_scale_slots[layer]))
        for pair in stores:
            for slots in pair:
                slots[dst] = slots[src, heads].transpose(0, 1)  # [n, KVH, ...]

    @staticmethod
    def geometry(model_config: Any) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of a transformers config (text part of multimodal ones)."""
        cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        num_layers = int(cfg.num_hidden_layers)
        num_heads = int(cfg.num_attention_heads)
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        return num_layers, int(num_kv_heads), int(head_dim)

    @classmethod
    def bytes_per_block(cls, model_config: Any, block_size: int, dtype: torch.dtype, int8: bool = False) -> int:
        """Bytes one block costs over all layers, K and V: lets the engine size the pool from a budget."""
        num_layers, num_kv_heads, head_dim = cls.geometry(model_config)
        per_row = head_dim + 4 if int8 else head_dim * torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * per_row

    @classmethod
    def for_model(
        cls,
        model_config: Any,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """A cache shaped for `model_config`."""
        num_layers, num_kv_heads, head_dim = cls.geometry(model_config)
        return cls(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=dtype,
            device=device,
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *self.k_scale, *self.v_scale))

    @property
    def block_dtype(self) -> torch.dtype:
        """The dtype of `read_block`'s tensor (what tiers store)."""
        return self.storage_dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The shape of `read_block`'s tensor: int8 rows carry their fp32 scale in 4 more bytes."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim + (4 if self.quantized else 0))

    def block_is_finite(self, data: torch.Tensor) -> bool:
        """Whether a block's values (int8: its scales) are all finite: tiers drop one that is not."""
        if not self.quantized:
            return bool(torch.isfinite(data).all())
        return bool(torch.isfinite(data[..., self.head_dim:].contiguous().view(torch.float32)).all())

    def read_block(self, block_id: int) -> torch.Tensor:
        """A copy of one block over all layers, for tiers that move blocks out of the pool.

        Returns `block_shape` (`[num_layers, 2, block_size, kv_heads, head_dim (+4)]`, index 0 = K,
        1 = V). Tiers call it on the event loop: one small copy per layer and K/V stays under torch's
        parallel-op threshold, so this thread never starts an OpenMP team of its own (see
        `model_thread.py`).
        """
        out = torch.empty(self.block_shape, dtype=self.block_dtype, device=self.device)
        d = self.head_dim
        for layer in range(self.num_layers):
            for i, (codes, scales) in enumerate(self._stores(layer)):
                out[layer, i, ..., :d].copy_(codes[block_id])
                if scales is not None:
                    out[layer, i, ..., d:].copy_(scales[block_id].unsqueeze(-1).view(torch.int8))
        return out

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        """Inverse of `read_block`: `data` has `block_shape` and `block_dtype`."""
        if tuple(data.shape) != self.block_shape or data.dtype != self.block_dtype:
            raise ValueError(f"block data is {data.dtype}{tuple(data.shape)}, expected {self.block_dtype}"
                             f"{self.block_shape}")
        d = self.head_dim
        for layer in range(self.num_layers):
            for i, (codes, scales) in enumerate(self._stores(layer)):
                codes[block_id].copy_(data[layer, i, ..., :d])
                if scales is not None:
                    scales[block_id].copy_(data[layer, i, ..., d:].contiguous().view(torch.float32).squeeze(-1))
            if self.track_key_bounds:
                self._set_key_bounds(layer, block_id, self.block_size)

    def copy_rows(self, src_block: int, dst_block: int, num_rows: int) -> None:
        """Copy the first `num_rows` slots of `src_block` into `dst_block`, every layer, K and V (int8:
        with their scales; topk: the copied keys' bounds). A request that shares only the start of a
        cached block (partial prefix reuse) takes those rows instead of computing them. Called on the
        event loop between steps, like `write_block`: small copies, under torch's parallel threshold."""
        if not 0 < num_rows <= self.block_size:
            raise ValueError(f"cannot copy {num_rows} rows of a {self.block_size}-slot block")
        for layer in range(self.num_layers):
            for codes, scales in self._stores(layer):
                codes[dst_block, :num_rows].copy_(codes[src_block, :num_rows])
                if scales is not None:
                    scales[dst_block, :num_rows].copy_(scales[src_block, :num_rows])
            if self.track_key_bounds:
                self._set_key_bounds(layer, dst_block, num_rows)

    def _set_key_bounds(self, layer: int, block_id: int, num_rows: int) -> None:
        """The topk bounds of a block whose first `num_rows` keys were just written whole."""
        keys = self.gather(layer, torch.tensor([block_id], device=self.device))[0][0, :num_rows]
        self.k_min[layer][block_id] = keys.amin(0)
        self.k_max[layer][block_id] = keys.amax(0)

    def _stores(self, layer: int) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """(values, scales or None) of K then V in `layer`."""
        if self.quantized:
            return (self.k[layer], self.k_scale[layer]), (self.v[layer], self.v_scale[layer])
        return (self.k[layer], None), (self.v[layer], None)

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"blocks={self.num_blocks}x{self.block_size}, dtype={self.dtype}, device={self.device}, "
            f"{self.nbytes / 2**20:.1f} MiB)"
        )


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes `[..., head_dim]` and fp32 scales `[...]` of `x`, symmetric per row."""
    scale = x.float().abs().amax(-1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x.float() / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)
