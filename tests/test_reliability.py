"""Reliability on the tiny model: cancellation and deadlines, faults injected per stage, the leak
check, a bad-input battery, and a soak test at about four times the engine's capacity.

Each fault test prints the outcome every caller saw (`pytest -s` shows them).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections import Counter
from typing import Any

import anyio
import pytest
import torch

from tests.engines import poison_rows, running_engine, stage_of, until_idle
from tokenflow import Engine
from tokenflow.errors import DeadlineExceeded, EngineError, InvalidRequest, Overloaded
from tokenflow.stages.tokenizer import TokenizerStage

BASE = dict(max_model_len=128, num_kv_blocks=64, num_threads=1)


def _engine(tiny_model: Any, **settings: Any) -> contextlib.AbstractAsyncContextManager[Engine]:
    return running_engine(tiny_model, **{**BASE, **settings})


def _count_executed(engine: Engine) -> Counter[str]:
    """Chunks the model executed per request, keyed by `cache_salt` (our tag)."""
    seen: Counter[str] = Counter()
    backend = engine._loop.backend
    real = backend.execute

    def counting(plan: Any) -> Any:
        for chunk in plan.chunks:
            seen[chunk.request.params.cache_salt or ""] += 1
        return real(plan)

    backend.execute = counting
    return seen


async def _outcome(call: Any) -> str:
    try:
        await call
    except Exception as exc:
        return type(exc).__name__
    return "completed"


async def _callers(calls: dict[str, Any], limit: float = 30.0) -> dict[str, str]:
    """Run named calls concurrently; the outcome each saw. Nobody may hang."""
    outcomes: dict[str, str] = {}

    async def one(name: str, call: Any) -> None:
        outcomes[name] = await _outcome(call)

    with anyio.fail_after(limit):
        async with anyio.create_task_group() as tg:
            for name, call in calls.items():
                tg.start_soon(one, name, call)
    return outcomes


_until_clean = until_idle


# -- cancellation and deadlines ---------------------------------------------------------------
async def test_cancelled_or_expired_waiting_requests_never_reach_the_model(tiny_model) -> None:
    async with _engine(tiny_model, max_num_seqs=1, tokenizer_window_ms=5.0) as engine:
        seen = _count_executed(engine)
        ended: dict[str, str] = {}

        async def victim(tag: str, cancel_after: float | None = None, timeout: float | None = None) -> None:
            with anyio.move_on_after(cancel_after) as scope:
                ended[tag] = await _outcome(engine.generate(f"victim {tag}", max_tokens=4, timeout=timeout,
                                                            cache_salt=tag))
            if scope.cancelled_caught:
                ended[tag] = "cancelled"

        # On an idle engine, while the prompt waits for its tokenizer batch.
        for i, delay in enumerate([0.0, 0.001, 0.003]):
            await victim(f"tokenizing-cancel-{i}", cancel_after=delay)
        for i, delay in enumerate([0.001, 0.003]):
            await victim(f"tokenizing-deadline-{i}", timeout=delay)
        # Queued behind a long request that holds the only sequence slot.
        busy = anyio.Event()

        async def long_request() -> None:
            async for _ in engine.stream("busy", max_tokens=120, ignore_eos=True, cache_salt="busy"):
                busy.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_request)
            await busy.wait()
            async with anyio.create_task_group() as victims:
                for i in range(4):
                    victims.start_soon(victim, f"queued-cancel-{i}", 0.005 + 0.01 * i, None)
                    victims.start_soon(victim, f"queued-deadline-{i}", None, 0.005 + 0.01 * i)
            tg.cancel_scope.cancel()
        print(f"\n[cancellation] outcomes {dict(Counter(ended.values()))}; executed chunks {dict(seen)}")
        assert all(v in ("cancelled", "DeadlineExceeded") for v in ended.values()), ended
        assert not [tag for tag in ended if seen[tag]], "a cancelled waiting request reached the model"
        await _until_clean(engine)
        done = await engine.generate("after", max_tokens=3, ignore_eos=True)
        assert len(done.token_ids) == 3


async def test_cancel_while_prefilling_or_decoding_frees_blocks_at_the_next_step(tiny_model) -> None:
    async with _engine(tiny_model, max_batch_tokens=8, num_kv_blocks=32) as engine:
        seen = _count_executed(engine)
        long_prompt = "The quick brown fox jumps over the lazy dog. " * 4  # many 8-token prefill chunks
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.generate, long_prompt, None)
            with anyio.fail_after(10):
                while not seen[""]:
                    await anyio.sleep(0.0005)
            tg.cancel_scope.cancel()  # mid-prefill
        at_cancel = seen[""]
        stats = await _until_clean(engine)
        assert seen[""] <= at_cancel + 1 and stats["kv_blocks_used"] == 0  # at most the step in flight
        chunks = 0
        stream = engine.stream("decode then leave", max_tokens=100, ignore_eos=True)
        async with contextlib.aclosing(stream) as it:
            async for _ in it:
                chunks += 1
                if chunks == 5:
                    break  # mid-decode
        await _until_clean(engine)


# -- faults injected per stage ----------------------------------------------------------------
def _report(name: str, outcomes: dict[str, str]) -> None:
    print(f"\n[fault: {name}] " + ", ".join(f"{k}={v}" for k, v in sorted(outcomes.items())))


async def test_fault_tokenizer_stage_fails_only_that_request(tiny_model) -> None:
    async with _engine(tiny_model) as engine:
        stage = stage_of(engine, TokenizerStage)
        real = stage.prepare

        async def flaky(request: Any) -> None:
            if request.params.cache_salt == "poison":
                raise RuntimeError("injected tokenizer fault")
            await real(request)

        stage.prepare = flaky
        calls = {f"good-{i}": engine.generate(f"good {i}", max_tokens=6, ignore_eos=True) for i in range(3)}
        calls["poison"] = engine.generate("poison", max_tokens=6, cache_salt="poison")
        outcomes = await _callers(calls)
        _report("tokenizer stage raises for one request", outcomes)
        assert outcomes.pop("poison") == "EngineError"  # a stage's bug reaches its caller typed
        assert set(outcomes.values()) == {"completed"}
        assert (await _until_clean(engine))["dead"] is False


async def test_fault_tokenizer_encode_of_one_prompt_spares_its_batch_neighbours(tiny_model) -> None:
    async with _engine(tiny_model, tokenizer_window_ms=20.0) as engine:
        stage = stage_of(engine, TokenizerStage)
        real = stage.tokenizer

        class Poisoned:
            def __call__(self, texts: list[str], **kwargs: Any) -> Any:
                if any("POISON" in t for t in texts):
                    raise RuntimeError("injected encode fault")
                return real(texts, **kwargs)

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        stage.tokenizer = Poisoned()
        outcomes = await _callers({name: engine.generate(f"{name} text", max_tokens=4)
                                   for name in ("good-1", "POISON", "good-2")})
        _report("tokenizer encode raises for one prompt of a batch", outcomes)
        assert outcomes == {"good-1": "completed", "POISON": "InvalidRequest", "good-2": "completed"}


async def test_fault_schedule_raising_fails_pending_requests_and_the_engine_carries_on(tiny_model) -> None:
    async with _engine(tiny_model, max_num_seqs=2) as engine:
        batcher = engine._loop.scheduler

        class Running(list):  # raises inside schedule(), after a request left `waiting` and got blocks
            appends = 0

            def append(self, request: Any) -> None:
                Running.appends += 1
                if Running.appends == 3:
                    raise RuntimeError("injected scheduler fault")
                super().append(request)

        batcher.running = Running(batcher.running)
        calls = {f"caller-{i}": engine.generate(f"c{i}", max_tokens=20, ignore_eos=True) for i in range(4)}
        outcomes = await _callers(calls)
        _report("batcher.schedule raises once", outcomes)
        assert "EngineError" in outcomes.values()
        assert set(outcomes.values()) <= {"completed", "EngineError"}
        stats = await _until_clean(engine)
        assert stats["dead"] is False
        done = await engine.generate("after the fault", max_tokens=4, ignore_eos=True)
        assert len(done.token_ids) == 4


async def test_fault_schedule_always_raising_kills_the_engine(tiny_model) -> None:
    async with _engine(tiny_model) as engine:
        def broken() -> Any:
            raise RuntimeError("injected scheduler fault")

        engine._loop.scheduler.schedule = broken
        outcomes: dict[str, str] = {}
        for round_ in range(4):
            calls = {f"r{round_}-{i}": engine.generate("x", max_tokens=4) for i in range(3)}
            outcomes.update(await _callers(calls))
        _report("batcher.schedule always raises", outcomes)
        assert engine.stats()["dead"] is True
        assert set(outcomes.values()) == {"EngineError", "EngineClosed"}
        assert all(v == "EngineError" for k, v in outcomes.items() if k < "r3")  # three failures, then dead


async def test_fault_model_step_once(tiny_model) -> None:
    async with _engine(tiny_model, max_num_seqs=2) as engine:
        backend = engine._loop.backend
        real = backend.execute
        state = {"calls": 0}

        def flaky(plan: Any) -> Any:
            state["calls"] += 1
            if state["calls"] == 4:
                raise RuntimeError("injected step fault")
            return real(plan)

        backend.execute = flaky
        calls = {f"caller-{i}": engine.generate(f"c{i}", max_tokens=10, ignore_eos=True) for i in range(4)}
        outcomes = await _callers(calls)
        _report("model step fails once", outcomes)
        assert Counter(outcomes.values()) == {"EngineError": 2, "completed": 2}  # the two in that step
        assert (await _until_clean(engine))["dead"] is False
        assert (await _outcome(engine.generate("after", max_tokens=3))) == "completed"


async def test_fault_model_step_always(tiny_model) -> None:
    async with _engine(tiny_model, max_num_seqs=2) as engine:
        def broken(plan: Any) -> Any:
            raise RuntimeError("device lost")

        engine._loop.backend.execute = broken
        outcomes = await _callers({f"caller-{i}": engine.generate(f"c{i}", max_tokens=4) for i in range(7)})
        outcomes["after-death"] = await _outcome(engine.generate("after", max_tokens=4))
        _report("model step always fails", outcomes)
        assert outcomes.pop("after-death") == "EngineClosed"
        assert set(outcomes.values()) == {"EngineError"}  # including those still waiting when it died
        assert engine.stats()["dead"] is True and engine.stats()["kv_blocks_used"] == 0


async def test_breaker_opens_on_slow_steps_and_closes_when_they_recover(tiny_model) -> None:
    async with _engine(tiny_model, breaker_step_p95_ms=40.0, breaker_window=8, breaker_open_s=1.0) as engine:
        backend = engine._loop.backend
        real = backend.execute
        slow = {"on": True}

        def sluggish(plan: Any) -> Any:
            if slow["on"]:
                time.sleep(0.06)
            return real(plan)

        backend.execute = sluggish
        await engine.generate("slow steps", max_tokens=4, ignore_eos=True)  # trips on its 4th step
        assert engine.stats()["breaker_state"] == "open"
        with pytest.raises(Overloaded, match="p95") as info:
            await engine.generate("refused", max_tokens=2)
        assert 0 < info.value.retry_after <= 1.0
        slow["on"] = False
        await anyio.sleep(info.value.retry_after)
        outcomes = await _callers({f"probe-{i}": engine.generate("probe", max_tokens=4) for i in range(2)})
        assert set(outcomes.values()) == {"completed"}
        assert engine.stats()["breaker_state"] == "closed" and engine.stats()["breaker_trips"] == 1


async def test_shutdown_with_callers_at_every_stage(tiny_model) -> None:
    """Tokenizing, waiting, prefilling, decoding: each caller gets its result or `EngineClosed`."""
    # arrival order (prompt_token_wait_s=0): "short" is first in line whatever its prompt's length
    settings = dict(max_num_seqs=2, tokenizer_window_ms=30.0, max_model_len=2048, num_kv_blocks=160,
                    prompt_token_wait_s=0.0)
    engine = Engine(tiny_model, **{**BASE, **settings})
    threads = torch.get_num_threads()
    await engine.start()
    try:
        calls = {"short": engine.generate("short", max_tokens=2, ignore_eos=True)}  # first in line
        for i in range(4):
            calls[f"long-{i}"] = engine.generate(f"l{i}", max_tokens=2000, ignore_eos=True)

        async def late() -> None:
            await anyio.sleep(0.1)  # arrives while the tokenizer window of the others is long over
            await engine.generate("late", max_tokens=2000, ignore_eos=True)

        async def close() -> None:
            await anyio.sleep(0.12)
            await engine.aclose(drain_timeout=0.2)

        calls.update(late=late(), close=close())
        outcomes = await _callers(calls)
        _report("aclose(drain_timeout=0.2) under load", outcomes)
        assert outcomes.pop("close") == "completed" and outcomes.pop("short") == "completed"
        assert set(outcomes.values()) == {"EngineClosed"}
        assert engine.stats()["kv_blocks_used"] == 0  # at its close
        assert engine._loop is None and engine.loaded.model is None  # a closed engine let go of its model
        assert await _outcome(engine.generate("after close")) == "EngineClosed"
    finally:
        await engine.aclose()
        torch.set_num_threads(threads)


# -- the idle leak check ----------------------------------------------------------------------
@pytest.mark.parametrize("debug_leaks", [False, True])
async def test_idle_leak_check_names_the_holder(tiny_model, caplog, debug_leaks: bool) -> None:
    async with _engine(tiny_model, debug_leaks=debug_leaks) as engine:
        batcher = engine._loop.scheduler
        real_release = batcher._release

        def leaky(request: Any) -> None:  # a batcher bug: forgets one request's blocks
            if request.params.cache_salt != "leak":
                real_release(request)

        batcher._release = leaky
        with caplog.at_level(logging.ERROR, logger="tokenflow"):
            done = await engine.generate("leaky", max_tokens=3, ignore_eos=True, cache_salt="leak")
            await anyio.sleep(0.05)
        assert f"{done.request_id} (1 blocks, finished)" in caplog.text
        after = await _outcome(engine.generate("next", max_tokens=2))
        assert after == ("EngineClosed" if debug_leaks else "completed")
        assert engine.stats()["dead"] is debug_leaks


# -- bad input: what tests/test_errors.py does not cover yet ----------------------------------
MORE_BAD_INPUTS = [
    ("generate", "hi", {"stop_token_ids": "5"}, "stop_token_ids"),
    ("generate", "hi", {"stop_token_ids": [1.5]}, "stop_token_ids"),
    ("generate", "hi", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("generate", "hi", {"stop_token_ids": [True]}, "stop_token_ids"),
    ("generate", "hi", {"timeout": float("nan")}, "timeout"),
    ("generate", "hi", {"timeout": -1.0}, "timeout"),
    ("generate", "hi", {"timeout": float("inf")}, "timeout"),
    ("generate", "hi", {"deadline": float("nan")}, "deadline"),
    ("generate", "hi", {"seed": 2**70}, "seed"),
    ("generate", "hi", {"priority": "high"}, "priority"),
    ("generate", "hi", {"max_tokens": True}, "max_tokens"),
    ("generate", "hi", {"max_tokens": 2.0}, "max_tokens"),
    ("generate", "hi", {"repetition_penalty": 0.0}, "repetition_penalty"),
    ("generate", "hi", {"min_p": float("nan")}, "min_p"),
    ("generate", "hi", {"cache_salt": 5}, "cache_salt"),
    ("generate", "hi", {"params": {"max_tokens": 3}}, "params"),
    ("generate", b"hi", {}, "prompt"),
    ("generate", None, {}, "prompt"),
    ("generate", [True, 3], {}, "prompt"),
    ("generate", [5] * 128, {}, "prompt"),  # token ids as long as the whole context
    ("chat", [{"role": "user", "content": "lone \udfff surrogate"}], {}, "messages"),
    ("chat", [{"role": "user", "content": "hi"}, "not a dict"], {}, "messages"),
    ("chat", [{"role": "user", "content": "hi"}], {"top_k": -1}, "top_k"),
]


async def _bad_and_good(engine: Engine, method: str, prompt: Any, kwargs: dict[str, Any]) -> tuple[str, int]:
    """Send a bad request next to a good one: what the bad one raised, and the good one's length."""
    seen: dict[str, Any] = {}

    async def bad() -> None:
        try:
            await getattr(engine, method)(prompt, **kwargs)
            seen["bad"] = "accepted"
        except InvalidRequest as exc:
            seen["bad"] = exc.field
        except Exception as exc:
            seen["bad"] = type(exc).__name__

    async def good() -> None:
        try:
            done = await engine.generate("The quick brown fox", max_tokens=8, ignore_eos=True)
            seen["good"] = len(done.token_ids)
        except Exception as exc:
            seen["good"] = type(exc).__name__

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(good)
            tg.start_soon(bad)
    return seen["bad"], seen["good"]


