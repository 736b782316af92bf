"""The breaker stage alone: its state machine and queue bounds, on a fake clock and a fake batcher."""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenflow.config import EngineConfig
from tokenflow.errors import Overloaded
from tokenflow.params import SamplingParams
from tokenflow.protocols import EngineContext
from tokenflow.request import Request, RequestStatus
from tokenflow.stages.breaker import CLOSED, HALF_OPEN, OPEN, BreakerStage


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeBatcher:
    def __init__(self) -> None:
        self.waiting: list[Request] = []


def _request(num_tokens: int | None = 4) -> Request:
    ids = list(range(num_tokens)) if num_tokens is not None else None
    return Request(SamplingParams(), prompt="some text", prompt_token_ids=ids)


async def _make(clock: Clock, **settings: Any) -> tuple[BreakerStage, FakeBatcher, EngineContext]:
    defaults: dict[str, Any] = dict(
        breaker_window=8, breaker_error_rate=0.5, breaker_open_s=5.0, breaker_probes=2
    )
    config = EngineConfig(**{**defaults, **settings})
    batcher = FakeBatcher()
    ctx = EngineContext(config, None, 128, frozenset(), 100, scheduler=batcher)
    stage = BreakerStage(config, clock=clock)
    await stage.start(ctx)
    return stage, batcher, ctx


def _enqueue_into(batcher: FakeBatcher, tokenized: int | None = None):
    """A stand-in for the rest of the chain: tokenize (optionally), then queue."""

    async def call_next(request: Request) -> None:
        if tokenized is not None:
            request.prompt_token_ids = list(range(tokenized))
        request.status = RequestStatus.WAITING
        batcher.waiting.append(request)

    return call_next


async def _admit(stage: BreakerStage, batcher: FakeBatcher | None = None) -> Request:
    request = _request()
    await stage.handle(request, _enqueue_into(batcher or FakeBatcher()))
    return request


def _end(stage: BreakerStage, outcome: str, n: int = 1) -> None:
    for _ in range(n):
        stage.on_request_end(_request(), outcome)


async def test_an_observer_with_stats() -> None:
    config = EngineConfig()
    stage = BreakerStage(config)
    ctx = EngineContext(config, None, 128, frozenset(), 100)
    await stage.start(ctx)
    assert stage in ctx.observers
    assert {"breaker_state", "breaker_rejections", "breaker_trips", "queue_rejections"} <= set(stage.stats())


async def test_opens_when_the_error_rate_exceeds_the_threshold() -> None:
    stage, _, _ = await _make(Clock())
    _end(stage, "completed", 2)
    _end(stage, "failed", 2)  # 2 of 4 = 0.5: not above 0.5
    assert stage.state == CLOSED
    _end(stage, "failed")  # 3 of 5
    assert stage.state == OPEN
    assert stage.stats()["breaker_trips"] == 1 and "failed" in stage.trip_reason


async def test_one_early_failure_does_not_trip() -> None:
    stage, _, _ = await _make(Clock())
    _end(stage, "failed", 3)  # below the minimum of half a window (4)
    assert stage.state == CLOSED


async def test_caller_side_endings_are_neutral() -> None:
    stage, _, _ = await _make(Clock())
    for outcome in ("aborted", "deadline", "rejected"):
        _end(stage, outcome, 10)
    _end(stage, "completed", 4)
    assert stage.state == CLOSED and stage.stats()["breaker_error_rate"] == 0.0


async def test_the_window_forgets_old_failures() -> None:
    stage, _, _ = await _make(Clock(), breaker_window=8, breaker_error_rate=0.5)
    _end(stage, "completed", 4)
    _end(stage, "failed", 4)  # 4 of 8: not above
    _end(stage, "completed", 4)  # pushes the first 4 successes out: 4 failed of 8 still
    assert stage.state == CLOSED
    _end(stage, "completed", 4)  # 0 of 8
    assert stage.stats()["breaker_error_rate"] == 0.0


