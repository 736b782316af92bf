"""Async scheduling (`async_scheduling=True`): each decode step is planned and queued while the one before runs,
its input tokens handed over on the model thread (`Scheduler.schedule_ahead`, `AheadInput`).

The oracle is the same engine without it: every request's tokens, text and finish reason must be the same
(fp32, so batch shapes cannot flip a token), through stop strings, EOS, length limits, seeded sampling, and
neighbours whose parameters keep steps on the usual path (a grammar, penalties). Faults are injected into ahead
steps: a failed step, a row with non-finite logits, a device out of memory, a caller's cancellation; each must
end only its own requests, and no KV block may stay referenced (`debug_leaks`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest
import torch

from tests.engines import poison_rows, running_engine, until_idle
from tokenflow import Engine
from tokenflow.config import EngineConfig
from tokenflow.errors import EngineError
from tokenflow.kv.block_pool import BlockPool
from tokenflow.params import SamplingParams
from tokenflow.protocols import ScheduledChunk, StepPlan
from tokenflow.request import Request, RequestStatus
from tokenflow.scheduler.scheduler import Scheduler

SETTINGS = dict(max_model_len=256, num_kv_blocks=160, num_threads=1, debug_leaks=True, dtype="float32")
PROMPTS = ["The cat sat on the mat and", "def add(a, b):", "Once upon a time there", "1, 2, 3, 4,",
           "A long road", "Lists of things:", "Hello", "Tokens flow"]


def _params(i: int) -> dict[str, Any]:
    """Request i's sampling: greedy or seeded sampling, some stopping at EOS, various lengths."""
    kinds: list[dict[str, Any]] = [
        dict(temperature=0.0, ignore_eos=True),
        dict(temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True),
        dict(temperature=1.0, top_k=20, seed=200 + i),  # may stop at EOS
        dict(temperature=0.0, logprobs=2, ignore_eos=True),
    ]
    return {**kinds[i % len(kinds)], "max_tokens": 9 + 5 * i}


async def _serve(engine: Engine, requests: list[tuple[str, dict[str, Any]]], *, stagger_s: float = 0.0
                 ) -> list[tuple[list[int], str, str | None]]:
    """Each request streamed by its own task (started `stagger_s` apart): its tokens, text and finish reason."""
    results: list[Any] = [None] * len(requests)

    async def one(k: int, prompt: str, params: dict[str, Any]) -> None:
        await anyio.sleep(k * stagger_s)
        tokens: list[int] = []
        text, finish = "", None
        async for chunk in engine.stream(prompt, **params):
            tokens.extend(chunk.token_ids)
            text += chunk.text
            finish = chunk.finish_reason or finish
        results[k] = (tokens, text, finish)

    async with anyio.create_task_group() as tg:
        for k, (prompt, params) in enumerate(requests):
            tg.start_soon(one, k, prompt, params)
    return results


def _stop_string(text: str) -> str:
    """Three characters first met in the second half of `text`: a stop string a request meets mid-way."""
    return next(text[i:i + 3] for i in range(len(text) // 2, len(text) - 3)
                if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())


def _mixed_requests(stop: str) -> list[tuple[str, dict[str, Any]]]:
    requests = [(p, _params(i)) for i, p in enumerate(PROMPTS)]
    requests.append((PROMPTS[0], dict(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])))
    requests.append((PROMPTS[1], dict(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3)))
    requests.append((PROMPTS[2], dict(temperature=0.0, max_tokens=20, regex="[a-z]{3,12}")))
    return requests


