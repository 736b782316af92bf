"""The CUDA checks of scripts/gpu_check.sh, printed as one table and written as JSON.

Each check runs on its own and reports a failure with its traceback, so one run on a lent GPU
shows everything that works and everything that does not:

1. load: the embedded model in bf16 on the device: weights, the profiled step peak the KV pool
   leaves free, the pool, the CUDA graphs captured at start;
2. oracle (tiny): a tiny random-weight Llama in fp32, 10 prompts at once with chunked prefill: greedy
   tokens identical to transformers' `generate` on the same device (decode steps replayed from graphs);
3. oracle (real): the embedded model through tokenflow against transformers' eager forward in the same
   dtype (bf16, then fp32, then fp32 with the Triton kernels: `cuda_attention="triton"`,
   `cuda_triton_ops=True`, `cuda_graph_prefill_steps=True`), judged by vLLM's logprob rule: where the
   greedy tokens first differ, each must be in the other's top 5, and nothing after it is compared;
4. out of memory: the process may use only part of a largest step's measured peak beyond what the
   engine holds after start (`torch.cuda.set_per_process_memory_fraction`); 16 long prompts arrive at
   once; every caller must get its completion (or an EngineError of its own) and no block may leak;
5. speed: `tokenflow bench`'s closed-loop workload (chat prompts of ~20-600 tokens, 64 new tokens,
   greedy, EOS ignored, prefix cache off) at concurrency 16 and 1: CUDA graphs, CUDA graphs with the
   Triton kernels, CUDA graphs with decode steps planned while the one before runs
   (`async_scheduling=True`), eager, and naive transformers `generate`;
6. profile: eager steps under each SDPA backend;
7. int8: `quantization="int8"` on CUDA (torchao's weight-only int8) against bf16 and fp32: weight
   bytes, perplexity of a held-out text, greedy agreement (`tokenflow bench-quality`'s measures), and
   the speed workload at concurrency 16 and 1, bf16 and int8 one after the other;
8. sampling: seeded top-p requests through the engine with decode steps sampled on the device and
   with every step sampled on the host: the same tokens (up to float rounding at a CDF boundary);
9. shapes: real-size shapes with random weights (`gpu_shapes.py`): decode steps at batch 1, 16, 64 and
   a 2k-token prefill against the roofline measured in the same run (the decode steps again with the
   Triton decode attention, and its logits' distance from the gathered path's), beside transformers'
   static-cache `generate` and `generate_batch` on the same model.

Last, one `goal:` row per goal of the GPU issue that the run measured (the best variant's figure against it:
decode steps at batch 1 and 16, concurrency-16 requests/s against 3x the H200 baseline, the 8B shapes' roofline
fractions and ratio to transformers' static cache, fp32 parity).

    python scripts/gpu_check.py [MODEL] [--device cuda] [--json FILE]
    python scripts/gpu_check.py --dry-run      # on the CPU, tiny shapes: every line of checks 2, 8, 9 runs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import gpu_shapes  # beside this script
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: tests.test_oracle's helpers

ROWS: list[tuple[str, str]] = []
RESULTS: dict[str, Any] = {}


def report(name: str, value: str) -> None:
    ROWS.append((name, value))
    print(f"[gpu_check] {name}: {value}", flush=True)


async def attempt(name: str, check: Callable[[], Awaitable[None]]) -> None:
    started = time.perf_counter()
    try:
        await check()
    except BaseException as exc:  # every check reports; none stops the others
        if isinstance(exc, KeyboardInterrupt):
            raise
        traceback.print_exc()
        report(name, f"FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        RESULTS[name] = {"failed": repr(exc)[:2000]}
    print(f"[gpu_check] {name} took {time.perf_counter() - started:.1f} s", flush=True)


# -- 1. load ---------------------------------------------------------------------------------------
async def check_load(model: str, device: str) -> None:
    from tokenflow import Engine

    started = time.perf_counter()
    async with Engine(model, device=device, dtype="bfloat16") as engine:
        load_s = time.perf_counter() - started
        stats = engine.stats()
        question = "What is the capital of France? Answer in one sentence."
        done = await engine.chat([{"role": "user", "content": question}], max_tokens=24, temperature=0.0)
    keys = ("kv_blocks_total", "kv_cache_bytes", "step_peak_bytes", "cuda_graphs", "cuda_graph_capture_s",
            "cuda_graph_error")
    RESULTS["load"] = {"load_s": round(load_s, 2), "answer": done.text, **{k: stats.get(k) for k in keys}}
    report("load (bf16)", f"{load_s:.1f} s; KV {stats['kv_blocks_total']} blocks "
           f"({stats['kv_cache_bytes'] / 2**30:.2f} GiB), step peak {stats.get('step_peak_bytes', 0) / 2**20:.0f} MiB, "
           f"{stats.get('cuda_graphs', 0)} graphs in {stats.get('cuda_graph_capture_s', 0)} s "
           f"{stats.get('cuda_graph_error') or ''}; "
           f"answer: {done.text.strip()!r}")


# -- 2. oracle on a tiny model ----------------------------------------------------------------------
async def check_oracle_tiny(device: str) -> None:
    from transformers import AutoModelForCausalLM

    from tests.test_oracle import make_prompts, run_concurrently
    from tokenflow import Engine
    from tokenflow.testing import build_tiny_model

    folder = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    prompts = make_prompts(400, [3, 9, 17, 33, 64, 100, 150, 230, 301, 47])
    async with Engine(folder, device=device, dtype="float32", max_num_seqs=8, max_batch_tokens=128) as engine:
        outputs = await run_concurrently(engine, prompts, max_tokens=24, stagger_s=0.01)
        stats = engine.stats()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    same = 0
    for prompt, got in zip(prompts, outputs):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=24, do_sample=False)
        same += got == out[0, len(prompt):].tolist()
    RESULTS["oracle_tiny"] = {"identical": same, "of": len(prompts), "cuda_graphs": stats.get("cuda_graphs", 0),
                              "leaked_blocks": stats["kv_blocks_used"]}
    verdict = "ok" if same == len(prompts) and not stats["kv_blocks_used"] else "MISMATCH"
    report("oracle, tiny Llama fp32 (10 prompts at once)",
           f"{verdict}: {same}/{len(prompts)} greedy outputs identical to transformers generate; "
           f"{stats.get('cuda_graphs', 0)} graphs, {stats['kv_blocks_used']} blocks left")


# -- 3. oracle on the real model --------------------------------------------------------------------
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The three primary colours are",
           "In 1969, astronauts", "A haiku about autumn:", "SELECT name FROM", "The largest planet is"]


async def check_oracle_real(model: str, device: str, dtype: str, cuda_graphs: bool = True,
                            triton: bool = False) -> None:
    from transformers import AutoModelForCausalLM

    from tokenflow import Engine

    settings = SPEED_VARIANTS["graphs-triton-async"] if triton else {}  # everything on
    async with Engine(model, device=device, dtype=dtype, cuda_graphs=cuda_graphs, **settings) as engine:
        ours = [await engine.generate(p, max_tokens=32, temperature=0.0, logprobs=5, ignore_eos=True)
                for p in PROMPTS]
        path = engine.loaded.model.name_or_path
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="eager")
    hf = hf.to(device).eval()
    identical = diverged = 0
    worst = 0.0
    for done in ours:
        ids = list(done.prompt_token_ids or []) + list(done.token_ids)
        with torch.no_grad():  # teacher-forced on our tokens: position p predicts token p + 1
            logits = hf(torch.tensor([ids], device=device)).logits[0].float()
        start = len(done.prompt_token_ids or [])
        for step, lp in enumerate(done.logprobs or []):
            ref = logits[start + step - 1].log_softmax(-1)
            top = ref.topk(5).indices.tolist()
            worst = max(worst, abs(float(ref[lp.token_id]) - lp.logprob))
            if top[0] == lp.token_id:
                identical += 1
                continue
            if lp.token_id not in top or top[0] not in lp.top:  # vLLM's rule, then stop comparing
                raise AssertionError(f"{done.request_id} step {step}: ours {lp.token_id}, transformers "
                                     f"{top[0]}: not in each other's top 5")
            diverged += 1
            break
    how = ("" if cuda_graphs else "_eager") + ("_triton" if triton else "")
    RESULTS[f"oracle_{dtype}{how}"] = {"identical_tokens": identical, "sequences_diverged": diverged,
                                       "max_logprob_diff": worst}
    report(f"oracle, SmolLM2 {dtype}{how.replace('_', ' ')} vs transformers eager",
           f"ok: {identical} of {32 * len(PROMPTS)} tokens identical, {diverged} sequences diverged within "
           f"vLLM's top-5 rule; max |logprob diff| {worst:.3f} before any divergence")


# -- 4. out of memory with a real allocation limit --------------------------------------------------
async def check_out_of_memory(model: str, device: str) -> None:
    from tokenflow import Engine
    from tokenflow.errors import EngineError

    if not device.startswith("cuda"):
        report("out of memory", "skipped: needs CUDA's allocator")
        return
    settings = dict(device=device, dtype="bfloat16", max_num_seqs=16, max_batch_tokens=4096, prefix_caching=False)
    async with Engine(model, **settings) as engine:
        peak = engine.stats()["step_peak_bytes"]
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        headroom = peak // 3  # a largest step does not fit; a third of one does
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + headroom) / total))
        outcomes: list[str] = []

        async def one(i: int) -> None:
            try:
                done = await engine.generate([100 + (i * 13 + j) % 20000 for j in range(1500)], max_tokens=16,
                                             ignore_eos=True, temperature=0.0)
                outcomes.append("ok" if len(done.token_ids) == 16 else "short")
            except EngineError:
                outcomes.append("EngineError")

        try:
            async with anyio.create_task_group() as tg:
                for i in range(16):
                    tg.start_soon(one, i)
            stats = engine.stats()
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
    keys = ("num_oom_recoveries", "num_kv_pool_shrinks", "num_oom_failures", "num_preemptions", "kv_blocks_used",
            "kv_blocks_total", "dead")
    RESULTS["out_of_memory"] = {"headroom_bytes": headroom, "outcomes": outcomes, **{k: stats[k] for k in keys}}
    if len(outcomes) != 16 or stats["dead"] or stats["kv_blocks_used"]:
        raise AssertionError(f"outcomes {outcomes}, stats { {k: stats[k] for k in keys} }")
    report(f"out of memory ({headroom / 2**20:.0f} MiB over the engine, 16 x 1,500 tokens at once)",
           f"{outcomes.count('ok')} ok, {outcomes.count('EngineError')} failed alone; "
           f"{stats['num_oom_recoveries']} recoveries, {stats['num_kv_pool_shrinks']} KV pool shrinks "
           f"(now {stats['kv_blocks_total']} blocks), {stats['num_preemptions']} preemptions, 0 blocks leaked")


# -- 5. speed -----------------------------------------------------------------------------------------
async def _engine_pass(model: str, device: str, prompts: list[list[int]], concurrency: int,
                       **settings: Any) -> dict[str, Any]:
    from tokenflow import Engine
    from tokenflow.benchmarks.clients import closed_loop, warmup_prompt

    async with Engine(model, device=device, dtype="bfloat16", prefix_caching=False, max_num_seqs=16,
                      **settings) as engine:
        async def stream(ids: list[int], max_tokens: int):
            async for chunk in engine.stream(ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                yield chunk.token_ids

        async for _ in stream(warmup_prompt(engine.loaded.vocab_size), 8):
            pass
        result = await closed_loop(stream, prompts, 64, concurrency)
        stats = engine.stats()
    result["decode_step_ms_by_batch"] = stats.get("decode_step_ms_by_batch", {})
    result["fixed_shape_decode_steps"] = stats.get("fixed_shape_decode_steps", 0)
    result["device_sampled_steps"] = stats.get("device_sampled_steps", 0)
    result["ahead_steps"] = stats.get("num_ahead_steps", 0)
    result["chained_steps"] = stats.get("chained_decode_steps", 0)
    result["steps"] = stats.get("num_steps", 0)
    return result


def _report_pass(name: str, result: dict[str, Any], concurrency: int) -> None:
    steps = result["decode_step_ms_by_batch"]
    step = steps.get(concurrency) or steps.get(str(concurrency)) or {}
    report(name, f"{result['req_per_s']:.2f} req/s, {result['out_tok_per_s']:.0f} tok/s, "
                 f"TTFT p50 {result['ttft_p50_s'] * 1e3:.0f} ms; decode step at batch {concurrency}: "
                 f"{step.get('step', float('nan')):.2f} ms (forward {step.get('forward', float('nan')):.2f}); "
                 f"{result['fixed_shape_decode_steps']} steps at fixed shapes, "
                 f"{result['device_sampled_steps']} of them sampled on the device; "
                 f"{result['ahead_steps']} of {result['steps']} steps planned ahead, "
                 f"{result['chained_steps']} chained on the device")


SPEED_VARIANTS: dict[str, dict[str, Any]] = {
    "graphs": {}, "graphs-async": {"async_scheduling": True}, "eager": {"cuda_graphs": False},
    "graphs-512": {"max_batch_tokens": 512},
    # every Triton setting: attention, pointwise kernels, graphs of the steps with prefill chunks
    "graphs-triton": {"cuda_attention": "triton", "cuda_triton_ops": True, "cuda_graph_prefill_steps": True},
    # ... and decode steps chained on the device (async scheduling): nothing waits for the host between them
    "graphs-triton-async": {"cuda_attention": "triton", "cuda_triton_ops": True, "cuda_graph_prefill_steps": True,
                            "async_scheduling": True},
    "graphs-triton-attention": {"cuda_attention": "triton"}, "graphs-triton-ops": {"cuda_triton_ops": True},
    "graphs-triton-no-prefill-graphs": {"cuda_attention": "triton", "cuda_triton_ops": True},
}


async def check_speed(model: str, device: str, requests: int, variants: list[str], concurrencies: list[int],
                      naive: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenflow.benchmarks.throughput import _run_naive, make_workload
    from tokenflow.hub import resolve_model

    path = resolve_model(model).path
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = make_workload(tokenizer, requests, 20, 600)
    rows: dict[str, dict[str, Any]] = {}
    for concurrency in concurrencies:
        for variant in variants:
            result = await _engine_pass(model, device, prompts, concurrency, **SPEED_VARIANTS[variant])
            rows[f"{variant} c{concurrency}"] = result
            _report_pass(f"speed, {variant}, concurrency {concurrency}", result, concurrency)
    RESULTS["speed"] = rows
    if naive:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
        for result in _run_naive(SimpleNamespace(max_tokens=64), hf, prompts[: max(requests // 2, 1)], concurrencies):
            rows[f"naive c{result['concurrency']}"] = result
        gpu_shapes.synchronize(device)
    for c in concurrencies:
        base = rows[f"{variants[0]} c{c}"]
        ratios = [f"{variants[0]}/{other} {base['req_per_s'] / rows[f'{other} c{c}']['req_per_s']:.2f}x req/s"
                  for other in variants[1:]]
        if naive:
            n = rows[f"naive c{c}"]
            ratios.append(f"{variants[0]}/naive {base['req_per_s'] / n['req_per_s']:.2f}x req/s (naive "
                          f"{n['req_per_s']:.2f} req/s, {n['out_tok_per_s']:.0f} tok/s, on every other prompt)")
        report(f"speed ratios, concurrency {c}", "; ".join(ratios))


# -- 6. where an eager step's time goes ---------------------------------------------------------------
async def check_profile(model: str, device: str) -> None:
    """Eager (graph-free) steps of fixed compositions timed under each SDPA backend, and the top ops of a
    batch-16 decode step by device and host time: what the steps that graphs do not cover cost."""
    import contextlib
    import math

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tokenflow import Engine
    from tokenflow.runtime import paged_runner
    from tokenflow.runtime.attention.paged import sdpa_backends
    from tokenflow.runtime.paged_runner import SeqChunk

    async with Engine(model, device=device, dtype="bfloat16", cuda_graphs=False, prefix_caching=False,
                      max_num_seqs=16) as engine:
        runner = engine._loop.backend.runner
        bs = runner.block_size

        def decodes(n: int, low: int = 100, high: int = 700) -> list[SeqChunk]:
            lengths = [low + (high - low) * i // max(n - 1, 1) for i in range(n)]
            return [SeqChunk([5], ctx, list(range(i * 64, i * 64 + ctx // bs + 1)), True)
                    for i, ctx in enumerate(lengths)]

        def prefill(tokens: int, start: int) -> SeqChunk:
            return SeqChunk([7] * tokens, start, list(range(2000, 2000 + (start + tokens) // bs + 1)), True)

        cases: dict[str, list[SeqChunk] | None] = {
            "decode x16 (ctx 100-700)": decodes(16), "decode x16, lengths +1 a run": None,
            "decode x1 (ctx 400)": decodes(1, 400, 400),
            "15 decodes + 400-token prefill": [*decodes(15), prefill(400, 0)],
            "prefill 512": [prefill(512, 0)], "prefill 256 after 256 cached": [prefill(256, 256)],
        }

        def timed(chunks: list[SeqChunk] | None, reps: int = 5) -> float:
            """Median ms of `reps` runs after one warm-up; None: decodes whose lengths grow every run, as
            in serving (kernels that plan per shape pay for it each time)."""
            runner.execute(chunks or decodes(16, 90, 690))
            times = []
            for rep in range(reps):
                started = time.perf_counter()
                runner.execute(chunks or decodes(16, 100 + rep, 700 + rep))  # logits come back: synchronised
                times.append((time.perf_counter() - started) * 1e3)
            return sorted(times)[reps // 2]

        # "ours": the runner's own choice (no cuDNN); the others replace it, "torch" with torch's default order.
        backends = {"ours": None, "torch": [], "efficient": [SDPBackend.EFFICIENT_ATTENTION],
                    "math": [SDPBackend.MATH], "cudnn": [SDPBackend.CUDNN_ATTENTION],
                    "flash+efficient": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]}
        table: dict[str, dict[str, float | str]] = {}
        for name, chunks in cases.items():
            table[name] = {}
            for label, choice in backends.items():
                try:
                    if choice is None:
                        table[name][label] = round(timed(chunks), 2)
                        continue
                    paged_runner.sdpa_backends = lambda device: contextlib.nullcontext()
                    with sdpa_kernel(choice) if choice else contextlib.nullcontext():
                        table[name][label] = round(timed(chunks), 2)
                except Exception as exc:
                    table[name][label] = f"{type(exc).__name__}"
                finally:
                    paged_runner.sdpa_backends = sdpa_backends
            slack, runner.decode_group_slack = runner.decode_group_slack, math.inf
            table[name]["one decode group"] = round(timed(chunks), 2)
            runner.decode_group_slack = slack
            report(f"profile: {name}", ", ".join(f"{k} {v} ms" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in table[name].items()))
        RESULTS["profile_ms"] = table
        if device.startswith("cuda"):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                runner.execute(decodes(16))
            averages = prof.key_averages()
            for key in ("self_cuda_time_total", "self_cpu_time_total"):
                try:
                    print(averages.table(sort_by=key, row_limit=14), flush=True)
                except Exception as exc:
                    print(f"profile table by {key}: {exc}", flush=True)


# -- 7. int8 weights on CUDA ----------------------------------------------------------------------------
async def check_int8(model: str, device: str, text: str, requests: int, concurrencies: list[int]) -> None:
    from transformers import AutoTokenizer

    from tokenflow.benchmarks.quality import _measure, common_prefix
    from tokenflow.benchmarks.throughput import make_workload
    from tokenflow.hub import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model).path)
    ids = list(tokenizer(Path(text).read_text(), add_special_tokens=False)["input_ids"])[:4096]
    windows = [ids[i:i + 1024] for i in range(0, len(ids) - 1, 1024)]
    variants = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
                "int8": {"dtype": "bfloat16", "quantization": "int8"}}
    quality = {name: await _measure(model, {"device": device, **settings}, windows, 32)
               for name, settings in variants.items()}
    table: dict[str, Any] = {}
    for name, r in quality.items():
        prefixes = [common_prefix(a, b) for a, b in zip(r["answers"], quality["fp32"]["answers"])]
        table[name] = {"perplexity": round(r["perplexity"], 3), "weight_bytes": r["weight_bytes"],
                       "mean_common_prefix_with_fp32": round(sum(prefixes) / len(prefixes), 2),
                       "identical_answers": prefixes.count(32)}
        report(f"int8 quality: {name}", f"perplexity {r['perplexity']:.3f} "
               f"({r['perplexity'] / quality['bf16']['perplexity']:.4f}x bf16) over {r['scored_tokens']} tokens; "
               f"greedy common prefix with fp32 {table[name]['mean_common_prefix_with_fp32']:.1f}/32, "
               f"{table[name]['identical_answers']}/{len(prefixes)} identical; "
               f"weights {r['weight_bytes'] / 2**20:.0f} MiB")
    prompts = make_workload(tokenizer, requests, 20, 600)
    speed: dict[str, Any] = {}
    for concurrency in concurrencies:
        for name in ("bf16", "int8"):
            settings = {"quantization": "int8"} if name == "int8" else {}
            result = await _engine_pass(model, device, prompts, concurrency, **settings)
            speed[f"{name} c{concurrency}"] = result
            _report_pass(f"int8 speed: {name}, concurrency {concurrency}", result, concurrency)
        ratio = speed[f"int8 c{concurrency}"]["req_per_s"] / speed[f"bf16 c{concurrency}"]["req_per_s"]
        report(f"int8 speed ratio, concurrency {concurrency}", f"int8/bf16 {ratio:.2f}x req/s")
    RESULTS["int8"] = {"quality": table, "speed": speed}


# -- 8. device sampling against host sampling ----------------------------------------------------------
async def check_sampling(model: str, device: str) -> None:
    """16 seeded top-p / top-k requests at once, run twice: decode steps sampled on the device (in the graphs),
    then every step on the host sampler. Each request's uniforms come from its own generator either way."""
    from tokenflow import Engine
    from tokenflow.runtime.backends import paged

    kinds = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0), dict(temperature=1.1, top_k=20, min_p=0.05),
             dict(temperature=0.0)]

    async def run() -> tuple[list[list[int]], dict[str, Any]]:
        async with Engine(model, device=device, dtype="float32", max_num_seqs=16, prefix_caching=False) as engine:
            outputs: list[list[int]] = [[] for _ in range(16)]

            async def one(i: int) -> None:
                done = await engine.generate(f"Story number {i}: once upon a time", max_tokens=32, seed=i,
                                             ignore_eos=True, **kinds[i % len(kinds)])
                outputs[i] = done.token_ids

            async with anyio.create_task_group() as tg:
                for i in range(16):
                    tg.start_soon(one, i)
            return outputs, engine.stats()

    real = paged.device_rows
    on_device, stats = await run()
    paged.device_rows = lambda plan: None  # type: ignore[assignment]
    try:
        on_host, host_stats = await run()
    finally:
        paged.device_rows = real
    same = sum(a == b for a, b in zip(on_device, on_host))
    prefix = sum(next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(on_device, on_host))
    RESULTS["sampling"] = {"identical": same, "of": 16, "mean_common_prefix": prefix / 16,
                           "device_sampled_steps": stats.get("device_sampled_steps", 0),
                           "host_run_device_sampled_steps": host_stats.get("device_sampled_steps", 0),
                           "decode_step_ms_by_batch": stats.get("decode_step_ms_by_batch", {}),
                           "host_decode_step_ms_by_batch": host_stats.get("decode_step_ms_by_batch", {})}
    verdict = "ok" if same >= 15 and stats.get("device_sampled_steps", 0) else "MISMATCH"
    report("sampling, fp32: device vs host sampler (16 seeded requests)",
           f"{verdict}: {same}/16 outputs identical (mean common prefix {prefix / 16:.1f}/32); "
           f"{stats.get('device_sampled_steps', 0)} steps sampled on the device")
    if verdict != "ok":
        raise AssertionError(f"device and host sampling disagree: {RESULTS['sampling']}")


