"""The `prefetcher` stage: start moving a queued request's cached prefix from lower tiers to the pool.

Placed after the tokenizer on the request path. When a request is queued, it
hashes the prompt's full blocks; if the pool lacks a prefix, it asks the
pool's lower tiers in order (disk first, then any plugin tier such as a
shared remote store) and the first that may hold the next block starts a
load job in its reader threads (`prefetch_concurrency`), so by the time the
batcher gets to the request its blocks are resident, pinned for it until it
is admitted or ends. A job still running when the batcher gets there counts
as late (the request waits while others run); each tier's `stats()`
reports both.

Without lower tiers or without prefix caching it passes requests straight on.
"""

from __future__ import annotations

from typing import Any

from tokenflow.config import EngineConfig
from tokenflow.protocols import EngineContext, NextStage
from tokenflow.request import Request

__all__ = ("Prefetcher", "create")


class Prefetcher:
    def __init__(self, config: EngineConfig) -> None:
        self.pool: Any = None

    async def start(self, ctx: EngineContext) -> None:
        self.pool = ctx.pool

    async def handle(self, request: Request, call_next: NextStage) -> None:
        tiers = getattr(self.pool, "lower_tiers", ())
        if tiers and request.prompt_token_ids:
            for tier in tiers:
                if tier.prefetch(request):
                    break
        await call_next(request)


def create(config: EngineConfig) -> Prefetcher:
    return Prefetcher(config)
