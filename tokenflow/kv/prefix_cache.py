"""The `token_pool` stage: the KV block pool with prefix caching.

Every block is in one of three states, and `used + free + cached == total`:
- used: referenced by at least one request (or pinned for a queued one);
- cached: unreferenced but holding the K/V of a known prefix (a content key,
  see `block_hash.py`); the eviction policy orders these;
- free: unreferenced and holding nothing worth keeping.

When a request is about to be admitted, `lookup_prefix` walks the keys of its
full prompt blocks and finds each resident block whose key, parent and tokens
all match; after them it looks for a resident block with the same parent whose
first tokens continue the prompt (a partial block: chats that share a system
prompt part ways mid-block). Once the scheduler admits it, `take_prefix`
references the full blocks, copies the partial block's matching rows into the
request's next block, and its prefill starts after them. As a request's blocks fill,
`commit` registers them under their keys so later requests can share them;
when it ends, `release` drops its references and its unshared blocks become
cached. Allocation takes free blocks first and then evicts cached ones, in
the policy's order; an eviction listener (the disk tier) may copy a block out
before it is reused. Everything is O(1) or O(log n) per block: dicts, a free
stack and the policy's heap, never a scan of the pool.

Lower tiers (`lower_tiers`, `kv/tiers/base.py`: the disk tier, plugins' remote
tiers) are asked in order for the blocks after the resident prefix; while
one loads them the request waits and `match_prefix` says so. Loaded blocks
come back through `restore`, pinned for the request until it is admitted or
ends; at most `max_pinned` (half the pool) are pinned, later ones come back
cached, so queued requests' prefixes never hold what the running ones need.
Tiers may also listen to evictions (`evict_listeners`: copy a block out
before it is reused) and to blocks as they fill (`commit_listeners`).

All methods run on the event loop: between steps, or, with `async_scheduling`, while a step planned ahead
runs, which writes only a position past every committed block.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tokenflow.kv.block_hash import BlockKey, block_keys, prefix_root
from tokenflow.kv.block_pool import BlockPool, OutOfBlocks
from tokenflow.kv.eviction import RankingPolicy
from tokenflow.protocols import PrefixHit

if TYPE_CHECKING:
    import torch

    from tokenflow.kv.eviction import EvictionPolicy
    from tokenflow.kv.kv_cache import KVCache
    from tokenflow.request import Request

__all__ = ("PrefixCache", "TokenPool", "common_prefix", "create")

log = logging.getLogger("tokenflow")

BlockListener = Callable[[int, BlockKey], None]


class PrefixCache(BlockPool):
    def __init__(
        self, num_blocks: int, block_size: int, *, policy: EvictionPolicy, prefix_caching: bool = True,
        model_key: bytes = b"", kv: KVCache | None = None,
    ) -> None:
        super().__init__(num_blocks, block_size)
        self.policy = policy
        self.prefix_caching = prefix_caching
        self.model_key = model_key
        self.kv = kv
        self.lower_tiers: list[Any] = []
        self.evict_listeners: list[BlockListener] = []
        self.commit_listeners: list[BlockListener] = []
        self._block_of: dict[bytes, int] = {}  # key hash -> block
        self._key_of: dict[int, BlockKey] = {}  # block -> its key (cached or used)
        # parent key hash -> sorted (tokens, block) of the blocks under it: the one sharing the longest
        # start with a prompt's next tokens is next to where those tokens would sort
        self._children: dict[bytes, list[tuple[tuple[int, ...], int]]] = {}
        self._tick = 0
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.num_evictions = 0
        self.num_restored = 0

    @property
    def num_cached(self) -> int:
        return len(self.policy)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free) + len(self.policy)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks: free ones first, then evicted cached ones; all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if not self.can_allocate(n):
            raise OutOfBlocks(n, len(self._free) + len(self.policy))
        short = n - len(self._free)
        for _ in range(short):
            self._free.append(self._evict_one())
        return super().allocate(n)

    def _evict_one(self) -> int:
        block = self.policy.evict()
        key = self._unregister(block)
        self.num_evictions += 1
        _notify(self.evict_listeners, block, key)  # tiers copy the block out before it is overwritten
        return block

    def _drop_cached_from(self, num_blocks: int) -> None:
        for block in [b for b in self._key_of if b >= num_blocks and self._ref_count[b] == 0]:
            self.policy.forget(block)
            key = self._unregister(block)
            self.num_evictions += 1
            _notify(self.evict_listeners, block, key)  # tiers copy it out before its memory goes
            self._free.append(block)

    def _register(self, block: int, key: BlockKey) -> None:
        self._block_of[key.hash] = block
        self._key_of[block] = key
        bisect.insort(self._children.setdefault(key.parent, []), (key.tokens, block))

    def _unregister(self, block: int) -> BlockKey:
        key = self._key_of.pop(block)
        del self._block_of[key.hash]
        siblings = self._children[key.parent]
        del siblings[bisect.bisect_left(siblings, (key.tokens,))]  # (tokens,) sorts just before (tokens, block)
        if not siblings:
            del self._children[key.parent]
        return key

    def _unreferenced(self, block_id: int) -> None:
        if block_id in self._key_of:
            self.policy.on_evictable(block_id)
        else:
            self._free.append(block_id)

    def _reference(self, block_id: int) -> None:
        if self._ref_count[block_id] == 0:
            self.policy.on_referenced(block_id)
        self._ref_count[block_id] += 1

    # -- request level ------------------------------------------------------------
    def _root(self, request: Request) -> bytes:
        """The parent key of the request's first block: model, tenant salt, and its LoRA adapter's content (an
        adapter's blocks are its own)."""
        adapter = request.adapter.key if request.adapter is not None else None
        return prefix_root(self.model_key, request.params.cache_salt, adapter)

    def keys(self, request: Request, num_tokens: int | None = None) -> list[BlockKey]:
        """Keys of the request's full blocks within its first `num_tokens` tokens (hashed once each)."""
        limit = request.num_tokens if num_tokens is None else min(num_tokens, request.num_tokens)
        if len(request.block_keys) < limit // self.block_size:  # only then build the token list
            block_keys(request.all_token_ids[:limit], self.block_size, self._root(request), request.block_keys)
        return request.block_keys

    def prefix_keys(self, request: Request) -> list[BlockKey]:
        """Keys of the blocks a prefix hit may cover: full prompt blocks short of the last token, which
        is always computed (its logits start the generation)."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.keys(request, max_blocks * self.block_size)[:max_blocks]

    def resident_prefix(self, keys: list[BlockKey]) -> list[int]:
        """Blocks holding the longest resident prefix of `keys` (key, parent and tokens all equal)."""
        blocks = []
        for key in keys:
            block = self._block_of.get(key.hash)
            if block is None or self._key_of[block] != key:
                break
            blocks.append(block)
        return blocks

    def lookup_prefix(self, request: Request) -> PrefixHit | None:
        """The resident prefix `request` may share; None while a lower tier loads the rest of it (lower
        tiers are asked in order for what the pool lacks). Changes no request state."""
        if not self.prefix_caching or request.block_table or request.params.prompt_logprobs is not None:
            return PrefixHit([], 0)  # prompt_logprobs: every prompt position's logits must be computed
        for tier in self.lower_tiers:
            tier.poll()
        keys = self.prefix_keys(request)
        hits = self.resident_prefix(keys)
        for tier in self.lower_tiers:
            if len(hits) == len(keys):
                break
            if tier.begin_load(request, keys[len(hits):]):
                return None  # the rest of its prefix is on its way from this tier
            hits = self.resident_prefix(keys)  # installing its load may have evicted or added blocks
        unreferenced = sum(1 for b in hits if self._ref_count[b] == 0)
        num_tokens = len(hits) * self.block_size
        parent = keys[len(hits) - 1].hash if hits else self._root(request)
        partial = self.partial_block(request, parent, num_tokens)
        if partial is None:
            return PrefixHit(hits, num_tokens, unreferenced)
        # the source counts as taken: it is referenced while the request's own block is allocated
        return PrefixHit(hits, num_tokens + partial[1], unreferenced + int(self._ref_count[partial[0]] == 0), partial)

    def partial_block(self, request: Request, parent: bytes, start: int) -> tuple[int, int] | None:
        """(block, rows): the resident block under `parent` whose first tokens continue the request's
        prompt from token `start` furthest (short of its last token, which is always computed); None
        when none shares a token."""
        limit = min(self.block_size, request.num_tokens - 1 - start)
        siblings = self._children.get(parent)
        if self.kv is None or limit <= 0 or not siblings:
            return None
        prompt = request.prompt_token_ids or []
        source = prompt if start + limit <= len(prompt) else request.all_token_ids  # no copy of a long prompt
        wanted = tuple(source[start:start + limit])
        i = bisect.bisect_left(siblings, (wanted,))
        best: tuple[int, int] | None = None
        for tokens, block in siblings[max(i - 1, 0):i + 1]:
            shared = common_prefix(tokens, wanted)
            if shared and (best is None or shared > best[1]):
                best = (block, shared)
        return best

    def take_prefix(self, request: Request, hit: PrefixHit) -> None:
        """Admit `request` after its cached prefix: reference the hit's blocks, drop its pins."""
        for block in hit.blocks:
            self._reference(block)
        self.unpin(request)
        request.block_table = list(hit.blocks)
        request.num_committed_blocks = len(hit.blocks)
        request.num_computed_tokens = len(hit.blocks) * self.block_size
        if hit.partial is not None and self.kv is not None:
            source, rows = hit.partial
            self._reference(source)  # kept from eviction while the request's block is allocated
            if self.can_allocate(1):  # else (an unchecked admission, no room) those rows are computed
                block = self.allocate(1)[0]
                self.kv.copy_rows(source, block, rows)
                request.block_table.append(block)
                request.num_computed_tokens += rows
            self.free([source])
        if request.num_preemptions == 0:  # counted once per request, at its admission
            self.queried_tokens += request.num_prompt_tokens - request.num_prefix_queried_tokens
            self.hit_tokens += request.num_computed_tokens - request.num_cached_tokens
            request.num_prefix_queried_tokens = request.num_prompt_tokens
            request.num_cached_tokens = request.num_computed_tokens

    def commit(self, request: Request) -> None:
        if not self.prefix_caching or request.num_dropped_tokens:  # compressed blocks stay the request's own
            return
        upto = min(request.num_computed_tokens // self.block_size, len(request.block_table))
        if upto <= request.num_committed_blocks:
            return
        keys = self.keys(request, upto * self.block_size)
        for i in range(request.num_committed_blocks, upto):
            key, block = keys[i], request.block_table[i]
            if block >= 0 and key.hash not in self._block_of and block not in self._key_of:
                self._register(block, key)
                _notify(self.commit_listeners, block, key)
            # else: another request computed the same block first; this copy stays private
        request.num_committed_blocks = upto

    def release(self, request: Request) -> None:
        self.commit(request)
        if self.prefix_caching and request.block_table:
            self._tick += 1
            for depth, block in enumerate(request.block_table):
                if block in self._key_of:
                    self.policy.on_access(block, depth, self._tick)
        super().release(request)
        request.num_committed_blocks = 0

    def replace_table(self, request: Request, table: list[int]) -> None:
        """As `BlockPool.replace_table`; the full blocks given up stay cached as the uncompressed prefix (noted
        as used now, as at a release)."""
        self.commit(request)
        if self.prefix_caching:
            self._tick += 1
            for depth, block in enumerate(request.block_table):
                if block in self._key_of:
                    self.policy.on_access(block, depth, self._tick)
        super().replace_table(request, table)

    # -- lower tiers ------------------------------------------------------------------
    def restore(self, key: BlockKey, data: torch.Tensor, request: Request | None) -> bool:
        """Install a block loaded from a lower tier, pinned for `request` (cached when None, or when the
        pool already holds `max_pinned` pins).

        False when it cannot be installed (no room, or a different block under its hash).
        """
        if request is not None and self._num_pinned >= self.max_pinned:
            request = None  # cached: it is still found at admission unless the pool needed the room
        block = self._block_of.get(key.hash)
        if block is not None:
            if self._key_of[block] != key:
                return False
            if request is not None:
                self._reference(block)
        else:
            if not self.can_allocate(1) or self.kv is None:
                return False
            block = self.allocate(1)[0]
            self.kv.write_block(block, data)
            self._register(block, key)
            self.num_restored += 1
            if request is None:
                self._tick += 1
                self.policy.on_access(block, 0, self._tick)
                self.free([block])  # unreferenced: cached
                return True
        self._tick += 1
        if request is not None:
            self.policy.on_access(block, len(request.pinned_blocks), self._tick)
            request.pinned_blocks.append(block)
            self._num_pinned += 1
        return True

    def hashed_blocks(self) -> Iterator[tuple[int, BlockKey]]:
        """Every block that holds a known prefix (cached or in use), for tiers that persist them."""
        return iter(list(self._key_of.items()))

    def hottest_blocks(self) -> list[tuple[int, BlockKey]]:
        """`hashed_blocks`, most worth keeping first: in use, then cached in the policy's `ranked` order
        (any order for a policy without one). A flush with a time budget writes them in this order."""
        used = [b for b in self._key_of if self._ref_count[b] > 0]
        cached = [b for b in self._key_of if self._ref_count[b] == 0]
        if isinstance(self.policy, RankingPolicy):
            used, cached = self.policy.ranked(used), self.policy.ranked(cached)
        return [(b, self._key_of[b]) for b in [*used, *cached]]

    def evict_all(self) -> int:
        """Evict every cached block (listeners see each); returns how many. For benchmarks and tests."""
        count = 0
        while len(self.policy):
            self._free.append(self._evict_one())
            count += 1
        return count

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats.update({
            "prefix_caching": self.prefix_caching,
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_queried_tokens": self.queried_tokens,
            "prompt_tokens_computed": self.queried_tokens - self.hit_tokens,  # the rest came from the cache
            "prefix_cache_hit_rate": round(self.hit_tokens / self.queried_tokens, 4) if self.queried_tokens else 0.0,
            "pool_evictions": self.num_evictions,
            "pool_restored_blocks": self.num_restored,
            "eviction_policy": getattr(self.policy, "name", type(self.policy).__name__),
        })
        return stats


TokenPool = PrefixCache  # the old name


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _notify(listeners: list[BlockListener], block: int, key: BlockKey) -> None:
    """Call every listener; one that fails is logged and never breaks the pool."""
    for listener in listeners:
        try:
            listener(block, key)
        except Exception:
            log.exception("a KV block listener failed")


def create(
    config: Any, *, num_blocks: int, block_size: int, model_key: bytes = b"", kv: KVCache | None = None
) -> PrefixCache:
    """The stage factory; the paged backend calls it once it knows the pool's size."""
    from tokenflow import registry

    policy = registry.load_policy(config.eviction_policy, config)
    return PrefixCache(
        num_blocks, block_size, policy=policy, prefix_caching=config.prefix_caching, model_key=model_key, kv=kv
    )
