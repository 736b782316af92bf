"""`kv_cache_dtype="int8"`: K/V stored as int8 with per-token, per-head scales, inside a running engine: the
same bytes hold ~1.9x the blocks, outputs stay close to the float cache's, the disk tier stores and restores the
int8 form, and int8 blocks never share keys with float ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenflow import Engine

PROMPT = list(range(11, 11 + 120))  # 7 full blocks of 16, and a partial one


async def _prompt_logprobs(engine: Engine, prompt: list[int]) -> list[float]:
    done = await engine.generate(prompt, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    return [entry[t] for t, entry in zip(prompt[1:], done.prompt_logprobs[1:])]


async def test_same_bytes_hold_more_blocks_and_outputs_stay_close(tiny_model) -> None:
    common = dict(dtype="float32", kv_cache_bytes=2**20, max_batch_tokens=32)  # 4 chunks: later ones read the cache
    async with Engine(tiny_model, **common) as engine:
        exact = await _prompt_logprobs(engine, PROMPT)
        float_stats = engine.stats()
    async with Engine(tiny_model, kv_cache_dtype="int8", debug_leaks=True, **common) as engine:
        approx = await _prompt_logprobs(engine, PROMPT)
        done = await engine.generate(PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True)
        stats = engine.stats()
    assert stats["kv_blocks_total"] >= 1.8 * float_stats["kv_blocks_total"]
    assert stats["kv_bytes_per_token"] * 1.8 <= float_stats["kv_bytes_per_token"]
    assert stats["kv_cache_dtype"] == "int8" and len(done.token_ids) == 16 and stats["kv_blocks_used"] == 0
    drift = sum(abs(a - b) for a, b in zip(approx, exact)) / len(exact)
    assert drift < 0.05, drift  # mean |logprob difference| per prompt token


async def test_the_disk_tier_keeps_int8_blocks_and_restores_them(tiny_model, tmp_path: Path) -> None:
    settings = dict(kv_cache_dtype="int8", max_num_seqs=4, max_batch_tokens=64, num_kv_blocks=32,
                    cache_dir=str(tmp_path))
    async with Engine(tiny_model, **settings) as engine:
        first = await engine.generate(PROMPT, max_tokens=8, temperature=0.0)
    assert len(list(tmp_path.rglob("*.val"))) == 7
    async with Engine(tiny_model, **settings) as engine:  # a restart on the same folder: warm
        again = await engine.generate(PROMPT, max_tokens=8, temperature=0.0)
        stats = engine.stats()
    assert stats["disk_blocks_loaded"] == 7 and again.usage.cached_tokens == 112
    assert again.token_ids == first.token_ids  # restored codes and scales, bit for bit
    async with Engine(tiny_model, **{**settings, "kv_cache_dtype": "auto"}) as engine:  # a float engine: no hit
        await engine.generate(PROMPT, max_tokens=8, temperature=0.0)
        assert engine.stats()["disk_blocks_loaded"] == 0


async def test_int8_kv_refuses_topk_attention(tiny_model) -> None:
    from tokenflow.errors import ConfigError

    with pytest.raises(ConfigError, match="topk"):
        Engine(tiny_model, kv_cache_dtype="int8", attention="topk")
