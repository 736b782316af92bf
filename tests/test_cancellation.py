"""A caller's cancellation ends its own request and nothing else.

The victim request is cancelled at each of its await points in turn (waiting for its tokenizer batch,
queued, prefilling, decoding, waiting for its next chunk, inside the stream consumer's own await), by
asyncio's `task.cancel()`, by an anyio cancel scope, by `asyncio.wait_for` timeouts and by a trio
cancel scope. Its neighbours, started with it so that they share its tokenizer batch (a 50 ms window)
and its steps, must each get their uncancelled output; nobody gets an `EngineError`; no KV block is
left referenced (`debug_leaks` kills an idle engine that holds one, and `until_idle` checks it).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any

import anyio
import pytest

from tests.engines import running_engine, until_idle
from tokenflow import Engine

# No tokenizer cache: every prompt waits for its batch, every time.
SETTINGS = dict(max_model_len=256, num_kv_blocks=96, num_threads=1, tokenizer_window_ms=50.0, tokenizer_cache_size=0,
                debug_leaks=True)
GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
NEIGHBOURS = ["The cat sat on the mat and", "def add(a, b):", "Once upon a time there", "1, 2, 3, 4,"]
VICTIM = "A victim prompt that is cancelled somewhere"


class CancelAt:
    """Drives a coroutine and calls `cancel()` once the coroutine has suspended `at` times, so the
    cancellation lands at exactly that await point. `suspensions` counts them (an uncancelled run
    tells how many await points a request has)."""

    def __init__(self, coro: Coroutine[Any, Any, Any], at: int, cancel: Callable[[], None]) -> None:
        self._coro = coro
        self.at = at
        self._cancel = cancel
        self.suspensions = 0

    def __await__(self) -> Generator[Any, Any, Any]:
        return self  # type: ignore[return-value]

    def __iter__(self) -> CancelAt:
        return self

    def __next__(self) -> Any:
        return self.send(None)

    def send(self, value: Any) -> Any:
        return self._suspended(self._coro.send(value))

    def throw(self, *exc: Any) -> Any:
        return self._suspended(self._coro.throw(*exc))

    def close(self) -> None:
        self._coro.close()

    def _suspended(self, yielded: Any) -> Any:
        self.suspensions += 1
        if self.suspensions == self.at:
            self._cancel()
        return yielded


async def _generate(engine: Engine) -> list[int]:
    return (await engine.generate(VICTIM, **GREEDY)).token_ids


async def _stream(engine: Engine) -> list[int]:
    tokens: list[int] = []
    async for chunk in engine.stream(VICTIM, **GREEDY):
        tokens.extend(chunk.token_ids)
        await anyio.sleep(0)  # the consumer's own await point
    return tokens


VICTIMS: dict[str, Callable[[Engine], Coroutine[Any, Any, list[int]]]] = {"generate": _generate, "stream": _stream}


async def _references(engine: Engine) -> list[list[int]]:
    """The neighbours' outputs when the victim runs beside them uncancelled."""
    victim = asyncio.ensure_future(_generate(engine))
    done = await asyncio.gather(*(engine.generate(p, **GREEDY) for p in NEIGHBOURS))
    await victim
    return [d.token_ids for d in done]


async def _await_points(engine: Engine, kind: str) -> int:
    counter = CancelAt(VICTIMS[kind](engine), 0, lambda: None)
    neighbours = asyncio.gather(*(engine.generate(p, **GREEDY) for p in NEIGHBOURS))
    await counter
    await neighbours
    return counter.suspensions


async def _check_neighbours(engine: Engine, neighbours: Awaitable[list[Any]], expected: list[list[int]],
                            what: str) -> None:
    with anyio.fail_after(30):  # a stranded neighbour fails the test, not hangs it
        done = await neighbours  # an exception here (an EngineError) fails the test
    assert [d.token_ids for d in done] == expected, f"a neighbour's output changed when the victim was {what}"
    stats = await until_idle(engine)
    assert stats["num_failed"] == 0 and stats["kv_blocks_used"] == 0, stats
    assert not stats["dead"]


async def _cancel_at(engine: Engine, kind: str, at: int, how: str, expected: list[list[int]]) -> str:
    """Run the victim beside its neighbours, cancelled at its `at`-th await point; its outcome. The victim
    runs first, so its prompt opens the tokenizer window (the batch's leader, where one caller used to
    encode the whole batch in its own task)."""
    outcome = "completed"
    if how == "task.cancel":
        task: asyncio.Task[Any] | None = None

        async def victim() -> Any:
            return await CancelAt(VICTIMS[kind](engine), at, lambda: task.cancel())

        task = asyncio.ensure_future(victim())
        neighbours = asyncio.gather(*(engine.generate(p, **GREEDY) for p in NEIGHBOURS))
        try:
            await task
        except asyncio.CancelledError:
            outcome = "cancelled"
    else:  # an anyio cancel scope around the victim (which runs in this task up to its first await)
        neighbours = asyncio.gather(*(engine.generate(p, **GREEDY) for p in NEIGHBOURS))
        with anyio.CancelScope() as scope:
            await CancelAt(VICTIMS[kind](engine), at, scope.cancel)
        outcome = "cancelled" if scope.cancelled_caught else outcome
    await _check_neighbours(engine, neighbours, expected, f"cancelled at await point {at} ({how}, {kind})")
    return outcome


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["planned-per-step", "planned-ahead"])
@pytest.mark.parametrize("how", ["task.cancel", "anyio"])
@pytest.mark.parametrize("kind", list(VICTIMS))
async def test_cancelling_at_every_await_point_spares_the_neighbours(tiny_model, kind: str, how: str,
                                                                     async_scheduling: bool) -> None:
    async with running_engine(tiny_model, async_scheduling=async_scheduling, **SETTINGS) as engine:
        expected = await _references(engine)
        points = await _await_points(engine, kind)
        assert points >= 8  # tokenizer wait, queue, prefill, one per chunk ... (a stream: its consumer too)
        outcomes = [await _cancel_at(engine, kind, at, how, expected) for at in range(1, points + 2)]
        # Each point was one. Planned ahead, a step's output reaches the stream while the next step runs, so a
        # slow consumer may find two chunks merged and its last await point or so come and go between runs.
        sure = points - 2 if async_scheduling else points
        assert outcomes[:sure].count("cancelled") == sure, outcomes
        assert outcomes[-1] == "completed"  # past its last await point: not cancelled at all


