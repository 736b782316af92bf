"""tokenflow-redis: a Redis tier shared by tokenflow engines (KV blocks and responses).

Enable it by adding the `redis_tier` stage after `disk_tier`:

    Engine(model, request_stages=with_redis_tier(), cache_dir="...",
           plugin_settings={"redis_tier": {"urls": ["redis://10.0.0.5:6379/0", "redis://10.0.0.6:6379/0"],
                                           "secret": "<the same random string on every replica>"}})
"""

from __future__ import annotations

from tokenflow import EngineConfig
from tokenflow_redis.ring import HashRing
from tokenflow_redis.stage import RedisTier, RedisTierSettings

__all__ = ("HashRing", "RedisTier", "RedisTierSettings", "with_redis_tier")


def with_redis_tier(stages: list[str] | None = None) -> list[str]:
    """`stages` (default: the engine's default request stages) with `redis_tier` right after
    `disk_tier` (or before `tokenizer` when there is no disk tier)."""
    stages = list(stages if stages is not None else EngineConfig().request_stages)
    if "redis_tier" in stages:
        return stages
    at = stages.index("disk_tier") + 1 if "disk_tier" in stages else stages.index("tokenizer")
    return [*stages[:at], "redis_tier", *stages[at:]]
