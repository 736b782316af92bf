"""Tiered prefix caching end to end on a tiny model: outputs identical with caching off, pool only,
and pool + disk; hits counted; warm restarts; faults in the disk tier never change outputs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.test_oracle import hf_greedy, run_concurrently
from tokenflow import Engine

BLOCK = 16


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    """Three long shared prefixes, each followed by several different tails, plus one-offs."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 400) for _ in range(n)] for n in (70, 130, 200)]
    prompts = []
    for i in range(12):
        head = heads[i % 3]
        prompts.append(head + [rng.randrange(3, 400) for _ in range(rng.randint(1, 40))])
    prompts += [[rng.randrange(3, 400) for _ in range(n)] for n in (50, 96)]
    prompts.append(list(heads[0][:64]))  # exactly 4 full blocks: the last one is still recomputed
    return prompts


async def run_all(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return await run_concurrently(engine, prompts, max_tokens=10, stagger_s=0.005)


def settings(**kw):
    return {"max_num_seqs": 6, "max_batch_tokens": 96, "num_kv_blocks": 64, **kw}


@pytest.fixture(scope="module")
def expected(tiny_model: Path) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return [hf_greedy(model, p, 10) for p in shared_prefix_prompts()]


async def test_outputs_identical_with_caching_off_pool_and_disk(tiny_model, expected, tmp_path) -> None:
    prompts = shared_prefix_prompts()
    async with Engine(tiny_model, **settings(prefix_caching=False)) as engine:
        assert await run_all(engine, prompts) == expected
        assert engine.stats()["prefix_cache_hit_tokens"] == 0
    async with Engine(tiny_model, **settings()) as engine:
        assert await run_all(engine, prompts) == expected  # cold, concurrent: hits among arrivals
        assert await run_all(engine, prompts) == expected  # warm
        stats = engine.stats()
        assert stats["prefix_cache_hit_tokens"] > 0.5 * stats["prefix_cache_queried_tokens"] / 2
        assert stats["kv_blocks_used"] == 0
        assert stats["kv_blocks_used"] + stats["kv_blocks_free"] + stats["kv_blocks_cached"] == 64
    # A pool too small for the workload: evicted blocks go to disk and come back from there.
    async with Engine(tiny_model, **settings(num_kv_blocks=40, cache_dir=str(tmp_path / "c"))) as engine:
        assert await run_all(engine, prompts) == expected
        assert await run_all(engine, prompts) == expected
        stats = engine.stats()
        assert stats["pool_evictions"] > 0 and stats["disk_blocks_written"] > 0
        assert stats["disk_blocks_loaded"] > 0, stats


async def test_hit_skips_prefill_and_reports_cached_tokens(tiny_model) -> None:
    prompt = list(range(5, 5 + 100))
    async with Engine(tiny_model, **settings()) as engine:
        first = await engine.generate(prompt, max_tokens=4, temperature=0.0)
        second = await engine.generate(prompt, max_tokens=4, temperature=0.0)
        assert first.token_ids == second.token_ids
        assert first.usage.cached_tokens == 0
        assert second.usage.cached_tokens == 96  # 6 full blocks; the 7th is partial
        salted = await engine.generate(prompt, max_tokens=4, temperature=0.0, cache_salt="tenant-b")
        assert salted.usage.cached_tokens == 0  # another tenant never shares
        assert salted.token_ids == first.token_ids


@pytest.mark.parametrize("variant", [{}, {"kv_cache_dtype": "int8"}, {"attention": "topk", "topk_budget": 32}])
async def test_prompts_parting_mid_block_share_its_first_rows(tiny_model, variant) -> None:
    """Two prompts that share 40 tokens (2 full blocks and 8 rows of the third): the second takes the 8
    rows by copy (int8: with their scales; topk: with the rows' key bounds) and its output is the same as
    without the prefix cache (fp32: the same as transformers)."""
    rng = random.Random(3)
    stem = [rng.randrange(3, 400) for _ in range(40)]
    prompts = [stem + [rng.randrange(3, 400) for _ in range(n)] for n in (60, 45)]
    async with Engine(tiny_model, **settings(prefix_caching=False, **variant)) as engine:
        cold = [(await engine.generate(p, max_tokens=8, temperature=0.0)).token_ids for p in prompts]
    if not variant:
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
        assert cold == [hf_greedy(model, p, 8) for p in prompts]
    async with Engine(tiny_model, **settings(**variant)) as engine:
        first = await engine.generate(prompts[0], max_tokens=8, temperature=0.0)
        second = await engine.generate(prompts[1], max_tokens=8, temperature=0.0)
    assert (first.usage.cached_tokens, second.usage.cached_tokens) == (0, 40)
    assert [first.token_ids, second.token_ids] == cold


async def test_warm_restart_gets_disk_hits(tiny_model, tmp_path) -> None:
    prompt = list(range(7, 7 + 120))
    async with Engine(tiny_model, **settings(cache_dir=str(tmp_path))) as engine:
        first = await engine.generate(prompt, max_tokens=6, temperature=0.0)
    assert list(tmp_path.rglob("*.val")), "aclose() flushes cached blocks to disk"
    async with Engine(tiny_model, **settings(cache_dir=str(tmp_path))) as engine:
        again = await engine.generate(prompt, max_tokens=6, temperature=0.0)
        stats = engine.stats()
    assert again.token_ids == first.token_ids
    assert again.usage.cached_tokens == 112
    assert stats["disk_blocks_loaded"] == 7


async def test_lfu_lru_keeps_hot_prefixes_that_lru_loses(tiny_model) -> None:
    """The bench-prefix workload, scaled down: hot system prompts between bursts of one-off documents."""
    from tokenflow.benchmarks.prefix import hit_rate_workload, run_hit_rate

    workload = hit_rate_workload(400, system_tokens=160, doc_tokens=192, cycles=8)
    lfu, lru = [
        await run_hit_rate(str(tiny_model), policy, workload, num_kv_blocks=48, max_batch_tokens=256)
        for policy in ("lfu_lru", "lru")
    ]
    assert lfu["queried_tokens"] == lru["queried_tokens"] > 0
    assert lfu["hot_hit_rate"] > 0.55 and lru["hot_hit_rate"] < 0.45, (lfu, lru)
    assert lfu["hit_tokens"] > 1.5 * lru["hit_tokens"]


def test_truncating_the_pool_evicts_cached_tail_blocks_through_the_listeners() -> None:
    from tokenflow.kv.eviction import LFULRUPolicy
    from tokenflow.kv.prefix_cache import PrefixCache
    from tokenflow.params import SamplingParams
    from tokenflow.request import Request

    pool = PrefixCache(6, 4, policy=LFULRUPolicy())
    evicted: list[int] = []
    pool.evict_listeners.append(lambda block, key: evicted.append(block))
    request = Request(SamplingParams(max_tokens=1), prompt_token_ids=list(range(17)))
    request.block_table = pool.allocate(5)  # blocks 0..4, four of them full
    request.num_computed_tokens = 17
    pool.release(request)  # its four full blocks stay cached, block 4 is free
    assert pool.num_cached == 4
    pool.truncate(2)
    assert sorted(evicted) == [2, 3] and pool.num_cached == 2 and pool.num_free == 0
    assert pool.num_blocks == 2 and pool.num_used == 0
    request = Request(SamplingParams(max_tokens=1), prompt_token_ids=list(range(17)))
    assert pool.lookup_prefix(request).blocks == [0, 1]  # the prefix kept in the first blocks still hits
