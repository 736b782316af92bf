"""`tokenflow-redis-bench`: what the shared tier buys, measured.

1. TTFT across processes: process A computes a long prompt (publishing its
   blocks); process B, a fresh engine with an empty pool and no disk, asks
   for the same prompt (a Redis hit), then once more (a pool hit), and also a
   long prompt nobody computed (a recompute in the same process, the
   baseline for the ratio). Both processes warm up first.
2. Consistent hashing: the share of keys that move when a node joins N nodes,
   next to the ideal 1/(N+1).

Without `--urls` it starts a temporary `redis-server` on a free port. The
two processes share a random secret made for the run (in the environment,
`TFREDIS_BENCH_SECRET`), so the values they write serve nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tokenflow_redis.ring import HashRing, moved_fraction

_SECRET_ENV = "TFREDIS_BENCH_SECRET"
QUESTION = "\n\nQuestion: summarise the text above in one sentence."


def _long_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocab = ["river", "stone", "engine", "cache", "block", "token", "light", "garden", "network", "memory",
             "paper", "signal", "winter", "harbor", "motion", "quiet", "number", "forest", "window", "market"]
    return " ".join(rng.choice(vocab) for _ in range(words))


async def _ttft(engine: Any, prompt: str) -> tuple[float, Any]:
    """Seconds to the first chunk, and the request's usage (prompt and cached tokens)."""
    started = time.perf_counter()
    first = None
    async for chunk in engine.stream(prompt, max_tokens=4, temperature=0.0):
        first = first if first is not None else time.perf_counter() - started
        usage = chunk.usage
    return first, usage


async def _process(role: str, model: str, urls: list[str], words: int) -> dict[str, Any]:
    """One engine process: A computes the shared prompt, B measures hits against a recompute."""
    from tokenflow import Engine
    from tokenflow_redis import KV_TIERS

    shared, fresh = _long_text(1, words) + QUESTION, _long_text(2, words) + QUESTION
    secret = os.environ[_SECRET_ENV]
    settings = {"kv_tiers": KV_TIERS,
                "plugin_settings": {"redis_tier": {"urls": urls, "secret": secret}}}
    rows: dict[str, Any] = {}
    async with Engine(model, **settings) as engine:
        await engine.generate("Hello there, warm up please.", max_tokens=4, temperature=0.0)
        if role == "A":
            rows["A: recompute (publishes)"], usage = await _ttft(engine, shared)
        else:
            rows["B: recompute (not in Redis)"], _ = await _ttft(engine, fresh)
            rows["B: Redis hit"], usage = await _ttft(engine, shared)
            rows["B: pool hit"], _ = await _ttft(engine, shared)
            rows["redis_hit_tokens"] = usage.cached_tokens
        stats = engine.stats()
        rows["prompt_tokens"] = usage.prompt_tokens
        rows["blocks_published"] = stats["redis_blocks_published"]
        rows["blocks_loaded"] = stats["redis_blocks_loaded"]
    return rows


def _run_process(role: str, model: str, urls: list[str], words: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "tokenflow_redis.bench", "--role", role, "--model", model, "--words", str(words),
         "--urls", ",".join(urls)],
        capture_output=True, text=True, check=True, timeout=900,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def ring_movement(max_nodes: int = 8, num_keys: int = 100_000, vnodes: int = 160) -> list[dict[str, float]]:
    keys = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(num_keys)]
    rows = []
    for n in range(1, max_nodes + 1):
        nodes = [f"node{i}" for i in range(n)]
        before, after = HashRing(nodes, vnodes), HashRing([*nodes, f"node{n}"], vnodes)
        rows.append({"nodes": n, "moved": moved_fraction(before, after, keys), "ideal": 1 / (n + 1)})
    return rows


def _start_redis() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("no --urls given and redis-server is not installed")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tokenflow-redis-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--urls", default="", help="comma-separated Redis URLs (default: start one)")
    parser.add_argument("--words", type=int, default=1200, help="words in the long prompt")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--role", choices=["A", "B"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    urls = [u for u in args.urls.split(",") if u]
    if args.role:
        print(json.dumps(asyncio.run(_process(args.role, args.model, urls, args.words))))
        return
    os.environ.setdefault(_SECRET_ENV, secrets.token_hex(32))  # inherited by both processes
    proc = None
    if not urls:
        proc, url = _start_redis()
        urls = [url]
    try:
        a = _run_process("A", args.model, urls, args.words)
        b = _run_process("B", args.model, urls, args.words)
    finally:
        if proc is not None:
            proc.kill()
    recompute, hit = b["B: recompute (not in Redis)"], b["B: Redis hit"]
    print(f"TTFT, {args.model}, a {b['prompt_tokens']}-token prompt, two processes sharing {len(urls)} "
          f"Redis node(s)")
    print(f"{'case':<30} {'TTFT ms':>9}")
    for name, value in [("A: recompute (publishes)", a["A: recompute (publishes)"]), *(
            (k, b[k]) for k in ("B: recompute (not in Redis)", "B: Redis hit", "B: pool hit"))]:
        print(f"{name:<30} {value * 1e3:>9.0f}")
    print(f"Redis hit vs recompute in process B: {recompute / hit:.1f}x faster "
          f"({b['redis_hit_tokens']} tokens from Redis; A published {a['blocks_published']} blocks)")
    ring = ring_movement()
    print("\nconsistent hashing, 100,000 keys, 160 virtual nodes per node: a node joins N nodes")
    print(f"{'N':>3} {'moved':>8} {'1/(N+1)':>8}")
    for row in ring:
        print(f"{row['nodes']:>3} {row['moved']:>8.3f} {row['ideal']:>8.3f}")
    if args.json:
        args.json.write_text(json.dumps({"ttft_s": {"A": a, "B": b}, "ring": ring}, indent=2))


if __name__ == "__main__":
    main()
