"""The `redis` KV tier in running engines: sharing across processes, and Redis faults that
never fail a request. Outputs are checked against transformers' greedy `generate`."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenflow import Engine
from tokenflow.errors import ConfigError
from tokenflow_redis import KV_TIERS
from tokenflow_redis.stage import RedisTierSettings

rng = random.Random(7)
LONG = [rng.randrange(5, 500) for _ in range(300)]  # 18 full blocks of 16
PROMPTS = [[rng.randrange(5, 500) for _ in range(120)] for _ in range(6)]  # 7 full blocks each
NEW = [[rng.randrange(5, 500) for _ in range(100)] for _ in range(4)]
MAX_TOKENS = 8


def settings(urls: list[str], **tier) -> dict:
    return {
        "max_num_seqs": 2, "max_batch_tokens": 64, "num_kv_blocks": 24, "kv_tiers": KV_TIERS,
        "plugin_settings": {"redis_tier": {"urls": urls, "secret": "replicas-share-this", **tier}},
    }


@pytest.fixture(scope="module")
def expected(tiny_model: Path) -> dict[str, list]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def greedy(ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        return out[0, len(ids):].tolist()

    return {"long": greedy(LONG), "prompts": [greedy(p) for p in PROMPTS], "new": [greedy(p) for p in NEW]}


async def published(engine: Engine, count: int, timeout_s: float = 10.0) -> None:
    """Wait until `count` blocks are in Redis: publishing is write-behind, so it can trail the requests."""
    with anyio.move_on_after(timeout_s):
        while engine.stats()["redis_blocks_published"] < count:
            await anyio.sleep(0.01)


async def generate_all(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    results: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        results[i] = (await engine.generate(prompts[i], max_tokens=MAX_TOKENS, temperature=0.0)).token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return [results[i] for i in range(len(prompts))]


WORKER = """
import asyncio, json, sys
from tokenflow import Engine

async def main(model, settings, prompt, blocks):
    async with Engine(model, **settings) as engine:
        done = await engine.generate(prompt, max_tokens=8, temperature=0.0)
        cached = await engine.generate("a cached answer", max_tokens=6, temperature=0.0, cache_response=True)
        for _ in range(1000):  # publishing is write-behind: it can trail the requests
            if engine.stats()["redis_blocks_published"] >= blocks:
                break
            await asyncio.sleep(0.01)
        print(json.dumps({"tokens": done.token_ids, "text": cached.text,
                          "published": engine.stats()["redis_blocks_published"]}))