@pytest.fixture(params=["dynamic", "device"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How decode steps run: the dynamic path, or at the fixed shapes of CUDA graphs (run eagerly here), where
    tokens are drawn on the device and, with async scheduling, chained there: a step is queued behind the one
    before with that step's tokens as its inputs before they reach the host (`DecodeGraphs.run`)."""
    if request.param == "device":
        monkeypatch.setattr("tokenflow.runtime.backends.paged.decode_graph_mode", lambda config, device: "eager")
    return str(request.param)


async def test_outputs_equal_the_usual_scheduling(tiny_model, decode_path: str) -> None:
    """Twelve concurrent and staggered requests of every kind: the same tokens, text and finish with async
    scheduling as without, most decode steps planned ahead (on the device: chained there), no block left
    referenced."""
    async with running_engine(tiny_model, **SETTINGS) as engine:
        greedy = await engine.generate(PROMPTS[0], temperature=0.0, max_tokens=30, ignore_eos=True)
        stop = _stop_string(greedy.text)
        usual = await _serve(engine, _mixed_requests(stop), stagger_s=0.01)
        assert engine.stats()["num_ahead_steps"] == 0  # off by default
    async with running_engine(tiny_model, async_scheduling=True, **SETTINGS) as engine:
        ahead = await _serve(engine, _mixed_requests(stop), stagger_s=0.01)
        stats = await until_idle(engine)
    assert ahead == usual
    assert usual[len(PROMPTS)][2] == "stop" and stop not in usual[len(PROMPTS)][1]  # the stop string was met
    assert stats["num_ahead_steps"] > 0 and stats["num_ahead_skipped"] == 0
    assert stats["kv_blocks_used"] == 0 and stats["num_failed"] == 0
    if decode_path == "device":
        assert stats["chained_decode_steps"] > 0 and stats["deferred_decode_steps"] > stats["chained_decode_steps"]


async def test_a_request_stopped_mid_chain_computes_one_dropped_token(tiny_model) -> None:
    """Four plain greedy requests decode in one chain; one meets its stop string there. Its answer is the
    usual one, and its decode rows number its tokens (one per token after the first, and the row planned ahead
    while its stopping token was drawn, whose token was dropped); planned one at a time, one fewer."""
    async with running_engine(tiny_model, **SETTINGS) as engine:
        greedy = await engine.generate(PROMPTS[3], temperature=0.0, max_tokens=30, ignore_eos=True)
    stop = _stop_string(greedy.text)
    requests = [(p, dict(temperature=0.0, max_tokens=30, ignore_eos=True)) for p in PROMPTS[:3]]
    requests.append((PROMPTS[3], dict(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])))
    outputs, rows = [], []
    for async_scheduling in (False, True):
        async with running_engine(tiny_model, async_scheduling=async_scheduling, **SETTINGS) as engine:
            backend = engine._loop.backend
            real_execute = backend.execute
            decode_rows = {"n": 0}

            def counting(plan: StepPlan, real_execute: Any = real_execute, decode_rows: Any = decode_rows) -> Any:
                decode_rows["n"] += sum(bool(c.request.params.stop) and (
                    c.ahead is not None or (c.num_tokens == 1
                    and c.request.num_prompt_tokens <= c.request.num_computed_tokens)) for c in plan.chunks)
                return real_execute(plan)

            backend.execute = counting
            outputs.append(await _serve(engine, requests))
            rows.append(decode_rows["n"])
            stats = await until_idle(engine)
    usual, ahead = outputs
    tokens, text, finish = ahead[3]
    assert ahead == usual and finish == "stop" and len(tokens) < 30 and stop not in text
    assert rows == [len(tokens) - 1, len(tokens)] and stats["num_ahead_steps"] > 0


async def test_a_cancelled_stream_ends_only_itself(tiny_model, decode_path: str) -> None:
    """A stream cancelled with plain `task.cancel()` after 1..6 tokens, while its neighbours' decode steps
    are planned ahead (on the device: chained there): each neighbour gets its solo answer, and nothing holds a
    block after."""
    neighbours = [(p, dict(temperature=0.0, max_tokens=24, ignore_eos=True)) for p in PROMPTS[:4]]
    async with running_engine(tiny_model, async_scheduling=True, **SETTINGS) as engine:
        solo = [(await engine.generate(p, **params)).token_ids for p, params in neighbours]
        for cancel_after in range(1, 7):
            seen: list[int] = []

            async def victim(after: int = cancel_after, seen: list[int] = seen) -> None:
                async for chunk in engine.stream("A victim that is cancelled", max_tokens=40, temperature=0.0,
                                                 ignore_eos=True):
                    seen.extend(chunk.token_ids)
                    if len(seen) >= after:
                        await asyncio.sleep(3600)  # cancelled here

            task = asyncio.create_task(victim())
            others = asyncio.create_task(_serve(engine, neighbours))
            while len(seen) < cancel_after:
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert [tokens for tokens, _, _ in await others] == solo
            stats = await until_idle(engine)
            assert stats["kv_blocks_used"] == 0
        assert stats["num_ahead_steps"] > 0 and stats["num_aborted"] == 6
        assert decode_path == "dynamic" or stats["chained_decode_steps"] > 0


async def test_a_failed_ahead_step_fails_its_requests_and_the_engine_carries_on(tiny_model, decode_path: str
                                                                                 ) -> None:
    """The fifth decode step raises: its requests get `EngineError`, the step queued behind it is skipped (no
    token to run on, on the host or the device), and the engine then serves new requests as before."""
    async with running_engine(tiny_model, async_scheduling=True, **SETTINGS) as engine:
        expected = (await engine.generate("after the fault", max_tokens=12, temperature=0.0,
                                          ignore_eos=True)).token_ids
        backend = engine._loop.backend
        real_execute = backend.execute
        calls = {"decode": 0}

        def flaky(plan: StepPlan) -> Any:
            if all(c.ahead is not None for c in plan.chunks):
                calls["decode"] += 1
                if calls["decode"] == 5:
                    raise RuntimeError("injected fault")
            return real_execute(plan)

        backend.execute = flaky
        outcomes: dict[str, Any] = {}

        async def one(prompt: str) -> None:
            try:
                done = await engine.generate(prompt, max_tokens=20, temperature=0.0, ignore_eos=True)
                outcomes[prompt] = done.token_ids
            except EngineError as exc:
                outcomes[prompt] = exc

        async with anyio.create_task_group() as tg:
            for prompt in PROMPTS[:3]:
                tg.start_soon(one, prompt)
        failed = [p for p, o in outcomes.items() if isinstance(o, EngineError)]
        assert failed and all("injected fault" in str(outcomes[p]) for p in failed)  # those in the failed step
        for prompt in set(PROMPTS[:3]) - set(failed):  # any that joined after it: their usual answer
            backend.execute = real_execute
            assert outcomes[prompt] == (await engine.generate(prompt, max_tokens=20, temperature=0.0,
                                                              ignore_eos=True)).token_ids
        stats = await until_idle(engine)
        assert stats["num_ahead_skipped"] >= 1 and stats["kv_blocks_used"] == 0
        backend.execute = real_execute
        again = await engine.generate("after the fault", max_tokens=12, temperature=0.0, ignore_eos=True)
        assert again.token_ids == expected and not engine.stats()["dead"]


async def test_a_row_with_non_finite_logits_fails_alone(tiny_model, decode_path: str) -> None:
    """One request's row in an ahead step comes back NaN (on the device: its draw -1, after the step behind it was
    queued with that row's input taken there): it fails with `EngineError`; on the host the step planned behind it
    has no token for it and is skipped, on the device the token that step drew for it is dropped; its neighbours
    carry on to their usual answers."""
    requests = [(p, dict(temperature=0.0, max_tokens=20 + (k == 1), ignore_eos=True))  # the victim: 21 tokens
                for k, p in enumerate(PROMPTS[:4])]
    async with running_engine(tiny_model, **SETTINGS) as engine:
        usual = await _serve(engine, requests)
    async with running_engine(tiny_model, async_scheduling=True, **SETTINGS) as engine:
        backend = engine._loop.backend
        real_execute = backend.execute
        poisoned = {"done": False}

        def poison_once(plan: StepPlan) -> Any:
            out = real_execute(plan)
            sampling = [c for c in plan.chunks if c.samples]
            rows = [j for j, c in enumerate(sampling) if c.request.params.max_tokens == 21]  # the victim's
            if not poisoned["done"] and rows and all(c.ahead is not None for c in plan.chunks) and len(
                    sampling[rows[0]].request.output_token_ids) >= 5:
                poisoned["done"] = True
                return poison_rows(out, rows)
            return out

        backend.execute = poison_once
        results: dict[int, Any] = {}

        async def one(k: int) -> None:
            prompt, params = requests[k]
            try:
                results[k] = (await engine.generate(prompt, **params)).token_ids
            except EngineError as exc:
                results[k] = exc

        async with anyio.create_task_group() as tg:
            for k in range(4):
                tg.start_soon(one, k)
        stats = await until_idle(engine)
    assert poisoned["done"] and isinstance(results[1], EngineError) and "non-finite" in str(results[1])
    assert [results[k] for k in (0, 2, 3)] == [usual[k][0] for k in (0, 2, 3)]
    assert stats["num_failed"] == 1 and stats["kv_blocks_used"] == 0
    if decode_path == "dynamic":
        assert stats["num_ahead_skipped"] >= 1
    else:
        assert stats["chained_decode_steps"] > 0


async def test_out_of_memory_in_an_ahead_step_shrinks_the_batch(tiny_model, decode_path: str) -> None:
    """A device out of memory (simulated) in any ahead step of more than two rows (on the device: chained on
    the step before): the batch shrinks (preempting half, which recompute) and everyone still gets the usual
    answer."""
    requests = [(f"prompt {i}", dict(temperature=0.0, max_tokens=12, ignore_eos=True)) for i in range(6)]
    async with running_engine(tiny_model, **SETTINGS) as engine:
        usual = await _serve(engine, requests)
    async with running_engine(tiny_model, async_scheduling=True, **SETTINGS) as engine:
        backend = engine._loop.backend
        real_execute = backend.execute
        ooms = {"n": 0}

        def tight_memory(plan: StepPlan) -> Any:
            if len(plan.chunks) > 2 and any(c.ahead is not None for c in plan.chunks):
                ooms["n"] += 1
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real_execute(plan)

        backend.execute = tight_memory
        ahead = await _serve(engine, requests)
        stats = await until_idle(engine)
    assert ooms["n"] >= 1 and stats["num_oom_recoveries"] >= 1 and stats["num_preemptions"] >= 1
    assert ahead == usual and stats["num_failed"] == 0 and stats["kv_blocks_used"] == 0


# -- the scheduler's ahead plan, alone ------------------------------------------------------------------------
def _scheduler(num_blocks: int = 16, block_size: int = 4, **config: Any) -> Scheduler:
    scheduler = Scheduler(EngineConfig(max_batch_tokens=64, block_size=block_size, **config))
    scheduler.pool = BlockPool(num_blocks, block_size)
    scheduler.max_model_len = 64
    return scheduler


def _decoding(scheduler: Scheduler, prompt_len: int, outputs: int, **params: Any) -> Request:
    """A running request whose prompt and `outputs` generated tokens are known, all but the last computed."""
    request = Request(SamplingParams(**{"max_tokens": 20, "ignore_eos": True, **params}),
                      prompt_token_ids=list(range(5, 5 + prompt_len)))
    scheduler.add(request)
    scheduler.waiting.remove(request)
    request.output_token_ids.extend([9] * outputs)
    request.num_computed_tokens = request.num_tokens - 1
    request.block_table.extend(scheduler.kv.allocate(scheduler.kv.blocks_needed(request.num_tokens)))
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)
    return request


