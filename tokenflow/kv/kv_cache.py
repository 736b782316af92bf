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
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ("KVCache",)


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
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        dev = self.device
        # per layer: [num_blocks, block_size, kv_heads, head_dim]
        self.k: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(num_layers)]
        flat = (num_blocks * block_size, num_kv_heads, head_dim)
        # Views sharing the memory above, indexed by slot = block_id * block_size + offset.
        self.k_slots: list[torch.Tensor] = [t.view(flat) for t in self.k]  # [num_slots, kv_heads, head_dim]
        self.v_slots: list[torch.Tensor] = [t.view(flat) for t in self.v]  # [num_slots, kv_heads, head_dim]
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
        flat = (num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        for tensors, views in ((self.k, self.k_slots), (self.v, self.v_slots), (self.k_min, None), (self.k_max, None)):
            for layer in range(len(tensors)):
                kept = tensors[layer][:num_blocks]
                if self.device.type == "cuda":
                    kept = kept.cpu()
                    tensors[layer] = torch.empty(0, dtype=self.dtype, device=self.device)  # the last references
                    if views is not None:
                        views[layer] = tensors[layer]
                    torch.cuda.empty_cache()  # the old tensor's segment, whole, back to the device
                tensors[layer] = kept.to(self.device) if self.device.type == "cuda" else kept.clone()
                if views is not None:
                    views[layer] = tensors[layer].view(flat)
        self.num_blocks = num_blocks
        self.version += 1

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `block_ids` in `layer`, each `[len(block_ids), block_size, kv_heads, head_dim]`.

        The results live in scratch buffers that the next `gather` overwrites: use them before.
        """
        shape = (block_ids.shape[0], self.block_size, self.num_kv_heads, self.head_dim)
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        if self._gather_k.numel() < numel:
            self._gather_k = torch.empty(numel, dtype=self.dtype, device=self.device)
            self._gather_v = torch.empty(numel, dtype=self.dtype, device=self.device)
        k = self._gather_k[:numel].view(shape)
        v = self._gather_v[:numel].view(shape)
        torch.index_select(self.k[layer], 0, block_ids, out=k)
        torch.index_select(self.v[layer], 0, block_ids, out=v)
        return k, v

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
    def bytes_per_block(cls, model_config: Any, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block costs over all layers, K and V: lets the engine size the pool from a budget."""
        num_layers, num_kv_heads, head_dim = cls.geometry(model_config)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

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
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def read_block(self, block_id: int) -> torch.Tensor:
        """A copy of one block over all layers, for tiers that move blocks out of the pool.

        Returns `[num_layers, 2, block_size, kv_heads, head_dim]` (index 0 = K, 1 = V). Tiers call
        it on the event loop: one small copy per layer and K/V stays under torch's parallel-op
        threshold, so this thread never starts an OpenMP team of its own (see `model_thread.py`).
        """
        out = torch.empty(
            (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim), dtype=self.dtype,
            device=self.device,
        )
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            out[layer, 0].copy_(k[block_id])
            out[layer, 1].copy_(v[block_id])
        return out

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        """Inverse of `read_block`: `data` is `[num_layers, 2, block_size, kv_heads, head_dim]`."""
        expected = (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(data.shape) != expected:
            raise ValueError(f"block data has shape {tuple(data.shape)}, expected {expected}")
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k[block_id].copy_(data[layer, 0])
            v[block_id].copy_(data[layer, 1])
            if self.track_key_bounds:
                self.k_min[layer][block_id] = k[block_id].amin(0)
                self.k_max[layer][block_id] = k[block_id].amax(0)

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"blocks={self.num_blocks}x{self.block_size}, dtype={self.dtype}, device={self.device}, "
            f"{self.nbytes / 2**20:.1f} MiB)"
        )
