"""Prefetching: start moving a queued request's cached prefix from the KV tiers to the pool.

The engine calls `prefetch` for every request it queues (with `prefetch=True`, after tokenizing). If the
pool lacks a prefix of the prompt's full blocks, the pool's lower tiers are asked in order (disk first, then
any plugin tier such as a shared remote store) and the first that may hold the next block starts a load job
in its reader threads (`prefetch_concurrency`), so by the time the scheduler gets to the request its blocks
are resident, pinned for it until it is admitted or ends. A job still running when the scheduler gets there
counts as late (the request waits while others run); each tier's `stats()` reports both. Without it the
scheduler starts the load when it first tries to admit the request.

`Prefetcher` is the old request stage of the same job, kept for configs that still list it.
"""

from __future__ import annotations

from typing import Any

from tokenflow.config import EngineConfig
from tokenflow.protocols import EngineContext, NextStage, TieredPool
from tokenflow.request import Request

__all__ = ("Prefetcher", "create", "prefetch")


def prefetch(pool: Any, request: Request) -> bool:
    """Start loading `request`'s prefix from the first of the pool's tiers that may have it; True when one did."""
    if not isinstance(pool, TieredPool) or not pool.lower_tiers or not request.prompt_token_ids:
        return False
    return any(tier.prefetch(request) for tier in pool.lower_tiers)


class Prefetcher:
    def __init__(self, config: EngineConfig) -> None:
        self.pool: Any = None

    async def start(self, ctx: EngineContext) -> None:
        self.pool = ctx.pool

    async def handle(self, request: Request, call_next: NextStage) -> None:
        prefetch(self.pool, request)
        await call_next(request)


def create(config: EngineConfig) -> Prefetcher:
    return Prefetcher(config)