def test_schedule_ahead_plans_the_next_decode_from_the_running_step() -> None:
    scheduler = _scheduler()
    a = _decoding(scheduler, prompt_len=6, outputs=1)  # computes position 6 now; position 7 ahead: block 1 has room
    b = _decoding(scheduler, prompt_len=6, outputs=2)  # computes position 7 now; position 8 ahead: a new block
    plan = StepPlan([ScheduledChunk(a, 1), ScheduledChunk(b, 1)])
    before = [(r.num_computed_tokens, list(r.output_token_ids)) for r in (a, b)]
    free = scheduler.kv.num_free
    ahead = scheduler.schedule_ahead(plan)
    assert ahead is not None and [c.request for c in ahead.chunks] == [a, b]
    assert [(c.num_tokens, c.samples, c.ahead.position) for c in ahead.chunks if c.ahead] == [(1, True, 7),
                                                                                              (1, True, 8)]
    assert len(a.block_table) == 2 and len(b.block_table) == 3 and scheduler.kv.num_free == free - 1
    assert [c.ahead.block_table for c in ahead.chunks if c.ahead] == [a.block_table, b.block_table]
    assert [(r.num_computed_tokens, list(r.output_token_ids)) for r in (a, b)] == before  # the step's view kept
    b.block_table.append(99)  # the ahead chunk keeps the table as planned
    assert ahead.chunks[1].ahead is not None and 99 not in ahead.chunks[1].ahead.block_table


