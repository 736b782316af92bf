"""N-gram (prompt lookup) speculation: the draft proposer, the acceptance rule, and the engine's
greedy outputs with speculation on, which must equal transformers' generate and the engine without it."""

from __future__ import annotations

import itertools
import random

import anyio
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.test_oracle import hf_greedy
from tokenflow import Engine
from tokenflow.errors import ConfigError
from tokenflow.params import SamplingParams
from tokenflow.scheduler.ngram import accepted_tokens, can_speculate, propose_draft


def test_draft_follows_the_latest_occurrence_of_the_longest_suffix() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 1, 2, 3, 9, 8, 2, 3, 7, 6, 1, 2, 3]
    # suffix [1, 2, 3] recurs at 1..3 (followed by 9, 8); [2, 3] alone recurs later at 6..7 (then 7)
    assert propose_draft(tokens, 2) == [9, 8]
    assert propose_draft(tokens, 1) == [9]
    assert propose_draft([4, 2, 3, 7, 2, 3], 3) == [7, 2, 3]  # the latest match, drafted up to the end
    assert propose_draft([1, 2, 3, 4], 3) == []  # no token recurs
    assert propose_draft([3, 3], 2) == [3]
    assert propose_draft([1, 2, 1], 0) == []
    assert propose_draft([7], 4) == []


def test_accepted_tokens_keep_the_verified_prefix_and_the_token_after_it() -> None:
    draft = [10, 11, 12]
    assert accepted_tokens(10, draft, [11, 12, 13]) == [10, 11, 12, 13]  # all accepted + the bonus token
    assert accepted_tokens(10, draft, [11, 99, 13]) == [10, 11, 99]  # the model disagreed at draft[2]
    assert accepted_tokens(42, draft, [11, 12, 13]) == [42]  # the first token already differs
    assert accepted_tokens(5, [], []) == [5]


def test_only_plain_greedy_requests_speculate() -> None:
    assert can_speculate(SamplingParams(temperature=0.0), 0)
    assert not can_speculate(SamplingParams(temperature=0.7), 0)
    assert not can_speculate(SamplingParams(temperature=0.0, repetition_penalty=1.2), 0)
    assert not can_speculate(SamplingParams(temperature=0.0, presence_penalty=0.5), 0)
    assert not can_speculate(SamplingParams(temperature=0.0, logprobs=2), 0)
    assert not can_speculate(SamplingParams(temperature=0.0, min_tokens=4), 3)  # EOS still masked
    assert can_speculate(SamplingParams(temperature=0.0, min_tokens=4), 4)


def test_speculation_needs_dense_attention() -> None:
    from tokenflow.config import EngineConfig

    with pytest.raises(ConfigError, match="speculative_tokens"):
        EngineConfig.load(environ={}, speculative_tokens=2, attention="sliding")


def _repetitive_prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase with variations, so n-gram drafts exist and are sometimes wrong."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 9))]
        prompt: list[int] = []
        for _ in range(rng.randrange(2, 6)):
            prompt += [*phrase, rng.randrange(3, vocab)]
        prompts.append(prompt)
    return prompts


async def _generate_all(engine: Engine, prompts: list[list[int]], gap_s: float = 0.005, **params) -> list:
    results: dict[int, object] = {}

    async def one(i: int) -> None:
        await anyio.sleep(gap_s * i)  # arrivals while others decode
        results[i] = await engine.generate(prompts[i], **params)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return [results[i] for i in range(len(prompts))]


async def test_speculative_greedy_equals_transformers_generate(tiny_model) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts = _repetitive_prompts(400, 8)
    async with Engine(tiny_model, speculative_tokens=3, max_num_seqs=4, max_batch_tokens=64,
                      debug_leaks=True) as engine:
        done = await _generate_all(engine, prompts, max_tokens=24, temperature=0.0, ignore_eos=True)
        stats = engine.stats()
    assert stats["num_draft_tokens"] > 0
    assert 0 < stats["num_accepted_draft_tokens"] < stats["num_draft_tokens"]  # both outcomes exercised
    assert stats["kv_blocks_used"] == 0
    for prompt, result in zip(prompts, done):
        assert len(result.token_ids) == 24  # never past max_tokens, however much of a draft is accepted
        assert result.token_ids == hf_greedy(model, prompt, 24)


