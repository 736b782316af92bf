"""Loops and threads: an engine serves the event loop that started it; other threads use a bridge.

A call from another event loop or thread fails at once with `WrongEventLoop` (it used to wait, silently,
for a wake-up that never came); `engine.portal()` and `tokenflow.SyncEngine` run calls on the engine's
loop for sync code, with the same outputs as awaiting the engine there.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import pytest

import tokenflow
from tests.engines import running_engine, until_idle
from tokenflow.errors import InvalidRequest, WrongEventLoop

SETTINGS = dict(max_model_len=256, num_kv_blocks=64, num_threads=1)
GREEDY = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = ["The cat sat on the mat and", "def add(a, b):", "Once upon a time there", "1, 2, 3, 4,"]


def _in_thread(fn: Any) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


async def _join(thread: threading.Thread, limit_s: float = 60.0) -> None:
    """Wait for `thread` without blocking the loop (the engine keeps serving)."""
    with anyio.fail_after(limit_s):
        while thread.is_alive():
            await anyio.sleep(0.005)


async def test_a_call_from_another_event_loop_or_thread_fails_at_once(tiny_model) -> None:
    """Each foreign call raises WrongEventLoop instead of waiting: none of them reaches the engine (no request is
    queued, run or aborted; the engine keeps running), and one that waited instead (the old deadlock) fails the
    test, naming the call, after a generous hang guard rather than hanging the suite."""
    async with running_engine(tiny_model, **SETTINGS) as engine:
        calls = {
            "generate on another loop": lambda: asyncio.run(engine.generate("hello", **GREEDY)),
            "chat on another loop": lambda: asyncio.run(engine.chat([{"role": "user", "content": "hi"}])),
            "stream from plain sync code": lambda: engine.stream("hello", **GREEDY),
            "tokenize on another loop": lambda: asyncio.run(engine.tokenize("hello")),
            "aclose on another loop": lambda: asyncio.run(engine.aclose()),
        }
        seen: dict[str, BaseException | None] = {}

        def foreign() -> None:
            for name, call in calls.items():
                try:
                    call()
                except BaseException as exc:
                    seen[name] = exc
                else:
                    seen[name] = None

        counters = ("num_finished", "num_aborted", "num_failed", "num_running", "num_waiting", "num_steps")
        before = {k: engine.stats()[k] for k in counters}
        thread = _in_thread(foreign)
        with anyio.move_on_after(60):  # a hang guard, not a speed limit
            while thread.is_alive():
                await anyio.sleep(0.005)
        hung = next((name for name in calls if name not in seen), None)
        assert hung is None, f"{hung!r} waited instead of failing with WrongEventLoop"
        for name, error in seen.items():
            assert isinstance(error, WrongEventLoop), (name, error)
            assert "engine.portal()" in str(error)
        after = engine.stats()
        assert {k: after[k] for k in counters} == before, "a refused call reached the engine"
        assert after["state"] == "running"
        assert (await engine.generate("still serving", **GREEDY)).finish_reason == "length"


async def test_a_thread_through_the_portal_gets_what_the_home_loop_gets(tiny_model) -> None:
    async with running_engine(tiny_model, **SETTINGS) as engine:
        reference = {p: (await engine.generate(p, **GREEDY)).token_ids for p in PROMPTS}
        bridge = engine.portal()
        from_thread: dict[str, Any] = {}

        def worker() -> None:
            for p in PROMPTS:
                from_thread[("generate", p)] = bridge.generate(p, **GREEDY).token_ids
                from_thread[("stream", p)] = [t for c in bridge.stream(p, **GREEDY) for t in c.token_ids]
            from_thread["tokenize"] = bridge.tokenize(PROMPTS[0])
            from_thread["chat"] = bridge.chat([{"role": "user", "content": "hi"}], **GREEDY).finish_reason
            try:
                bridge.generate("x", max_tokens=-1)
            except InvalidRequest as exc:  # errors cross the bridge typed
                from_thread["invalid"] = exc.field

        thread = _in_thread(worker)
        home = await asyncio.gather(*(engine.generate(p, **GREEDY) for p in PROMPTS * 3))  # the loop serves on
        await _join(thread)
        assert [d.token_ids for d in home] == [reference[p] for p in PROMPTS * 3]
        for p in PROMPTS:
            assert from_thread[("generate", p)] == reference[p]
            assert from_thread[("stream", p)] == reference[p]
        assert from_thread["tokenize"] == await engine.tokenize(PROMPTS[0])
        assert from_thread["chat"] == "length" and from_thread["invalid"] == "max_tokens"
        with pytest.raises(WrongEventLoop, match=r"await engine\.generate"):
            bridge.generate("on the home thread", **GREEDY)  # would wait for itself


async def test_leaving_a_bridged_stream_early_aborts_its_request(tiny_model) -> None:
    async with running_engine(tiny_model, **SETTINGS) as engine:
        bridge = engine.portal()
        taken: list[int] = []

        def worker() -> None:
            for chunk in bridge.stream("a long story", max_tokens=200, ignore_eos=True):
                taken.extend(chunk.token_ids)
                if len(taken) >= 3:
                    break

        await _join(_in_thread(worker))
        stats = await until_idle(engine)
        assert stats["num_aborted"] == 1 and stats["kv_blocks_used"] == 0
        assert 3 <= len(taken) < 200


def test_sync_engine_runs_on_its_own_thread_and_loop(tiny_model) -> None:
    async def reference() -> list[list[int]]:
        async with running_engine(tiny_model, **SETTINGS) as engine:
            return [(await engine.generate(p, **GREEDY)).token_ids for p in PROMPTS]

    expected = anyio.run(reference)
    with tokenflow.SyncEngine(str(tiny_model), **SETTINGS) as engine:
        assert [engine.generate(p, **GREEDY).token_ids for p in PROMPTS] == expected
        assert [t for c in engine.stream(PROMPTS[0], **GREEDY) for t in c.token_ids] == expected[0]
        assert engine.chat([{"role": "user", "content": "hi"}], **GREEDY).finish_reason == "length"
        assert engine.detokenize(engine.tokenize("hello world")).endswith("hello world")
        assert engine.stats()["state"] == "running"
        inner = engine.engine
    assert inner.stats()["state"] == "closed"


def test_the_portal_bridges_to_an_engine_on_trio(tiny_model) -> None:
    async def main() -> None:
        async with running_engine(tiny_model, **SETTINGS) as engine:
            expected = (await engine.generate(PROMPTS[1], **GREEDY)).token_ids
            bridge = engine.portal()
            got: list[list[int]] = []
            await _join(_in_thread(lambda: got.append(bridge.generate(PROMPTS[1], **GREEDY).token_ids)))
            assert got == [expected]

    anyio.run(main, backend="trio")
