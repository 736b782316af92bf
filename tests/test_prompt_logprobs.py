"""`prompt_logprobs`: every prompt token scored by the model, equal to transformers' log-softmax in
fp32, across prefill chunks, a warm prefix cache, preemption with recompute and the response cache."""

from __future__ import annotations

import random

import anyio
import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenflow import Engine
from tokenflow.errors import InvalidRequest

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find"


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def oracle(hf_model, ids: list[int]) -> torch.Tensor:
    """log_softmax of every position's logits, [len(ids), vocab], in fp32 without a cache."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)


def assert_matches_oracle(prompt_logprobs, ids: list[int], expected: torch.Tensor, top: int) -> None:
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        entry = prompt_logprobs[p]
        assert entry is not None and ids[p] in entry
        assert abs(entry[ids[p]] - float(expected[p - 1, ids[p]])) < 1e-4, p
        best = expected[p - 1].topk(top).indices.tolist() if top else []
        assert set(entry) == set(best) | {ids[p]}, p
        for token in best:
            assert abs(entry[token] - float(expected[p - 1, token])) < 1e-4


@pytest.mark.parametrize("top", [0, 3])
async def test_prompt_logprobs_equal_the_oracle_across_prefill_chunks(tiny_model, hf_model, top) -> None:
    rng = random.Random(5)
    ids = [rng.randrange(5, 400) for _ in range(150)]
    # 64-token steps: the prompt is prefilled in three chunks
    async with Engine(tiny_model, num_kv_blocks=64, max_batch_tokens=64) as engine:
        done = await engine.generate(ids, max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=top)
        plain = await engine.generate(ids, max_tokens=3, temperature=0.0, ignore_eos=True)
        assert engine.stats()["kv_blocks_used"] == 0
    assert_matches_oracle(done.prompt_logprobs, ids, oracle(hf_model, ids), top)
    assert done.token_ids == plain.token_ids  # scoring the prompt does not change what is sampled
    assert plain.prompt_logprobs is None


async def test_prompt_logprobs_are_whole_when_the_prefix_is_cached(tiny_model, hf_model) -> None:
    async with Engine(tiny_model, num_kv_blocks=64) as engine:
        await engine.generate(PROMPT, max_tokens=2, temperature=0.0)  # caches the prompt's full blocks
        done = await engine.generate(PROMPT, max_tokens=2, temperature=0.0, prompt_logprobs=1)
    assert done.prompt_token_ids is not None
    assert_matches_oracle(done.prompt_logprobs, done.prompt_token_ids, oracle(hf_model, done.prompt_token_ids), 1)


async def test_prompt_logprobs_survive_preemption_and_recompute(tiny_model, hf_model) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(5, 400) for _ in range(rng.randint(20, 60))] for _ in range(8)]
    results: list = [None] * len(prompts)
    # 8 sequences of up to 100 tokens need up to 56 blocks: 20 forces preemption mid-decode.
    async with Engine(tiny_model, max_num_seqs=8, max_batch_tokens=128, num_kv_blocks=20,
                      kv_high_watermark=1.0, debug_leaks=True) as engine:
        async def one(i: int) -> None:
            results[i] = await engine.generate(prompts[i], max_tokens=40, temperature=0.0, ignore_eos=True,
                                               prompt_logprobs=2)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_used"] == 0
    for ids, done in zip(prompts, results, strict=True):
        assert_matches_oracle(done.prompt_logprobs, ids, oracle(hf_model, ids), 2)


async def test_prompt_logprobs_on_the_first_streamed_chunk_and_from_the_response_cache(tiny_model) -> None:
    async with Engine(tiny_model, num_kv_blocks=64, response_cache=True) as engine:
        chunks = [c async for c in engine.stream(PROMPT, max_tokens=4, temperature=0.0, prompt_logprobs=0)]
        replayed = await engine.generate(PROMPT, max_tokens=4, temperature=0.0, prompt_logprobs=0)
        assert engine.stats()["response_cache_memory_hits"] == 1
        other = await engine.generate(PROMPT, max_tokens=4, temperature=0.0)  # another key: no prompt scoring
    assert chunks[0].prompt_logprobs is not None
    assert all(c.prompt_logprobs is None for c in chunks[1:])
    assert replayed.prompt_logprobs == chunks[0].prompt_logprobs
    assert other.prompt_logprobs is None


async def test_prompt_logprobs_limits(tiny_model) -> None:
    async with Engine(tiny_model, num_kv_blocks=64, max_logprobs=5) as engine:
        with pytest.raises(InvalidRequest) as err:
            await engine.generate(PROMPT, max_tokens=2, prompt_logprobs=6)
        assert err.value.field == "prompt_logprobs"
        with pytest.raises(InvalidRequest):
            await engine.generate(PROMPT, max_tokens=2, prompt_logprobs=-1)
        assert len((await engine.generate(PROMPT, max_tokens=2, prompt_logprobs=5)).prompt_logprobs) > 1
    async with Engine(tiny_model, backend="hf") as engine:
        with pytest.raises(InvalidRequest) as err:
            await engine.generate(PROMPT, max_tokens=2, prompt_logprobs=0)
        assert err.value.field == "prompt_logprobs"
