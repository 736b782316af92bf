"""`tokenflow bench-prefix`: what the tiered prefix cache saves.

Two tables from one run, on one model:

* Hit rate of the eviction policies. One seeded workload is run once per
  policy: most requests start with one of three long system prompts (used
  with skewed popularity), interleaved with bursts of one-off long documents
  whose blocks together exceed the pool. A policy that keeps the hot
  prefixes hits on them; one that follows recency alone lets each burst of
  documents push them out.
* Time to first token of one request whose long prefix is: not cached
  (recompute), resident in the pool, on disk without a prefetcher (loaded
  when the batcher admits it), and on disk with the prefetcher while the
  request waits behind a busy one (the load overlaps the wait); then a queue
  of requests sent at once, each with its own prefix on disk, without and with
  the prefetcher (the later ones' loads overlap the earlier ones' turns). The
  disk is this machine's disk through the OS page cache, as in a warm restart.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from tokenflow.engine import Engine

QUEUED = 4  # requests in the queue case of the TTFT table

__all__ = ("add_arguments", "hit_rate_workload", "run_bench_prefix", "run_hit_rate", "run_ttft")


def hit_rate_workload(
    vocab: int, *, system_tokens: int, doc_tokens: int, cycles: int, seed: int = 0
) -> list[tuple[str, list[int]]]:
    """(kind, prompt) pairs: each cycle is 4 requests on the hot system prompts, then 3 one-off documents."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    systems = [tokens(system_tokens) for _ in range(3)]
    workload = []
    for _ in range(cycles):
        for _ in range(4):
            system = rng.choices(systems, weights=(5, 3, 2))[0]
            workload.append(("hot", system + tokens(rng.randint(8, 24))))
        workload += [("doc", tokens(doc_tokens)) for _ in range(3)]
    return workload


async def run_hit_rate(model: str, policy: str, workload: list[tuple[str, list[int]]], **settings: Any) -> dict:
    """Run `workload` one request at a time under `policy`; hit rates overall and on hot requests."""
    hot_hit = hot_total = 0
    started = time.perf_counter()
    async with Engine(model, eviction_policy=policy, **settings) as engine:
        for kind, prompt in workload:
            done = await engine.generate(prompt, max_tokens=1, temperature=0.0, ignore_eos=True)
            if kind == "hot":
                hot_hit += done.usage.cached_tokens
                hot_total += len(prompt)
        stats = engine.stats()
    return {
        "policy": policy,
        "requests": len(workload),
        "hit_rate": round(stats["prefix_cache_hit_tokens"] / stats["prefix_cache_queried_tokens"], 4),
        "hot_hit_rate": round(hot_hit / hot_total, 4) if hot_total else 0.0,
        "hit_tokens": stats["prefix_cache_hit_tokens"],
        "queried_tokens": stats["prefix_cache_queried_tokens"],
        "evictions": stats["pool_evictions"],
        "pool_blocks": stats["kv_blocks_total"],
        "wall_s": round(time.perf_counter() - started, 1),
    }


async def _ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    started = time.perf_counter()
    async for chunk in engine.stream(prompt, max_tokens=1, temperature=0.0, ignore_eos=True):
        ttft = time.perf_counter() - started
        return ttft, (chunk.usage.cached_tokens if chunk.usage else 0)
    raise RuntimeError("no output")


async def _queue_ttfts(engine: Engine, prompts: list[list[int]], busy: list[int],
                       busy_tokens: int) -> list[tuple[float, int]]:
    """(TTFT, cached tokens) of `prompts`, sent at once while `busy` occupies the engine's only sequence slot."""
    ttfts: list[tuple[float, int]] = []

    async def one(prompt: list[int]) -> None:
        ttfts.append(await _ttft(engine, prompt))

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: engine.generate(busy, max_tokens=busy_tokens, temperature=0.0, ignore_eos=True))
        await anyio.sleep(0.05)
        for prompt in prompts:
            tg.start_soon(one, prompt)
    return sorted(ttfts)


