"""The `disk_tier` stage: KV blocks and whole responses on disk (diskcache).

KV blocks. At start the stage attaches to the token pool as its first lower
tier (`kv/tier.py` has the load-job machinery it shares with other tiers):
- a cached block the pool evicts is copied out (one small copy, on the event
  loop, before the block is reused) and written by a writer thread; `stop()`
  (called by `Engine.aclose`) writes the pool's other blocks too, hottest
  first (in use, then the eviction policy's ranking) for at most
  `disk_flush_timeout_s`, so a new engine on the same `cache_dir` starts warm
  with what matters most and a slow disk cannot hold shutdown;
- when a request's prefix continues on disk past what the pool holds, a load
  job reads those blocks in a reader thread and restores them into the pool.

Responses (opt-in: `response_cache=True` or per request `cache_response`).
On the request path, a deterministic request whose completion is stored (in
memory, else on disk) is answered from it, replayed chunk by chunk, and never
reaches the model; otherwise its chunks are recorded and stored when it
completes. Keys use the serving fingerprint (`EngineContext.serving_key`);
disk entries expire after `response_cache_ttl_s`.

All storage checks and the I/O breaker live in `kv/disk_store.py`; without a
`cache_dir` the stage keeps responses in memory only and has no KV tier.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import anyio.to_thread
import torch

from tokenflow.config import EngineConfig
from tokenflow.kv.block_hash import BlockKey
from tokenflow.kv.tiers.base import BlockTier
from tokenflow.kv.tiers.disk_store import DiskStore
from tokenflow.protocols import EngineContext
from tokenflow.stages.response_tier import ResponseCache, ResponseTier, StoredResponse

__all__ = ("DiskTier", "create")

log = logging.getLogger("tokenflow")


READ_AHEAD = 8  # blocks of one load job read at once
READ_THREADS = 2


class DiskTier(ResponseTier, BlockTier):
    """Both a response tier (request path) and a KV tier (below the prefix cache), on one folder."""

    name = "disk"

    def __init__(self, config: EngineConfig) -> None:
        BlockTier.__init__(self)
        ResponseTier.__init__(self, config)
        self.store: DiskStore | None = None
        self.responses = ResponseCache(config.response_cache_size, config.response_cache_ttl_s)
        self.load_timeout_s = config.tier_load_timeout_s
        self._block_readers: ThreadPoolExecutor | None = None  # a load job's block reads, side by side

    async def start(self, ctx: EngineContext) -> None:
        self.start_responses(ctx)
        if not self.config.cache_dir:
            return
        config = self.config
        self.store = await anyio.to_thread.run_sync(
            lambda: DiskStore(config.cache_dir, config.disk_cache_bytes, config.disk_retry_s,
                              secret=config.cache_secret)
        )
        self.start_writer()
        if self.attach(ctx.pool, config.prefetch_concurrency):
            self._block_readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tokenflow-disk-block")

    async def stop(self) -> None:
        """Write the pool's blocks not yet on disk, hottest first, and let pending writes finish, all
        within `disk_flush_timeout_s`; then close the folder."""
        deadline = time.monotonic() + self.config.disk_flush_timeout_s
        self.poll()
        if self.pool is not None and self.store is not None:
            await anyio.to_thread.run_sync(self._flush_pool, deadline)
        await anyio.to_thread.run_sync(self.close_threads, deadline - time.monotonic())
        if self._block_readers is not None:
            self._block_readers.shutdown(wait=False, cancel_futures=True)  # reads a hung job left behind
        if self.store is not None:
            await anyio.to_thread.run_sync(self.store.resync)
            await anyio.to_thread.run_sync(self.store.close)

    # -- the response tier -------------------------------------------------------------------
    async def lookup_response(self, key: str) -> StoredResponse | None:
        """Memory first, then the disk (a disk hit is promoted to memory; a bad entry deleted)."""
        stored = self.responses.get_memory(key)
        if stored is None and self.store is not None and self.store.available:
            raw = await anyio.to_thread.run_sync(self.store.get_response, key)
            stored = self.responses.decode_disk(key, raw)
            if stored is None and raw is not None:
                await anyio.to_thread.run_sync(self.store.delete_response, key)
        return stored

    def store_response(self, key: str, stored: StoredResponse) -> None:
        raw = self.responses.encode(key, stored)
        if self.writer is not None and self.store is not None:
            self.writer.submit(self.store.put_response, key, raw, self.config.response_cache_ttl_s)

    # -- the KV tier ----------------------------------------------------------------------
    def on_evict(self, block: int, key: BlockKey) -> None:
        """The pool is about to reuse `block`: copy it out and write it behind."""
        store = self.store
        if store is not None and store.available and not store.has_block(key):
            self.write_behind(block, key)

    def write_block(self, key: BlockKey, data: torch.Tensor) -> bool:
        return self.store is not None and self.store.put_block(key, data)

    def discard_block(self, key: BlockKey) -> None:
        if self.store is not None:
            self.store.delete_block(key)

    def _flush_pool(self, deadline: float) -> None:
        """Worker thread, after the step loop stopped: persist what the pool still holds, hottest
        first, until `deadline` (time.monotonic())."""
        store = self.store
        assert store is not None
        for block, key in getattr(self.pool, "hottest_blocks", self.pool.hashed_blocks)():
            if not store.available or time.monotonic() >= deadline:
                return
            if not store.has_block(key) and store.put_block(key, self.pool.kv.read_block(block).to("cpu")):
                with self._write_lock:
                    self.blocks_written += 1

    def might_have(self, key: BlockKey) -> bool:
        return self.store is not None and self.store.has_block(key)

    def fetch_blocks(self, keys: list[BlockKey]) -> list[tuple[BlockKey, torch.Tensor]]:
        """Reader thread: consecutive blocks from disk, stopping at the first miss. `READ_AHEAD` blocks at a
        time are read by `READ_THREADS` threads: a block's file read, MAC and SQLite lookup release the GIL,
        so a warm restart's shared prefix loads in about half the time on two cores."""
        loaded: list[tuple[BlockKey, torch.Tensor]] = []
        for start in range(0, len(keys), READ_AHEAD):
            batch = keys[start:start + READ_AHEAD]
            readers = self._block_readers
            blocks = readers.map(self._read_one, batch) if readers is not None else map(self._read_one, batch)
            for key, data in zip(batch, blocks):
                if data is None:
                    return loaded
                loaded.append((key, data))
        return loaded

    def _read_one(self, key: BlockKey) -> torch.Tensor | None:
        if self.store is None or not self.store.has_block(key):
            return None
        return self.store.get_block(key, self.dtype, self.block_shape)

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            **super().stats(),
            "disk_blocks_written": self.blocks_written,
            "disk_writes_dropped": self.writes_dropped,
            **self.responses.stats(),
            "response_cache_misses": self.response_misses,
            "response_cache_stores": self.response_stores,
        }
        if self.store is not None:
            stats.update(self.store.stats())
        return stats


def create(config: EngineConfig) -> DiskTier:
    return DiskTier(config)