# -- 9. real-size shapes ----------------------------------------------------------------------------------
def _triton_figures(t: dict[str, float] | None) -> str:
    if t is None:
        return ""
    return (f"; triton {t['step_ms_device_greedy']:.2f} ms ({t['of_roofline']:.1%}, logits within "
            f"{t['max_logit_diff']:.3f} of {t['max_logit']:.1f})")


async def check_shapes(device: str, shapes: list[str], peers: list[str], dry_run: bool) -> None:
    dev = torch.device(device)
    limits = gpu_shapes.device_limits(dev, torch.bfloat16, dry_run)
    RESULTS["limits"] = limits
    report("limits (bf16)", f"memory {limits['read_bytes_per_s'] / 1e9:.0f} GB/s (a copy), "
                            f"matmul {limits['flops_per_s'] / 1e12:.1f} TFLOPS")
    for name in shapes:
        r = gpu_shapes.measure_shape(name, dev, limits, dry_run=dry_run, peers=name in peers)
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the shape's model, KV cache and graphs are gone
        RESULTS[f"shape {name}"] = r
        steps = "; ".join(
            f"b{b}: {d['step_ms_device_greedy']:.2f} ms ({d['tokens_per_s']:.0f} tok/s, {d['of_roofline']:.1%} "
            f"of roofline; top-p {d['step_ms_device_top_p']:.2f}, logits to the host {d['step_ms_logits_to_host']:.2f}"
            f"{_triton_figures(d.get('triton'))})" for b, d in r["decode"].items())
        pre = r["prefill"]
        line = (f"{r['parameters'] / 1e6:,.1f} M params; decode {steps}; prefill {pre['tokens']}: "
                f"{pre['tokens_per_s']:.0f} tok/s ({pre['of_roofline']:.1%} of roofline)")
        if "transformers_static_b1" in r:
            static, batch = r["transformers_static_b1"], r["transformers_generate_batch_c16"]
            ours_b1 = r["decode"]["1"]["tokens_per_s"]
            line += (f"; transformers static b1 {static['tokens_per_s']:.0f} tok/s "
                     f"(ours {ours_b1 / static['tokens_per_s']:.2f}x), "
                     f"generate_batch {batch['tokens_per_s']:.0f} tok/s")
        report(f"shape {name}", line)


