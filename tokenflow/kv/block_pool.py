"""Bookkeeping of KV cache blocks: which block ids are free, which are in use.

No tensors live here; `KVCache` holds the memory and this pool hands out the
indices into it. Every operation is O(1) per block: the free ids sit on a
stack, and a per-block reference count answers "is this block in use?"
without scanning.

The request-level methods (`lookup_prefix` / `take_prefix`, `commit`,
`release`) are what the scheduler calls; here they only hand out and take back
a request's blocks. `PrefixCache` (`prefix_cache.py`) overrides them to share
cached prefix blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tokenflow.protocols import PrefixHit

if TYPE_CHECKING:
    from tokenflow.request import Request

__all__ = ("BlockPool", "OutOfBlocks")


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than requested; nothing was allocated."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"requested {requested} KV blocks but only {free} are free")
        self.requested = requested
        self.free = free


class BlockPool:
    """A fixed set of `num_blocks` KV blocks of `block_size` token slots each."""

    __slots__ = ("_block_size", "_free", "_num_blocks", "_num_pinned", "_ref_count")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        # Stack of free ids; reversed so the first allocations get 0, 1, 2, ... (predictable in tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref_count: list[int] = [0] * num_blocks
        self._num_pinned = 0  # references held for queued requests (`Request.pinned_blocks`)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that still hold a cached prefix (evictable); none without prefix caching."""
        return 0

    @property
    def num_pinned(self) -> int:
        """References held for queued requests on blocks a lower tier restored (`Request.pinned_blocks`)."""
        return self._num_pinned

    @property
    def max_pinned(self) -> int:
        """At most this many pins: past it a tier's blocks are restored as cached (evictable), so queued
        requests' prefixes never hold the memory the running ones and the queue's head need."""
        return self._num_blocks // 2

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one request."""
        return self._num_blocks - len(self._free) - self.num_cached

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self._block_size)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (reference count 1 each); all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        free = self._free
        if n > len(free):
            raise OutOfBlocks(n, len(free))
        if n == 0:
            return []
        ids = free[-n:]
        del free[-n:]
        ids.reverse()
        ref = self._ref_count
        for b in ids:
            ref[b] = 1
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks whose count reaches 0 become free.

        Validates the whole batch first, so a bad id (unknown, already free, or
        listed twice) raises `ValueError` and leaves the pool unchanged.
        """
        ids = list(block_ids)
        ref = self._ref_count
        n = self._num_blocks
        for b in ids:
            if not (0 <= b < n):
                raise ValueError(f"block id {b} is out of range [0, {n})")
            if ref[b] <= 0:
                raise ValueError(f"double free of KV block {b}")
        if len(set(ids)) != len(ids):
            # Several references to one block in one call are only legal while it is shared.
            counts: dict[int, int] = {}
            for b in ids:
                counts[b] = counts.get(b, 0) + 1
            for b, c in counts.items():
                if c > ref[b]:
                    raise ValueError(f"double free of KV block {b} (listed {c} times, {ref[b]} references)")
        for b in ids:
            ref[b] -= 1
            if ref[b] == 0:
                self._unreferenced(b)

    def _unreferenced(self, block_id: int) -> None:
        """`block_id` lost its last reference."""
        self._free.append(block_id)

    def truncate(self, num_blocks: int) -> None:
        """Give up the ids from `num_blocks` on, because the KV memory behind them is being freed
        (the device ran out of memory repeatedly). Every one of them must be unreferenced: the
        scheduler preempts their holders first. Cached ones are evicted (listeners copy them out)."""
        if not 0 < num_blocks <= self._num_blocks:
            raise ValueError(f"cannot truncate a pool of {self._num_blocks} blocks to {num_blocks}")
        held = [b for b in range(num_blocks, self._num_blocks) if self._ref_count[b] > 0]
        if held:
            raise ValueError(f"cannot truncate to {num_blocks} blocks: {len(held)} past it are in use")
        self._drop_cached_from(num_blocks)
        self._free = [b for b in self._free if b < num_blocks]
        del self._ref_count[num_blocks:]
        self._num_blocks = num_blocks

    def _drop_cached_from(self, num_blocks: int) -> None:
        """Move cached blocks at or past `num_blocks` to the free list (none without prefix caching)."""

    # -- request level: what the batcher calls ------------------------------------
    def lookup_prefix(self, request: Request) -> PrefixHit | None:
        """The cached prefix a request about to be admitted may share (none here); None means "wait, it
        is loading from a lower tier". A query: nothing changes until `take_prefix`."""
        return PrefixHit([], 0)

    def take_prefix(self, request: Request, hit: PrefixHit) -> None:
        """Start `request` after `hit`: it references the hit's blocks (nothing to take here)."""

    def match_prefix(self, request: Request) -> bool:
        """`lookup_prefix` then `take_prefix` at once (for callers that admit unconditionally)."""
        hit = self.lookup_prefix(request)
        if hit is None:
            return False
        self.take_prefix(request, hit)
        return True

    def commit(self, request: Request) -> None:
        """Note the request's newly computed full blocks (nothing to note without prefix caching)."""

    def release(self, request: Request) -> None:
        """Drop every reference the request holds (its block table and any pinned blocks)."""
        if request.block_table:
            self.free([b for b in request.block_table if b >= 0])
        request.block_table = []
        request.num_trimmed_blocks = 0
        self.unpin(request)

    def unpin(self, request: Request) -> None:
        """Drop the references held for a queued request's restored blocks (they stay cached)."""
        if request.pinned_blocks:
            self.free(request.pinned_blocks)
            self._num_pinned -= len(request.pinned_blocks)
            request.pinned_blocks = []

    def replace_table(self, request: Request, table: list[int]) -> None:
        """Give `request` the blocks `table` (allocated for it) in place of its block table, whose references
        are dropped (kv_compression's swap to the compacted copy)."""
        old = request.block_table
        request.block_table = list(table)
        self.free([b for b in old if b >= 0])

    def trim(self, request: Request, keep_from: int, sink_tokens: int) -> int:
        """Free the request's blocks wholly between its first `sink_tokens` tokens and position
        `keep_from` (sliding attention never reads them again); their table entries become -1.
        Returns how many were freed."""
        table = request.block_table
        first = max(-(-sink_tokens // self._block_size), request.num_trimmed_blocks)
        last = min(max(keep_from, 0) // self._block_size, len(table))
        freed = [table[i] for i in range(first, last) if table[i] >= 0]
        if freed:
            self.free(freed)
            for i in range(first, last):
                table[i] = -1
        request.num_trimmed_blocks = max(request.num_trimmed_blocks, last)
        return len(freed)

    def stats(self) -> dict[str, Any]:
        return {
            "kv_blocks_total": self._num_blocks,
            "kv_blocks_used": self.num_used,
            "kv_blocks_free": self.num_free,
            "kv_blocks_cached": self.num_cached,
        }

    def ref_count(self, block_id: int) -> int:
        """References held on `block_id` (0 when free)."""
        return self._ref_count[block_id]

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self._num_blocks}, block_size={self._block_size}, "
            f"free={self.num_free}, used={self.num_used})"
        )
