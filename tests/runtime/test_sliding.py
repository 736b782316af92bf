"""attention="sliding": the StreamingLLM rule against a from-scratch reference, the dense oracle
with a wide window, and flat KV memory however long generation runs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.test_oracle import hf_greedy, run_concurrently
from tokenflow import Engine
from tokenflow.kv.kv_cache import KVCache
from tokenflow.runtime.attention.sliding import build_segment, sliding_attention
from tokenflow.testing import build_tiny_model


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE of `x [n, H, D]` at `positions [n]`."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    angle = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    half = x.shape[-1] // 2
    return x * angle.cos() + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * angle.sin()


def streaming_llm_reference(q0, k0, v, p: int, window: int, sinks: int, inv_freq, scale: float) -> torch.Tensor:
    """Query at text position `p` (pre-RoPE q0 [H, D]; keys k0/v [p+1, H, D]), written from the paper:
    the cache holds the sinks and the last `window` tokens, numbered by their place in the cache."""
    kept = sorted(set(range(min(sinks, p + 1))) | set(range(max(p - window + 1, 0), p + 1)))
    cache_pos = torch.arange(len(kept))
    k = rope(k0[kept], cache_pos, inv_freq)
    q = rope(q0[None], cache_pos[-1:], inv_freq)[0]
    scores = torch.einsum("hd,nhd->hn", q, k) * scale
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), v[kept])


@pytest.mark.parametrize(("start", "num_tokens"), [(37, 1), (20, 9), (3, 30)])
def test_sliding_attention_is_streaming_llm(start: int, num_tokens: int) -> None:
    torch.manual_seed(0)
    heads, head_dim, block, window, sinks = 2, 8, 4, 8, 2
    end = start + num_tokens
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    q0 = torch.randn(end, heads, head_dim)
    k0 = torch.randn(end, heads, head_dim)
    v = torch.randn(end, heads, head_dim)
    cache = KVCache(num_layers=1, num_kv_heads=heads, head_dim=head_dim, num_blocks=16, block_size=block,
                    dtype=torch.float32, device="cpu")
    table = list(range(15, 15 - (-(-end // block)), -1))  # reversed ids: a wrong gather cannot pass
    positions = torch.arange(end)
    slots = torch.tensor([table[p // block] * block + p % block for p in range(end)])
    cache.k_slots[0].index_copy_(0, slots, rope(k0, positions, inv_freq))  # keys as the model stores them
    cache.v_slots[0].index_copy_(0, slots, v)
    seg = build_segment(0, start, num_tokens, table, block, window, sinks, torch.device("cpu"))
    q = rope(q0[start:end], positions[start:end], inv_freq)
    got = sliding_attention(q, cache, 0, seg, head_dim**-0.5, inv_freq)
    for i, p in enumerate(range(start, end)):
        want = streaming_llm_reference(q0[p], k0[: p + 1], v[: p + 1], p, window, sinks, inv_freq, head_dim**-0.5)
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


async def _generate_all(engine: Engine, prompts: list[list[int]], max_tokens: int, concurrent: bool):
    if concurrent:
        return await run_concurrently(engine, prompts, max_tokens)
    return [(await engine.generate(p, max_tokens=max_tokens, temperature=0.0)).token_ids for p in prompts]


async def test_window_at_least_the_context_gives_exactly_dense(tiny_model) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 400) for _ in range(n)] for n in (30, 100, 230)]
    async with Engine(tiny_model, attention="sliding", window=256, sink_tokens=4, max_batch_tokens=64) as engine:
        outs = await _generate_all(engine, prompts, 20, concurrent=True)
    assert outs == [hf_greedy(model, p, 20) for p in prompts]


async def test_narrow_window_is_consistent_across_chunking_and_batching(tiny_model) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(5, 400) for _ in range(n)] for n in (40, 120, 200)]
    settings = dict(attention="sliding", window=32, sink_tokens=4)
    async with Engine(tiny_model, max_batch_tokens=256, **settings) as engine:
        alone = await _generate_all(engine, prompts, 30, concurrent=False)
    async with Engine(tiny_model, max_batch_tokens=24, prefix_caching=False, **settings) as engine:
        batched = await _generate_all(engine, prompts, 30, concurrent=True)
    assert alone == batched
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    assert alone[2] != hf_greedy(model, prompts[2], 30), "a 32-token window must change a 200-token prompt's output"


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-512", max_position_embeddings=512)


async def test_kv_stays_flat_and_generation_runs_past_the_trained_context(short_context_model) -> None:
    """A model trained on 512 positions generates 1,500 tokens with a 64-token window: the blocks in use
    never exceed sinks + window + one step's chunk."""
    prompt = list(range(5, 45))
    used: list[int] = []
    settings = dict(attention="sliding", window=64, sink_tokens=4, max_model_len=4096, num_kv_blocks=64)
    async with Engine(short_context_model, **settings) as engine:
        count = 0
        async for chunk in engine.stream(prompt, max_tokens=1500, temperature=0.0, ignore_eos=True):
            count += len(chunk.token_ids)
            used.append(engine.stats()["kv_blocks_used"])
        assert count == 1500
        assert engine.stats()["kv_blocks_used"] == 0
    assert max(used) <= 1 + 4 + 1 + 1, max(used)  # sink block + 64/16 window blocks + the growing one + spare
    async with Engine(short_context_model, num_kv_blocks=64, clamp_max_tokens=True) as engine:  # dense: capped
        done = await engine.generate(prompt, max_tokens=1500, temperature=0.0, ignore_eos=True)
        assert done.finish_reason == "length" and len(done.token_ids) == 512 - len(prompt)
