"""Eviction policies of the token pool: which cached block to give up first.

A policy only orders candidates; the pool owns the blocks. The pool tells it
when a request uses a block (`on_access`, with the block's depth in its chain
and a tick that is the same for all blocks one request touches), when a block
loses its last reference (`on_evictable`: it joins the candidates), when it is
referenced again (`on_referenced`: it leaves them) and asks for a victim with
`evict()`. Optionally it ranks blocks by value (`ranked`, most worth keeping
first: the reverse of its eviction order), so a shutdown flush with a time
budget writes the hottest blocks first.

Both built-ins keep candidates in a binary heap with lazy deletion, so every
operation is O(log n) and nothing scans the pool; stale heap entries are
dropped when popped, and the heap is rebuilt when they outnumber live ones
(amortised O(1) per operation).

- `lru`: least recently used first; among blocks used by the same request,
  the chain's tail before its head (a head still serves shorter prefixes).
- `lfu_lru` (default): frequency with aging, in the LRFU family. Each use of a
  block adds `2^(tick / half_life)` to its score, where the tick counts
  finished requests, so a use loses half its weight every `half_life`
  requests. The heap key is `half_life * log2(score)`, in ticks: a block used
  once sorts as plain LRU would; each doubling of recent uses buys it
  `half_life` ticks of extra life. A block that was hot long ago decays like
  any other and leaves instead of squatting forever. Ties (blocks of one
  request) go tail before head.

Third-party policies register a factory `(config) -> policy` in the entry-point
group `tokenflow.eviction_policies`.
"""

from __future__ import annotations

import abc
import heapq
import math
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

__all__ = ("EvictionPolicy", "LFULRUPolicy", "LRUPolicy", "RankingPolicy", "create_lfu_lru", "create_lru")


@runtime_checkable
class EvictionPolicy(Protocol):
    def on_access(self, block: int, depth: int, tick: int) -> None: ...
    def on_evictable(self, block: int) -> None: ...
    def on_referenced(self, block: int) -> None: ...
    def evict(self) -> int: ...
    def forget(self, block: int) -> None: ...
    def __len__(self) -> int: ...


@runtime_checkable
class RankingPolicy(Protocol):
    """Optional: `ranked(blocks)`, most worth keeping first (a shutdown flush writes them in that order)."""

    def ranked(self, blocks: Iterable[int]) -> list[int]: ...


class _HeapPolicy(abc.ABC):
    """Candidates ordered by `_key(block)`, smallest evicted first."""

    name = "heap"

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[float, ...], int, int]] = []  # (key, version, block)
        self._version: dict[int, int] = {}
        self._candidates: set[int] = set()
        self._tick: dict[int, int] = {}
        self._depth: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._candidates)

    @abc.abstractmethod
    def _key(self, block: int) -> tuple[float, ...]:
        """The block's eviction order (smallest first), from what on_access recorded."""

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
            _, version, block = heapq.heappop(self._heap)
            if block in self._candidates and self._version.get(block) == version:
                self.forget(block)
                return block
        raise LookupError("no evictable block")

    def forget(self, block: int) -> None:
        """Drop everything known about `block` (it no longer holds a cached prefix)."""
        self.on_referenced(block)
        self._tick.pop(block, None)
        self._depth.pop(block, None)

    def ranked(self, blocks: Iterable[int]) -> list[int]:
        """`blocks` from the most worth keeping to the least: the reverse of eviction order."""
        return sorted(blocks, key=self._key, reverse=True)

    def _rebuild(self) -> None:
        self._heap = [(self._key(b), self._version[b], b) for b in self._candidates]
        heapq.heapify(self._heap)

    def stats(self) -> dict[str, Any]:
        return {"eviction_candidates": len(self._candidates)}


class LRUPolicy(_HeapPolicy):
    name = "lru"

    def _key(self, block: int) -> tuple[float, ...]:
        return (self._tick.get(block, 0), -self._depth.get(block, 0))


class LFULRUPolicy(_HeapPolicy):
    name = "lfu_lru"

    def __init__(self, half_life: float = 64.0) -> None:
        super().__init__()
        if half_life <= 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self.half_life = half_life
        self._score: dict[int, float] = {}

    def on_access(self, block: int, depth: int, tick: int) -> None:
        super().on_access(block, depth, tick)
        # score = H * log2(sum over uses of 2^(tick_i / H)), updated without overflow.
        old = self._score.get(block)
        if old is None:
            self._score[block] = float(tick)
        else:
            high, low = max(old, tick), min(old, tick)
            self._score[block] = high + self.half_life * math.log2(1.0 + 2.0 ** ((low - high) / self.half_life))

    def _key(self, block: int) -> tuple[float, ...]:  # type: ignore[override]
        return (self._score.get(block, 0.0), self._tick.get(block, 0), -self._depth.get(block, 0))

    def forget(self, block: int) -> None:
        super().forget(block)
        self._score.pop(block, None)


def create_lru(config: Any = None) -> LRUPolicy:
    return LRUPolicy()


def create_lfu_lru(config: Any = None) -> LFULRUPolicy:
    return LFULRUPolicy(getattr(config, "eviction_half_life", 64.0))
