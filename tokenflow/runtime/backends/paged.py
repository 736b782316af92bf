"""The `paged` backend (default): one packed forward per step over a paged KV cache.

The batcher decides the step's chunks and reserves their blocks; this
backend turns them into the runner's `SeqChunk`s and returns the logits of
the chunks that sample. The KV memory is sized here, at load; its bookkeeping
is the `memory` stage named by `kv_pool` (`token_pool`: prefix caching), which
the scheduler and the tiers find as `EngineContext.pool`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from tokenflow import registry
from tokenflow.config import EngineConfig
from tokenflow.errors import ModelLoadError
from tokenflow.kv.kv_cache import KVCache
from tokenflow.protocols import EngineContext, StepPlan
from tokenflow.runtime.compiled import compile_mlps, decode_buckets, padded_size
from tokenflow.runtime.cpu.packed_linear import pack_linears
from tokenflow.runtime.cpu.rms_norm import fuse_rms_norms
from tokenflow.runtime.gated_mlp import inplace_gated_mlps
from tokenflow.runtime.paged_runner import PagedModelRunner, SeqChunk

__all__ = ("PagedBackend", "create", "kv_pool_blocks")

log = logging.getLogger("tokenflow")

# Share of free memory for the KV pool when no size is given: on a GPU the pool is the point of the
# device memory; on a CPU it shares RAM with the app embedding us (the pool is zero-filled, so resident).
_DEFAULT_FRACTION = {False: 0.05, True: 0.6}


def available_memory(device: torch.device) -> int:
    """Free bytes on the device: `mem_get_info` on CUDA, available RAM on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def kv_pool_blocks(config: EngineConfig, bytes_per_block: int, max_model_len: int, device: torch.device) -> int:
    """Pool size: `num_kv_blocks`, else `kv_cache_bytes`, else a fraction of free memory,
    never more than every sequence at full length needs."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    fraction = config.kv_cache_memory_fraction or _DEFAULT_FRACTION[device.type == "cuda"]
    budget = config.kv_cache_bytes or int(available_memory(device) * fraction)
    blocks_per_seq = -(-max_model_len // config.block_size)
    ceiling = blocks_per_seq * config.max_num_seqs
    return max(1, min(budget // bytes_per_block, ceiling))


class PagedBackend:
    static = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner: PagedModelRunner | None = None
        self.pool: Any = None
        self.kv_bytes = 0
        self.buckets: list[int] = []  # static decode batch sizes, with `compile`
        self.scratch_block = -1

    def load(self, ctx: EngineContext, model: Any) -> None:
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        attention = self.config.attention_policy
        per_block = KVCache.bytes_per_block(model.config, self.config.block_size, dtype)
        num_blocks = kv_pool_blocks(self.config, per_block, ctx.max_model_len, device)
        layers, kv_heads, head_dim = KVCache.geometry(model.config)
        # With `compile`, one extra block past the pool's ids takes the K/V of padding rows.
        extra = 1 if self.config.compile else 0
        try:
            kv_cache = KVCache(
                num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, num_blocks=num_blocks + extra,
                block_size=self.config.block_size, dtype=dtype, device=device,
                track_key_bounds=attention.topk_budget is not None,
            )
        except torch.OutOfMemoryError as exc:
            raise ModelLoadError(
                f"out of memory allocating the KV cache: {num_blocks + extra} blocks of {per_block} bytes "
                f"({per_block * (num_blocks + extra) / 2**30:.2f} GiB) on {device}; lower num_kv_blocks, "
                f"kv_cache_bytes or kv_cache_memory_fraction (or max_model_len x max_num_seqs, which cap it): {exc}"
            ) from exc
        self.kv_bytes = per_block * (num_blocks + extra)
        self.pool = registry.load_pool(
            self.config.kv_pool, self.config, num_blocks=num_blocks, block_size=self.config.block_size,
            model_key=ctx.model_key, kv=kv_cache,
        )
        self.runner = PagedModelRunner(
            model, kv_cache, max_model_len=ctx.max_model_len, self_check=self.config.self_check,
            window=attention.window, sinks=self.config.sink_tokens, topk_budget=attention.topk_budget,
            native_kernels=self.config.native_kernels,
            fused_layers=self.config.fused_layers and not self.config.compile,  # compile works on the HF modules
            pack_weights=self.config.pack_cpu_weights,
        )
        # Only once the runner has accepted the model, so that a refused one is left as it came.
        fuse_rms_norms(model, self.runner.native)
        inplace_gated_mlps(model)  # with `compile`, the eager path of shapes it does not compile
        if self.config.compile:
            self.buckets = decode_buckets(self.config.max_num_seqs)
            self.scratch_block = num_blocks
            compile_mlps(model, set(self.buckets))
        elif self.config.pack_cpu_weights and self.runner.fused is None:  # the fused layers pack their own
            pack_linears(model)
        ctx.pool = self.pool
        log.info("paged KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.config.block_size,
                 self.kv_bytes / 2**20)

    def shrink_kv(self, num_blocks: int) -> None:
        """Model thread: free the KV memory of blocks from `num_blocks` on (the pool gave those ids up);
        the scratch block of padding rows moves to the new end."""
        assert self.runner is not None
        kv = self.runner.kv_cache
        extra = 1 if self.scratch_block >= 0 else 0
        kv.truncate(num_blocks + extra)
        if self.scratch_block >= 0:
            self.scratch_block = num_blocks
        self.kv_bytes = kv.nbytes
        if kv.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back to the device, not just to torch's cache

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Blocking: one forward; logits in plan order, `num_logit_rows` rows per chunk (one per sampling
        chunk plus one per draft token, and every row of a chunk that scores prompt tokens)."""
        assert self.runner is not None
        chunks = []
        for c in plan.chunks:
            r = c.request
            start = r.num_computed_tokens
            known = c.num_tokens - len(c.draft)
            if known == 1 and start == r.num_tokens - 1 and r.output_token_ids:
                tokens = [r.output_token_ids[-1]]  # the common decode case, no list concat
            else:
                tokens = r.all_token_ids[start:start + known]
            if c.draft:  # verified in the same forward: the logits of every draft position are kept
                tokens = tokens + c.draft
            rows = c.num_logit_rows
            chunks.append(SeqChunk(tokens, start, r.block_table, rows > 0, max(rows, 1)))
        if self.buckets and plan.num_tokens == len(chunks):  # decode-only: pad to a static batch size
            pad = padded_size(len(chunks), self.buckets) - len(chunks)
            chunks.extend(SeqChunk([0], 0, [self.scratch_block], False) for _ in range(pad))
        return self.runner.execute(chunks)

    def warmup_batch_sizes(self) -> list[int]:
        """Decode batch sizes worth a warm-up: every bucket when compiled, else one and a full batch."""
        return list(self.buckets) if self.buckets else sorted({1, self.config.max_num_seqs})

    def stats(self) -> dict[str, Any]:
        if self.pool is None:
            return {}
        return {**self.pool.stats(), "kv_cache_bytes": self.kv_bytes}


def create(config: EngineConfig) -> PagedBackend:
    return PagedBackend(config)
