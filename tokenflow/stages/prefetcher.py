"""The `prefetcher` stage: start moving a queued request's cached prefix from disk to the pool.

Placed after the tokenizer on the request path. When a request is queued, it
hashes the prompt's full blocks; if the pool lacks a prefix that the disk
tier holds, it starts a load job right away (a bounded pool of reader
threads, `prefetch_concurrency`), so by the time the batcher gets to the
request its blocks are resident, pinned for it until it is admitted or ends.
A job still running when the batcher gets there counts as late (the request
waits while others run); `stats()` of the disk tier reports both.

Without a disk tier (no `cache_dir`) or without prefix caching it passes
requests straight on.
"""

from __future__ import annotations

from typing import Any

from tokenflow.config import EngineConfig
from tokenflow.protocols import EngineContext, NextStage
from tokenflow.request import Request

__all__ = ("Prefetcher", "create")


class Prefetcher:
    def __init__(self, config: EngineConfig, tier_name: str = "disk_tier") -> None:
        self.tier_name = tier_name
        self.tier: Any = None

    async def start(self, ctx: EngineContext) -> None:
        tier = ctx.shared.get(self.tier_name)
        self.tier = tier if getattr(tier, "pool", None) is not None else None

    async def handle(self, request: Request, call_next: NextStage) -> None:
        if self.tier is not None and request.prompt_token_ids:
            self.tier.prefetch(request)
        await call_next(request)


def create(config: EngineConfig) -> Prefetcher:
    return Prefetcher(config)
