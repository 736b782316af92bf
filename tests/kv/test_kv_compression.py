"""`kv_compression="snapkv"` inside a running engine: a long prompt's K/V shrinks to ~1/ratio after its
prefill, the request decodes on, the uncompressed prefix stays shareable and compressed blocks are never served
to another request, preemption recomputes and compresses again, and nothing leaks."""

from __future__ import annotations

import anyio
import pytest

from tokenflow import Engine

LONG = [5 + (7 * j + j // 13) % 300 for j in range(300)]
SETTINGS = dict(dtype="float32", kv_compression="snapkv", kv_compression_ratio=4, kv_compression_min_tokens=128,
                kv_compression_window=16, max_batch_tokens=128, debug_leaks=True)


async def test_a_long_prompt_holds_a_quarter_of_its_blocks_and_decodes_on(tiny_model) -> None:
    async with Engine(tiny_model, **SETTINGS) as engine:
        holding: list[int] = []
        async for chunk in engine.stream(LONG, max_tokens=24, temperature=0.0, ignore_eos=True):
            if len(holding) < 3:
                holding.append(engine.stats()["kv_blocks_used"])
            last = chunk
        stats = engine.stats()
    assert last.finish_reason == "length"
    assert stats["kv_compressed_requests"] == 1 and stats["kv_compression_tokens_dropped"] == 300 - 75
    assert holding[-1] <= -(-(75 + 24) // 16) + 1  # ~75 kept prompt positions, not 300 (19 blocks)
    assert stats["kv_blocks_used"] == 0  # debug_leaks: nothing held after it ends


async def test_the_uncompressed_prefix_is_shared_and_compressed_blocks_never_are(tiny_model) -> None:
    suffix = [17, 23, 29, 31, 37, 41]
    async with Engine(tiny_model, dtype="float32", max_batch_tokens=128) as engine:  # no compression
        dense = await engine.generate(LONG + suffix, max_tokens=1, temperature=0.0)
    async with Engine(tiny_model, **SETTINGS) as engine:
        await engine.generate(LONG, max_tokens=8, temperature=0.0, ignore_eos=True)  # compressed
        pool = engine._loop.pool
        assert pool.num_cached >= 300 // 16  # its full prompt blocks stayed cached, whole
        again = await engine.generate(LONG + suffix, max_tokens=1, temperature=0.0)
    assert again.usage.cached_tokens == 288  # the uncompressed prefix, served from the cache
    assert again.token_ids == dense.token_ids  # its first token sees the whole prompt, as without compression


async def test_preempted_compressed_requests_recompute_and_compress_again(tiny_model) -> None:
    prompts = [[(i * 11 + j * 7) % 380 + 5 for j in range(200 + 20 * i)] for i in range(4)]
    async with Engine(tiny_model, **{**SETTINGS, "num_kv_blocks": 40, "max_num_seqs": 4}) as engine:
        results = {}

        async def one(i: int) -> None:
            results[i] = await engine.generate(prompts[i], max_tokens=220, temperature=0.0, ignore_eos=True)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        stats = engine.stats()
    assert all(len(results[i].token_ids) == 220 for i in range(4))
    assert stats["num_preemptions"] >= 1 and stats["kv_compressed_requests"] >= 4
    assert stats["kv_blocks_used"] == 0


def test_compression_needs_dense_attention(tiny_model) -> None:
    from tokenflow.errors import ConfigError

    with pytest.raises(ConfigError, match="kv_compression"):
        Engine(tiny_model, kv_compression="snapkv", attention="sliding")


@pytest.mark.parametrize("extra", [{"kv_cache_dtype": "int8"}, {"speculative_tokens": 3}, {"prefix_caching": False}],
                         ids=["int8-kv", "speculative", "no-prefix-cache"])
async def test_compression_runs_with_the_other_kv_features(tiny_model, extra) -> None:
    repetitive = [5 + (j % 40) for j in range(300)]  # n-gram drafts find matches in it
    async with Engine(tiny_model, **{**SETTINGS, **extra}) as engine:
        done = await engine.generate(repetitive, max_tokens=40, temperature=0.0, ignore_eos=True)
        stats = engine.stats()
    assert len(done.token_ids) == 40 and stats["kv_compressed_requests"] == 1 and stats["kv_blocks_used"] == 0
    if "speculative_tokens" in extra:
        assert stats["num_draft_tokens"] > 0


async def test_speculation_over_a_compressed_prompt_equals_plain_greedy(tiny_model) -> None:
    """Drafts verified over compacted K/V (multi-token chunks at shifted cache positions) keep greedy output."""
    repetitive = [5 + (j % 40) for j in range(300)]
    outputs = []
    for extra in ({}, {"speculative_tokens": 3}):
        async with Engine(tiny_model, **{**SETTINGS, **extra}) as engine:
            done = await engine.generate(repetitive, max_tokens=40, temperature=0.0, ignore_eos=True)
            outputs.append(done.token_ids)
            drafts = engine.stats().get("num_draft_tokens", 0)
    assert drafts > 0 and outputs[0] == outputs[1]