async def test_wait_for_timeouts_spare_the_neighbours(tiny_model) -> None:
    """`asyncio.wait_for` at timeouts spread over a request's life, from inside its tokenizer window on."""
    async with running_engine(tiny_model, **SETTINGS) as engine:
        expected = await _references(engine)
        for timeout in [0.0, 0.001, 0.01, 0.03, 0.049, 0.051, 0.06, 0.07, 0.08, 0.1, 0.15, 0.2]:
            for kind, victim in VICTIMS.items():
                task = asyncio.ensure_future(victim(engine))  # first: its prompt opens the tokenizer window
                neighbours = asyncio.gather(*(engine.generate(p, **GREEDY) for p in NEIGHBOURS))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(task, timeout)
                await _check_neighbours(engine, neighbours, expected, f"timed out after {timeout} s ({kind})")


async def test_an_idle_engine_never_strands_a_request_whose_batch_neighbour_left(tiny_model) -> None:
    """The case that hung for good: two prompts in one tokenizer window, the first one's caller cancelled."""
    async with running_engine(tiny_model, **SETTINGS) as engine:
        first = asyncio.ensure_future(engine.generate("first prompt", **GREEDY))
        second = asyncio.ensure_future(engine.generate("second prompt", **GREEDY))
        await asyncio.sleep(0.01)
        first.cancel()
        with anyio.fail_after(10):
            done = await second
        assert len(done.token_ids) == GREEDY["max_tokens"]
        with pytest.raises(asyncio.CancelledError):
            await first
        await until_idle(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["planned-per-step", "planned-ahead"])
async def test_thousands_of_streams_cancelled_at_random_moments(tiny_model, async_scheduling: bool) -> None:
    """Streams cancelled at random by `asyncio.wait_for` while others run: every stream that is not
    cancelled gets its reference output, and none gets an error."""
    prompts = [f"Request number {i} asks about" for i in range(8)]
    settings = {**SETTINGS, "num_kv_blocks": 256, "async_scheduling": async_scheduling}
    async with running_engine(tiny_model, **settings) as engine:
        expected = {p: (await engine.generate(p, **GREEDY)).token_ids for p in prompts}
        rnd = random.Random(40)

        async def stream(prompt: str) -> list[int]:
            return [t async for chunk in engine.stream(prompt, **GREEDY) for t in chunk.token_ids]

        async def one(i: int) -> tuple[str, str, list[int] | None]:
            prompt = prompts[i % len(prompts)]
            await asyncio.sleep(rnd.uniform(0, 2.0))
            cancel = rnd.random() < 0.5
            try:
                tokens = await asyncio.wait_for(stream(prompt), rnd.uniform(0, 0.3) if cancel else None)
            except TimeoutError:
                return prompt, "cancelled", None
            except Exception as exc:
                return prompt, type(exc).__name__, None
            return prompt, "completed", tokens

        with anyio.fail_after(300):
            results = await asyncio.gather(*(one(i) for i in range(2000)))
        outcomes = [o for _, o, _ in results]
        assert set(outcomes) <= {"completed", "cancelled"}, [o for o in outcomes if o not in ("completed", "cancelled")]
        assert outcomes.count("completed") >= 800
        assert all(tokens == expected[p] for p, o, tokens in results if o == "completed")
        stats = await until_idle(engine)
        assert stats["num_failed"] == 0 and not stats["dead"]
        assert (stats["num_ahead_steps"] > 0) == async_scheduling


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["planned-per-step", "planned-ahead"])
def test_cancel_scopes_under_trio_spare_the_neighbours(tiny_model, async_scheduling: bool) -> None:
    async def main() -> None:
        async with running_engine(tiny_model, async_scheduling=async_scheduling, **SETTINGS) as engine:
            async def round_(at: int) -> tuple[str, dict[str, list[int]]]:
                """The victim's outcome, cancelled at await point `at` by a trio cancel scope, and the
                neighbours' outputs."""
                results: dict[str, list[int]] = {}

                async def neighbour(prompt: str) -> None:
                    results[prompt] = (await engine.generate(prompt, **GREEDY)).token_ids

                with anyio.fail_after(30):
                    async with anyio.create_task_group() as tg:
                        for prompt in NEIGHBOURS:
                            tg.start_soon(neighbour, prompt)
                        with anyio.CancelScope() as scope:
                            await CancelAt(_stream(engine), at, scope.cancel)
                stats = await until_idle(engine)
                assert stats["num_failed"] == 0 and stats["kv_blocks_used"] == 0
                return ("cancelled" if scope.cancelled_caught else "completed"), results

            outcome, expected = await round_(0)
            assert outcome == "completed"
            counter = CancelAt(_stream(engine), 0, lambda: None)
            await counter
            sure = counter.suspensions - (2 if async_scheduling else 0)  # as in the asyncio test above
            for at in range(1, counter.suspensions + 1):
                outcome, results = await round_(at)
                assert outcome == "cancelled" or at > sure
                assert results == expected, f"a neighbour's output changed (cancelled at await point {at})"

    anyio.run(main, backend="trio")