async def test_more_bad_inputs_are_invalid_requests_naming_the_field(tiny_model) -> None:
    async with _engine(tiny_model) as engine:
        wrong = []
        for method, prompt, kwargs, field in MORE_BAD_INPUTS:
            got, good = await _bad_and_good(engine, method, prompt, kwargs)
            if (got, good) != (field, 8):
                wrong.append((method, repr(prompt)[:40], kwargs, f"want {field}, got {got}; good: {good}"))
        assert not wrong, wrong
        assert (await _until_clean(engine))["kv_blocks_used"] == 0


@pytest.mark.parametrize(("method", "prompt", "kwargs", "field"), [
    ("chat", [{"role": "\ud800", "content": "hi"}], {}, "messages"),
    ("generate", "hi", {"stop": ["\ud800"]}, "stop"),
])
async def test_surrogates_outside_the_prompt_text(tiny_model, method: str, prompt: Any, kwargs: dict,
                                                  field: str) -> None:
    async with _engine(tiny_model) as engine:
        assert await _bad_and_good(engine, method, prompt, kwargs) == (field, 8)


# -- the soak test ------------------------------------------------------------------------------
SOAK_ENGINE = dict(max_num_seqs=4, max_queue=8, num_kv_blocks=10, block_size=16, breaker_window=8,
                   breaker_error_rate=0.5, breaker_open_s=1.0, breaker_probes=2)
