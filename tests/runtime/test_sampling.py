"""Every sampling parameter has an observable effect through the engine,
checked against transformers or a reference greedy loop on the same model."""

from __future__ import annotations

import anyio
import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenflow import Engine

PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(params=["paged", "hf"])
async def engine(request, tiny_model):
    async with Engine(tiny_model, backend=request.param, num_kv_blocks=256) as eng:
        yield eng


def reference_greedy(model, prompt_ids, steps, *, presence=0.0, frequency=0.0, repetition=1.0):
    """Greedy decoding with OpenAI-style presence/frequency and CTRL repetition penalties, no cache."""
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].clone()
        if repetition != 1.0:
            seen = torch.tensor(sorted(set(ids)))
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / repetition, vals * repetition)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float() \
            if out else torch.zeros_like(logits)
        logits -= frequency * counts + presence * (counts > 0).float()
        token = int(logits.argmax())
        ids.append(token)
        out.append(token)
    return out


async def test_max_tokens_and_greedy(engine, hf_model) -> None:
    done = await engine.generate(PROMPT, max_tokens=7, temperature=0.0, ignore_eos=True)
    assert done.finish_reason == "length" and len(done.token_ids) == 7
    assert done.token_ids == reference_greedy(hf_model, done.prompt_token_ids, 7)


@pytest.mark.parametrize("kwargs", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
async def test_filters_that_leave_one_token_equal_greedy(engine, kwargs) -> None:
    greedy = await engine.generate(PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True)
    sampled = await engine.generate(PROMPT, max_tokens=10, temperature=1.5, seed=3, ignore_eos=True, **kwargs)
    assert sampled.token_ids == greedy.token_ids


async def test_temperature_samples_differ_from_greedy_and_seed_reproduces(engine) -> None:
    greedy = await engine.generate(PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = [await engine.generate(PROMPT, max_tokens=16, temperature=2.0, seed=s, ignore_eos=True) for s in (1, 1, 2)]
    assert runs[0].token_ids == runs[1].token_ids  # same seed, same tokens
    assert runs[0].token_ids != runs[2].token_ids  # another seed, other tokens
    assert runs[0].token_ids != greedy.token_ids


async def test_seeded_request_is_independent_of_its_batch(engine) -> None:
    alone = await engine.generate(PROMPT, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    results = {}

    async def one(i: int) -> None:
        kwargs = dict(seed=7) if i == 0 else dict(seed=100 + i)
        results[i] = await engine.generate(PROMPT if i == 0 else f"other prompt {i}", max_tokens=12,
                                           temperature=1.0, ignore_eos=True, **kwargs)

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(one, i)
    assert results[0].token_ids == alone.token_ids


@pytest.mark.parametrize("penalty", [dict(presence=1.5), dict(frequency=1.0), dict(repetition=1.8)])
async def test_penalties_match_the_reference(engine, hf_model, penalty) -> None:
    names = {"presence": "presence_penalty", "frequency": "frequency_penalty", "repetition": "repetition_penalty"}
    kwargs = {names[k]: v for k, v in penalty.items()}
    plain = await engine.generate(PROMPT, max_tokens=20, temperature=0.0, ignore_eos=True)
    done = await engine.generate(PROMPT, max_tokens=20, temperature=0.0, ignore_eos=True, **kwargs)
    assert done.token_ids == reference_greedy(hf_model, done.prompt_token_ids, 20, **penalty)
    assert done.token_ids != plain.token_ids  # the penalty did change something here


async def test_repetition_penalty_matches_transformers_generate(engine, hf_model) -> None:
    done = await engine.generate(PROMPT, max_tokens=15, temperature=0.0, repetition_penalty=1.3)
    expected = hf_model.generate(torch.tensor([done.prompt_token_ids]), max_new_tokens=15, do_sample=False,
                                 repetition_penalty=1.3)[0, len(done.prompt_token_ids):].tolist()
    assert done.token_ids == expected[: len(done.token_ids)]


async def test_stop_strings_cut_the_text(engine) -> None:
    full = await engine.generate(PROMPT, max_tokens=30, temperature=0.0, ignore_eos=True)
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), "the reference text is too short for this test"
    cut = await engine.generate(PROMPT, max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    kept = await engine.generate(PROMPT, max_tokens=30, temperature=0.0, ignore_eos=True, stop=stop,
                                 include_stop_str_in_output=True)
    assert kept.text == text[: text.index(stop) + len(stop)]


async def test_stop_token_ids(engine) -> None:
    full = await engine.generate(PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True)
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    done = await engine.generate(PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id])
    assert done.finish_reason == "stop" and done.stop_reason == stop_id
    assert done.token_ids == full.token_ids[: first + 1]


async def test_eos_ignore_eos_and_min_tokens(engine) -> None:
    full = await engine.generate(PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True)
    fake_eos = full.token_ids[2]
    first = full.token_ids.index(fake_eos)
    engine.output.eos_token_ids = frozenset({fake_eos})  # pretend this token is the model's EOS
    engine._loop.worker.sampler.eos_token_ids = (fake_eos,)
    if hasattr(engine._loop.backend, "sampler"):
        engine._loop.backend.sampler.eos_token_ids = (fake_eos,)
    stopped = await engine.generate(PROMPT, max_tokens=10, temperature=0.0)
    assert stopped.finish_reason == "stop" and stopped.token_ids == full.token_ids[: first + 1]
    assert stopped.stop_reason is None  # EOS, not a requested stop token
    ignored = await engine.generate(PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True)
    assert ignored.finish_reason == "length" and ignored.token_ids == full.token_ids
    late = await engine.generate(PROMPT, max_tokens=10, temperature=0.0, min_tokens=first + 3)
    assert fake_eos not in late.token_ids[: first + 3]


async def test_logprobs_are_the_models_log_softmax(engine, hf_model) -> None:
    done = await engine.generate(PROMPT, max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    assert done.logprobs is not None and len(done.logprobs) == 4
    with torch.no_grad():
        logits = hf_model(torch.tensor([done.prompt_token_ids])).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1)
    first = done.logprobs[0]
    assert first.token_id == done.token_ids[0]
    assert abs(first.logprob - float(expected[first.token_id])) < 1e-3
    assert len(first.top) == 3
    top_ids = expected.topk(3).indices.tolist()
    assert sorted(first.top) == sorted(top_ids)
    no_lp = await engine.generate(PROMPT, max_tokens=2, temperature=0.0)
    assert no_lp.logprobs is None


async def test_scheduling_fields_are_accepted(engine) -> None:
    done = await engine.generate(PROMPT, max_tokens=3, temperature=0.0, priority=-5, timeout=30.0,
                                 deadline=anyio.current_time() + 30, cache_salt="tenant-a")
    assert len(done.token_ids) >= 1
