"""Every typed error, and that a bad request never disturbs a good one."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from tokenflow import Engine
from tokenflow.errors import DeadlineExceeded, EngineClosed, EngineError, InvalidRequest, Overloaded


@pytest.fixture
async def engine(tiny_model):
    async with Engine(tiny_model, max_model_len=64, num_kv_blocks=64) as eng:
        yield eng


BAD_REQUESTS = [
    ({"prompt": "hi", "top_p": 2.0}, "top_p"),
    ({"prompt": "hi", "temperature": float("nan")}, "temperature"),
    ({"prompt": "hi", "temperature": -1.0}, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
    ({"prompt": "hi", "top_k": -3}, "top_k"),
    ({"prompt": "hi", "presence_penalty": 9.0}, "presence_penalty"),
    ({"prompt": "hi", "logprobs": 1000}, "logprobs"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "stop": [1, 2]}, "stop"),
    ({"prompt": "hi", "no_such_param": 1}, "no_such_param"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": [1, "x"]}, "prompt"),
    ({"prompt": [1, 10**9]}, "prompt"),
    ({"prompt": [-1, 3]}, "prompt"),
    ({"prompt": "lone \ud800 surrogate"}, "prompt"),
    ({"prompt": "word " * 200}, "prompt"),  # longer than max_model_len=64
]


@pytest.mark.parametrize(("kwargs", "field"), BAD_REQUESTS)
async def test_bad_input_is_invalid_request_naming_the_field(engine: Engine, kwargs, field) -> None:
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt")
    good = None

    async def good_request() -> None:
        nonlocal good
        good = await engine.generate("The quick brown fox", max_tokens=8, temperature=0.0, ignore_eos=True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(good_request)
        with pytest.raises(InvalidRequest) as info:
            await engine.generate(prompt, **kwargs)
    assert info.value.field == field, str(info.value)
    assert good is not None and len(good.token_ids) == 8
    assert engine.stats()["kv_blocks_used"] == 0


async def test_bad_chat_messages(engine: Engine) -> None:
    for messages in ([], [{"role": "user"}], [{"role": "user", "content": 3}], "hello"):
        with pytest.raises(InvalidRequest) as info:
            await engine.chat(messages, max_tokens=2)
        assert info.value.field == "messages"


async def test_request_that_can_never_fit_the_pool(tiny_model) -> None:
    """A pool of 2 blocks serves a 32-token context (clamped from the model's, with a warning): a request that
    would need more is refused for the context, up front, and the engine keeps serving."""
    async with Engine(tiny_model, num_kv_blocks=2, block_size=16) as engine:
        with pytest.raises(InvalidRequest, match="context is 32 tokens") as info:
            await engine.generate("hello there", max_tokens=100)
        assert info.value.field == "max_tokens"
        done = await engine.generate("hello", max_tokens=4, temperature=0.0)  # still serving
        assert done.token_ids


async def test_deadline_exceeded_frees_the_request(engine: Engine) -> None:
    """Each step is held 5 ms, so 60 tokens take 0.3 s whatever the CPU: the 0.05 s deadline falls mid-decode."""
    backend = engine._loop.backend
    real = backend.execute

    def held(plan: Any) -> Any:
        time.sleep(0.005)
        return real(plan)

    backend.execute = held
    with pytest.raises(DeadlineExceeded):
        await engine.generate("slow", max_tokens=60, temperature=0.0, ignore_eos=True, timeout=0.05)
    backend.execute = real
    with anyio.fail_after(5):
        while engine.stats()["num_running"] or engine.stats()["kv_blocks_used"]:
            await anyio.sleep(0.01)


async def test_engine_default_timeout(tiny_model) -> None:
    async with Engine(tiny_model, timeout=0.01) as engine:
        with pytest.raises(DeadlineExceeded):
            await engine.generate("slow", max_tokens=2000, temperature=0.0, ignore_eos=True)


async def test_overloaded_when_the_queue_is_full(tiny_model) -> None:
    async with Engine(tiny_model, backend="hf", max_num_seqs=1, max_queue=1) as engine:
        first_token = anyio.Event()

        async def long_request() -> None:
            async for _ in engine.stream("busy", max_tokens=300, temperature=0.0, ignore_eos=True):
                first_token.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_request)
            await first_token.wait()  # the model is busy with it now
            tg.start_soon(engine.generate, "queued", None)  # fills the one queue slot
            await anyio.sleep(0.05)
            with pytest.raises(Overloaded) as info:
                await engine.generate("one too many", max_tokens=2)
            assert info.value.retry_after > 0
            tg.cancel_scope.cancel()


async def test_engine_closed_before_start_and_after_close(tiny_model) -> None:
    engine = Engine(tiny_model)
    with pytest.raises(EngineClosed):
        await engine.generate("hi")
    async with engine:
        await engine.generate("hi", max_tokens=2)
    with pytest.raises(EngineClosed):
        await engine.generate("hi")


async def test_close_aborts_what_cannot_drain(tiny_model) -> None:
    engine = Engine(tiny_model)
    await engine.start()
    errors = []

    async def caller() -> None:
        try:
            await engine.generate("long", max_tokens=1500, temperature=0.0, ignore_eos=True)
        except EngineClosed as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await anyio.sleep(0.1)
        await engine.aclose(drain_timeout=0.1)
    assert len(errors) == 1


async def test_a_failed_step_fails_its_requests_and_the_engine_carries_on(engine: Engine) -> None:
    backend = engine._loop.backend
    real_execute = backend.execute
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real_execute(plan)

    backend.execute = flaky
    with pytest.raises(EngineError, match="injected fault"):
        await engine.generate("first", max_tokens=4)
    done = await engine.generate("second", max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(done.token_ids) == 4
    assert engine.stats()["kv_blocks_used"] == 0


async def test_repeated_step_failures_kill_the_engine(tiny_model) -> None:
    async with Engine(tiny_model, max_num_seqs=1) as engine:  # one request per step: failures in a row
        await _fail_until_dead(engine)


async def _fail_until_dead(engine: Engine) -> None:
    def broken(plan):
        raise RuntimeError("device lost")

    engine._loop.backend.execute = broken
    outcomes = []

    async def caller(i: int) -> None:
        try:
            await engine.generate(f"caller {i}", max_tokens=4)
        except EngineError as exc:
            outcomes.append(type(exc))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(caller, i)
    assert outcomes == [EngineError] * 5
    assert engine.stats()["dead"] is True
    with pytest.raises(EngineClosed):
        await engine.generate("after death")


async def test_out_of_memory_in_a_step_shrinks_the_batch_before_failing_anyone(tiny_model) -> None:
    """A CUDA OOM (simulated: torch.OutOfMemoryError is what CUDA raises) preempts half the batch."""
    import torch

    async with Engine(tiny_model, num_kv_blocks=256) as engine:
        backend = engine._loop.backend
        real_execute = backend.execute
        ooms = {"n": 0}

        def tight_memory(plan):
            if len(plan.chunks) > 2:  # the "device" only fits two sequences per step
                ooms["n"] += 1
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real_execute(plan)

        alone = [await engine.generate(f"prompt {i}", max_tokens=6, temperature=0.0, ignore_eos=True)
                 for i in range(6)]
        backend.execute = tight_memory
        results = {}

        async def one(i: int) -> None:
            results[i] = await engine.generate(f"prompt {i}", max_tokens=6, temperature=0.0, ignore_eos=True)

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
        stats = engine.stats()
    assert ooms["n"] >= 1 and stats["num_oom_recoveries"] >= 1 and stats["num_preemptions"] >= 1
    assert stats["num_failed"] == 0
    assert [results[i].token_ids for i in range(6)] == [a.token_ids for a in alone]