SOAK_PHASES = (("overload", 26.0), ("faults", 8.0), ("recovery", 10.0))  # seconds, all at 4x capacity
SOAK_PROMPTS = ["The quick brown fox", "What is the capital of France?", "Tokenflow runs language models",
                "def add(a, b):", "天空为什么是蓝色的？", "emoji 🙂🚀 and more"]
SOAK_MALFORMED = [  # (prompt, kwargs, refused before admission: no engine-side request at all)
    ("", {}, False), ("lone \ud800 surrogate", {}, False), ([10**6], {}, False), ("word " * 200, {}, False),
    ("ok", {"temperature": float("nan")}, True), ("ok", {"max_tokens": -1}, True),
    ("ok", {"stop_token_ids": "x"}, True), ("ok", {"no_such_param": 1}, True),
    # hostile: refused before any engine-side request exists ...
    ("ok", {"repetition_penalty": 1e-300, "temperature": 1.0}, True), ("ok", {"stop": ["x" * 100_000]}, True),
    ("ok", {"max_tokens": 10**9}, True), ("y" * 2**20, {}, True), ("ok", {"stop_token_ids": list(range(10**5))}, True),
    # ... or by the tokenizer (the prompt tokenizes past the context)
    ("tokenflow " * 200, {}, False),
]
SOAK_POISON = "POISON: this request's logits come out NaN"  # a model fault in one row of a step
# caller's outcome -> the engine-side endings it may pair with (races: it finished just before)
SOAK_PAIRS = {"completed": {"completed"}, "overloaded": {"rejected"}, "invalid": {"rejected"},
              "engine_error": {"failed"}, "deadline": {"deadline", "completed", "failed"},
              "cancelled": {"aborted", "completed", "failed"}, "left": {"aborted", "completed", "failed"}}


