"""The scheduler in a running engine: aging bounds starvation, priorities order admission, a burst's
short prompts start first, forced preemption keeps outputs identical, watermarks pause admission."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from tokenflow import Engine
from tokenflow.protocols import StepPlan
from tokenflow.request import Request
from tokenflow.scheduler.scheduler import Scheduler


@dataclass
class Flood:
    """What `_flood_with_long_prompt` saw: the requests the scheduler admitted while the flood lasted, in order;
    the long request; and the steps from its arrival to its first token (None: starved) and in all."""

    admitted: list[Request]
    long: Request
    first: int | None
    steps: int


async def _flood_with_long_prompt(
    model: Path, aging_s: float | None, *, steps: int | None = None, late_s: float = 0.0
) -> Flood:
    """Six clients keep sending short priority-0 requests; after a moment one 4,000-token priority-1
    request arrives. The flood lasts until that request's first token, or with `steps` for at least that
    many steps after its arrival and until a request that arrived `late_s` after it has been admitted. Each
    prompt token counts as no later arrival (`prompt_token_wait_s=0`), so the queue order is priority and
    aging alone. A spy on `Scheduler.schedule` records every admission."""
    rng = random.Random(0)
    admitted: list[Request] = []
    longs: list[Request] = []
    real_schedule = Scheduler.schedule

    def spying_schedule(self: Scheduler) -> StepPlan:
        waiting = {id(r): r for r in self.waiting}
        longs.extend(r for r in waiting.values() if r.params.priority == 1 and r not in longs)
        plan = real_schedule(self)
        admitted.extend(r for r in self.running if waiting.get(id(r)) is r)
        return plan

    settings = dict(max_num_seqs=4, max_batch_tokens=256, num_kv_blocks=600, priority_aging_s=aging_s,
                    prompt_token_wait_s=0.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Scheduler, "schedule", spying_schedule)
        async with Engine(model, **settings) as engine:
            result: dict[str, int] = {}
            stop = anyio.Event()

            async def client() -> None:
                while not stop.is_set():
                    prompt = [rng.randrange(5, 400) for _ in range(rng.randint(8, 40))]
                    await engine.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True, priority=0)

            async def long_request() -> None:
                await anyio.sleep(0.3)
                start = engine.stats()["num_steps"]
                result["start"] = start
                prompt = [rng.randrange(5, 400) for _ in range(4000)]
                async for _ in engine.stream(prompt, max_tokens=2, temperature=0.0, ignore_eos=True, priority=1):
                    result["first"] = engine.stats()["num_steps"] - start
                    break

            def over() -> bool:
                if steps is None:
                    return "first" in result
                return ("start" in result and engine.stats()["num_steps"] - result["start"] >= steps
                        and bool(longs) and admitted[-1].arrival_time > longs[0].arrival_time + late_s)

            async with anyio.create_task_group() as tg:
                for _ in range(6):
                    tg.start_soon(client)
                tg.start_soon(long_request)
                with anyio.fail_after(120):  # a hang guard: with aging the long request does get its token
                    while not over():
                        await anyio.sleep(0.01)
                during = list(admitted)  # once the flood ends, the queue drains: the long request goes too
                stop.set()
                total = engine.stats()["num_steps"] - result["start"]
                tg.cancel_scope.cancel()
    assert len(longs) == 1
    return Flood(during, longs[0], result.get("first"), total)


async def test_aging_bounds_how_long_a_long_low_priority_prompt_waits(long_context_model) -> None:
    """With aging, one priority level is worth `priority_aging_s` of waiting: of the flood, only requests that
    arrived less than that after the long priority-1 request are admitted before it, and it gets its first
    token while the flood still runs (its chunked prefill then takes about 4,000 / 256 = 16 steps). Strict
    priorities starve it through a flood of more steps than that, in which requests arriving twice the aging
    interval after it went first. Asserted on the order of admissions and the scheduler's own clock (arrival
    times), not on how long anything took."""
    aging_s = 0.5
    aged = await _flood_with_long_prompt(long_context_model, aging_s=aging_s)
    assert aged.first is not None and aged.long in aged.admitted
    place = aged.admitted.index(aged.long)
    passed = [r for r in aged.admitted[:place] if r.arrival_time > aged.long.arrival_time]
    too_late = [r.arrival_time - aged.long.arrival_time for r in passed
                if r.arrival_time > aged.long.arrival_time + aging_s]
    assert too_late == [], "requests arriving more than priority_aging_s after it went first"
    assert any(r.params.priority == 0 for r in aged.admitted[place + 1:]), "the flood ran on alongside it"

    # The same flood without aging, for more steps than the aged run needed and until requests that arrived
    # well past `priority_aging_s` after the long one have gone first: it is still waiting.
    starved = await _flood_with_long_prompt(long_context_model, aging_s=None, steps=aged.first + 50,
                                            late_s=2 * aging_s)
    assert starved.first is None and starved.long not in starved.admitted, "without aging the flood goes first"


async def test_high_priority_requests_go_first(tiny_model) -> None:
    """Two long requests hold both slots while 40 short ones of two priorities queue up; as slots
    free, every priority-0 request is admitted before any priority-5 one. Asserted on the order of
    completion, not on latencies, so a slow or fast machine cannot change the outcome."""
    rng = random.Random(1)
    finished: list[int] = []
    async with Engine(tiny_model, max_num_seqs=2, max_batch_tokens=64, priority_aging_s=None) as engine:
        holding = [anyio.Event(), anyio.Event()]

        async def holder(started: anyio.Event) -> None:
            async for _ in engine.stream(rng.sample(range(5, 400), 30), max_tokens=400, temperature=0.0,
                                         ignore_eos=True, priority=0):
                started.set()

        async def one(priority: int) -> None:
            prompt = [rng.randrange(5, 400) for _ in range(30)]
            await engine.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True, priority=priority)
            finished.append(priority)

        async with anyio.create_task_group() as tg:
            for event in holding:
                tg.start_soon(holder, event)
            for event in holding:
                await event.wait()
            for i in range(40):
                tg.start_soon(one, 0 if i % 2 else 5)
            with anyio.fail_after(60):
                while engine.stats()["num_waiting"] < 40:
                    await anyio.sleep(0.005)
            assert engine.stats()["num_running"] == 2, "the holders must still hold both slots"
    assert finished == [0] * 20 + [5] * 20, finished


async def _admission_order(model: Path, token_wait_s: float, lengths: list[int],
                           gap_before_last_s: float = 0.0) -> list[int]:
    """One slot, held by a long stream while requests with prompts of `lengths` tokens queue up in that
    order (the last `gap_before_last_s` after the others); then the holder is cancelled. Returns the
    prompt lengths in the order the requests ran (one at a time: completion order is admission order)."""
    rng = random.Random(3)
    finished: list[int] = []
    async with Engine(model, max_num_seqs=1, max_batch_tokens=64, prompt_token_wait_s=token_wait_s) as engine:
        backend = engine._loop.backend
        real_execute = backend.execute

        def held_step(plan: StepPlan) -> Any:  # 2 ms a step: the holder's 2,000 tokens outlast the queueing
            time.sleep(0.002)                 # on any CPU (a fast one decoded them within the 0.5 s gap)
            return real_execute(plan)

        backend.execute = held_step
        held = anyio.Event()

        async def holder() -> None:
            async for _ in engine.stream(rng.sample(range(5, 400), 20), max_tokens=2000, temperature=0.0,
                                         ignore_eos=True):
                held.set()

        async def one(length: int) -> None:
            prompt = [rng.randrange(5, 400) for _ in range(length)]
            await engine.generate(prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
            finished.append(length)

        async with anyio.create_task_group() as tg, anyio.create_task_group() as holding:
            holding.start_soon(holder)
            await held.wait()
            for i, length in enumerate(lengths):
                if i == len(lengths) - 1 and gap_before_last_s:
                    await anyio.sleep(gap_before_last_s)
                tg.start_soon(one, length)
                with anyio.fail_after(30):
                    while engine.stats()["num_waiting"] < i + 1:
                        await anyio.sleep(0.001)
            holding.cancel_scope.cancel()  # frees the slot: the queue runs in its order
    return finished


async def test_of_a_burst_shorter_prompts_start_first(tiny_model) -> None:
    """Requests queued together run shortest prompt first (each token counts as `prompt_token_wait_s` of
    later arrival); with 0 they run in arrival order; a long prompt that arrived more than its tokens x
    the wait before a short one still goes first (the wait it can suffer is bounded)."""
    lengths = [60, 10, 40, 20, 50, 30]
    assert await _admission_order(tiny_model, 0.01, lengths) == sorted(lengths)
    assert await _admission_order(tiny_model, 0.0, lengths) == lengths
    # 60 tokens x 5 ms = 0.3 s: a 10-token prompt arriving 0.5 s later is placed behind it
    assert await _admission_order(tiny_model, 0.005, [60, 10], gap_before_last_s=0.5) == [60, 10]
    assert await _admission_order(tiny_model, 0.005, [60, 10]) == [10, 60]


async def test_forced_preemption_keeps_outputs_identical(tiny_model) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(5, 400) for _ in range(rng.randint(20, 60))] for _ in range(8)]

    async def run(**settings) -> tuple[list[list[int]], dict]:
        async with Engine(tiny_model, max_num_seqs=8, max_batch_tokens=128, **settings) as engine:
            outs = [None] * len(prompts)

            async def one(i: int) -> None:
                done = await engine.generate(prompts[i], max_tokens=40, temperature=0.0, ignore_eos=True)
                outs[i] = done.token_ids

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            return outs, engine.stats()

    roomy, roomy_stats = await run(num_kv_blocks=256)
    # 8 sequences of up to 100 tokens need up to 56 blocks: 20 forces preemption mid-decode.
    tight, tight_stats = await run(num_kv_blocks=20, kv_high_watermark=1.0, prefix_caching=False)
    assert roomy_stats["num_preemptions"] == 0
    assert tight_stats["num_preemptions"] > 0
    assert tight == roomy
    cached, cached_stats = await run(num_kv_blocks=20, kv_high_watermark=1.0)  # recompute hits the prefix cache
    assert cached == roomy and cached_stats["num_preemptions"] > 0


async def test_high_watermark_pauses_admission_and_avoids_preemption(tiny_model) -> None:
    prompts = [[(i * 37 + j) % 390 + 5 for j in range(40)] for i in range(8)]

    async def run(watermark: float) -> dict:
        async with Engine(tiny_model, max_num_seqs=8, num_kv_blocks=24, kv_high_watermark=watermark,
                          prefix_caching=False) as engine:
            async with anyio.create_task_group() as tg:
                for prompt in prompts:
                    tg.start_soon(lambda p=prompt: engine.generate(p, max_tokens=40, temperature=0.0, ignore_eos=True))
            return engine.stats()

    no_watermark, watermark = await run(1.0), await run(0.6)
    assert watermark["num_paused_admissions"] > 0
    assert watermark["num_preemptions"] < no_watermark["num_preemptions"], (watermark, no_watermark)


def test_decode_buckets() -> None:
    from tokenflow.runtime.compiled import decode_buckets, padded_size

    assert decode_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert decode_buckets(12) == [1, 2, 4, 8, 12]
    assert [padded_size(n, decode_buckets(12)) for n in (1, 3, 5, 9, 12, 13)] == [1, 4, 8, 12, 12, 13]


@pytest.mark.slow
async def test_compiled_padded_decode_matches_transformers(tiny_model) -> None:
    """compile=True: decode batches padded to static sizes (3 -> 4 rows) and a compiled MLP; greedy
    outputs still equal transformers' generate, and the padding's scratch block is no one's."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.test_oracle import hf_greedy

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 400) for _ in range(n)] for n in (12, 30, 45)]
    async with Engine(tiny_model, compile=True, warmup=True, max_num_seqs=4, num_kv_blocks=64) as engine:
        outs: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            outs[i] = (await engine.generate(prompts[i], max_tokens=12, temperature=0.0)).token_ids

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(one, i)
        stats = engine.stats()
        assert engine._loop.backend.scratch_block == 64 and stats["kv_blocks_total"] == 64
    assert stats["kv_blocks_used"] == 0 and 3 in stats["decode_step_ms_by_batch"]
    for i, prompt in enumerate(prompts):
        assert outs[i] == hf_greedy(model, prompt, 12)