def test_schedule_ahead_leaves_out_requests_whose_token_now_is_their_last() -> None:
    scheduler = _scheduler()
    last = _decoding(scheduler, prompt_len=3, outputs=4, max_tokens=5)  # the running step draws token 5 of 5
    on = _decoding(scheduler, prompt_len=3, outputs=3, max_tokens=5)
    ahead = scheduler.schedule_ahead(StepPlan([ScheduledChunk(last, 1), ScheduledChunk(on, 1)]))
    assert ahead is not None and [c.request for c in ahead.chunks] == [on]
    on.status = RequestStatus.FINISHED  # aborted while the step runs
    assert scheduler.schedule_ahead(StepPlan([ScheduledChunk(last, 1), ScheduledChunk(on, 1)])) is None


@pytest.mark.parametrize("params", [dict(repetition_penalty=1.2), dict(min_tokens=3), dict(logit_bias={5: 1.0}),
                                    dict(prompt_logprobs=1)])
def test_schedule_ahead_declines_rows_that_depend_on_the_token_being_drawn(params: dict[str, Any]) -> None:
    scheduler = _scheduler()
    plain = _decoding(scheduler, prompt_len=3, outputs=1)
    other = _decoding(scheduler, prompt_len=3, outputs=1, **params)
    assert scheduler.schedule_ahead(StepPlan([ScheduledChunk(plain, 1), ScheduledChunk(other, 1)])) is None