async def test_opens_on_p95_step_latency() -> None:
    stage, _, _ = await _make(Clock(), breaker_window=40, breaker_step_p95_ms=100.0)
    for _ in range(40):
        stage.on_step(0.010, True)
    stage.on_step(0.500, True)
    stage.on_step(0.500, True)  # 2 of 40 slow: p95 (38th of 40) still fast
    assert stage.state == CLOSED
    stage.on_step(0.500, True)  # 3 of 40: p95 is slow
    assert stage.state == OPEN and "p95" in stage.trip_reason


async def test_latency_check_off_by_default() -> None:
    stage, _, _ = await _make(Clock())
    for _ in range(20):
        stage.on_step(10.0, True)
    assert stage.state == CLOSED
    assert stage.stats()["breaker_step_p95_ms"] == pytest.approx(10_000.0)


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=60), st.floats(0.01, 0.99))
def test_incremental_p95_matches_nearest_rank(durations: list[float], threshold: float) -> None:
    stage = BreakerStage(EngineConfig(breaker_window=20, breaker_step_p95_ms=threshold * 1e3), clock=Clock())
    stage.state = OPEN  # record only; never trip
    stage.opened_at = math.inf
    for d in durations:
        stage.on_step(d, True)
    window = sorted(durations[-20:])
    p95 = window[math.ceil(0.95 * len(window)) - 1]
    assert stage._latency_exceeded(1) == (p95 > stage.step_p95_s)  # the threshold after its ms round trip


async def test_open_rejects_with_the_remaining_open_time() -> None:
    clock = Clock()
    stage, _, _ = await _make(clock, breaker_open_s=5.0)
    _end(stage, "failed", 4)
    assert stage.state == OPEN
    clock.now += 1.5
    reached = []

    async def call_next(request: Request) -> None:
        reached.append(request)

    with pytest.raises(Overloaded, match="open") as info:
        await stage.handle(_request(), call_next)
    assert info.value.retry_after == pytest.approx(3.5)
    assert not reached
    assert stage.stats()["breaker_rejections"] == 1


async def test_half_open_lets_probes_through_and_closes_on_their_success() -> None:
    clock = Clock()
    stage, batcher, _ = await _make(clock, breaker_open_s=5.0, breaker_probes=2)
    _end(stage, "failed", 4)
    clock.now += 5.0
    assert stage.stats()["breaker_state"] == HALF_OPEN
    probes = [await _admit(stage, batcher) for _ in range(2)]
    with pytest.raises(Overloaded, match="half-open") as info:
        await _admit(stage, batcher)
    assert info.value.retry_after > 0
    stage.on_request_end(probes[0], "completed")
    assert stage.state == HALF_OPEN
    stage.on_request_end(probes[1], "completed")
    assert stage.state == CLOSED
    assert stage.stats()["breaker_rejections"] == 1 and stage.breaker_trips == 1
    await _admit(stage, batcher)  # closed: admits again


async def test_a_failed_probe_reopens() -> None:
    clock = Clock()
    stage, batcher, _ = await _make(clock, breaker_open_s=5.0)
    _end(stage, "failed", 4)
    clock.now += 5.0
    probe = await _admit(stage, batcher)
    stage.on_request_end(probe, "failed")
    assert stage.state == OPEN and stage.breaker_trips == 2
    with pytest.raises(Overloaded) as info:
        await _admit(stage, batcher)
    assert info.value.retry_after == pytest.approx(5.0)


async def test_a_cancelled_probe_frees_its_slot() -> None:
    clock = Clock()
    stage, batcher, _ = await _make(clock, breaker_probes=1)
    _end(stage, "failed", 4)
    clock.now += 5.0
    probe = await _admit(stage, batcher)
    with pytest.raises(Overloaded):
        await _admit(stage, batcher)
    stage.on_request_end(probe, "aborted")  # neither success nor failure
    assert stage.state == HALF_OPEN
    second = await _admit(stage, batcher)
    stage.on_request_end(second, "completed")
    assert stage.state == CLOSED