async def test_sampled_requests_are_not_speculated(tiny_model) -> None:
    """Seeded sampled requests sharing the batch with drafted greedy ones keep their tokens."""
    prompts = _repetitive_prompts(400, 6, seed=1)
    outputs = {}
    for k in (0, 3):
        # Speculation on however many of the 6 run at once (the default stops above 4: timing-dependent).
        async with Engine(tiny_model, speculative_tokens=k, speculative_max_seqs=8, max_num_seqs=8,
                          debug_leaks=True) as engine:
            greedy = await _generate_all(engine, prompts, max_tokens=20, temperature=0.0, ignore_eos=True)
            sampled = await _generate_all(engine, prompts, max_tokens=12, temperature=0.8, seed=7)
            outputs[k] = ([r.token_ids for r in greedy], [r.token_ids for r in sampled])
            drafted = engine.stats()["num_draft_tokens"]
        assert (drafted > 0) == (k > 0)
    assert outputs[3] == outputs[0]


def _oracle_drafts(prompts: list[list[int]], outputs: list[list[int]]):
    """A stand-in for `propose_draft` that knows each prompt's greedy output and spoils one guess in three."""
    calls = itertools.count()

    def propose(tokens: list[int], max_draft: int) -> list[int]:
        for prompt, out in zip(prompts, outputs):
            if tokens[: len(prompt)] == prompt:
                draft = out[len(tokens) - len(prompt):][:max_draft]
                if draft and next(calls) % 3 == 2:
                    draft[-1] = (draft[-1] + 1) % 400
                return draft
        return []

    return propose


async def test_a_request_ending_inside_an_accepted_draft(tiny_model, monkeypatch) -> None:
    """Drafts from an oracle (the plain greedy output, one guess in three spoiled) so that long drafts
    are accepted: a stop token inside one ends the request right there, a stream closed mid-way
    frees everything, and small blocks make those ends fall short of the drafts' last blocks."""
    prompts = _repetitive_prompts(400, 4, seed=1)
    async with Engine(tiny_model, block_size=4) as engine:
        ref = [(await engine.generate(p, max_tokens=20, temperature=0.0, ignore_eos=True)).token_ids
               for p in prompts]
    monkeypatch.setattr("tokenflow.scheduler.scheduler.propose_draft", _oracle_drafts(prompts, ref))
    async with Engine(tiny_model, speculative_tokens=3, block_size=4, debug_leaks=True) as engine:
        for prompt, out in zip(prompts, ref):
            for j in range(12):
                done = await engine.generate(prompt, max_tokens=20, temperature=0.0, ignore_eos=True,
                                             stop_token_ids=[out[j]])
                end = out.index(out[j]) + 1
                assert (done.token_ids, done.finish_reason) == (out[:end], "stop")
            for wanted in range(1, 5):  # closed after 1..4 chunks: aborts land between and during steps
                stream = engine.stream(prompt, max_tokens=20, temperature=0.0, ignore_eos=True)
                seen = 0
                async for _chunk in stream:
                    seen += 1
                    if seen == wanted:
                        break
                await stream.aclose()
        again = await engine.generate(prompts[0], max_tokens=20, temperature=0.0, ignore_eos=True)
        stats = engine.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["num_accepted_draft_tokens"] > stats["num_draft_tokens"] / 2
    assert again.token_ids == ref[0]
    assert not stats["dead"]


async def test_speculation_under_preemption(tiny_model, monkeypatch) -> None:
    """KV blocks run out while drafted requests decode: preempted ones recompute and every output
    still equals plain greedy decoding."""
    rng = random.Random(2)
    prompts = [[rng.randrange(5, 400) for _ in range(rng.randint(20, 60))] for _ in range(8)]
    async with Engine(tiny_model, num_kv_blocks=256) as engine:
        ref = await _generate_all(engine, prompts, max_tokens=40, temperature=0.0, ignore_eos=True)
    ref_tokens = [r.token_ids for r in ref]
    monkeypatch.setattr("tokenflow.scheduler.scheduler.propose_draft", _oracle_drafts(prompts, ref_tokens))
    # 8 sequences of up to 100 tokens need up to 56 blocks: 20 forces preemption mid-decode.
    async with Engine(tiny_model, speculative_tokens=3, speculative_max_seqs=8, max_num_seqs=8,
                      max_batch_tokens=128, num_kv_blocks=20, kv_high_watermark=1.0, debug_leaks=True) as engine:
        # All at once: staggered arrivals could finish early ones before the blocks run out.
        done = await _generate_all(engine, prompts, gap_s=0.0, max_tokens=40, temperature=0.0, ignore_eos=True)
        stats = engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_accepted_draft_tokens"] > 0
    assert stats["kv_blocks_used"] == 0
    assert [r.token_ids for r in done] == ref_tokens
