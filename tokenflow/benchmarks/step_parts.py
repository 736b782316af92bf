"""`tokenflow bench-step --parts`: where a step's time goes, part by part, on the CPU.

A `PagedModelRunner` on the real model (the engine's fused layers, packed weights and native kernels)
runs decode steps at batch 1 and 16 over 350 cached tokens and 512-token prefill chunks (from the
start, and after 300 cached tokens). Each part of the fused loop is timed around its calls: the 30
layers' linears, the head, attention (with the KV write), the norms, and the rest (embedding, RoPE,
the SiLU product, residual adds) as what remains of the step. Steps alternate between the engine's
linears (the few-rows kernel for decodes, oneDNN with fused post-ops for prefill chunks, whose SiLU
product and residual adds then count as linears) and plain oneDNN (`FusedDecoder.without_few_rows_kernel`),
so both columns come from one run; medians over the repeats. Decode steps also alternate with the
engine's own form of them where it has one, all layers in one C call (`NativeDecodeLayers`, "C loop"):
its step time only, as nothing inside it is a Python call to time, and the head (with the final norm);
with an fp32 greedy head (`tokenflow.runtime.cpu.greedy_head`), also as greedy steps take it ("C+greedy":
the rows' tokens from bf16 estimates instead of the fp32 logits).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ("step_parts",)

CONTEXT = 350  # cached tokens of each decoding sequence


class _PartTimer:
    """Accumulates seconds per part while installed around a fused decoder's callables."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - started

        return timed


class _TimedResidual:
    """A `PackedLinear` whose residual form is timed as a linear."""

    def __init__(self, linear: Any, timer: _PartTimer) -> None:
        self.add_to = timer.wrap("linears", linear.add_to)


def _install(runner: Any, timer: _PartTimer) -> None:
    """Time the runner's fused loop part by part (attention through the runner's `LayerAttention`)."""
    fused = runner.fused
    for layer in fused.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(layer, name, timer.wrap("linears", getattr(layer, name)))
        if layer.mlp is not None:  # the post-op forms: products with their elementwise work
            layer.mlp = timer.wrap("linears", layer.mlp)
        if layer.o_residual is not None:
            layer.o_residual = _TimedResidual(layer.o_residual, timer)
        for name in ("input_norm", "post_norm", "attention_out_norm", "mlp_out_norm"):
            if getattr(layer, name) is not None:
                setattr(layer, name, timer.wrap("norms", getattr(layer, name)))
    fused._logits = timer.wrap("head", fused._logits)  # the final norm and the head, or the greedy head
    cache = runner.kv_cache
    runner._attention[cache.quantized] = timer.wrap("attention", runner.attention_for(cache))


@contextlib.contextmanager
def _linears(runner: Any, kernel: str, c_loop: Any) -> Iterator[None]:
    """The step's linears: the few-rows kernel, oneDNN (`FusedDecoder.without_few_rows_kernel`), or the
    few-rows kernel inside the C loop (`c_loop`, installed for the step only)."""
    if kernel == "oneDNN":
        with runner.fused.without_few_rows_kernel():
            yield
        return
    runner.fused.native_layers = c_loop if kernel.startswith("C") else None
    try:
        yield
    finally:
        runner.fused.native_layers = None


def step_parts(model_path: str, dtype: torch.dtype, repeats: int = 10) -> list[dict[str, Any]]:
    """Rows of (case, linears kernel, step ms and ms per part) for one dtype."""
    from transformers import AutoModelForCausalLM

    from tokenflow.kv.block_pool import BlockPool
    from tokenflow.kv.kv_cache import KVCache
    from tokenflow.runtime.cpu.rms_norm import fuse_rms_norms
    from tokenflow.runtime.gated_mlp import inplace_gated_mlps
    from tokenflow.runtime.paged_runner import PagedModelRunner, SeqChunk

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    num_blocks = 16 * (CONTEXT + 32) // 16 + 200
    cache = KVCache.for_model(model.config, num_blocks=num_blocks, block_size=16, dtype=dtype)
    # timing only: the engine's load checks this arithmetic (its self-check against the model's own attention)
    runner = PagedModelRunner(model, cache, self_check=False)
    if runner.fused is None:
        raise ValueError(f"{model_path}: the parts need the fused layers (a Llama-family model)")
    fuse_rms_norms(model, runner.native)
    inplace_gated_mlps(model)
    pool = BlockPool(num_blocks, 16)
    vocab = int(model.config.vocab_size) - 10

    def ids(count: int, stride: int, offset: int) -> list[int]:
        return [(stride * j + offset) % vocab + 5 for j in range(count)]

    tables = [pool.allocate(pool.blocks_needed(CONTEXT + 16)) for _ in range(16)]
    for i, table in enumerate(tables):  # 16 sequences of CONTEXT cached tokens
        runner.execute([SeqChunk(ids(CONTEXT, 7, 31 * i), 0, table, False)])
    prefill_table = pool.allocate(pool.blocks_needed(812))
    runner.execute([SeqChunk(ids(300, 13, 50), 0, prefill_table, False)])
    cases = {
        "decode, batch 1": [SeqChunk([101], CONTEXT, tables[0], True)],
        "decode, batch 16": [SeqChunk([100 + i], CONTEXT, tables[i], True) for i in range(16)],
        "prefill 512 from 0": [SeqChunk(ids(512, 11, 70), 0, pool.allocate(pool.blocks_needed(512)), True)],
        "prefill 512 after 300": [SeqChunk(ids(512, 17, 90), 300, prefill_table, True)],
    }
    timer = _PartTimer()
    c_loop, runner.fused.native_layers = runner.fused.native_layers, None  # parts are timed in the Python loop
    _install(runner, timer)
    rows = []
    for case, chunks in cases.items():
        kernels = ["few-rows", "oneDNN"]
        if c_loop is not None and case.startswith("decode"):
            kernels += ["C loop"] + (["C+greedy"] if runner.fused.greedy_head is not None else [])
        samples: dict[str, list[dict[str, float]]] = {kernel: [] for kernel in kernels}
        for _ in range(2):  # warm both
            for kernel in samples:
                with _linears(runner, kernel, c_loop):
                    runner.execute(chunks, greedy=kernel == "C+greedy")
        for _ in range(repeats):
            for kernel in samples:
                with _linears(runner, kernel, c_loop):
                    timer.seconds.clear()
                    started = time.perf_counter()
                    runner.execute(chunks, greedy=kernel == "C+greedy")
                    step = time.perf_counter() - started
                parts = {k: v * 1e3 for k, v in timer.seconds.items()}
                parts["rest"] = step * 1e3 - sum(parts.values())
                parts["step"] = step * 1e3
                samples[kernel].append(parts)
        for kernel, runs in samples.items():
            label = "post-ops" if kernel == "few-rows" and case.startswith("prefill") else kernel
            row = {"dtype": str(dtype).removeprefix("torch."), "case": case, "linears_kernel": label}
            for key in ("step", "linears", "head", "attention", "norms", "rest"):
                timed = not kernel.startswith("C") or key in ("step", "head")  # the head runs after the loop
                row[f"{key}_ms"] = round(statistics.median(r.get(key, 0.0) for r in runs), 2) if timed else None
            rows.append(row)
    return rows
