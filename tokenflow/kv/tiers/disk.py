"""The `disk` KV tier: KV blocks and whole responses on disk (diskcache), under `cache_dir`.

KV blocks. At start the tier attaches to the token pool as a lower tier, in `kv_tiers` order
(`kv/tiers/base.py` has the load-job machinery it shares with other tiers):
- a cached block the pool evicts is copied out (one small copy, on the event
  loop, before the block is reused) and written by a writer thread; `stop()`
  (called by `Engine.aclose`) writes the pool's other blocks too, hottest
  first (in use, then the eviction policy's ranking) for at most
  `disk_flush_timeout_s`, so a new engine on the same `cache_dir` starts warm
  with what matters most and a slow disk cannot hold shutdown;
- when a request's prefix continues on disk past what the pool holds, a load
  job reads those blocks in a reader thread and restores them into the pool.

Responses (a `ResponseStore`): the engine's response cache (`stages/response_cache.py`) asks the disk after
its memory; entries expire after `response_cache_ttl_s`.

All storage checks and the I/O breaker live in `kv/tiers/disk_store.py`; without a `cache_dir` the tier
stays off.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import torch

from tokenflow.config import EngineConfig
from tokenflow.kv.block_hash import BlockKey
from tokenflow.kv.tiers.base import BlockTier
from tokenflow.kv.tiers.disk_store import DiskStore
from tokenflow.output.stored_responses import StoredResponse, decode_response
from tokenflow.protocols import EngineContext

__all__ = ("DiskTier", "create")

log = logging.getLogger("tokenflow")


READ_AHEAD = 8  # blocks of one load job read at once
READ_THREADS = 2


class DiskTier(BlockTier):
    """A KV tier below the pool and a store of whole responses, on one folder."""

    name = "disk"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config
        self.store: DiskStore | None = None
        self.load_timeout_s = config.tier_load_timeout_s
        self._block_readers: ThreadPoolExecutor | None = None  # a load job's block reads, side by side
        self.response_hits = 0

    async def start(self, ctx: EngineContext) -> None:
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

    # -- the response store --------------------------------------------------------------------
    def might_answer(self, key: str) -> bool:
        return self.store is not None and self.store.available

    async def lookup_response(self, key: str) -> StoredResponse | None:
        """The disk's entry under `key`, checked (a bad entry is deleted)."""
        assert self.store is not None
        raw = await anyio.to_thread.run_sync(self.store.get_response, key)
        stored = None if raw is None else decode_response(raw)
        if stored is None and raw is not None:
            await anyio.to_thread.run_sync(self.store.delete_response, key)
        self.response_hits += stored is not None
        return stored

    def store_response(self, key: str, stored: StoredResponse) -> None:
        if self.writer is not None and self.store is not None:
            self.writer.submit(self.store.put_response, key, msgspec.json.encode(stored),
                               self.config.response_cache_ttl_s)

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
        for block, key in self.pool.hottest_blocks():
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
            "response_cache_disk_hits": self.response_hits,
        }
        if self.store is not None:
            stats.update(self.store.stats())
        return stats


def create(config: EngineConfig) -> DiskTier:
    return DiskTier(config)
