"""`tokenflow bench`: throughput and latency against transformers on one workload.

The workload is fixed and seeded: N chat requests whose prompts run from
about 20 to 600 tokens, each generating exactly `--max-tokens` tokens (EOS
ignored, greedy), sent by C closed-loop clients. Engines compared in one run:
`paged`, `paged-ngram` (the same with n-gram speculative decoding), `hf`,
and `naive` (plain `transformers` `generate`, one request at a time: the
baseline). Each engine runs in its own subprocess so that its peak memory is
its own. The table also shows the bare model forward time of
a decode step at batch 1 and 16, so each engine's per-step overhead shows.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ("ENGINE_VARIANTS", "add_arguments", "make_workload", "run_bench")

_WORDS = (
    "the engine model token cache block batch request stream latency memory python async worker queue "
    "prefix decode prefill window sparse dense attention scheduler budget chunk sample logits answer "
    "river mountain library garden window harbor lantern orchard meadow village winter summer music"
).split()


# Engines of the table that are another engine with settings of their own.
ENGINE_VARIANTS: dict[str, dict[str, Any]] = {
    "paged-ngram": {"backend": "paged", "speculative_tokens": 3},  # n-gram speculative decoding
}


def make_workload(
    tokenizer: Any, num_requests: int, min_tokens: int, max_tokens: int, seed: int = 0
) -> list[list[int]]:
    """Seeded chat prompts with lengths spread evenly over [min_tokens, max_tokens]."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num_requests):
        target = min_tokens + (max_tokens - min_tokens) * i // max(num_requests - 1, 1)
        words = [rng.choice(_WORDS) for _ in range(target)]
        text = "Summarize these notes: " + " ".join(words)
        messages = [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        prompts.append(ids[: max_tokens + 40] if len(ids) > max_tokens + 40 else ids)
    rng.shuffle(prompts)
    return prompts


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def _summary(name: str, concurrency: int, wall: float, ttfts: list[float], latencies: list[float],
             out_tokens: int) -> dict[str, Any]:
    return {
        "engine": name,
        "concurrency": concurrency,
        "requests": len(latencies),
        "output_tokens": out_tokens,
        "wall_s": round(wall, 2),
        "req_per_s": round(len(latencies) / wall, 3),
        "out_tok_per_s": round(out_tokens / wall, 1),
        "ttft_p50_s": round(_percentile(ttfts, 50), 3),
        "ttft_p99_s": round(_percentile(ttfts, 99), 3),
        "latency_p50_s": round(_percentile(latencies, 50), 3),
        "latency_p99_s": round(_percentile(latencies, 99), 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


async def _run_tokenflow(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    import anyio

    from tokenflow.engine import Engine

    settings = dict(model=args.model, backend=args.engine, dtype=args.dtype, max_num_seqs=max(args.concurrency, 1))
    settings.update(ENGINE_VARIANTS.get(args.engine, {}))
    settings.update(json.loads(args.settings or "{}"))
    async with Engine(**settings) as engine:
        if args.warmup:
            await engine.generate(prompts[0], max_tokens=4, temperature=0.0, ignore_eos=True)
        queue = list(prompts)
        ttfts: list[float] = []
        latencies: list[float] = []
        out_tokens = 0

        async def client() -> None:
            nonlocal out_tokens
            while queue:
                ids = queue.pop()
                sent = time.perf_counter()
                first = None
                async for chunk in engine.stream(ids, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True):
                    if first is None and chunk.token_ids:
                        first = time.perf_counter()
                    out_tokens += len(chunk.token_ids)
                done = time.perf_counter()
                ttfts.append((first or done) - sent)
                latencies.append(done - sent)

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(args.concurrency):
                tg.start_soon(client)
        wall = time.perf_counter() - started
        result = _summary(args.engine, args.concurrency, wall, ttfts, latencies, out_tokens)
        stats = engine.stats()
        result["engine_stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}
        result["decode_step_ms_by_batch"] = stats.get("decode_step_ms_by_batch", {})
        return result


def _run_naive(args: argparse.Namespace, model: Any, prompts: list[list[int]],
               concurrencies: list[int]) -> list[dict[str, Any]]:
    """One request at a time with `generate`. The model serves one request at a time whatever the
    concurrency, so each request runs once and C closed-loop clients are replayed from the measured
    service times: with C clients, request k is sent when request k - C finishes."""
    import torch
    from transformers import GenerationConfig

    class FirstToken:
        def __init__(self) -> None:
            self.calls = 0
            self.first: float | None = None

        def put(self, value: Any) -> None:
            self.calls += 1
            if self.calls == 2 and self.first is None:  # call 1 is the prompt
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    gen = GenerationConfig(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                           pad_token_id=0)
    services: list[tuple[float, float]] = []  # (time to first token, total time) per request
    out_tokens = 0
    for ids in prompts:
        streamer = FirstToken()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), generation_config=gen, streamer=streamer)
        done = time.perf_counter()
        services.append(((streamer.first or done) - t0, done - t0))
        out_tokens += out.shape[1] - len(ids)
    results = []
    for c in concurrencies:
        finish: list[float] = []
        ttfts, latencies = [], []
        clock = 0.0
        for i, (first, total) in enumerate(services):
            sent = 0.0 if i < c else finish[i - c]
            start = max(clock, sent)
            clock = start + total
            finish.append(clock)
            ttfts.append(start + first - sent)
            latencies.append(clock - sent)
        results.append(_summary("naive", c, clock, ttfts, latencies, out_tokens))
    return results


def bare_forward_ms(model: Any, batch: int, context: int = 300, repeats: int = 5) -> float:
    """Median time of one decode step with HF's own DynamicCache (no engine)."""
    import torch
    from transformers import DynamicCache

    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(min(100, vocab // 2), min(1000, vocab), (batch, context))
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(ids, past_key_values=cache, use_cache=True)
        step = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model(step, past_key_values=out.past_key_values, use_cache=True)
            times.append((time.perf_counter() - t0) * 1e3)
            step = out.logits[:, -1:].argmax(-1)
    return round(statistics.median(times), 2)


def _worker(args: argparse.Namespace) -> None:
    """Run one engine on the workload and print one JSON line (a list of results)."""
    concurrencies = [int(c) for c in str(args.concurrency).split(",")]
    args.concurrency = concurrencies[0]
    import anyio
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenflow.hub import resolve_model
    from tokenflow.runtime.loader import resolve_dtype

    path = resolve_model(args.model).path
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = make_workload(tokenizer, args.requests, args.min_prompt, args.max_prompt)
    if args.engine == "naive":
        dtype = resolve_dtype(args.dtype, torch.device("cpu"))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        results = _run_naive(args, model, prompts, concurrencies)
        results[0]["bare_forward_ms"] = {str(b): bare_forward_ms(model, b) for b in (1, 16)}
    else:
        results = [anyio.run(_run_tokenflow, args, prompts)]
    print("RESULT " + json.dumps(results), flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--engines", default="paged,paged-ngram,hf,naive",
                   help="comma list of paged, paged-ngram (paged with speculative_tokens=3), hf, naive")
    p.add_argument("--concurrency", default="1,16", help="comma list of client counts")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=20)
    p.add_argument("--max-prompt", type=int, default=600)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--naive-dtype", default=None,
                   help="dtype of the naive baseline (default: --dtype); e.g. bf16 engines against fp32 naive")
    p.add_argument("--settings", default=None, help="JSON of extra engine settings")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--json", dest="json_out", default=None, help="write the results to this file")
    p.add_argument("--worker", dest="engine", default=None, help=argparse.SUPPRESS)


def _print_table(results: list[dict[str, Any]]) -> None:
    cols = ["engine", "dtype", "concurrency", "req_per_s", "out_tok_per_s", "ttft_p50_s", "ttft_p99_s",
            "latency_p50_s", "latency_p99_s", "peak_rss_mb"]
    naive = {r["concurrency"]: r["req_per_s"] for r in results if r["engine"] == "naive"}
    rows = [[*(str(r[c]) for c in cols),
             f"{r['req_per_s'] / naive[r['concurrency']]:.2f}x" if r["concurrency"] in naive else "-"]
            for r in results]
    header = [*cols, "vs_naive"]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    for row in [header, *rows]:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    for r in results:
        if "bare_forward_ms" in r:
            print(f"bare HF decode forward ({r['dtype']}, DynamicCache, context 300): "
                  f"batch 1 = {r['bare_forward_ms']['1']} ms, "
                  f"batch 16 = {r['bare_forward_ms']['16']} ms")
            break
    for r in results:
        for size, t in r.get("decode_step_ms_by_batch", {}).items():
            if str(size) in ("1", "16") and t["count"] >= 3:
                share = (t["step"] - t["forward"]) / t["step"] * 100
                print(f"{r['engine']} c={r['concurrency']}: decode step at batch {size}: {t['step']} ms median "
                      f"({t['forward']} ms in the model forward, engine overhead {share:.1f}%; n={t['count']})")


def run_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.engine:
        _worker(args)
        return []
    results: list[dict[str, Any]] = []
    jobs = [(engine, str(c)) for c in args.concurrency.split(",") for engine in args.engines.split(",")
            if engine != "naive"]
    if "naive" in args.engines.split(","):
        jobs.insert(0, ("naive", args.concurrency))  # one run serves every concurrency level
    for engine, concurrency in jobs:
        dtype = (args.naive_dtype or args.dtype) if engine == "naive" else args.dtype
        cmd = [sys.executable, "-m", "tokenflow", "bench", "--worker", engine, "--concurrency", concurrency,
               "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
               "--min-prompt", str(args.min_prompt), "--max-prompt", str(args.max_prompt), "--dtype", dtype]
        if args.model:
            cmd += ["--model", args.model]
        if args.settings:
            cmd += ["--settings", args.settings]
        if not args.warmup:
            cmd.append("--no-warmup")
        print(f"running {engine} at concurrency {concurrency} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"bench worker {engine} failed (exit {proc.returncode})")
        results.extend({**r, "dtype": dtype} for r in json.loads(line[len("RESULT "):]))
    results.sort(key=lambda r: (r["concurrency"], r["engine"] != "naive"))
    _print_table(results)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json_out}")
    return results
