"""Eviction policies of the token pool: which cached block to give up first.

A policy only orders candidates; the pool owns the blocks. The pool tells it
when a request uses a block (`on_access`, with the block's depth in its chain
and a tick that is the same for all blocks one request touches), when a block
loses its last reference (`on_evictable`: it joins the candidates), when it is
referenced again (`on_referenced`: it leaves them) and asks for a victim with
`evict()`.

Both built-ins keep candidates in a binary heap with lazy deletion, so every
operation is O(log n) and nothing scans the pool; stale heap entries are
dropped when popped, and the heap is rebuilt when they outnumber live ones
(amortised O(1) per operation).

- `lru`: least recently used first; among blocks used by the same request,
  the chain's tail before its head (a head still serves shorter prefixes).
- `lfu_lru` (default): LFU with dynamic aging (LFU-DA). A block's priority is
  `age + uses`, where `age` is the priority of the last evicted block: a block
  that was hot long ago keeps its old priority while the age climbs with every
  eviction, so it eventually leaves instead of squatting forever. Ties go to
  recency, then tail before head.

Third-party policies register a factory `(config) -> policy` in the entry-point
group `tokenflow.eviction_policies`.
"""

from __future__ import annotations

import heapq
from typing import Any, Protocol, runtime_checkable

__all__ = ("EvictionPolicy", "LFULRUPolicy", "LRUPolicy", "create_lfu_lru", "create_lru")


@runtime_checkable
class EvictionPolicy(Protocol):
    def on_access(self, block: int, depth: int, tick: int) -> None: ...
    def on_evictable(self, block: int) -> None: ...
    def on_referenced(self, block: int) -> None: ...
    def evict(self) -> int: ...
    def forget(self, block: int) -> None: ...
    def __len__(self) -> int: ...


class _HeapPolicy:
    """Candidates ordered by `_key(block)`, smallest evicted first."""

    name = "heap"

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, ...], int, int]] = []  # (key, version, block)
        self._version: dict[int, int] = {}
        self._candidates: set[int] = set()
        self._tick: dict[int, int] = {}
        self._depth: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._candidates)

    def _key(self, block: int) -> tuple[int, ...]:
        raise NotImplementedError

    def on_access(self, block: int, depth: int, tick: int) -> None:
        self._tick[block] = tick
        self._depth[block] = depth

    def on_evictable(self, block: int) -> None:
        if block in self._candidates:
            return
        self._candidates.add(block)
        version = self._version.get(block, 0) + 1
        self._version[block] = version
        heapq.heappush(self._heap, (self._key(block), version, block))
        if len(self._heap) > 2 * len(self._candidates) + 64:
            self._rebuild()

    def on_referenced(self, block: int) -> None:
        if block in self._candidates:
            self._candidates.discard(block)
            self._version[block] = self._version.get(block, 0) + 1  # its heap entry is now stale

    def evict(self) -> int:
        while self._heap:
            key, version, block = heapq.heappop(self._heap)
            if block in self._candidates and self._version.get(block) == version:
                self._evicted(block, key)
                self.forget(block)
                return block
        raise LookupError("no evictable block")

    def forget(self, block: int) -> None:
        """Drop everything known about `block` (it no longer holds a cached prefix)."""
        self.on_referenced(block)
        self._tick.pop(block, None)
        self._depth.pop(block, None)

    def _evicted(self, block: int, key: tuple[int, ...]) -> None:
        pass

    def _rebuild(self) -> None:
        self._heap = [(self._key(b), self._version[b], b) for b in self._candidates]
        heapq.heapify(self._heap)

    def stats(self) -> dict[str, Any]:
        return {"eviction_candidates": len(self._candidates)}


class LRUPolicy(_HeapPolicy):
    name = "lru"

    def _key(self, block: int) -> tuple[int, ...]:
        return (self._tick.get(block, 0), -self._depth.get(block, 0))


class LFULRUPolicy(_HeapPolicy):
    name = "lfu_lru"

    def __init__(self) -> None:
        super().__init__()
        self._age = 0
        self._priority: dict[int, int] = {}

    def on_access(self, block: int, depth: int, tick: int) -> None:
        super().on_access(block, depth, tick)
        # LFU-DA: a use lifts the block to at least the current age, plus one use.
        self._priority[block] = max(self._priority.get(block, 0), self._age) + 1

    def _key(self, block: int) -> tuple[int, ...]:
        return (self._priority.get(block, self._age), self._tick.get(block, 0), -self._depth.get(block, 0))

    def _evicted(self, block: int, key: tuple[int, ...]) -> None:
        self._age = max(self._age, key[0])

    def forget(self, block: int) -> None:
        super().forget(block)
        self._priority.pop(block, None)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "eviction_age": self._age}


def create_lru(config: Any = None) -> LRUPolicy:
    return LRUPolicy()


def create_lfu_lru(config: Any = None) -> LFULRUPolicy:
    return LFULRUPolicy()