async def test_slow_steps_while_half_open_reopen_on_probe_completion() -> None:
    clock = Clock()
    stage, batcher, _ = await _make(clock, breaker_step_p95_ms=100.0, breaker_window=8)
    for _ in range(8):
        stage.on_step(0.5, True)
    assert stage.state == OPEN
    clock.now += 5.0
    probe = await _admit(stage, batcher)
    stage.on_step(0.5, True)  # still slow with one probe running
    stage.on_request_end(probe, "completed")
    assert stage.state == OPEN and stage.breaker_trips == 2 and "slow" in stage.trip_reason


async def test_queue_bound_by_requests_counts_requests_still_on_the_path() -> None:
    stage, batcher, _ = await _make(Clock(), max_queue=3)
    batcher.waiting.append(_request())  # one already queued
    release = anyio.Event()
    admitted = []

    async def slow_tokenizer(request: Request) -> None:
        admitted.append(request)
        await release.wait()
        batcher.waiting.append(request)

    async with anyio.create_task_group() as tg:
        for _ in range(2):  # two more in the tokenizer: the queue is full
            tg.start_soon(stage.handle, _request(), slow_tokenizer)
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(Overloaded, match="3 of 3 requests") as info:
            await stage.handle(_request(), slow_tokenizer)
        assert info.value.retry_after > 0
        release.set()
    assert len(admitted) == 2 and len(batcher.waiting) == 3
    assert stage.stats()["queue_rejections"] == 1 and stage.queued() == 3


async def test_queue_bound_by_tokens() -> None:
    stage, batcher, _ = await _make(Clock(), max_queue_tokens=10)
    big = _request(50)
    await stage.handle(big, _enqueue_into(batcher))  # an empty queue admits even a prompt over the bound
    batcher.waiting.clear()
    batcher.waiting.append(_request(8))
    reached = []

    async def spy(request: Request) -> None:
        reached.append(request)
        await _enqueue_into(batcher)(request)

    with pytest.raises(Overloaded, match="prompt tokens"):  # token ids known: refused before any work
        await stage.handle(_request(3), spy)
    assert not reached
    await stage.handle(_request(2), spy)  # 8 + 2 fits
    assert len(reached) == 1
    with pytest.raises(Overloaded):  # a text prompt when the bound is already full: refused up front
        await stage.handle(_request(None), spy)
    assert len(reached) == 1
    assert stage.queue_rejections == 2


async def test_text_prompt_is_counted_exactly_after_tokenizing() -> None:
    stage, batcher, _ = await _make(Clock(), max_queue_tokens=10)
    batcher.waiting.append(_request(6))
    request = _request(None)
    with pytest.raises(Overloaded, match="11 prompt tokens"):
        await stage.handle(request, _enqueue_into(batcher, tokenized=5))
    assert request in batcher.waiting  # the engine aborts it before the step loop runs:
    batcher.waiting.remove(request)
    await stage.handle(_request(None), _enqueue_into(batcher, tokenized=4))  # 6 + 4 fits


async def test_retry_after_follows_recent_throughput() -> None:
    clock = Clock()
    stage, batcher, _ = await _make(clock, max_queue=2, max_queue_tokens=100)
    for _ in range(20):  # 20 completions of 10 prompt tokens over 2 s: 10 req/s, 100 tokens/s
        clock.now += 0.1
        stage.on_request_end(_request(10), "completed")
    batcher.waiting.extend([_request(60), _request(30)])
    with pytest.raises(Overloaded) as info:
        await _admit(stage, batcher)
    assert info.value.retry_after == pytest.approx(0.1)  # one slot at 10 req/s
    batcher.waiting.pop()
    with pytest.raises(Overloaded) as info:
        await stage.handle(_request(50), _enqueue_into(batcher))
    assert info.value.retry_after == pytest.approx(0.1)  # 60 + 50 - 100 = 10 tokens at 100 tokens/s