asyncio.run(main(*json.loads(sys.argv[1])))
"""


async def test_a_second_process_gets_the_first_ones_prefix_and_response(
    tiny_model, redis_urls, expected
) -> None:
    config = {**settings(redis_urls), "num_kv_blocks": 64}
    first = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps([str(tiny_model), config, LONG, 18])],
        capture_output=True, text=True, timeout=120, check=True,
    )
    report = json.loads(first.stdout.strip().splitlines()[-1])
    assert report["tokens"] == expected["long"]
    assert report["published"] >= 18
    async with Engine(tiny_model, **config) as engine:
        done = await engine.generate(LONG, max_tokens=MAX_TOKENS, temperature=0.0)
        cached = await engine.generate("a cached answer", max_tokens=6, temperature=0.0, cache_response=True)
        stats = engine.stats()
    assert done.token_ids == expected["long"]
    assert done.usage.cached_tokens == 18 * 16  # every full block came from Redis
    assert stats["redis_blocks_loaded"] == 18 and stats["redis_prefetch_jobs"] == 1
    assert cached.text == report["text"] and stats["redis_response_hits"] == 1
    assert stats["redis_blocks_published"] == 0  # the blocks it filled itself were in Redis already


async def test_redis_stopped_mid_run_no_request_fails_and_it_is_used_again(tiny_model, own_redis, expected) -> None:
    async with Engine(tiny_model, **settings([own_redis.url], timeout_s=0.2, retry_s=0.5)) as engine:
        assert await generate_all(engine, PROMPTS) == expected["prompts"]
        await published(engine, 6 * 7)
        up = engine.stats()
        assert up["redis_blocks_published"] == 6 * 7
        # The pool (24 blocks) kept only the latest prompts: the first comes back from Redis.
        assert await generate_all(engine, PROMPTS[:1]) == expected["prompts"][:1]
        assert engine.stats()["redis_blocks_loaded"] == 7

        own_redis.stop()
        assert await generate_all(engine, PROMPTS + NEW) == expected["prompts"] + expected["new"]
        down = engine.stats()
        assert down["redis_breaker_trips"] == 1 and down["redis_bypassed_ops"] > 0
        assert down["redis_breaker_recoveries"] == 0 and down["num_failed"] == 0

        own_redis.start()  # empty: nothing survived
        await anyio.sleep(0.6)
        assert await generate_all(engine, NEW) == expected["new"]
        await published(engine, down["redis_blocks_published"] + 1)
        back = engine.stats()
        assert back["redis_breaker_recoveries"] == 1
        assert back["redis_blocks_published"] > down["redis_blocks_published"]  # sharing again
        assert await generate_all(engine, PROMPTS[:4]) == expected["prompts"][:4]  # pushes NEW[0] out
        assert await generate_all(engine, NEW[:1]) == expected["new"][:1]
        assert engine.stats()["redis_blocks_loaded"] > back["redis_blocks_loaded"]  # and loading again


async def test_a_stalled_redis_costs_at_most_its_timeout(tiny_model, own_redis, expected) -> None:
    """Redis stops answering mid-run: every request is still served right, each of the tier's threads (its
    readers and its writer) meets the stall at most once, on its timeout, and from then on the node is
    bypassed. A watchdog resumes Redis after a generous limit, so a tier that waited on the stall fails the
    test instead of hanging it."""
    readers = RedisTierSettings().readers
    async with Engine(tiny_model, **settings([own_redis.url], timeout_s=0.2, retry_s=30)) as engine:
        assert await generate_all(engine, PROMPTS[:2]) == expected["prompts"][:2]
        own_redis.pause()
        resumed_by_watchdog = threading.Event()
        watchdog = threading.Timer(60, lambda: (resumed_by_watchdog.set(), own_redis.resume()))
        watchdog.daemon = True
        watchdog.start()
        try:
            assert await generate_all(engine, PROMPTS) == expected["prompts"]
            stats = engine.stats()
        finally:
            watchdog.cancel()
    own_redis.resume()
    assert not resumed_by_watchdog.is_set(), "the tier waited for the stalled Redis"
    assert stats["redis_breaker_trips"] == 1 and stats["redis_bypassed_ops"] > 0 and stats["num_failed"] == 0
    assert 1 <= stats["redis_errors"] <= readers + 1, stats  # one timeout per thread that met the stall at most


async def test_without_a_shared_secret_the_tier_refuses_to_start(tiny_model, redis_urls) -> None:
    config = settings(redis_urls)
    del config["plugin_settings"]["redis_tier"]["secret"]
    with pytest.raises(ConfigError, match="secret"):
        async with Engine(tiny_model, **config):
            pass
    async with Engine(tiny_model, **config, cache_secret="from the engine") as engine:  # the fallback
        assert (await engine.generate(PROMPTS[0], max_tokens=2, temperature=0.0)).token_ids


async def test_replicas_with_another_secret_share_nothing(tiny_model, redis_urls, expected) -> None:
    """A replica (or anyone) writing under another secret: its blocks and responses are misses here."""
    theirs = {**settings(redis_urls, secret="theirs"), "num_kv_blocks": 64}
    async with Engine(tiny_model, **theirs) as engine:
        await engine.generate(LONG, max_tokens=MAX_TOKENS, temperature=0.0)
        await engine.generate("a cached answer", max_tokens=6, temperature=0.0, cache_response=True)
        await published(engine, 18)
        assert engine.stats()["redis_blocks_published"] >= 18
    async with Engine(tiny_model, **{**settings(redis_urls), "num_kv_blocks": 64}) as engine:
        done = await engine.generate(LONG, max_tokens=MAX_TOKENS, temperature=0.0)
        await engine.generate("a cached answer", max_tokens=6, temperature=0.0, cache_response=True)
        stats = engine.stats()
    assert done.token_ids == expected["long"] and done.usage.cached_tokens == 0
    assert stats["redis_blocks_loaded"] == 0 and stats["redis_response_hits"] == 0
    assert stats["redis_corrupt_entries"] >= 2  # counted and deleted