def test_schedule_ahead_declines_while_requests_wait_or_blocks_run_short() -> None:
    scheduler = _scheduler(num_blocks=4)
    a = _decoding(scheduler, prompt_len=7, outputs=1, max_tokens=8)  # two full blocks; the ahead token needs a third
    plan = StepPlan([ScheduledChunk(a, 1)])
    queued = Request(SamplingParams(max_tokens=4), prompt_token_ids=[5, 6])
    scheduler.add(queued)
    assert scheduler.schedule_ahead(plan) is None  # admission is `schedule()`'s: it waits one step, not more
    scheduler.waiting.remove(queued)
    scheduler.kv.allocate(scheduler.kv.num_free)  # no block left for the ahead token
    assert scheduler.schedule_ahead(plan) is None and len(a.block_table) == 2


def test_schedule_ahead_declines_a_plan_with_a_prefill_chunk() -> None:
    scheduler = _scheduler()
    a = _decoding(scheduler, prompt_len=6, outputs=1)
    b = _decoding(scheduler, prompt_len=6, outputs=1)
    b.num_computed_tokens = 2  # five prompt tokens to go: this step's chunk is a prefill
    assert scheduler.schedule_ahead(StepPlan([ScheduledChunk(a, 1), ScheduledChunk(b, 5)])) is None
    assert scheduler.schedule_ahead(StepPlan([ScheduledChunk(a, 1)])) is not None
