"""Real-size model shapes on the device for scripts/gpu_check.py: decode and prefill speed against the roofline.

Each shape is the architecture part of a published config.json (real vocabulary sizes: the head is a large part
of what a decode step reads), built with random weights directly on the device, since with a fixed token budget
speed does not depend on the weights' values and nothing has to be carried to the GPU machine. Measured for
each, in one run:

- the machine's limits: device memory bandwidth (a copy of 2 GiB) and the dtype's matmul rate (8192^3);
- transformers' own fast paths on the same model object, first (tokenflow rebinds its attention): `generate`
  with a static cache (transformers compiles its forward for it on CUDA) at batch 1, and its continuous batching
  `generate_batch` at concurrency 16;
- tokenflow's paged backend on that model (CUDA graphs, device sampling): decode steps at batch 1, 16 and 64
  at position `context` (1,024 cached tokens with it: a whole context bucket of 64 blocks), timed from the host
  (staging, replay, the tokens back), again with the Triton decode kernel (`cuda_attention="triton"`)
  where triton runs, and a prefill of `prefill` tokens; each against its floor
  (`benchmarks.step_parts.step_floor`: weights and cached K/V read once at the measured bandwidth, or the step's
  arithmetic at the measured matmul rate, whichever is longer).

`dry_run` shrinks every shape (2 layers, 64 wide, a 512-token vocabulary) and runs the same code on the CPU
without compiling: what CI runs, so that the script a lent GPU gets has run end to end.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tokenflow.benchmarks.model_shapes import MODEL_SHAPES

# `tokenflow bench --model-shape`'s shapes where it has them, with the model's own vocabulary size here
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
        "rms_norm_eps": 1e-5, "rope_theta": 100000, "max_position_embeddings": 8192, "tie_word_embeddings": True,
    },
    "llama-3.2-1b": {**MODEL_SHAPES["llama-3.2-1b"], "vocab_size": 128256},
    "llama-3.1-8b": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "rms_norm_eps": 1e-5, "rope_theta": 500000, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    },
    "qwen3-8b": {
        "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    },
}
_DRY_RUN = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
BLOCK = 16


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(run: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median wall time of `repeats` runs after one warm-up, each synchronised."""
    run()
    synchronize(device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def device_limits(device: torch.device, dtype: torch.dtype, dry_run: bool) -> dict[str, float]:
    """Memory bandwidth (read + write of a copy) and the dtype's matmul rate, measured now (best of five)."""
    size, n = (2**24, 512) if dry_run else (2**30, 8192)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    copy_ms = min(timed_ms(lambda: dst.copy_(src), device, 3) for _ in range(5))
    mm_ms = min(timed_ms(lambda: a @ b, device, 3) for _ in range(5))
    return {"read_bytes_per_s": 2 * size / (copy_ms / 1e3), "flops_per_s": 2 * n**3 / (mm_ms / 1e3)}


def build(name: str, device: torch.device, dtype: torch.dtype, dry_run: bool) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {**SHAPES[name], **(_DRY_RUN if dry_run else {})}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def transformers_static_batch1(model: Any, new_tokens: int, compile: bool) -> dict[str, Any]:
    """transformers `generate` with a static cache at batch 1 (a 32-token prompt, `new_tokens` greedy tokens, EOS
    off): ms per token of the whole call, after a first call that compiles."""
    from transformers import GenerationConfig

    device = model.device
    ids = torch.randint(100, model.config.vocab_size - 1, (1, 32), device=device)
    gen = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           cache_implementation="static", pad_token_id=0, eos_token_id=None,
                           disable_compile=not compile)
    with torch.inference_mode():
        ms = timed_ms(lambda: model.generate(ids, generation_config=gen), device, 5)
    return {"ms_per_token": ms / new_tokens, "tokens_per_s": new_tokens / (ms / 1e3), "compiled": compile}


