"""`tokenflow bench-step`: the cost of one step, and of scheduling it.

* Decode step time at batch 1 and 16, with and without `compile=True`
  (each engine warmed up first, so compilation is not in the numbers): the
  median over the run of the whole step and of its model forward.
* Structured outputs: decode step time at batch 16 with and without a
  JSON-schema constraint on every row (the masks are filled beside the
  forward pass), and the first request's costs: building the grammar
  library's view of the vocabulary, and compiling the schema.
* With `--parts`, only where a step's time goes, and each step's floor here (`step_parts.py`).
* The scheduler's own time per step with 64 running sequences (no model):
  `schedule()` and `update_from_output()` over the prefix cache, as the step
  loop calls them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import anyio

__all__ = ("add_arguments", "run_bench_step", "scheduler_us_per_step")


async def _decode_rows(model: str, compile: bool, batches: tuple[int, ...], steps: int) -> list[dict[str, Any]]:
    from tokenflow.engine import Engine

    rows = []
    async with Engine(model, compile=compile, warmup=True, max_num_seqs=max(batches)) as engine:
        for batch in batches:
            async with anyio.create_task_group() as tg:
                for i in range(batch):
                    prompt = [(31 * i + 7 * j) % 20000 + 100 for j in range(64)]
                    tg.start_soon(lambda p=prompt, salt=f"b{batch}": engine.generate(
                        p, max_tokens=steps, temperature=0.0, ignore_eos=True, cache_salt=salt))
        by_batch = engine.stats()["decode_step_ms_by_batch"]
    for batch in batches:
        t = by_batch.get(batch) or by_batch.get(str(batch))
        rows.append({"compile": compile, "batch": batch, "step_ms": t["step"], "forward_ms": t["forward"],
                     "steps": t["count"]})
    return rows


# At least 40 items: the output is still inside the array when the step budget ends, so every row stays
# constrained (and running) for the whole pass.
LIST_SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}}


class _StepTimes:
    """An engine observer keeping each step's duration (ms)."""

    def __init__(self) -> None:
        self.ms: list[float] = []

    def on_step(self, duration_s: float, ok: bool) -> None:
        self.ms.append(duration_s * 1e3)

    def on_request_end(self, request: Any, outcome: str) -> None:
        pass


async def _structured_rows(model: str, steps: int, rounds: int = 15) -> dict[str, Any]:
    """Median step time of passes of 16 requests, unconstrained and with LIST_SCHEMA on every row,
    alternating in one engine (so machine drift hits both alike); the median of each pass skips its one
    prefill step. The overhead is the median over rounds of each round's constrained / plain ratio. Two
    prompt sets: random tokens (the model knows nothing of the schema, so the grammar refuses many of its
    tokens) and chat prompts asking for the JSON (what an app sends)."""
    from tokenflow.engine import Engine

    variants = {"none": {}, "json_schema": {"json_schema": LIST_SCHEMA}}
    times = _StepTimes()
    results: dict[str, Any] = {}
    async with Engine(model, warmup=True, max_num_seqs=16) as engine:
        engine.add_observer(times)
        asked = [await engine.tokenize([{"role": "user", "content": f"List 40 people (set {i}) as a JSON array of "
                                         "objects with a name and an age."}]) for i in range(16)]
        prompt_sets = {"random": [[[(31 * i + 7 * j + r) % 20000 + 100 for j in range(64)] for i in range(16)]
                                  for r in range(rounds)],
                       "asked": [asked] * rounds}
        for name, prompts in prompt_sets.items():
            medians: dict[str, list[float]] = {label: [] for label in variants}
            resampled = engine.stats()["num_masked_resamples"]
            settled = engine.stats()["num_rejection_settled"]
            for round_ in range(rounds):
                for label, extra in variants.items():
                    times.ms.clear()
                    async with anyio.create_task_group() as tg:
                        for i in range(16):
                            tg.start_soon(lambda p=prompts[round_][i], i=i, x=extra: engine.generate(
                                p, max_tokens=steps, temperature=1.0, seed=i, ignore_eos=True, **x))
                    medians[label].append(statistics.median(times.ms))
            ratios = [c / n for n, c in zip(medians["none"], medians["json_schema"], strict=True)]
            results[name] = {
                "rows": [{"constraint": label, "batch": 16, "step_ms": round(statistics.median(v), 2),
                          "passes_ms": [round(x, 2) for x in v]} for label, v in medians.items()],
                "overhead_pct": round(100 * (statistics.median(ratios) - 1), 1),
                "resampled_fraction": round((engine.stats()["num_masked_resamples"] - resampled)
                                            / (rounds * 16 * steps), 3),
                "masked_fraction": round((engine.stats()["num_masked_resamples"] - resampled
                                          - engine.stats()["num_rejection_settled"] + settled)
                                         / (rounds * 16 * steps), 3)}
    return results