# -- the issue's goals, from what ran --------------------------------------------------------------------
BASELINE_C16_REQ_PER_S = 27.8  # graphs at concurrency 16 on an H200, 2026-12-04 (docs/gpu_check_h200.md, run 3)


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def report_goals() -> None:
    """One row per goal of the GPU issue that this run measured: the best variant's figure against it."""
    goals: dict[str, dict[str, Any]] = {}
    speed = RESULTS.get("speed", {})
    if isinstance(speed, dict) and "failed" not in speed:
        for batch, limit in ((1, 1.0), (16, 1.5)):
            by_batch = {name: row["decode_step_ms_by_batch"] for name, row in speed.items()
                        if name.endswith(f" c{batch}")}
            steps = {name: (rows.get(batch) or rows.get(str(batch)) or {}).get("step")
                     for name, rows in by_batch.items()}
            steps = {name: ms for name, ms in steps.items() if ms}
            if steps:
                best = min(steps, key=lambda name: steps[name])
                goals[f"decode step, batch {batch}"] = {"ms": steps[best], "variant": best, "goal_ms": limit,
                                                        "met": steps[best] <= limit}
        c16 = {name: row["req_per_s"] for name, row in speed.items() if name.endswith(" c16")}
        if c16:
            best = max(c16, key=lambda name: c16[name])
            goals["chat requests/s, concurrency 16"] = {"req_per_s": c16[best], "variant": best,
                                                       "goal": 3 * BASELINE_C16_REQ_PER_S,
                                                       "met": c16[best] >= 3 * BASELINE_C16_REQ_PER_S}
    for name in ("llama-3.1-8b", "qwen3-8b"):
        shape = RESULTS.get(f"shape {name}")
        if not isinstance(shape, dict) or "failed" in shape:
            continue
        decode, prefill = shape["decode"], shape["prefill"]
        if "1" in decode:
            goals[f"{name}: batch-1 decode of the roofline"] = {"fraction": decode["1"]["of_roofline"],
                                                               "goal": 0.8, "met": decode["1"]["of_roofline"] >= 0.8}
        if "64" in decode:
            goals[f"{name}: batch-64 decode of the roofline"] = {
                "fraction": decode["64"]["of_roofline"], "goal": 0.6, "met": decode["64"]["of_roofline"] >= 0.6}
        goals[f"{name}: 2k prefill of the roofline"] = {"fraction": prefill["of_roofline"], "goal": 0.6,
                                                       "met": prefill["of_roofline"] >= 0.6}
        if "transformers_static_b1" in shape and "1" in decode:
            ratio = decode["1"]["tokens_per_s"] / shape["transformers_static_b1"]["tokens_per_s"]
            goals[f"{name}: batch 1 vs transformers' compiled static cache"] = {"ratio": ratio, "goal": 1.5,
                                                                               "met": ratio >= 1.5}
    for name in ("oracle_fp32", "oracle_fp32_triton"):
        oracle = RESULTS.get(name)
        if isinstance(oracle, dict) and "failed" not in oracle:
            goals[f"fp32 parity ({name})"] = {"diverged": oracle["sequences_diverged"],
                                             "met": oracle["sequences_diverged"] == 0}
    RESULTS["goals"] = goals
    for goal, got in goals.items():
        figures = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in got.items() if k != "met")
        report(f"goal: {goal}", f"{_verdict(got['met'])} ({figures})")


