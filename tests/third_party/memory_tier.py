"""A third-party KV tier, written against `tokenflow.plugin_api` only: blocks kept in a process-wide dict
(standing in for a store replicas share), published as they fill and loaded back for a queued request
whose prefix continues past the pool. The tests install it through an entry point in `tokenflow.kv_tiers`."""

from __future__ import annotations

import threading
from typing import Any

import anyio.to_thread
import torch

from tokenflow.plugin_api import BlockKey, BlockTier, EngineConfig, EngineContext

STORE: dict[bytes, torch.Tensor] = {}
_LOCK = threading.Lock()


class MemoryTier(BlockTier):
    name = "memtier"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()

    async def start(self, ctx: EngineContext) -> None:
        self.start_writer()
        self.attach(ctx.pool, readers=1)

    async def stop(self) -> None:
        self.poll()
        await anyio.to_thread.run_sync(self.close_threads)

    def on_commit(self, block: int, key: BlockKey) -> None:
        if key.hash not in STORE:
            self.write_behind(block, key)

    def might_have(self, key: BlockKey) -> bool:
        return key.hash in STORE

    def fetch_blocks(self, keys: list[BlockKey]) -> list[tuple[BlockKey, torch.Tensor]]:
        loaded = []
        with _LOCK:
            for key in keys:
                data = STORE.get(key.hash)
                if data is None:
                    break
                loaded.append((key, data.clone()))
        return loaded

    def write_block(self, key: BlockKey, data: torch.Tensor) -> bool:
        with _LOCK:
            STORE[key.hash] = data.clone()
        return True

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "memtier_blocks_stored": len(STORE)}


def create(config: EngineConfig) -> MemoryTier:
    return MemoryTier(config)