async def run_ttft(model: str, prefix_tokens: int, vocab: int, queued: int = QUEUED,
                   **settings: Any) -> list[dict[str, Any]]:
    rng = random.Random(1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    prompt = tokens(prefix_tokens) + tokens(12)
    busy = tokens(64)
    queue = [tokens(prefix_tokens) + tokens(12) for _ in range(queued)]  # each its own prefix
    rows = []

    def row(case: str, ttft: float, cached: int, note: str = "") -> None:
        rows.append({"case": case, "ttft_ms": round(ttft * 1e3, 1), "cached_tokens": cached, "note": note})

    with tempfile.TemporaryDirectory(prefix="tokenflow-bench-") as folder:
        async with Engine(model, cache_dir=folder, **settings) as engine:
            await _ttft(engine, busy)  # warm-up: first-call costs out of the way
            row("recompute (not cached)", *await _ttft(engine, prompt))
            row("pool hit", *await _ttft(engine, prompt))
            for other in queue:  # their prefixes reach the disk tier too
                await _ttft(engine, other)
        async with Engine(model, cache_dir=folder, prefetch=False, **settings) as engine:
            await _ttft(engine, busy)
            row("disk hit, no prefetch", *await _ttft(engine, prompt), note="loaded at admission")
        async with Engine(model, cache_dir=folder, prefetch=False, max_num_seqs=1, **settings) as engine:
            await _ttft(engine, busy)
            row("disk hit, no prefetch, queued", *(await _queue_ttfts(engine, [prompt], busy, 16))[0],
                note="behind a 16-token request")
        async with Engine(model, cache_dir=folder, max_num_seqs=1, **settings) as engine:
            await _ttft(engine, busy)
            (ttft, cached), = await _queue_ttfts(engine, [prompt], busy, 16)
            stats = engine.stats()
            row("disk hit, prefetch, queued", ttft, cached,
                note=f"behind a 16-token request; prefetch in time {stats['disk_prefetch_in_time']}, "
                     f"late {stats['disk_prefetch_late']}")
        for prefetch in (False, True):  # a queue: each request waits for the ones ahead, its prefix on disk
            async with Engine(model, cache_dir=folder, prefetch=prefetch, max_num_seqs=1, **settings) as engine:
                await _ttft(engine, busy)
                ttfts = await _queue_ttfts(engine, queue, busy, 16)
                late = engine.stats().get("disk_prefetch_late", 0) if prefetch else None
            mean = sum(t for t, _ in ttfts) / len(ttfts)
            row(f"{queued} disk hits queued, {'prefetch' if prefetch else 'no prefetch'}", mean,
                sum(c for _, c in ttfts), note=f"mean TTFT of {queued} sent at once behind a 16-token request (last "
                f"{ttfts[-1][0] * 1e3:.0f} ms)" + (f"; loads late {late}" if late is not None else ""))
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model name, folder or file")
    p.add_argument("--system-tokens", type=int, default=1000, help="length of each hot system prompt")
    p.add_argument("--doc-tokens", type=int, default=1200, help="length of each one-off document")
    p.add_argument("--cycles", type=int, default=6, help="cycles of 4 hot requests and 3 documents")
    p.add_argument("--pool-blocks", type=int, default=320, help="KV pool size for the hit-rate run")
    p.add_argument("--prefix-tokens", type=int, default=1500, help="cached prefix length in the TTFT table")
    p.add_argument("--json", dest="json_out", default=None, help="write the results to this JSON file (default: none)")
    p.add_argument("--plot", default=None, help="draw the results into this PNG (needs the plot extra; default: none)")


def _print(rows: list[dict[str, Any]], cols: list[str]) -> None:
    cells = [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(cols, *cells)]
    for line in [cols, *cells]:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip())


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenflow.hub import resolve_model

    model = str((await anyio.to_thread.run_sync(resolve_model, args.model)).path)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    workload = hit_rate_workload(vocab, system_tokens=args.system_tokens, doc_tokens=args.doc_tokens,
                                 cycles=args.cycles)
    settings = {"num_kv_blocks": args.pool_blocks, "max_batch_tokens": 512}
    hit_rows = [await run_hit_rate(model, policy, workload, **settings) for policy in ("lfu_lru", "lru")]
    ttft_rows = await run_ttft(model, args.prefix_tokens, vocab, max_batch_tokens=512)
    return {"hit_rate": hit_rows, "ttft": ttft_rows}


def run_bench_prefix(args: argparse.Namespace) -> dict[str, Any]:
    results = anyio.run(_run, args)
    print(f"hit rate: {args.cycles} cycles of 4 requests on 3 hot {args.system_tokens}-token system prompts "
          f"+ 3 one-off {args.doc_tokens}-token documents; pool of {args.pool_blocks} blocks")
    _print(results["hit_rate"], ["policy", "requests", "hit_rate", "hot_hit_rate", "hit_tokens", "queried_tokens",
                                 "evictions", "wall_s"])
    lfu, lru = results["hit_rate"]
    if lru["hit_tokens"]:
        print(f"lfu_lru hits {lfu['hit_tokens'] / lru['hit_tokens']:.2f}x the tokens lru hits")
    print(f"\ntime to first token, {args.prefix_tokens}-token cached prefix + 12 new tokens")
    _print(results["ttft"], ["case", "ttft_ms", "cached_tokens", "note"])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    if args.plot:
        from tokenflow.benchmarks.plots import plot_prefix

        plot_prefix(results, args.plot)
    return results
