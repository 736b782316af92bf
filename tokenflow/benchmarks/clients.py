"""The benchmark clients, shared by every engine under test (tokenflow and its peers).

Standard library only: the peers' drivers run this file in their own virtual environments, where
tokenflow is not installed, so one copy of the client logic and of the statistics measures every
engine the same way. An engine is given as `stream(prompt_ids, max_tokens)`: an async iterator of
the new token ids of each event (greedy, EOS ignored, exactly `max_tokens` in all).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

__all__ = ("Stream", "closed_loop", "conversations", "percentile", "summarise")

Stream = Callable[[list[int], int], AsyncIterator[list[int]]]


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def summarise(wall: float, ttfts: list[float], latencies: list[float], out_tokens: int) -> dict[str, Any]:
    """The numbers every table shows, computed one way for every engine."""
    return {
        "requests": len(latencies),
        "output_tokens": out_tokens,
        "wall_s": round(wall, 3),
        "req_per_s": round(len(latencies) / wall, 3),
        "out_tok_per_s": round(out_tokens / wall, 2),
        "ttft_p50_s": round(percentile(ttfts, 50), 3),
        "ttft_p99_s": round(percentile(ttfts, 99), 3),
        "latency_p50_s": round(percentile(latencies, 50), 3),
        "latency_p99_s": round(percentile(latencies, 99), 3),
    }


class _Tally:
    def __init__(self) -> None:
        self.ttfts: list[float] = []
        self.latencies: list[float] = []
        self.out_tokens = 0

    async def one(self, stream: Stream, ids: list[int], max_tokens: int) -> list[int]:
        """Send one request; record its time to first token and latency; return its token ids."""
        sent = time.perf_counter()
        first: float | None = None
        out: list[int] = []
        async for new in stream(ids, max_tokens):
            if new and first is None:
                first = time.perf_counter()
            out.extend(new)
        done = time.perf_counter()
        self.ttfts.append((first or done) - sent)
        self.latencies.append(done - sent)
        self.out_tokens += len(out)
        return out


async def closed_loop(stream: Stream, prompts: Sequence[list[int]], max_tokens: int,
                      concurrency: int) -> dict[str, Any]:
    """`concurrency` clients, each sending its next prompt when its last one finished."""
    queue = list(reversed(prompts))
    tally = _Tally()

    async def client() -> None:
        while queue:
            await tally.one(stream, queue.pop(), max_tokens)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return summarise(time.perf_counter() - started, tally.ttfts, tally.latencies, tally.out_tokens)


async def conversations(stream: Stream, system: list[int], turns: Sequence[Sequence[list[int]]],
                        reply_end: list[int], max_tokens: int) -> dict[str, Any]:
    """One client per conversation, all at once: turn k's prompt is the system prompt, every earlier
    user turn and reply (as token ids, so the prefix is reused to the token), and user turn k."""
    tally = _Tally()

    async def client(user_turns: Sequence[list[int]]) -> None:
        history = list(system)
        for user in user_turns:
            history += user
            reply = await tally.one(stream, list(history), max_tokens)
            history += reply + reply_end

    started = time.perf_counter()
    await asyncio.gather(*(client(t) for t in turns))
    return summarise(time.perf_counter() - started, tally.ttfts, tally.latencies, tally.out_tokens)


async def run_workload(stream: Stream, workload: dict[str, Any]) -> dict[str, Any]:
    """Run a workload as `tokenflow bench` writes it (JSON): closed loop or conversations."""
    if workload["kind"] == "closed_loop":
        return await closed_loop(stream, workload["prompts"], workload["max_tokens"], workload["concurrency"])
    if workload["kind"] == "conversations":
        return await conversations(stream, workload["system"], workload["turns"], workload["reply_end"],
                                   workload["max_tokens"])
    raise ValueError(f"unknown workload kind {workload['kind']!r}")


def warmup_prompt(vocab_size: int) -> list[int]:
    """Token ids of a short prompt that shares no prefix with any workload prompt (no template tokens)."""
    top = max(vocab_size - 10, 20)
    return [(37 * j + 11) % (top - 10) + 10 for j in range(24)]