class _Recorder:
    """An engine observer: every ending the engine reports, per request tag."""

    def __init__(self) -> None:
        self.ends: dict[str, list[str]] = {}

    def on_step(self, duration_s: float, ok: bool) -> None:
        pass

    def on_request_end(self, request: Any, outcome: str) -> None:
        self.ends.setdefault(request.params.cache_salt or "", []).append(outcome)


def _soak_spec(rnd: random.Random, i: int) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(max_tokens=rnd.randint(4, 32), temperature=rnd.choice([0.0, 0.8]),
                                  ignore_eos=rnd.random() < 0.5, cache_salt=f"soak-{i}")
    spec: dict[str, Any] = dict(prompt=rnd.choice(SOAK_PROMPTS), malformed=False, early=False)
    r = rnd.random()
    if r < 0.02:
        return dict(prompt=SOAK_POISON, kwargs=kwargs, malformed=False, early=False, poison=True)
    if r < 0.10:
        prompt, bad, early = rnd.choice(SOAK_MALFORMED)
        return dict(prompt=prompt, kwargs={**kwargs, **bad}, malformed=True, early=early)
    if r < 0.25:
        spec["cancel_after"] = rnd.uniform(0.0, 0.25)
    elif r < 0.40:
        kwargs["timeout"] = rnd.uniform(0.005, 0.25)
    elif r < 0.50:
        spec["leave_after"] = rnd.randint(1, 4)
    return {**spec, "kwargs": kwargs}


