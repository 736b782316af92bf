"""The `paged` backend (default): one packed forward per step over a paged KV cache.

The batcher decides the step's chunks and reserves their blocks; this
backend turns them into the runner's `SeqChunk`s and returns the logits of
the chunks that sample. The KV memory is sized here, at load; its bookkeeping
is the `memory` stage named by `kv_pool` (`token_pool`: prefix caching), which
the scheduler and the tiers find as `EngineContext.pool`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenflow import registry
from tokenflow.config import DEFAULT_BATCH_TOKENS, EngineConfig
from tokenflow.errors import ModelLoadError
from tokenflow.hub.cache import tokenflow_home
from tokenflow.kv.kv_cache import KVCache
from tokenflow.protocols import DeviceTokens, EngineContext, PendingTokens, StepPlan
from tokenflow.runtime.compiled import compile_mlps, decode_buckets, padded_size
from tokenflow.runtime.cpu.packed_linear import pack_linears
from tokenflow.runtime.cpu.rms_norm import fuse_rms_norms
from tokenflow.runtime.decode_graphs import DecodeGraphs
from tokenflow.runtime.device_sampler import device_rows
from tokenflow.runtime.gated_mlp import inplace_gated_mlps
from tokenflow.runtime.gpu.triton_launch import triton_available
from tokenflow.runtime.lora import install_lora_layers
from tokenflow.runtime.paged_runner import (
    PagedModelRunner,
    SeqChunk,
    all_layers_windowed,
    check_model_supported,
    own_window,
)
from tokenflow.runtime.quantize import quantize_runner
from tokenflow.runtime.sampler import GreedyTokens, argmax_only
from tokenflow.runtime.step_graphs import StepGraphs

__all__ = ("PagedBackend", "create", "kv_pool_blocks", "profile_step_peak")

log = logging.getLogger("tokenflow")

# Share of the available memory for the KV pool when no size is given: on a GPU the pool is the point of the
# device memory; on a CPU it shares RAM with the app embedding us (the pool is zero-filled, so resident).
_DEFAULT_FRACTION = {False: 0.05, True: 0.6}


def available_memory(device: torch.device) -> int:
    """Bytes the KV pool may be sized from: free device memory on CUDA (`mem_get_info`); on the CPU the
    RAM the OS can give without swapping (`MemAvailable`: free pages plus the page cache it can drop),
    not the free pages alone, which a busy page cache shrinks towards zero on any long-running host."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def kv_pool_blocks(config: EngineConfig, bytes_per_block: int, max_model_len: int, device: torch.device,
                   reserved: int = 0) -> int:
    """Pool size: `num_kv_blocks`, else `kv_cache_bytes`, else `kv_cache_memory_fraction` (default 5% on
    the CPU, 60% on CUDA) of the available memory left after `reserved` bytes (a step's measured peak);
    never more than every sequence at full length needs (`max_num_seqs` x `max_model_len`). Logs the rule
    it applied and the figures."""
    blocks_per_seq = -(-max_model_len // config.block_size)
    ceiling = blocks_per_seq * config.max_num_seqs
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if config.kv_cache_bytes:
        budget, rule = config.kv_cache_bytes, f"kv_cache_bytes={config.kv_cache_bytes}"
    else:
        fraction = config.kv_cache_memory_fraction or _DEFAULT_FRACTION[device.type == "cuda"]
        available = available_memory(device)
        budget = int(max(available - reserved, 0) * fraction)
        rule = (f"kv_cache_memory_fraction={fraction:g} of {available / 2**30:.2f} GiB available "
                f"{'on the device' if device.type == 'cuda' else 'RAM (MemAvailable)'}")
        if reserved:
            rule += f" less {reserved / 2**30:.2f} GiB for a step's activations"
    blocks = max(1, min(budget // bytes_per_block, ceiling))
    capped = " (capped at max_num_seqs x max_model_len)" if blocks == ceiling else ""
    log.info("KV pool: %d blocks, %.1f MiB, from %s%s", blocks, blocks * bytes_per_block / 2**20, rule, capped)
    return blocks


def profile_step_peak(runner: PagedModelRunner, num_tokens: int, num_logits: int) -> int:
    """Device bytes a step of `num_tokens` prompt tokens (`num_logits` of them projected to logits)
    allocates beyond what is held before it: the activations' peak, measured on CUDA as vLLM does,
    so that the KV pool leaves room for the largest step the batcher plans."""
    device = runner.device
    blocks = -(-num_tokens // runner.block_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device)
    runner.execute([SeqChunk([0] * num_tokens, 0, list(range(blocks)), True, num_logits)])
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - held)


def _parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, each storage once (a tied head is its embedding), GGUF blocks included."""
    from tokenflow.runtime.gguf_model import quantized_bytes

    seen: dict[int, int] = {}
    for param in model.parameters():  # GGUF modules' placeholders hold one value: their blocks count instead
        seen[param.untyped_storage().data_ptr()] = param.untyped_storage().nbytes()
    return sum(seen.values()) + quantized_bytes(model)


def decode_graph_mode(config: EngineConfig, device: torch.device) -> str | None:
    """How decode-only steps run at fixed shapes (`DecodeGraphs`): "capture" (CUDA graphs) on CUDA with
    `cuda_graphs`, dense attention over a float cache and no `compile` (which pads its own); None: the
    dynamic path."""
    dense = config.attention_policy.kind == "dense" and config.kv_cache_dtype == "auto"
    if config.cuda_graphs and device.type == "cuda" and not config.compile and dense:
        return "capture"
    return None


class PagedBackend:
    static = False
    runs_ahead = True  # takes plans with `AheadInput` chunks (async scheduling)

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner: PagedModelRunner | None = None
        self.pool: Any = None
        self.kv_bytes = 0
        self.step_peak_bytes = 0  # CUDA: the profiled activations' peak the KV budget left free
        self.int8_bytes = 0  # quantization="int8": the int8 weights' bytes
        self.weight_bytes = 0  # what a forward reads: the model's parameters (int8 ones in their place)
        self.kv_bytes_per_token = 0
        self.graph_error: str | None = None  # why CUDA graphs are off although asked for
        self.buckets: list[int] = []  # static decode batch sizes, with `compile`
        self.scratch_block = -1

    def _kv_cache(self, model: Any, num_blocks: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        layers, kv_heads, head_dim = KVCache.geometry(model.config)
        try:
            return KVCache(
                num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, num_blocks=num_blocks,
                block_size=self.config.block_size, dtype=dtype, device=device,
                track_key_bounds=self.config.attention_policy.topk_budget is not None,
                int8=self.config.kv_cache_dtype == "int8",
            )
        except torch.OutOfMemoryError as exc:
            per_block = KVCache.bytes_per_block(model.config, self.config.block_size, dtype,
                                                int8=self.config.kv_cache_dtype == "int8")
            raise ModelLoadError(
                f"out of memory allocating the KV cache: {num_blocks} blocks of {per_block} bytes "
                f"({per_block * num_blocks / 2**30:.2f} GiB) on {device}; lower num_kv_blocks, "
                f"kv_cache_bytes or kv_cache_memory_fraction (or max_model_len x max_num_seqs, which cap it): {exc}"
            ) from exc

    def load(self, ctx: EngineContext, model: Any) -> None:
        config = self.config
        check_model_supported(model, ctx.max_model_len)  # before the KV cache is sized from its attention
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        attention = config.attention_policy
        int8_kv = config.kv_cache_dtype == "int8"
        per_block = KVCache.bytes_per_block(model.config, config.block_size, dtype, int8=int8_kv)
        graphs = decode_graph_mode(config, device)
        # With `compile` or CUDA graphs, one extra block past the pool's ids takes the K/V of padding rows.
        extra = 1 if config.compile or graphs else 0
        # On CUDA without a set size, the runner starts on a cache for one largest step: its forward
        # measures the activations' peak, and the pool is sized from what is left (vLLM's profiling).
        profile = device.type == "cuda" and not (config.num_kv_blocks or config.kv_cache_bytes)
        if profile:
            num_blocks = -(-config.max_batch_tokens // config.block_size)
        else:
            num_blocks = kv_pool_blocks(config, per_block, ctx.max_model_len, device)
        kv_cache = self._kv_cache(model, num_blocks + extra, dtype, device)
        self.runner = PagedModelRunner(
            model, kv_cache, max_model_len=ctx.max_model_len, self_check=config.self_check,
            window=attention.window, sinks=config.sink_tokens, topk_budget=attention.topk_budget,
            native_kernels=config.native_kernels,
            # compile works on the HF modules; LoRA adds its products to the HF modules' linears (`runtime/lora.py`)
            fused_layers=config.fused_layers and not config.compile and not config.lora_enabled,
            pack_weights=config.pack_cpu_weights and config.quantization is None,
            release_weights=True,  # where the fused layers run packed copies, the HF layers' weights go
            triton_ops=self._triton_ops(kv_cache.device), triton_attention=self._triton_attention(kv_cache.device),
        )
        self._prepare_layers(ctx, model)
        if config.lora_enabled:
            install_lora_layers(model)
        if attention.window is None and all_layers_windowed(model.config):
            ctx.model_window = own_window(model.config, ctx.max_model_len)
        if profile:  # the pool from what the measured step leaves free
            del kv_cache
            num_blocks = self._pool_after_profile(ctx, per_block)
            kv_cache = self._kv_cache(model, num_blocks + extra, dtype, device)
            self.runner.kv_cache = kv_cache
        if extra:
            self.scratch_block = num_blocks
        self.kv_bytes = per_block * (num_blocks + extra)
        self.kv_bytes_per_token = per_block // config.block_size
        self.pool = registry.load_pool(
            config.kv_pool, config, num_blocks=num_blocks, block_size=config.block_size,
            model_key=ctx.model_key, kv=kv_cache,
        )
        if graphs and self.runner.fused is not None:
            self._decode_graphs(ctx, kv_cache, capture=graphs == "capture")
        ctx.pool = self.pool
        log.info("paged KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, config.block_size,
                 self.kv_bytes / 2**20)

    def _prepare_layers(self, ctx: EngineContext, model: Any) -> None:
        """The forward's speed-ups, once the runner has accepted the model (a refused one is left as it came):
        fused norms and MLPs, then int8 layers, compiled MLPs or packed weights."""
        assert self.runner is not None
        config = self.config
        fuse_rms_norms(model, self.runner.native or self.runner.pointwise)
        inplace_gated_mlps(model)  # with `compile`, the eager path of shapes it does not compile
        if config.quantization == "int8":
            self.int8_bytes = quantize_runner(self.runner, ctx.tokenizer, ctx.model_key, tokenflow_home() / "quantized")
        elif config.compile:
            self.buckets = decode_buckets(config.max_num_seqs)
            compile_mlps(model, set(self.buckets))
        elif config.pack_cpu_weights and self.runner.fused is None:  # the fused layers pack their own
            pack_linears(model)
        released = self.runner.fused.released_bytes if self.runner.fused is not None else 0  # the weights it runs
        if released:
            log.info("released the HF layers' weights (%.0f MiB): the fused layers run packed copies",
                     released / 2**20)
        self.weight_bytes = self.int8_bytes + released + _parameter_bytes(model)  # the weights as they run, once

    def _pool_after_profile(self, ctx: EngineContext, per_block: int) -> int:
        """CUDA: run one largest step on the runner's provisional cache, free that cache, and size the pool
        from the memory left after the step's measured peak."""
        assert self.runner is not None
        config = self.config
        try:
            self.step_peak_bytes = profile_step_peak(
                self.runner, config.max_batch_tokens, min(config.max_num_seqs, config.max_batch_tokens))
        except torch.OutOfMemoryError as exc:
            raise ModelLoadError(f"out of memory in a step of max_batch_tokens={config.max_batch_tokens} "
                                 f"tokens with no KV pool yet: lower max_batch_tokens: {exc}") from exc
        self.runner.kv_cache = None  # type: ignore[assignment]  # freed before the pool is sized
        torch.cuda.empty_cache()
        return kv_pool_blocks(config, per_block, ctx.max_model_len, self.runner.device, self.step_peak_bytes)

    def _decode_graphs(self, ctx: EngineContext, kv_cache: KVCache, capture: bool) -> None:
        """Decode steps at fixed shapes, captured as CUDA graphs now (a failed capture leaves them off)."""
        assert self.runner is not None and self.runner.fused is not None
        self.runner.graphs = DecodeGraphs(
            self.runner.fused, kv_cache, batch_sizes=decode_buckets(self.config.max_num_seqs),
            max_model_len=ctx.max_model_len, scratch_block=self.scratch_block, capture=capture,
            attention=self.runner.attention, vocab_size=ctx.vocab_size, eos_token_ids=sorted(ctx.eos_token_ids),
            kernel="triton" if self.runner.triton_attention else "gathered",
        )
        if self.config.cuda_graph_prefill_steps and self.runner.triton_attention:
            self.runner.step_graphs = StepGraphs(
                self.runner.fused, kv_cache, self.runner.attention, max_seqs=self.config.max_num_seqs,
                max_tokens=self.config.max_batch_tokens or DEFAULT_BATCH_TOKENS["cuda"],
                max_model_len=ctx.max_model_len, scratch_block=self.scratch_block, capture=capture)
        if not capture:
            return
        try:
            self.runner.graphs.capture_all()
        except Exception as exc:  # e.g. a runtime without graph capture: the dynamic path serves
            log.exception("CUDA graph capture failed; steps run without graphs")
            self.runner.graphs = self.runner.step_graphs = None
            self.graph_error = repr(exc)
            torch.cuda.empty_cache()
            return
        if self.runner.step_graphs is None:
            return
        try:
            self.runner.step_graphs.capture_all(self.runner.graphs.pool)
        except Exception as exc:  # the decode graphs stay
            log.exception("CUDA graph capture of the steps with prefill chunks failed; they run without graphs")
            self.runner.step_graphs = None
            self.graph_error = repr(exc)
            torch.cuda.empty_cache()

    @staticmethod
    def _triton(asked: bool, setting: str, instead: str, device: torch.device) -> bool:
        """A Triton setting that was `asked` for, on a CUDA device where the triton package is installed (said once
        in the log where it is missing: `instead` serves)."""
        if not asked or device.type != "cuda":
            return False
        if not triton_available():
            log.warning("%s but the triton package is not installed: %s", setting, instead)
            return False
        return True

    def _triton_ops(self, device: torch.device) -> bool:
        return self._triton(self.config.cuda_triton_ops, "cuda_triton_ops=True", "torch ops serve", device)

    def _triton_attention(self, device: torch.device) -> bool:
        return self._triton(self.config.cuda_attention == "triton", "cuda_attention='triton'",
                            "SDPA over gathered blocks serves", device)

    def hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        """Model thread: the final hidden states of `token_ids` (`Engine.embed`), a step's token budget at a
        time over a scratch cache (`PagedModelRunner.hidden_states`)."""
        assert self.runner is not None
        chunk = self.config.max_batch_tokens or DEFAULT_BATCH_TOKENS.get(self.runner.device.type, 512)
        return self.runner.hidden_states(token_ids, chunk)

    def shrink_kv(self, num_blocks: int) -> None:
        """Model thread: free the KV memory of blocks from `num_blocks` on (the pool gave those ids up);
        the scratch block of padding rows moves to the new end."""
        assert self.runner is not None
        kv = self.runner.kv_cache
        graphs = [g for g in (self.runner.graphs, self.runner.step_graphs) if g is not None]
        for g in graphs:
            g.release()  # they point at the tensors being replaced
        extra = 1 if self.scratch_block >= 0 else 0
        kv.truncate(num_blocks + extra)
        if self.scratch_block >= 0:
            self.scratch_block = num_blocks
            for g in graphs:
                g.scratch_block = num_blocks
        self.kv_bytes = kv.nbytes

    def compress_kv(self, window: SeqChunk, table: list[int], keep: int, sinks: int) -> None:
        """Model thread: kv_compression of one prompt (`PagedModelRunner.compress`)."""
        assert self.runner is not None
        self.runner.compress(window, table, keep, sinks)

    def execute(self, plan: StepPlan) -> torch.Tensor | GreedyTokens | DeviceTokens | PendingTokens:
        """Blocking: one forward; logits in plan order, `num_logit_rows` rows per chunk (one per sampling
        chunk plus one per draft token, and every row of a chunk that scores prompt tokens). For an
        `argmax_only` plan, the rows' tokens instead where the fused layers' greedy head settles them; for
        a decode step at fixed shapes whose rows the device sampler takes, the tokens it drew."""
        assert self.runner is not None
        chunks = []
        # with async scheduling, inputs the step before drew on the device and left there (`DecodeGraphs.run`)
        chained = [c.ahead.device_row if c.ahead is not None else -1 for c in plan.chunks]
        if max(chained, default=-1) < 0:
            chained = []
        for c in plan.chunks:
            r = c.request
            if c.ahead is not None:  # planned before the step before ran: the request itself may have moved on
                chunks.append(SeqChunk([c.ahead.token], c.ahead.position, c.ahead.block_table, True, 1, 0, r.adapter))
                continue
            start = r.num_computed_tokens
            known = c.num_tokens - len(c.draft)
            if known == 1 and start == r.num_tokens - 1 and r.output_token_ids:
                tokens = [r.output_token_ids[-1]]  # the common decode case, no list concat
            else:
                tokens = r.all_token_ids[start:start + known]
            if c.draft:  # verified in the same forward: the logits of every draft position are kept
                tokens = tokens + c.draft
            rows = c.num_logit_rows
            dropped = r.num_dropped_tokens  # kv_compression: the cache holds fewer positions than were computed
            chunks.append(SeqChunk(tokens, start - dropped, r.block_table, rows > 0, max(rows, 1), dropped, r.adapter))
        decode_only = plan.num_tokens == len(chunks)
        if self.buckets and decode_only:  # pad to a static batch size
            pad = padded_size(len(chunks), self.buckets) - len(chunks)
            chunks.extend(SeqChunk([0], 0, [self.scratch_block], False) for _ in range(pad))
            if chained:
                chained.extend([-1] * pad)
        # only decode-only steps run at fixed shapes (`DecodeGraphs.fits`), where the device may sample
        sampling = device_rows(plan) if self.runner.graphs is not None and decode_only else None
        # with async scheduling, device-drawn tokens stay on the device for the step queued behind this one
        return self.runner.execute(chunks, greedy=argmax_only(plan), sampling=sampling, chained=chained,
                                   defer=self.config.async_scheduling)

    def warmup_batch_sizes(self) -> list[int]:
        """Decode batch sizes worth a warm-up: every bucket when compiled, else one and a full batch."""
        return list(self.buckets) if self.buckets else sorted({1, self.config.max_num_seqs})

    def stats(self) -> dict[str, Any]:
        if self.pool is None:
            return {}
        stats = {**self.pool.stats(), "kv_cache_bytes": self.kv_bytes, "weight_bytes": self.weight_bytes,
                 "quantization": self.config.quantization or "none", "kv_cache_dtype": self.config.kv_cache_dtype,
                 "kv_bytes_per_token": self.kv_bytes_per_token}
        if self.step_peak_bytes:
            stats["step_peak_bytes"] = self.step_peak_bytes
        if self.runner is not None and self.runner.graphs is not None:
            stats.update(self.runner.graphs.stats())
        if self.runner is not None and self.runner.step_graphs is not None:
            stats.update(self.runner.step_graphs.stats())
        if self.graph_error:
            stats["cuda_graph_error"] = self.graph_error
        return stats


def create(config: EngineConfig) -> PagedBackend:
    return PagedBackend(config)
