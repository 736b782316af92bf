"""Content keys of full KV blocks, for prefix caching.

A block's key is a chained hash: `blake2b(parent key || token ids)`, where
the first block's parent is a root derived from everything else that shapes
the K/V values (model fingerprint, dtype, block size) and from the request's
`cache_salt`. So equal keys mean equal prefixes of equal models for the same
tenant, and a key says nothing about a block without its whole prefix.

A 128-bit hash makes a collision absurdly unlikely, but the pool and the disk
tier still compare the token ids and the parent key on every hit: a collision
costs a recompute, never wrong output.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ("BlockKey", "block_keys", "model_key", "prefix_root")

_DIGEST = 16


@dataclass(frozen=True, slots=True)
class BlockKey:
    """The identity of one full block: its hash, its parent's hash and its tokens."""

    hash: bytes
    parent: bytes
    tokens: tuple[int, ...]

    @property
    def hex(self) -> str:
        return self.hash.hex()


def model_key(model: Any, block_size: int, attention: str = "dense") -> bytes:
    """A fingerprint of everything that shapes a block's K/V: the model's config, dtype, block size,
    the attention policy (a window changes every later layer's K/V), and every byte of every weight
    (a CRC-32 per tensor, one fast pass over the weights: two checkpoints that differ in one value never
    share keys). Stable across processes, so a disk tier written by one engine serves the next."""
    import torch

    h = hashlib.blake2b(digest_size=_DIGEST, person=b"tokenflow-model")
    # The config without its folder: the same weights loaded from two places share their blocks.
    config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(f"block_size={block_size};attention={attention}".encode())
    with torch.no_grad():
        # GGUF modules' weights are placeholders of their shape: their blocks are hashed below
        placeholders = {id(m.weight) for m in model.modules() if getattr(m, "quantized", None) is not None}
        for name, param in model.named_parameters():
            if id(param) in placeholders:
                continue
            data = param.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            crc = zlib.crc32(data.numpy())
            h.update(f"{name};{param.dtype};{tuple(param.shape)};{data.numel()};{crc:08x}\n".encode())
        for name, module in model.named_modules():
            blocks = getattr(module, "quantized", None)  # GGUF's ggml blocks (runtime/cpu/gguf_linear.py)
            if blocks is not None:
                crc = zlib.crc32(blocks.data.contiguous().numpy())
                h.update(f"{name};ggml{blocks.format};{blocks.n}x{blocks.k};{crc:08x}\n".encode())
    return h.digest()


def prefix_root(model_key: bytes, cache_salt: str | None, adapter_key: bytes | None = None) -> bytes:
    """The parent key of a sequence's first block: model identity plus tenant salt and LoRA adapter."""
    h = hashlib.blake2b(model_key, digest_size=_DIGEST, person=b"tokenflow-root")
    if cache_salt is not None:
        h.update(b"\x00salt\x00" + cache_salt.encode("utf-8", "surrogatepass"))
    if adapter_key is not None:
        h.update(b"\x00lora\x00" + adapter_key)
    return h.digest()


def block_keys(
    token_ids: Sequence[int], block_size: int, root: bytes, known: list[BlockKey] | None = None
) -> list[BlockKey]:
    """Keys of every full block of `token_ids`, extending `known` (the keys of an earlier call on a
    prefix of the same tokens) so a growing sequence hashes each block once. Returns `known`, extended."""
    keys = known if known is not None else []
    parent = keys[-1].hash if keys else root
    for start in range(len(keys) * block_size, len(token_ids) - block_size + 1, block_size):
        tokens = tuple(token_ids[start:start + block_size])
        h = hashlib.blake2b(parent, digest_size=_DIGEST)
        h.update(array("q", tokens).tobytes())
        digest = h.digest()
        keys.append(BlockKey(digest, parent, tokens))
        parent = digest
    return keys