def grammar_compile_ms(model: str) -> dict[str, float]:
    """Milliseconds to build the grammar library's vocabulary view, then to compile LIST_SCHEMA."""
    from transformers import AutoTokenizer

    from tokenflow.params import SamplingParams
    from tokenflow.structured.grammar import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(model)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}), cache_size=4)
    started = time.perf_counter()
    compiler.tokenizer()
    built = time.perf_counter()
    compiler.matcher(SamplingParams(json_schema=LIST_SCHEMA))
    compiled = time.perf_counter()
    compiler.matcher(SamplingParams(json_schema=LIST_SCHEMA))
    cached = time.perf_counter()
    return {"vocabulary_ms": round((built - started) * 1e3, 1), "compile_ms": round((compiled - built) * 1e3, 1),
            "cached_ms": round((cached - compiled) * 1e3, 2)}


def scheduler_us_per_step(num_running: int = 64, prompt_tokens: int = 300, steps: int = 200) -> dict[str, float]:
    """Median and p99 microseconds of `schedule()` + `update_from_output()` with `num_running` decoding
    sequences."""
    from tokenflow.config import EngineConfig
    from tokenflow.kv.eviction import LFULRUPolicy
    from tokenflow.kv.prefix_cache import PrefixCache
    from tokenflow.params import SamplingParams
    from tokenflow.protocols import StepOutput
    from tokenflow.request import Request
    from tokenflow.runtime.sampler import SamplerOutput
    from tokenflow.scheduler.scheduler import Scheduler

    class Sink:  # the output processor's part: record the token, never finish
        def append(self, request: Request, token_id: int, logprob: Any) -> bool:
            request.output_token_ids.append(token_id)
            return False

    config = EngineConfig(max_num_seqs=num_running, max_batch_tokens=num_running * prompt_tokens)
    scheduler = Scheduler(config)
    scheduler.pool = PrefixCache(num_running * (prompt_tokens + steps) // 16 + 64, 16, policy=LFULRUPolicy())
    scheduler.max_model_len = 8192
    for i in range(num_running):
        params = SamplingParams(max_tokens=steps + 10, ignore_eos=True)
        scheduler.add(Request(params, prompt_token_ids=[(i * 13 + j) % 30000 for j in range(prompt_tokens)],
                              arrival_time=float(i)))
    times, sink = [], Sink()
    for step in range(steps):
        started = time.perf_counter()
        plan = scheduler.schedule()
        sampling = sum(1 for c in plan.chunks if c.samples)
        scheduler.update_from_output(plan, StepOutput(SamplerOutput([1] * sampling, None), [[]] * sampling), sink)
        elapsed = time.perf_counter() - started
        if step:  # the first step admits and prefills everyone; the rest are decode steps
            times.append(elapsed * 1e6)
    times.sort()
    return {"running": num_running, "median_us": round(statistics.median(times), 1),
            "p99_us": round(times[int(0.99 * (len(times) - 1))], 1)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model name, folder or file")
    p.add_argument("--steps", type=int, default=32, help="decode steps per batch size")
    p.add_argument("--json", dest="json_out", default=None, help="write the results to this JSON file (default: none)")
    p.add_argument("--parts", action="store_true",
                   help="only where a step's time goes: linears, head, attention, norms, rest, for decode steps "
                        "and prefill chunks in bf16 and fp32, few-rows kernel and oneDNN alternating, each against "
                        "its floor on this machine (memory read and matmul rates measured in the run)")


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenflow.hub import resolve_model

    model = str((await anyio.to_thread.run_sync(resolve_model, args.model)).path)
    rows = []
    for compile in (False, True):
        rows += await _decode_rows(model, compile, (1, 16), args.steps)
    structured = await _structured_rows(model, args.steps)
    compile_ms = await anyio.to_thread.run_sync(grammar_compile_ms, model)
    return {"decode": rows, "structured": structured, "grammar": compile_ms, "scheduler": scheduler_us_per_step()}


def _run_parts(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tokenflow.benchmarks.step_parts import step_parts
    from tokenflow.hub import resolve_model

    model = str(resolve_model(args.model).path)
    rows = [row for dtype in (torch.bfloat16, torch.float32) for row in step_parts(model, dtype)]
    keys = ("step_ms", "linears_ms", "head_ms", "attention_ms", "norms_ms", "rest_ms", "floor_ms")
    header = "".join(f"{k.removesuffix('_ms') + ' ms':>13}" for k in keys)
    print(f"{'dtype':>9} {'case':>22} {'linears by':>10}" + header + f"{'floor/step':>11}")
    for r in rows:
        cells = "".join(f"{'-' if r[k] is None else r[k]:>13}" for k in keys)  # None: not timed apart (C loop)
        print(f"{r['dtype']:>9} {r['case']:>22} {r['linears_kernel']:>10}" + cells
              + f"{r['floor_ms'] / r['step_ms']:>11.0%}")
    for dtype in {r["dtype"]: r for r in rows}.values():
        print(f"{dtype['dtype']}: floor = weights + cached K/V read at {dtype['read_gb_per_s']} GB/s, or the "
              f"arithmetic at {dtype['matmul_tflops']} TFLOPS (oneDNN matmul), both measured in this run")
    results = {"parts": rows}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return results


def run_bench_step(args: argparse.Namespace) -> dict[str, Any]:
    if args.parts:
        return _run_parts(args)
    results = anyio.run(_run, args)
    print(f"{'compile':>8}{'batch':>7}{'step ms':>10}{'forward ms':>12}{'steps':>7}")
    for r in results["decode"]:
        print(f"{r['compile']!s:>8}{r['batch']:>7}{r['step_ms']:>10}{r['forward_ms']:>12}{r['steps']:>7}")
    print(f"{'prompts':>8}{'constraint':>12}{'batch':>7}{'step ms':>10}  passes (ms)")
    for name, structured in results["structured"].items():
        for r in structured["rows"]:
            print(f"{name:>8}{r['constraint']:>12}{r['batch']:>7}{r['step_ms']:>10}  {r['passes_ms']}")
        print(f"{name} prompts, json_schema on every row: {structured['overhead_pct']:+.1f}% step time at batch 16 "
              f"(median of paired passes); {100 * structured['resampled_fraction']:.0f}% of its tokens drawn "
              f"again, {100 * structured['masked_fraction']:.0f}% under the mask")
    g = results["grammar"]
    print(f"first constrained request: vocabulary {g['vocabulary_ms']} ms once per engine, schema compile "
          f"{g['compile_ms']} ms, cached {g['cached_ms']} ms")
    s = results["scheduler"]
    print(f"scheduler: {s['median_us']} us per step median ({s['p99_us']} us p99) with {s['running']} running")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return results
