"""The `redis` KV tier: KV blocks and whole responses shared by every replica.

List it after `disk` in `kv_tiers` (`Engine(..., kv_tiers=["disk", "redis"])`); the engine's own pool
and disk stay in front of it (local first, then global):
- KV blocks: the tier joins the token pool's lower tiers after the disk
  tier. As blocks fill (`commit_listeners`) they are copied out and published
  by a writer thread (skipped when the store has them: another replica got
  there first); with `publish=False` only evicted blocks are. When a
  request's prefix continues past the pool and the disk, a load job fetches
  the next blocks from Redis (the engine starts it while the request is
  queued) and restores them into the pool.
- Responses (a `ResponseStore`): a deterministic request the engine's memory and disk did not have is
  looked up in Redis and replayed on a hit; a completed one is stored with a TTL.

Settings come from `EngineConfig.plugin_settings["redis_tier"]` (see
`RedisTierSettings`). Every value carries a MAC keyed by `secret` (else the
engine's `cache_secret`): without one the tier refuses to start, since any
client of the Redis could otherwise feed every replica. Response keys use the
serving fingerprint (`EngineContext.serving_key`). Nothing here does network
I/O on the event loop: the
store runs in worker threads, and its per-node breakers turn a dead or slow
Redis into misses until it answers again.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import torch

from tokenflow.plugin_api import BlockKey, BlockTier, ConfigError, EngineContext, StoredResponse
from tokenflow_redis.store import RedisStore

__all__ = ("RedisTier", "RedisTierSettings", "create")

log = logging.getLogger("tokenflow.redis")

STAGE_NAME = "redis_tier"
KNOWN_KEYS = 65536  # block hashes known to be in Redis, remembered so they are not offered again


class RedisTierSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    urls: list[str] = msgspec.field(default_factory=lambda: ["redis://127.0.0.1:6379/0"])
    namespace: str = "tokenflow"  # prefix of every Redis key: deployments sharing Redis stay apart
    block_ttl_s: float = 3600.0  # refreshed on every read
    response_ttl_s: float = 600.0
    timeout_s: float = 0.5  # a slower reply counts as a failure and trips the node's breaker
    retry_s: float = 5.0  # a tripped node is bypassed this long, then probed again
    vnodes: int = 160  # points per node on the hash ring
    publish: bool = True  # share blocks as they fill (False: only when the pool evicts them)
    readers: int = 2  # load jobs at once
    max_pending_writes: int = 256  # blocks copied out and not yet sent; more are not published
    secret: str | None = None  # keys the values' MACs; every replica must share it (default: cache_secret)


class RedisTier(BlockTier):
    """A KV tier and a response store on the shared Redis nodes."""

    name = "redis"

    def __init__(self, config: Any) -> None:
        super().__init__()
        try:
            self.settings = msgspec.convert(
                config.plugin_settings.get(STAGE_NAME, {}), RedisTierSettings, strict=False
            )
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid plugin_settings.{STAGE_NAME}: {exc}", field="plugin_settings") from None
        self.secret = self.settings.secret or getattr(config, "cache_secret", None)
        self.load_timeout_s = getattr(config, "tier_load_timeout_s", self.load_timeout_s)
        self.store: RedisStore | None = None
        self.max_pending_writes = self.settings.max_pending_writes
        self._known: OrderedDict[bytes, None] = OrderedDict()  # block hashes known to be in Redis
        self._lock = threading.Lock()

    async def start(self, ctx: EngineContext) -> None:
        if not self.secret:  # raised here, not in __init__, so the engine's caller gets the ConfigError itself
            raise ConfigError(
                f"the redis tier needs a shared secret: set plugin_settings.{STAGE_NAME}.secret (or cache_secret) "
                "to the same random string on every replica", field="plugin_settings",
            )
        s = self.settings
        self.store = RedisStore(
            s.urls, secret=self.secret, namespace=s.namespace, block_ttl_s=s.block_ttl_s,
            response_ttl_s=s.response_ttl_s, timeout_s=s.timeout_s, retry_s=s.retry_s, vnodes=s.vnodes,
        )
        up = await anyio.to_thread.run_sync(self.store.ping)
        log.info("redis tier: %d/%d nodes answering (%s)", sum(up.values()), len(up), ", ".join(up))
        self.start_writer()
        self.attach(ctx.pool, s.readers)

    async def stop(self) -> None:
        self.poll()
        await anyio.to_thread.run_sync(self.close_threads)
        if self.store is not None:
            self.store.close()

    # -- the KV tier -----------------------------------------------------------------------
    def might_have(self, key: BlockKey) -> bool:
        return self.store is not None and self.store.available(key.hash)

    def fetch_blocks(self, keys: list[BlockKey]) -> list[tuple[BlockKey, torch.Tensor]]:
        assert self.store is not None and self.dtype is not None
        loaded = self.store.get_blocks(keys, self.dtype, self.block_shape)
        self._remember(key.hash for key, _ in loaded)
        return loaded

    def discard_block(self, key: BlockKey) -> None:
        if self.store is not None:
            self._forget(key.hash)
            self.store.delete_block(key)

    def on_commit(self, block: int, key: BlockKey) -> None:
        if self.settings.publish:
            self._offer(block, key)

    def on_evict(self, block: int, key: BlockKey) -> None:
        self._offer(block, key)  # with `publish`, only blocks whose publishing was dropped get here new

    def _offer(self, block: int, key: BlockKey) -> None:
        """Publish the block unless Redis is known to have it or its node is bypassed."""
        if self.store is None or not self.store.available(key.hash):
            return
        with self._lock:
            if key.hash in self._known:
                return
        self._remember([key.hash])
        if not self.write_behind(block, key):
            self._forget(key.hash)

    def write_block(self, key: BlockKey, data: torch.Tensor) -> bool:
        assert self.store is not None
        published = self.store.put_block(key, data)
        if not published and not self.store.available(key.hash):
            self._forget(key.hash)  # not sent: offer it again later
        return published

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            self._known.pop(block_hash, None)

    def _remember(self, hashes: Any) -> None:
        with self._lock:
            for h in hashes:
                self._known[h] = None
                self._known.move_to_end(h)
            while len(self._known) > KNOWN_KEYS:
                self._known.popitem(last=False)

    # -- the response store ------------------------------------------------------------------
    def might_answer(self, key: str) -> bool:
        return self.store is not None and self.store.available(key)

    async def lookup_response(self, key: str) -> StoredResponse | None:
        assert self.store is not None
        return await anyio.to_thread.run_sync(self.store.get_response, key)

    def store_response(self, key: str, stored: StoredResponse) -> None:
        if self.writer is not None and self.store is not None:
            self.writer.submit(self.store.put_response, key, stored)

    def stats(self) -> dict[str, Any]:
        stats = {
            **super().stats(),
            "redis_blocks_published": self.blocks_written,
            "redis_publish_dropped": self.writes_dropped,
        }
        if self.store is not None:
            stats.update(self.store.stats())
        return stats


def create(config: Any) -> RedisTier:
    return RedisTier(config)
