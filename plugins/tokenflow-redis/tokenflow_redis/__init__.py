"""tokenflow-redis: a Redis tier shared by tokenflow engines (KV blocks and responses).

Enable it by listing the `redis` KV tier after `disk`:

    Engine(model, kv_tiers=["disk", "redis"], cache_dir="...",
           plugin_settings={"redis_tier": {"urls": ["redis://10.0.0.5:6379/0", "redis://10.0.0.6:6379/0"],
                                           "secret": "<the same random string on every replica>"}})
"""

from __future__ import annotations

import warnings

from tokenflow_redis.ring import HashRing
from tokenflow_redis.stage import RedisTier, RedisTierSettings

__all__ = ("KV_TIERS", "HashRing", "RedisTier", "RedisTierSettings", "with_redis_tier")

KV_TIERS = ["disk", "redis"]  # the engine's disk, then the shared Redis: `Engine(..., kv_tiers=KV_TIERS)`


def with_redis_tier(stages: list[str] | None = None) -> list[str]:
    """Deprecated: the old `request_stages` list with the `redis_tier` stage (tiers are `kv_tiers` now; the
    engine still reads such a list the old way)."""
    warnings.warn("with_redis_tier() is deprecated: pass kv_tiers=['disk', 'redis']", DeprecationWarning,
                  stacklevel=2)
    stages = list(stages if stages is not None else ["breaker", "disk_tier", "tokenizer", "prefetcher"])
    if "redis_tier" in stages:
        return stages
    at = stages.index("disk_tier") + 1 if "disk_tier" in stages else stages.index("tokenizer")
    return [*stages[:at], "redis_tier", *stages[at:]]