def transformers_generate_batch(model: Any, requests: int, new_tokens: int, dry_run: bool) -> dict[str, Any]:
    """transformers' continuous batching (`generate_batch`) of `requests` 256-token prompts, `new_tokens` each (its
    KV cache sized from free memory as it chooses; a small one in the dry run, where it would take the host's).
    The timed call reuses the manager the warm-up call built and warmed (its cache and graphs)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    g = torch.Generator().manual_seed(1)
    length = 32 if dry_run else 256
    vocab = model.config.vocab_size
    prompts = [torch.randint(100, vocab - 1, (length,), generator=g).tolist() for _ in range(requests)]
    small = ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=256, max_requests_per_batch=4)
    batching = small if dry_run else None
    gen = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                           eos_token_id=-1)
    with torch.inference_mode():
        model.generate_batch(prompts, generation_config=gen, continuous_batching_config=batching,
                             persistent_manager=True)  # warm-up: builds the manager the timed call reuses
        synchronize(model.device)
        started = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=batching,
                                   persistent_manager=True)
        synchronize(model.device)
        seconds = time.perf_counter() - started
        model.destroy_cached_continuous_batching_manager()
    made = sum(len(o.generated_tokens) for o in out.values())
    return {"requests_per_s": requests / seconds, "tokens_per_s": made / seconds, "tokens": made}


def tokenflow_backend(model: Any, device: torch.device, dtype: str, max_rows: int, max_model_len: int,
                      num_blocks: int) -> Any:
    """The paged backend loaded on `model` as the engine loads it (fused layers, CUDA graphs on CUDA)."""
    from tokenflow.config import EngineConfig
    from tokenflow.protocols import EngineContext
    from tokenflow.runtime.backends import paged

    config = EngineConfig.load(model="shape", device=str(device), dtype=dtype, max_num_seqs=max_rows,
                               max_model_len=max_model_len, num_kv_blocks=num_blocks, prefix_caching=False,
                               block_size=BLOCK)
    ctx = EngineContext(config=config, tokenizer=None, max_model_len=max_model_len, eos_token_ids=frozenset(),
                        vocab_size=model.config.vocab_size)
    backend = paged.PagedBackend(config)
    backend.load(ctx, model)
    return backend


def triton_runs(device: torch.device) -> bool:
    """Whether the Triton decode kernel runs here: on CUDA with triton installed, or on its interpreter."""
    import os

    from tokenflow.runtime.gpu.triton_launch import triton_available

    return triton_available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def triton_decode_figures(runner: Any, greedy: Callable[[], Any], logits: Callable[[], Any], device: torch.device,
                          repeats: int, batch: int, floor_ms: float) -> dict[str, float]:
    """The same decode step with `cuda_attention="triton"` (graphs captured again), and how far its logits
    are from the gathered path's; the graphs go back to the gathered path after."""
    graphs = runner.graphs
    gathered_logits = logits()
    try:
        graphs.release()
        graphs.kernel = "triton"
        greedy_ms = timed_ms(greedy, device, repeats)
        triton_logits = logits()
    finally:
        graphs.release()
        graphs.kernel = "gathered"
    return {"step_ms_device_greedy": greedy_ms, "tokens_per_s": batch / (greedy_ms / 1e3),
            "of_roofline": floor_ms / greedy_ms, "max_logit_diff": float((triton_logits - gathered_logits).abs().max()),
            "max_logit": float(gathered_logits.abs().max())}


def measure_shape(name: str, device: torch.device, limits: dict[str, float], *, dry_run: bool,
                  batches: tuple[int, ...] = (1, 16, 64), context: int = 1023, prefill: int = 2048,
                  peers: bool = True) -> dict[str, Any]:
    """One shape's figures (see the module docstring)."""
    from tokenflow.benchmarks.step_parts import step_floor
    from tokenflow.params import SamplingParams
    from tokenflow.protocols import DeviceTokens
    from tokenflow.runtime.paged_runner import SeqChunk
    from tokenflow.runtime.sampler import SamplingRow

    if dry_run:
        batches, context, prefill = (1, 4), 47, 64
    dtype = torch.bfloat16
    model = build(name, device, dtype, dry_run)
    result: dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters())}
    new_tokens = 8 if dry_run else 64
    if peers:
        result["transformers_static_b1"] = transformers_static_batch1(model, new_tokens, compile=not dry_run)
        result["transformers_generate_batch_c16"] = transformers_generate_batch(model, 4 if dry_run else 16, new_tokens,
                                                                                dry_run)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # the floors before tokenflow loads: its fused layers may release the HF layers' weights that step_floor counts
    floors = {b: step_floor(model, b, b * (context + 1), b * (context + 1), limits) for b in batches}
    prefill_floor = step_floor(model, prefill, prefill * (prefill + 1) // 2, prefill, limits)
    per_row = -(-(context + 1) // BLOCK)
    num_blocks = max(batches) * per_row + -(-prefill // BLOCK) + 1
    backend = tokenflow_backend(model, device, "bfloat16", max(batches), max(context + 1, prefill) + BLOCK,
                                num_blocks)
    runner = backend.runner
    repeats = 3 if dry_run else 20
    decode: dict[str, Any] = {}
    for batch in batches:
        chunks = [SeqChunk([5], context, list(range(i * per_row, (i + 1) * per_row)), True) for i in range(batch)]
        rows = [SamplingRow(SamplingParams(temperature=0.0), [], [])] * batch
        drawn = [SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), [], [])] * batch

        def step(sampling: list[SamplingRow] | None, chunks: list[SeqChunk] = chunks) -> Callable[[], Any]:
            def run() -> Any:
                out = runner.execute(chunks, sampling=sampling)
                assert sampling is None or isinstance(out, DeviceTokens)
                return out
            return run

        greedy_ms = timed_ms(step(rows), device, repeats)
        floor_ms = floors[batch]
        decode[str(batch)] = {
            "step_ms_device_greedy": greedy_ms, "step_ms_device_top_p": timed_ms(step(drawn), device, repeats),
            "step_ms_logits_to_host": timed_ms(step(None), device, repeats),  # forward + logits copy, no sampling
            "tokens_per_s": batch / (greedy_ms / 1e3), "floor_ms": floor_ms, "of_roofline": floor_ms / greedy_ms,
        }
        if triton_runs(device):
            decode[str(batch)]["triton"] = triton_decode_figures(runner, step(rows), step(None), device, repeats,
                                                                 batch, floor_ms)
    result["decode"] = decode
    first = max(batches) * per_row
    table = list(range(first, first + -(-prefill // BLOCK)))
    prefill_ms = timed_ms(lambda: runner.execute([SeqChunk([7] * prefill, 0, table, True)]), device, 3)
    result["prefill"] = {"tokens": prefill, "ms": prefill_ms, "tokens_per_s": prefill / (prefill_ms / 1e3),
                         "floor_ms": prefill_floor, "of_roofline": prefill_floor / prefill_ms}
    result["graphs"] = runner.graphs.stats() if runner.graphs is not None else {}
    return result
