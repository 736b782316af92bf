"""A third-party KV pool, written against `tokenflow.plugin_api` only: a free list and reference counts,
no prefix caching (every request computes its whole prompt). The tests install it through an entry point
in `tokenflow.kv_pools` and run the oracle with the built-in scheduler on it."""

from __future__ import annotations

from typing import Any

from tokenflow.plugin_api import EngineConfig, PrefixHit, Request


class PlainPool:
    def __init__(self, config: EngineConfig, *, num_blocks: int, block_size: int, **_: Any) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self.allocations = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise RuntimeError(f"{n} blocks asked, {len(self._free)} free")
        taken = [self._free.pop() for _ in range(n)]
        for block in taken:
            self._refs[block] = 1
        self.allocations += n
        return taken

    def free(self, block_ids: Any) -> None:
        for block in block_ids:
            assert self._refs[block] > 0, f"double free of {block}"
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)

    def lookup_prefix(self, request: Request) -> PrefixHit | None:
        return PrefixHit([], 0)  # nothing is shared

    def take_prefix(self, request: Request, hit: PrefixHit) -> None:
        pass

    def commit(self, request: Request) -> None:
        pass

    def release(self, request: Request) -> None:
        self.free([b for b in request.block_table if b >= 0])
        request.block_table = []
        self.free(request.pinned_blocks)
        request.pinned_blocks = []

    def trim(self, request: Request, keep_from: int, sink_tokens: int) -> int:
        first = -(-sink_tokens // self.block_size)
        last = min(max(keep_from, 0) // self.block_size, len(request.block_table))
        freed = [i for i in range(first, last) if request.block_table[i] >= 0]
        self.free([request.block_table[i] for i in freed])
        for i in freed:
            request.block_table[i] = -1
        return len(freed)

    def replace_table(self, request: Request, table: list[int]) -> None:
        old, request.block_table = request.block_table, list(table)
        self.free([b for b in old if b >= 0])

    def stats(self) -> dict[str, Any]:
        return {"kv_blocks_total": self.num_blocks, "kv_blocks_used": self.num_used, "kv_blocks_free": self.num_free,
                "kv_blocks_cached": 0, "plain_pool_allocations": self.allocations}


def create(config: EngineConfig, **sizes: Any) -> PlainPool:
    return PlainPool(config, **sizes)


class PoolWithoutTrim(PlainPool):
    """What a third-party pool written against an older contract looks like: refused when it is loaded."""

    trim = None  # type: ignore[assignment]


def create_without_trim(config: EngineConfig, **sizes: Any) -> PoolWithoutTrim:
    return PoolWithoutTrim(config, **sizes)