async def _soak_call(engine: Engine, spec: dict[str, Any]) -> str:
    outcome = None
    with anyio.CancelScope(deadline=anyio.current_time() + spec.get("cancel_after", math.inf)) as scope:
        try:
            if "leave_after" in spec:
                async with contextlib.aclosing(engine.stream(spec["prompt"], **spec["kwargs"])) as chunks:
                    n = 0
                    async for chunk in chunks:
                        n += 1
                        if chunk.finish_reason is not None or n >= spec["leave_after"]:
                            outcome = "completed" if chunk.finish_reason is not None else "left"
                            break
            else:
                await engine.generate(spec["prompt"], **spec["kwargs"])
                outcome = "completed"
        except Overloaded as exc:
            outcome = "overloaded" if exc.retry_after > 0 else "overloaded without retry_after"
        except InvalidRequest:
            outcome = "invalid"
        except DeadlineExceeded:
            outcome = "deadline"
        except EngineError:
            outcome = "engine_error"
        except Exception as exc:
            outcome = f"unexpected {type(exc).__name__}: {exc}"
    return outcome or ("cancelled" if scope.cancelled_caught else "no outcome")


async def _capacity(engine: Engine, seconds: float = 2.0) -> float:
    """Completed requests per second with the engine saturated by well-behaved callers."""
    rnd, done, end = random.Random(1), 0, anyio.current_time() + seconds

    async def worker() -> None:
        nonlocal done
        while anyio.current_time() < end:
            await engine.generate(rnd.choice(SOAK_PROMPTS), max_tokens=rnd.randint(4, 32), ignore_eos=True)
            done += 1

    async with anyio.create_task_group() as tg:
        for _ in range(2 * SOAK_ENGINE["max_num_seqs"]):
            tg.start_soon(worker)
    return done / seconds


