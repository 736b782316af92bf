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
the rows' tokens from bf16 estimates instead of the fp32 logits). Each case also has its floor on this machine
(`step_floor`: the weights and cached K/V read at the memory read rate, or the arithmetic at the matmul rate, both
measured in the same run by `machine_limits`), so a step reads as a fraction of what the hardware allows.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ("machine_limits", "step_floor", "step_parts")

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


def machine_limits(dtype: torch.dtype) -> dict[str, float]:
    """This machine's limits, measured now (best of ten): the memory read rate (a sum over 512 MiB, every thread)
    and the `dtype` matmul rate (512 x 4096 x 4096 on oneDNN's packed weights, as prefill chunks run), for the
    steps' floors."""
    from tokenflow.runtime.cpu.packed_linear import packed_linear

    data = torch.ones(2**27, dtype=torch.float32)  # 512 MiB: far past every cache
    x, weight = torch.randn(512, 4096).to(dtype), torch.randn(4096, 4096).to(dtype)
    linear = packed_linear(weight, None) or (lambda rows: torch.nn.functional.linear(rows, weight))  # the prefills'
    read, flops = [], []
    for _ in range(10):
        started = time.perf_counter()
        data.sum()
        read.append(data.numel() * 4 / (time.perf_counter() - started))
        started = time.perf_counter()
        linear(x)
        flops.append(2 * 512 * 4096 * 4096 / (time.perf_counter() - started))
    return {"read_bytes_per_s": max(read), "flops_per_s": max(flops)}


def step_floor(model: torch.nn.Module, rows: int, attended: int, kv_tokens: int, limits: dict[str, float]) -> float:
    """The least a step can take here, in ms: every layer weight, the head and `kv_tokens` tokens of cached K/V
    read once at the measured read rate, or the step's arithmetic (2 per weight per row, 4 per head dimension per
    attended key; `attended`: keys summed over the rows) at the measured matmul rate, whichever is longer."""
    config = model.config
    layers = model.model.layers
    head = model.lm_head.weight
    weights = sum(p.numel() * p.element_size() for p in layers.parameters()) + head.numel() * head.element_size()
    head_dim = layers[0].self_attn.head_dim
    kv_row = 2 * len(layers) * config.num_key_value_heads * head_dim * head.element_size()  # bytes per token
    memory = weights + kv_row * kv_tokens
    arithmetic = (2 * rows * weights // head.element_size()
                  + 4 * len(layers) * config.num_attention_heads * head_dim * attended)
    return 1e3 * max(memory / limits["read_bytes_per_s"], arithmetic / limits["flops_per_s"])


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
    limits = machine_limits(dtype)  # after the steps: its 512 MiB and matmuls do not disturb them
    floors = {  # rows, keys attended over the rows, cached tokens read
        "decode, batch 1": step_floor(model, 1, CONTEXT + 1, CONTEXT, limits),
        "decode, batch 16": step_floor(model, 16, 16 * (CONTEXT + 1), 16 * CONTEXT, limits),
        "prefill 512 from 0": step_floor(model, 512, sum(range(1, 513)), 0, limits),
        "prefill 512 after 300": step_floor(model, 512, sum(range(301, 813)), 300, limits),
    }
    for row in rows:
        row.update(floor_ms=round(floors[row["case"]], 2), read_gb_per_s=round(limits["read_bytes_per_s"] / 1e9, 1),
                   matmul_tflops=round(limits["flops_per_s"] / 1e12, 2))
    return rows
