"""The engine owns its required path: admission (queue bounds, the circuit breaker), the response cache,
tokenizing and prefetching run whatever `request_stages` lists, which is the caller's middleware only.

The redact plugin's docstring used to tell users `request_stages=["redact", "tokenizer"]`, which silently
dropped the queue bound, the breaker, the response cache and prefetching.
"""

from __future__ import annotations

import warnings
from typing import Any

import anyio
import pytest

from tests.engines import poison_rows, running_engine, until_idle
from tokenflow.config import EngineConfig
from tokenflow.errors import EngineError, Overloaded

SETTINGS = dict(max_model_len=256, num_kv_blocks=64, num_threads=1)


@pytest.mark.parametrize("stages", [["redact"], ["redact", "tokenizer"]], ids=["middleware", "legacy-list"])
async def test_middleware_alone_still_tokenizes_bounds_the_queue_and_caches(tiny_model, stages) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy list warns; it is read the old way
        engine_cm = running_engine(tiny_model, request_stages=stages, max_queue=2, max_num_seqs=1,
                                   response_cache=True, **SETTINGS)
    async with engine_cm as engine:
        done = await engine.generate("mail alice@example.com now", max_tokens=3, temperature=0.0)
        assert engine.loaded.tokenizer.decode(done.prompt_token_ids) == "mail [email] now"  # redacted, tokenized
        again = await engine.generate("mail bob@example.org now", max_tokens=3, temperature=0.0)
        assert engine.stats()["response_cache_memory_hits"] == 1  # the same redacted prompt: one answer
        assert again.token_ids == done.token_ids
        outcomes: list[str] = []

        async def one(i: int) -> None:
            try:
                await engine.generate(f"request {i}", max_tokens=40, ignore_eos=True, cache_response=False)
                outcomes.append("completed")
            except Overloaded:
                outcomes.append("Overloaded")

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
        assert outcomes.count("Overloaded") >= 4 and "completed" in outcomes  # max_queue=2 held
        assert engine.stats()["queue_rejections"] >= 4


async def test_middleware_alone_still_trips_the_breaker(tiny_model) -> None:
    async with running_engine(tiny_model, request_stages=["redact"], breaker_window=8, breaker_open_s=30.0,
                              **SETTINGS) as engine:
        backend = engine._loop.backend
        real = backend.execute
        backend.execute = lambda plan: poison_rows(real(plan), list(range(len([c for c in plan.chunks
                                                                                if c.samples]))))
        for i in range(4):
            with pytest.raises(EngineError):
                await engine.generate(f"doomed {i}", max_tokens=2)
        with pytest.raises(Overloaded, match="circuit breaker is open"):
            await engine.generate("refused at the door", max_tokens=2)
        backend.execute = real
        await until_idle(engine)
        assert engine.stats()["breaker_state"] == "open"


def test_a_legacy_request_stages_list_maps_to_the_new_settings() -> None:
    with pytest.warns(DeprecationWarning, match="request_stages"):
        config = EngineConfig.load(environ={}, request_stages=["breaker", "redact", "disk_tier", "redis_tier",
                                                               "tokenizer"])
    assert config.request_stages == ["redact"]
    assert config.kv_tiers == ["disk", "redis"]
    assert config.prefetch is False  # the list left the prefetcher out
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a list of middleware alone is not legacy: no warning
        assert EngineConfig.load(environ={}, request_stages=["redact"]).kv_tiers == ["disk"]


def _stages(engine: Any) -> list[str]:
    return [type(s).__name__ for s in engine._stages]


async def test_the_path_is_admission_then_middleware_then_the_response_cache(tiny_model) -> None:
    async with running_engine(tiny_model, request_stages=["redact"], **SETTINGS) as engine:
        assert _stages(engine) == ["BreakerStage", "RedactEmails", "ResponseCacheStage"]
