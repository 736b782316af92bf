"""`tokenflow bench-step`: the cost of one step, and of scheduling it.

* Decode step time at batch 1 and 16, with and without `compile=True`
  (each engine warmed up first, so compilation is not in the numbers): the
  median over the run of the whole step and of its model forward.
* The scheduler's own time per step with 64 running sequences (no model):
  `BucketingBatcher.schedule()` over the token pool, as the step loop calls it.
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


def scheduler_us_per_step(num_running: int = 64, prompt_tokens: int = 300, steps: int = 200) -> dict[str, float]:
    """Median and p99 microseconds of `schedule()` with `num_running` decoding sequences."""
    from tokenflow.config import EngineConfig
    from tokenflow.kv.eviction import LFULRUPolicy
    from tokenflow.kv.prefix_cache import TokenPool
    from tokenflow.params import SamplingParams
    from tokenflow.request import Request
    from tokenflow.scheduler.scheduler import BucketingBatcher

    config = EngineConfig(max_num_seqs=num_running, max_batch_tokens=num_running * prompt_tokens)
    batcher = BucketingBatcher(config)
    batcher.pool = TokenPool(num_running * (prompt_tokens + steps) // 16 + 64, 16, policy=LFULRUPolicy())
    batcher.max_model_len = 8192
    for i in range(num_running):
        params = SamplingParams(max_tokens=steps + 10, ignore_eos=True)
        batcher.add(Request(params, prompt_token_ids=[(i * 13 + j) % 30000 for j in range(prompt_tokens)],
                            arrival_time=float(i)))
    times = []
    for step in range(steps):
        started = time.perf_counter()
        plan = batcher.schedule()
        elapsed = time.perf_counter() - started
        if step:  # the first step admits and prefills everyone; the rest are decode steps
            times.append(elapsed * 1e6)
        for chunk in plan.chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
            chunk.request.output_token_ids.append(1)
    times.sort()
    return {"running": num_running, "median_us": round(statistics.median(times), 1),
            "p99_us": round(times[int(0.99 * (len(times) - 1))], 1)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=32, help="decode steps per batch size")
    p.add_argument("--json", dest="json_out", default=None)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenflow.hub import resolve_model

    model = str((await anyio.to_thread.run_sync(resolve_model, args.model)).path)
    rows = []
    for compile in (False, True):
        rows += await _decode_rows(model, compile, (1, 16), args.steps)
    return {"decode": rows, "scheduler": scheduler_us_per_step()}


def run_bench_step(args: argparse.Namespace) -> dict[str, Any]:
    results = anyio.run(_run, args)
    print(f"{'compile':>8}{'batch':>7}{'step ms':>10}{'forward ms':>12}{'steps':>7}")
    for r in results["decode"]:
        print(f"{r['compile']!s:>8}{r['batch']:>7}{r['step_ms']:>10}{r['forward_ms']:>12}{r['steps']:>7}")
    s = results["scheduler"]
    print(f"scheduler: {s['median_us']} us per step median ({s['p99_us']} us p99) with {s['running']} running")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return results