async def main(args: argparse.Namespace) -> int:
    """Every check in `args.checks`; the number that failed."""
    device = args.device
    if device.startswith("cuda"):
        report("GPU", f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    import transformers

    report("software", f"transformers {transformers.__version__}, torch {torch.__version__}")
    checks = {
        "load": lambda: check_load(args.model, device),
        "oracle_tiny": lambda: check_oracle_tiny(device),  # greedy rows: sampled on the device (argmax)
        "oracle_bf16": lambda: check_oracle_real(args.model, device, "bfloat16"),
        "oracle_fp32": lambda: check_oracle_real(args.model, device, "float32"),
        "oracle_bf16_eager": lambda: check_oracle_real(args.model, device, "bfloat16", cuda_graphs=False),
        "oracle_fp32_triton": lambda: check_oracle_real(args.model, device, "float32", triton=True),
        "out_of_memory": lambda: check_out_of_memory(args.model, device),
        "speed": lambda: check_speed(args.model, device, args.requests, args.speed_variants.split(","),
                                     [int(c) for c in args.concurrency.split(",")], not args.no_naive),
        "profile": lambda: check_profile(args.model, device),
        "int8": lambda: check_int8(args.model, device, args.text, args.requests,
                                   [int(c) for c in args.concurrency.split(",")]),
        "sampling": lambda: check_sampling(args.model, device),
        "shapes": lambda: check_shapes(device, args.shapes.split(","), args.peers.split(","), args.dry_run),
    }
    for name in args.checks.split(","):
        await attempt(name, checks[name])
    report_goals()
    width = max(len(name) for name, _ in ROWS)
    print("\n" + "\n".join(f"{name:<{width}}  {value}" for name, value in ROWS))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": ROWS, "results": RESULTS}, indent=1, default=str))
    return sum(name in RESULTS and "failed" in RESULTS[name] for name in args.checks.split(","))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--checks", default="load,oracle_tiny,oracle_bf16,oracle_fp32,oracle_fp32_triton,"
                                            "oracle_bf16_eager,sampling,shapes,out_of_memory,speed,profile,int8")
    parser.add_argument("--speed-variants",
                        default="graphs,graphs-triton,graphs-triton-async,graphs-async,eager,graphs-512",
                        help=f"of {', '.join(SPEED_VARIANTS)}")
    parser.add_argument("--concurrency", default="16,1")
    parser.add_argument("--no-naive", action="store_true", help="skip naive transformers in the speed check")
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3", help="int8: the held-out text")
    parser.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b,llama-3.1-8b", help="of gpu_shapes.SHAPES")
    parser.add_argument("--peers", default="llama-3.1-8b", help="shapes that also run transformers' fast paths")
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU with tiny shapes (checks oracle_tiny, sampling, shapes unless --checks)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.dry_run:  # decode steps take the fixed-shape path the graphs record, eagerly on the CPU
        from tokenflow.runtime.backends import paged

        paged.decode_graph_mode = lambda config, device: "eager"
        args.device = "cpu"
        if args.checks == parser.get_default("checks"):
            args.checks = "oracle_tiny,sampling,shapes"
        args.peers = args.shapes
    failures = anyio.run(main, args)
    sys.exit(1 if failures and args.dry_run else 0)