async def test_soak_at_four_times_capacity(tiny_model) -> None:
    async with _engine(tiny_model, **SOAK_ENGINE) as engine:
        capacity = await _capacity(engine)
        reference = [await engine.generate(p, max_tokens=12, temperature=0.0) for p in SOAK_PROMPTS[:3]]
        recorder = _Recorder()
        engine.ctx.observers.append(recorder)
        backend, fault = engine._loop.backend, {"on": False, "n": 0, "window": [math.inf, math.inf]}
        real_execute = backend.execute

        def faulty(plan: Any) -> Any:  # two failed steps of every three: errors, but never 3 in a row
            if fault["on"]:
                fault["n"] += 1
                if fault["n"] % 3:
                    raise RuntimeError("injected step fault")
            # poisoned rows, in any phase: only their own request may fail
            poisoned = [j for j, c in enumerate(c for c in plan.chunks if c.samples) if c.request.prompt == SOAK_POISON]
            return poison_rows(real_execute(plan), poisoned)

        backend.execute = faulty
        rnd, rate = random.Random(5), 4 * capacity
        results: dict[int, tuple[str, str, float, float]] = {}
        specs: list[dict[str, Any]] = []
        in_flight = peak = 0

        async def caller(i: int, spec: dict[str, Any], phase: str) -> None:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            t0 = time.monotonic()
            outcome = await _soak_call(engine, spec)
            assert i not in results, f"caller {i} ended twice"
            results[i] = (outcome, phase, t0, time.monotonic())
            in_flight -= 1

        started = time.monotonic()
        with anyio.fail_after(sum(d for _, d in SOAK_PHASES) + 60):
            async with anyio.create_task_group() as tg:
                for phase, seconds in SOAK_PHASES:
                    fault["on"] = phase == "faults"
                    if phase != "overload":  # the faults phase opens the window, recovery closes it
                        fault["window"][phase == "recovery"] = time.monotonic()
                    end, due = anyio.current_time() + seconds, anyio.current_time()
                    while anyio.current_time() < end:
                        while due <= anyio.current_time():  # Poisson arrivals at 4x capacity
                            specs.append(_soak_spec(rnd, len(specs)))
                            tg.start_soon(caller, len(specs) - 1, specs[-1], phase)
                            due += rnd.expovariate(rate)
                        await anyio.sleep(0.002)
        elapsed = time.monotonic() - started
        stats = await _until_clean(engine)

        by_phase = {p: Counter(o for o, ph, *_ in results.values() if ph == p) for p, _ in SOAK_PHASES}
        print(f"\n[soak] capacity {capacity:.1f} req/s; offered {len(specs) / elapsed:.1f} req/s "
              f"({len(specs) / elapsed / capacity:.1f}x) for {elapsed:.0f} s; {len(specs)} requests, "
              f"peak {peak} callers in flight")
        print(f"[soak] caller outcomes: {dict(Counter(o for o, *_ in results.values()))}")
        for phase, counts in by_phase.items():
            print(f"[soak]   {phase}: {dict(counts)}")
        print(f"[soak] engine endings: {dict(Counter(e for v in recorder.ends.values() for e in v))}")
        print(f"[soak] breaker trips {stats['breaker_trips']}, rejections {stats['breaker_rejections']}, "
              f"queue rejections {stats['queue_rejections']}, state {stats['breaker_state']}; "
              f"preemptions {stats['num_preemptions']}; KV blocks used {stats['kv_blocks_used']}")

        # Every request ended exactly once, with an outcome its kind allows ...
        assert sorted(results) == list(range(len(specs)))
        fault_start, fault_end = fault["window"]
        for i, spec in enumerate(specs):
            outcome, _phase, t0, t1 = results[i]
            allowed = {"invalid"} if spec["early"] else {"invalid", "overloaded"}
            if spec.get("poison"):
                allowed = {"engine_error", "overloaded"}
                allowed |= {"cancelled"} if "cancel_after" in spec else set()
            elif not spec["malformed"]:
                allowed = {"completed", "overloaded"}
                allowed |= {"cancelled"} if "cancel_after" in spec else set()
                allowed |= {"deadline"} if "timeout" in spec["kwargs"] else set()
                allowed |= {"left"} if "leave_after" in spec else set()
                allowed |= {"engine_error"} if t0 <= fault_end and t1 >= fault_start else set()
            assert outcome in allowed, (i, spec, outcome)
            ends = recorder.ends.pop(f"soak-{i}", [])  # ... and the engine agrees
            if spec["early"]:
                assert ends == [], (i, ends)
            else:
                assert len(ends) == 1 and ends[0] in SOAK_PAIRS[outcome], (i, outcome, ends)
        assert not [k for k in recorder.ends if k.startswith("soak-")]
        # ... no KV block is referenced, the breaker opened and closed again, nothing died ...
        assert stats["kv_blocks_used"] == 0 and not stats["dead"]
        assert stats["breaker_trips"] >= 1 and stats["breaker_state"] == "closed"
        assert by_phase["overload"]["completed"] and by_phase["recovery"]["completed"]
        assert by_phase["faults"]["engine_error"] and by_phase["overload"]["overloaded"]
        # ... and service is normal afterwards: greedy output unchanged, a burst all served.
        again = [await engine.generate(p, max_tokens=12, temperature=0.0) for p in SOAK_PROMPTS[:3]]
        assert [a.token_ids for a in again] == [r.token_ids for r in reference]
        burst = await _callers({f"after-{i}": engine.generate("after", max_tokens=8) for i in range(8)})
        assert set(burst.values()) == {"completed"}
