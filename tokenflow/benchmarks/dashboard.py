"""`tokenflow bench-dashboard`: what scraping the dashboard once a second costs under load.

Passes of closed-loop load (16 callers, 64 tokens each) alternate with and without a scraper that,
once a second, builds `GET /v1/engine/stats`'s JSON (`engine.stats()`, the feed's snapshot, encoding);
the table gives requests/s of each and the time one scrape takes, the cost's upper bound (CPU time
taken from the model per second).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import anyio

__all__ = ("add_arguments", "run_bench_dashboard")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model name, folder or file")
    p.add_argument("--rounds", type=int, default=6, help="passes of each kind, alternating")
    p.add_argument("--seconds", type=float, default=8.0, help="length of a pass")
    p.add_argument("--json", dest="json_out", default=None, help="write the results to this JSON file (default: none)")


async def _pass(engine: Any, feed: Any, seconds: float, scrape: bool, scrapes_ms: list[float]) -> float:
    """Requests/s of one pass of 16 closed-loop callers."""
    finished = 0
    stop = time.perf_counter() + seconds

    async def caller(k: int) -> None:
        nonlocal finished
        i = 0
        while time.perf_counter() < stop:
            prompt = [100 + (k * 131 + i * 17 + j) % 20000 for j in range(200)]
            await engine.generate(prompt, max_tokens=64, temperature=0.0, ignore_eos=True)
            finished += 1
            i += 1

    async def scraper() -> None:
        while time.perf_counter() < stop:
            started = time.perf_counter()
            json.dumps(feed.snapshot(engine.stats()))
            scrapes_ms.append((time.perf_counter() - started) * 1e3)
            await anyio.sleep(1.0)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for k in range(16):
            tg.start_soon(caller, k)
        if scrape:
            tg.start_soon(scraper)
    return finished / (time.perf_counter() - started)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenflow.engine import Engine
    from tokenflow.serve.dashboard import DashboardFeed

    rates: dict[str, list[float]] = {"without": [], "with": []}
    scrapes_ms: list[float] = []
    async with Engine(args.model, warmup=True, max_num_seqs=16) as engine:
        feed = DashboardFeed()
        engine.add_observer(feed)
        await _pass(engine, feed, 2.0, False, scrapes_ms)  # fills the feed and warms the caches
        for _ in range(args.rounds):
            for label in ("without", "with"):
                rates[label].append(await _pass(engine, feed, args.seconds, label == "with", scrapes_ms))
    ratios = [w / wo for wo, w in zip(rates["without"], rates["with"], strict=True)]
    return {"requests_per_s": {k: [round(x, 3) for x in v] for k, v in rates.items()},
            "ratio_median": round(statistics.median(ratios), 4),
            "scrape_ms_median": round(statistics.median(scrapes_ms), 3),
            "scrape_ms_max": round(max(scrapes_ms), 3)}


def run_bench_dashboard(args: argparse.Namespace) -> dict[str, Any]:
    results = anyio.run(_run, args)
    r = results["requests_per_s"]
    print(f"{'scraping':>10}{'req/s (median)':>16}  passes")
    for label in ("without", "with"):
        print(f"{label:>10}{statistics.median(r[label]):>16.3f}  {r[label]}")
    print(f"with / without: {results['ratio_median']:.4f} (median of paired passes); one scrape "
          f"{results['scrape_ms_median']} ms median, {results['scrape_ms_max']} ms max, once a second")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return results
