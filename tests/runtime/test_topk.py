"""attention="topk" (Quest): block bounds are true upper bounds, the selection keeps sinks, recent and
the best blocks, dropped blocks get no weight, and a budget at least the context is exactly dense."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tests.runtime.test_sliding import _generate_all
from tests.test_oracle import hf_greedy
from tokenflow import Engine
from tokenflow.kv.kv_cache import KVCache
from tokenflow.runtime.attention.topk import TopkDecode, topk_attention, update_key_bounds

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def filled_cache(context: int, seed: int = 0) -> tuple[KVCache, list[int], torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    cache = KVCache(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, num_blocks=32, block_size=BLOCK,
                    dtype=torch.float32, device="cpu", track_key_bounds=True)
    table = list(range(31, 31 - (-(-context // BLOCK)), -1))
    k, v = torch.randn(context, KV_HEADS, DIM), torch.randn(context, KV_HEADS, DIM)
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)])
    for start in range(0, context, 5):  # written in uneven steps, as chunks and decodes do
        part = slots[start:start + 5]
        cache.k_slots[0].index_copy_(0, part, k[start:start + 5])
        cache.v_slots[0].index_copy_(0, part, v[start:start + 5])
        update_key_bounds(cache, 0, part, k[start:start + 5])
    return cache, table, k, v


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    kh = k.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)  # [H, n, D]
    vh = v.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(q[:, None], kh, vh, scale=DIM**-0.5)[:, 0]  # [H, D]


def test_block_bounds_bound_every_key_score() -> None:
    cache, table, k, _ = filled_cache(37)
    q = torch.randn(KV_HEADS, DIM)
    for b, block in enumerate(table):
        keys = k[b * BLOCK:(b + 1) * BLOCK]  # [<=4, KVH, D]
        lo, hi = cache.k_min[0][block], cache.k_max[0][block]
        assert torch.equal(lo, keys.amin(0)) and torch.equal(hi, keys.amax(0))
        bound = torch.maximum(q * lo, q * hi).sum(-1)  # [KVH]
        assert (bound[None] >= torch.einsum("hd,nhd->nh", q, keys) - 1e-6).all()


def test_budget_covering_every_block_is_dense() -> None:
    cache, table, k, v = filled_cache(37)
    q = torch.randn(HEADS, DIM)
    seq = TopkDecode(0, torch.tensor(table), 37, keep_blocks=len(table), sink_blocks=1)
    torch.testing.assert_close(topk_attention(q, cache, 0, seq, DIM**-0.5), dense(q, k, v))


@pytest.mark.parametrize("hot_block", [3, 5])
def test_selection_keeps_sinks_recent_and_the_best_block(hot_block: int) -> None:
    context = 40  # 10 blocks; keep 4 = sink + 2 recent + the best one
    cache, table, k, v = filled_cache(context, seed=hot_block)
    q = torch.randn(HEADS, DIM)
    k_hot = k.clone()
    direction = q.view(KV_HEADS, HEADS // KV_HEADS, DIM).sum(1)  # aligned with every head of each group
    k_hot[hot_block * BLOCK:(hot_block + 1) * BLOCK] = 5 * direction
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)])
    cache.k_slots[0].index_copy_(0, slots, k_hot)
    update_key_bounds(cache, 0, slots, k_hot)
    seq = TopkDecode(0, torch.tensor(table), context, keep_blocks=4, sink_blocks=1)
    got = topk_attention(q, cache, 0, seq, DIM**-0.5)
    kept = [p for p in range(context) if p // BLOCK in (0, hot_block, 8, 9)]
    torch.testing.assert_close(got, dense(q, k_hot[kept], v[kept]))  # the others get exactly no weight


async def test_budget_at_least_the_context_gives_exactly_dense(tiny_model) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 400) for _ in range(n)] for n in (30, 100, 230)]
    async with Engine(tiny_model, attention="topk", topk_budget=256, max_batch_tokens=64) as engine:
        outs = await _generate_all(engine, prompts, 20, concurrent=True)
    assert outs == [hf_greedy(model, p, 20) for p in prompts]


async def test_small_budget_runs_consistently(tiny_model) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(5, 400) for _ in range(n)] for n in (90, 200)]
    settings = dict(attention="topk", topk_budget=48, sink_tokens=4)
    async with Engine(tiny_model, **settings) as engine:
        alone = await _generate_all(engine, prompts, 30, concurrent=False)
        assert engine.stats()["kv_blocks_used"] == 0
    async with Engine(tiny_model, max_batch_tokens=32, prefix_caching=False, **settings) as engine:
        batched = await _generate_all(engine, prompts, 30, concurrent=True)
    assert alone == batched
