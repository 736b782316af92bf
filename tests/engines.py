"""Engines for tests: started on a model with torch's thread count given back afterwards, and a wait
until an engine is idle (aborts free their blocks at the next step boundary)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import anyio
import torch

from tokenflow import Engine
from tokenflow.protocols import DeviceTokens, PendingTokens
from tokenflow.runtime.sampler import GreedyTokens

__all__ = ("poison_rows", "running_engine", "stage_of", "until_idle")

S = TypeVar("S")


@contextlib.asynccontextmanager
async def running_engine(model: Any, **settings: Any) -> AsyncIterator[Engine]:
    threads = torch.get_num_threads()  # `num_threads` is process-wide: give it back
    try:
        async with Engine(model, **settings) as engine:
            yield engine
    finally:
        torch.set_num_threads(threads)


def stage_of(engine: Engine, kind: type[S]) -> S:
    """The engine's part of this class: a request stage, a KV tier, or its tokenizer."""
    return next(s for s in [*engine._stages, *engine._tiers, engine._tokenizer] if isinstance(s, kind))


async def until_idle(engine: Engine, limit_s: float = 10.0) -> dict[str, Any]:
    """The engine's stats once nothing runs, waits or holds a KV block."""
    with anyio.fail_after(limit_s):
        while (s := engine.stats())["kv_blocks_used"] or s["num_running"] or s["num_waiting"]:
            await anyio.sleep(0.01)
    return s


Output = torch.Tensor | GreedyTokens | DeviceTokens | PendingTokens


def poison_rows(out: Output, rows: list[int]) -> Output:
    """A backend's step output with sampling rows `rows` made a model fault: NaN logits, or, for a step the
    backend gave as tokens (drawn on the device, or still on their way from it), the -1 it reports for a row
    whose logits are not finite."""
    if isinstance(out, PendingTokens):
        wait = out.wait
        return PendingTokens(lambda: DeviceTokens([-1 if j in rows else t for j, t in enumerate(wait().token_ids)]))
    if isinstance(out, GreedyTokens | DeviceTokens):
        return type(out)([-1 if j in rows else t for j, t in enumerate(out.token_ids)])
    with torch.inference_mode():
        for j in rows:
            out[j] = float("nan")
    return out
