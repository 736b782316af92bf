"""The public async API on a tiny model, for both backends."""

from __future__ import annotations

import anyio
import pytest

import tokenflow
from tokenflow import Engine, SamplingParams

BACKENDS = ["paged", "hf"]


@pytest.fixture(params=BACKENDS)
async def engine(request: pytest.FixtureRequest, tiny_model):
    async with Engine(tiny_model, backend=request.param, max_num_seqs=8, num_kv_blocks=256) as eng:
        yield eng


async def test_generate_returns_a_completion(engine: Engine) -> None:
    done = await engine.generate("The quick brown fox", max_tokens=12, temperature=0.0, ignore_eos=True)
    assert isinstance(done, tokenflow.Completion)
    assert done.finish_reason == "length"
    assert len(done.token_ids) == 12
    assert done.usage.completion_tokens == 12
    assert done.usage.prompt_tokens == len(done.prompt_token_ids)
    assert done.usage.total_tokens == done.usage.prompt_tokens + 12
    assert isinstance(done.text, str)


async def test_stream_deltas_concatenate_to_generate_text(engine: Engine) -> None:
    kwargs = dict(max_tokens=20, temperature=0.0, ignore_eos=True)
    done = await engine.generate("What is the capital of France?", **kwargs)
    chunks = [c async for c in engine.stream("What is the capital of France?", **kwargs)]
    assert "".join(c.text for c in chunks) == done.text
    assert [t for c in chunks for t in c.token_ids] == done.token_ids
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage is not None
    assert all(c.finish_reason is None for c in chunks[:-1])


async def test_prompt_as_token_ids_equals_text_prompt(engine: Engine) -> None:
    text = await engine.generate("Tokenflow runs language models", max_tokens=8, temperature=0.0)
    ids = await engine.generate(text.prompt_token_ids, max_tokens=8, temperature=0.0)
    assert ids.token_ids == text.token_ids


async def test_chat_uses_the_chat_template(engine: Engine) -> None:
    messages = [{"role": "user", "content": "hello"}]
    done = await engine.chat(messages, max_tokens=5, temperature=0.0)
    expected = engine.loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert engine.loaded.tokenizer.decode(done.prompt_token_ids) == expected


async def test_sampling_params_object_and_keywords(engine: Engine) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0)
    a = await engine.generate("hello", params)
    b = await engine.generate("hello", params, max_tokens=6)
    assert len(a.token_ids) <= 4 and len(b.token_ids) <= 6
    assert b.token_ids[: len(a.token_ids)] == a.token_ids


async def test_concurrent_requests_all_finish(engine: Engine) -> None:
    results: dict[int, tokenflow.Completion] = {}

    async def one(i: int) -> None:
        results[i] = await engine.generate(f"request number {i} " * (i + 1), max_tokens=6, temperature=0.0,
                                           ignore_eos=True)

    async with anyio.create_task_group() as tg:
        for i in range(12):
            tg.start_soon(one, i)
    assert sorted(results) == list(range(12))
    assert all(len(r.token_ids) == 6 for r in results.values())


async def test_cancelling_the_caller_aborts_the_request(engine: Engine) -> None:
    with anyio.move_on_after(0.05):
        await engine.generate("a long one", max_tokens=2000, temperature=0.0, ignore_eos=True)
    await _until_idle(engine)
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats.get("kv_blocks_used", 0) == 0
    assert stats["num_aborted"] >= 1


async def test_breaking_out_of_stream_aborts_the_request(engine: Engine) -> None:
    stream = engine.stream("a long one", max_tokens=2000, temperature=0.0, ignore_eos=True)
    async for _chunk in stream:
        break
    await stream.aclose()
    await _until_idle(engine)
    assert engine.stats()["num_running"] == 0
    assert engine.stats().get("kv_blocks_used", 0) == 0
    # and the engine still serves
    done = await engine.generate("after", max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(done.token_ids) == 3


async def test_stats_reports_the_basics(engine: Engine) -> None:
    await engine.generate("hello", max_tokens=3, temperature=0.0)
    stats = engine.stats()
    for key in ("state", "num_running", "num_waiting", "step_time_ms", "tokens_per_s", "num_finished"):
        assert key in stats
    assert stats["state"] == "running"
    if engine.config.backend == "paged":
        assert stats["kv_blocks_total"] == 256
        assert stats["kv_blocks_used"] + stats["kv_blocks_free"] == stats["kv_blocks_total"]


async def _until_idle(engine: Engine) -> None:
    with anyio.fail_after(10):
        while engine.stats()["num_running"] or engine.stats()["num_waiting"]:
            await anyio.sleep(0.01)
        await anyio.sleep(0.05)
