"""`tokenflow bench-tokenizer`: the tokenizer stage against encoding on the event loop.

64 concurrent requests with ~2,000-token prompts (distinct texts, so the
LRU cache does not help). For each way of encoding it reports the wall time,
the tokenization throughput, and the event loop's worst stall, measured by a
ticker task that sleeps 1 ms and records the largest gap it sees. It also
times the output path per step with 64 streams (detokenizer + stop strings).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import anyio

__all__ = ("add_arguments", "run_bench_tokenizer")

_WORDS = ("river stone bridge children water birds summer light village bread music tea 天空 蓝色 "
          "日本語 テキスト 🙂 cafe naive resume engine model token cache").split()


def _texts(n: int, approx_tokens: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"document {i}: " + " ".join(rng.choice(_WORDS) for _ in range(approx_tokens // 2))
            for i in range(n)]


class _LagTicker:
    """Measures how long the event loop is blocked: the worst delay of a 1 ms sleep."""

    def __init__(self) -> None:
        self.worst_ms = 0.0
        self._stop = anyio.Event()

    async def run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            await anyio.sleep(0.001)
            self.worst_ms = max(self.worst_ms, (time.perf_counter() - t0) * 1e3 - 1.0)

    def stop(self) -> None:
        self._stop.set()


async def _measure(encode: Any, texts: list[str]) -> dict[str, float]:
    ticker = _LagTicker()
    counts: list[int] = []

    async def one(text: str) -> None:
        counts.append(len(await encode(text)))

    started = time.perf_counter()
    async with anyio.create_task_group() as outer:
        outer.start_soon(ticker.run)
        await anyio.sleep(0.01)
        async with anyio.create_task_group() as tg:
            for text in texts:
                tg.start_soon(one, text)
        ticker.stop()
    wall = time.perf_counter() - started - 0.01
    return {"wall_s": round(wall, 3), "tokens": sum(counts), "tokens_per_s": round(sum(counts) / wall),
            "worst_loop_stall_ms": round(ticker.worst_ms, 1)}


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from tokenflow.config import EngineConfig
    from tokenflow.hub import resolve_model
    from tokenflow.protocols import EngineContext
    from tokenflow.stages.tokenizer import TokenizerStage

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model).path)
    texts = _texts(args.requests, args.prompt_tokens, seed=0)
    tokenizer(texts[:2])  # warm the tokenizer once for both contenders

    async def on_loop(text: str) -> list[int]:
        await anyio.lowlevel.checkpoint()
        return tokenizer(text)["input_ids"]

    config = EngineConfig(tokenizer_cache_size=0)
    stage = TokenizerStage(config)
    await stage.start(EngineContext(config, tokenizer, 10**9, frozenset(), len(tokenizer)))

    results = {
        "on_event_loop": await _measure(on_loop, texts),
        "tokenizer_stage": await _measure(stage.encode, _texts(args.requests, args.prompt_tokens, seed=1)),
        "stage_batches": stage.num_batches,
        "detok_us_per_step_64_streams": _detok_cost(tokenizer, streams=64, steps=128),
    }
    return results


def _detok_cost(tokenizer: Any, streams: int, steps: int) -> float:
    """Median µs per step for OutputProcessor.append over `streams` requests (2 stop strings each)."""
    import statistics

    from tokenflow.output.processor import OutputProcessor
    from tokenflow.params import SamplingParams
    from tokenflow.request import Request

    ids = tokenizer(" ".join(_texts(1, steps * 2, seed=2)))["input_ids"]
    out = OutputProcessor(tokenizer, frozenset(), 10**9)
    requests = []
    for _ in range(streams):
        r = Request(SamplingParams(max_tokens=10**6, stop=["</end>", "STOP HERE"]), prompt_token_ids=ids[:8])
        out.prepare(r)
        requests.append(r)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        for offset, r in enumerate(requests):
            out.append(r, ids[(step + offset) % len(ids)], None)
        times.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(times), 1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model whose tokenizer is measured (default: the embedded model)")
    p.add_argument("--requests", type=int, default=64, help="prompts encoded at once")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="tokens per prompt")
    p.add_argument("--json", dest="json_out", default=None, help="write the results to this JSON file (default: none)")


def run_bench_tokenizer(args: argparse.Namespace) -> dict[str, Any]:
    results = anyio.run(_run, args)
    print(f"{'':18}{'wall s':>8}{'tokens/s':>12}{'worst loop stall ms':>22}")
    for name in ("on_event_loop", "tokenizer_stage"):
        r = results[name]
        print(f"{name:18}{r['wall_s']:>8}{r['tokens_per_s']:>12}{r['worst_loop_stall_ms']:>22}")
    speed = results["tokenizer_stage"]["tokens_per_s"] / results["on_event_loop"]["tokens_per_s"]
    print(f"stage throughput: {speed:.2f}x the event-loop encoding, in {results['stage_batches']} batch calls")
    print(f"output path (detokenizer + 2 stop strings), 64 streams: "
          f"{results['detok_us_per_step_64_streams']} us per step")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return results
