"""TokenPool under random request traffic, driven through the request-level API the batcher uses.

A rule-based state machine creates requests over a two-token alphabet (so prefixes are shared
often), admits them (`match_prefix` + allocation), runs their steps, commits, decodes, preempts,
finishes them, evicts everything, restores blocks from a "lower tier" and tries illegal frees.
Every block's K/V is a value derived from the key of the tokens it holds, so any block shared,
cached or restored under the wrong key shows up as wrong memory. After every step:
- used + free + cached == total, and the three sets are disjoint;
- every block's reference count is exactly the number of live references to it;
- no block handed out by `allocate` is held by a live request;
- every registered block holds the K/V of its key; hits are the longest resident prefix, and a
  partial hit copies the rows of the registered block under the same parent that shares the most tokens.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenflow.kv.block_hash import BlockKey, block_keys, prefix_root
from tokenflow.kv.block_pool import OutOfBlocks
from tokenflow.kv.eviction import LFULRUPolicy, LRUPolicy
from tokenflow.kv.kv_cache import KVCache
from tokenflow.kv.prefix_cache import TokenPool
from tokenflow.params import SamplingParams
from tokenflow.request import Request

PARTIAL = -1.0  # the K/V of a block that is not full (never registered)
# A few shared stems plus a random tail over two tokens: prefix hits, partial hits and misses are all common.
STEMS = ([], [0, 1, 0, 1], [0, 1, 1, 0], [1, 1, 1, 1, 0, 0])
PROMPTS = st.builds(lambda stem, tail: stem + tail or [0], st.sampled_from(STEMS),
                    st.lists(st.integers(0, 1), max_size=4))
SALTS = st.sampled_from([None, None, "t"])


def make_pool(policy, num_blocks: int, block_size: int) -> TokenPool:
    kv = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=block_size,
                 dtype=torch.float32, device="cpu")
    return TokenPool(num_blocks, block_size, policy=policy, kv=kv)


def key_value(key: BlockKey) -> float:
    """The K/V every slot of a block holding `key`'s tokens gets (exact in float32)."""
    return float(int.from_bytes(key.hash[:3], "little") + 1)


def key_data(key: BlockKey, block_size: int) -> torch.Tensor:
    return torch.full((1, 2, block_size, 1, 2), key_value(key))


def keys_of(request: Request, block_size: int) -> list[BlockKey]:
    """The request's block keys, computed independently of the pool."""
    return block_keys(request.all_token_ids, block_size, prefix_root(b"", request.params.cache_salt))


def block_value(pool: TokenPool, block: int) -> torch.Tensor:
    assert pool.kv is not None
    return pool.kv.read_block(block)


def make_request(tokens: list[int], salt: str | None = None) -> Request:
    return Request(SamplingParams(cache_salt=salt), prompt_token_ids=list(tokens))


class PoolMachine(RuleBasedStateMachine):
    policy_cls: type = LRUPolicy
    num_blocks = 8
    block_size = 2
    max_live = 4

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(self.policy_cls(), self.num_blocks, self.block_size)
        self.pool.evict_listeners.append(self._on_evict)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.tried: list[Request] = []  # every request that went through match_prefix (for the hit stats)
        self.evicted: list[tuple[int, BlockKey]] = []
        self.bad_evictions: list[str] = []

    # -- helpers ------------------------------------------------------------------------
    @property
    def live(self) -> list[Request]:
        return self.waiting + self.running

    def held(self) -> Counter[int]:
        refs: Counter[int] = Counter()
        for r in self.live:
            refs.update(r.block_table)
            refs.update(r.pinned_blocks)
        return refs

    def snapshot(self) -> tuple:
        pool = self.pool
        return (list(pool._free), list(pool._ref_count), set(pool.policy._candidates), dict(pool._key_of),
                dict(pool._block_of), pool.num_evictions)

    def _on_evict(self, block: int, key: BlockKey) -> None:
        """The disk tier's hook: called before the block is reused, so it still holds `key`'s K/V.
        (The pool logs and swallows a listener's exceptions: problems are recorded, checked by `registry`.)"""
        if self.pool.ref_count(block) or block in self.held():
            self.bad_evictions.append(f"block {block} evicted while referenced")
        if block in self.pool._key_of or key.hash in self.pool._block_of:
            self.bad_evictions.append(f"block {block} evicted but still registered")
        if not torch.equal(block_value(self.pool, block), key_data(key, self.block_size)):
            self.bad_evictions.append(f"block {block} evicted without its K/V")
        self.evicted.append((block, key))

    def allocate(self, n: int) -> list[int]:
        pool = self.pool
        held = set(self.held())
        free_before, cached_before = set(pool._free), set(pool.policy._candidates)
        evictions = pool.num_evictions
        assert pool.can_allocate(n) == (n <= len(free_before) + len(cached_before))
        if not pool.can_allocate(n):
            before = self.snapshot()
            with pytest.raises(OutOfBlocks):
                pool.allocate(n)
            assert self.snapshot() == before
            return []
        ids = pool.allocate(n)
        assert len(ids) == n == len(set(ids))
        assert not set(ids) & held, f"allocate handed out held blocks {set(ids) & held}"
        assert set(ids) <= free_before | cached_before
        if n <= len(free_before):
            assert set(ids) <= free_before and pool.num_evictions == evictions  # free blocks first
        else:
            assert free_before <= set(ids) and pool.num_evictions == evictions + n - len(free_before)
        for b in ids:
            assert pool.ref_count(b) == 1 and b not in pool._key_of
        return ids

    def compute(self, request: Request) -> None:
        """The model's step: K/V for tokens [num_computed_tokens, num_tokens) into private blocks."""
        bs = self.block_size
        keys = keys_of(request, bs)
        for i in range(request.num_computed_tokens // bs, len(request.block_table)):
            b = request.block_table[i]
            assert self.pool.ref_count(b) == 1, f"writing into shared block {b}"
            assert b not in self.pool._key_of, f"writing into registered block {b}"
            assert self.pool.kv is not None
            data = key_data(keys[i], bs) if i < len(keys) else torch.full((1, 2, bs, 1, 2), PARTIAL)
            self.pool.kv.write_block(b, data)
        request.num_computed_tokens = request.num_tokens

    def _release(self, request: Request) -> None:
        self.pool.release(request)
        assert request.block_table == [] and request.pinned_blocks == []
        assert request.num_committed_blocks == 0

    # -- rules ---------------------------------------------------------------------------
    @precondition(lambda self: len(self.live) < self.max_live)
    @rule(tokens=PROMPTS, salt=SALTS, then=st.sampled_from(["wait", "admit", "run", "run"]))
    def new_request(self, tokens: list[int], salt: str | None, then: str) -> None:
        """A request arrives; most go straight to admission (and their first step), as when there is room."""
        req = make_request(tokens, salt)
        self.waiting.append(req)
        if then != "wait":
            self._admit(req, run=then == "run")

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), run=st.booleans())
    def admit(self, data: st.DataObject, run: bool) -> None:
        self._admit(data.draw(st.sampled_from(self.waiting)), run)

    def _admit(self, req: Request, run: bool) -> None:
        pool, bs = self.pool, self.block_size
        pinned = list(req.pinned_blocks)
        assert pool.match_prefix(req) is True
        if req not in self.tried:
            self.tried.append(req)
        hits, keys = req.block_table[:req.num_committed_blocks], keys_of(req, bs)
        cap = (req.num_tokens - 1) // bs
        assert len(hits) <= cap
        rows = req.num_computed_tokens - len(hits) * bs  # copied from a partially matching block
        assert 0 <= rows <= min(bs, req.num_tokens - 1 - len(hits) * bs)
        assert len(req.block_table) == len(hits) + (rows > 0)
        if req.num_preemptions == 0:  # the hit is counted at the latest try before the first preemption
            assert req.num_cached_tokens == req.num_computed_tokens
        assert req.pinned_blocks == []
        self._check_partial(req, hits, rows)
        for i, b in enumerate(hits):
            assert pool._key_of[b] == keys[i]
            assert torch.equal(block_value(pool, b), key_data(keys[i], bs))
        if len(hits) < cap:  # the longest resident prefix: the next key is not resident
            nxt = keys[len(hits)]
            b = pool._block_of.get(nxt.hash)
            assert b is None or pool._key_of[b] != nxt
        for b in pinned:  # the pins were handed over (as hits) or let go
            assert b in hits or pool.ref_count(b) == self.held()[b]
        assert pool.blocks_needed(req.num_tokens) > len(hits)  # the last prompt token is always computed
        needed = pool.blocks_needed(req.num_tokens) - len(req.block_table)
        if pool.can_allocate(needed):
            req.block_table.extend(self.allocate(needed))
            self.waiting.remove(req)
            self.running.append(req)
            if run:
                self.compute(req)
        else:
            assert self.allocate(needed) == []  # raises OutOfBlocks and changes nothing
            self._release(req)  # hand the shared prefix back until it fits
            req.num_computed_tokens = 0

    def _check_partial(self, req: Request, hits: list[int], rows: int) -> None:
        """The partial hit's block is the request's own and holds the copied rows of a registered block
        under the same parent that shares `rows` tokens; no registered block there shares more. (Admitted
        with no block to spare, as `match_prefix` may be, the request computes those rows instead.)"""
        pool, bs = self.pool, self.block_size
        start = len(hits) * bs
        parent = keys_of(req, bs)[len(hits) - 1].hash if hits else prefix_root(b"", req.params.cache_salt)
        wanted = req.all_token_ids[start:min(start + bs, req.num_tokens - 1)]
        siblings = [k for k in pool._key_of.values() if k.parent == parent]
        shared = [next((i for i, (a, b) in enumerate(zip(k.tokens, wanted, strict=False)) if a != b),
                       min(len(k.tokens), len(wanted))) for k in siblings]
        no_room = pool.num_free == 0 and pool.num_cached <= 1  # at most the partial source, back in the cache
        assert rows == max(shared, default=0) or (rows == 0 and no_room)
        if rows:
            block = req.block_table[-1]
            assert pool.ref_count(block) == 1 and block not in pool._key_of
            values = block_value(pool, block)[:, :, :rows]
            assert any(torch.equal(values, torch.full_like(values, key_value(k)))
                       for k, n in zip(siblings, shared, strict=True) if n == rows)

    @precondition(lambda self: any(r.num_computed_tokens < r.num_tokens for r in self.running))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from([r for r in self.running if r.num_computed_tokens < r.num_tokens]))
        self.compute(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.running))
        pool, bs = self.pool, self.block_size
        committed = req.num_committed_blocks
        self.pool.commit(req)
        upto = req.num_computed_tokens // bs
        assert req.num_committed_blocks == upto
        keys = keys_of(req, bs)
        for i in range(upto):
            b = req.block_table[i]
            owner = pool._block_of.get(keys[i].hash)
            # The first copy is registered and shared, later ones stay private (even once the first is evicted).
            assert owner == b or b not in pool._key_of
            if owner is not None:
                assert pool._key_of[owner] == keys[i]
        for i in range(committed, upto):
            assert keys[i].hash in pool._block_of  # just committed: findable by its key (this copy or another)

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.running))
    @rule(data=st.data(), token=st.integers(0, 1))
    def decode(self, data: st.DataObject, token: int) -> None:
        req = data.draw(st.sampled_from([r for r in self.running if r.num_computed_tokens == r.num_tokens]))
        req.output_token_ids.append(token)
        needed = self.pool.blocks_needed(req.num_tokens) - len(req.block_table)
        assert needed in (0, 1)
        if self.pool.can_allocate(needed):
            req.block_table.extend(self.allocate(needed))
        else:
            assert self.allocate(needed) == []
            self._preempt(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self._preempt(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.live))
        (self.running if req in self.running else self.waiting).remove(req)
        self._release(req)

    @precondition(lambda self: self.live)
    @rule()
    def release_all(self) -> None:
        for req in self.live:
            self._release(req)
        self.waiting, self.running = [], []
        pool = self.pool
        assert pool.num_used == 0
        assert all(pool.ref_count(b) == 0 for b in range(self.num_blocks))
        assert pool.num_free + pool.num_cached == self.num_blocks

    @precondition(lambda self: self.pool.num_cached)
    @rule()
    def evict_all(self) -> None:
        pool = self.pool
        cached = set(pool.policy._candidates)
        before = len(self.evicted)
        assert pool.evict_all() == len(cached)
        assert {b for b, _ in self.evicted[before:]} == cached
        assert pool.num_cached == 0
        assert all(pool.ref_count(b) > 0 for b in pool._key_of)  # only blocks in use keep their keys

    @rule(data=st.data(), tokens=PROMPTS, to_request=st.booleans())
    def restore(self, data: st.DataObject, tokens: list[int], to_request: bool) -> None:
        """A lower tier hands a block back: pinned for a waiting request (one of its own keys) or cached."""
        pool, bs = self.pool, self.block_size
        target = None
        if to_request and any(keys_of(r, bs) for r in self.waiting):
            target = data.draw(st.sampled_from([r for r in self.waiting if keys_of(r, bs)]))
            keys = keys_of(target, bs)
        else:
            keys = block_keys(tokens, bs, prefix_root(b"", None))
            if not keys:
                return
        key = data.draw(st.sampled_from(keys))
        resident = pool._block_of.get(key.hash)
        fits = pool.can_allocate(1)
        pins = list(target.pinned_blocks) if target is not None else []
        refs = pool.ref_count(resident) if resident is not None else 0
        if pool.num_pinned >= pool.max_pinned:  # the pins are at their bound: it comes back cached
            target = None
            pins = []
        ok = pool.restore(key, key_data(key, bs), target)
        assert ok is (resident is not None or fits)
        if not ok:
            return
        block = pool._block_of[key.hash]
        assert pool._key_of[block] == key
        assert torch.equal(block_value(pool, block), key_data(key, bs))
        if resident is not None:
            assert block == resident
            assert pool.ref_count(block) == refs + (target is not None)
        if target is not None:
            assert target.pinned_blocks == [*pins, block]
        elif resident is None:
            assert pool.ref_count(block) == 0 and block in pool.policy._candidates

    @rule(data=st.data())
    def illegal_free(self, data: st.DataObject) -> None:
        """Freeing an unreferenced block, or a block more often than it is referenced, raises and changes nothing."""
        pool = self.pool
        held = self.held()
        idle = [b for b in range(self.num_blocks) if pool.ref_count(b) == 0]
        batches = [[b] for b in idle]
        batches += [[b] * (n + 1) for b, n in held.items()]
        batches += [[h, b] for h in held for b in idle]  # a valid id next to a bad one: nothing freed
        batch = data.draw(st.sampled_from(batches))
        before = self.snapshot()
        with pytest.raises(ValueError, match="double free"):
            pool.free(batch)
        assert self.snapshot() == before

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def accounting(self) -> None:
        pool, n = self.pool, self.num_blocks
        held = self.held()
        for b in range(n):
            assert pool.ref_count(b) == held[b], f"block {b}: {pool.ref_count(b)} refs, {held[b]} held"
        free, cached = pool._free, set(pool.policy._candidates)
        used = {b for b in range(n) if held[b]}
        assert len(set(free)) == len(free), f"free list has duplicates: {free}"
        assert not (set(free) & cached) and not (set(free) & used) and not (cached & used)
        assert set(free) | cached | used == set(range(n))
        assert (pool.num_free, pool.num_cached, pool.num_used) == (len(free), len(cached), len(used))
        assert pool.num_used + pool.num_free + pool.num_cached == pool.num_blocks
        assert len(pool.policy._heap) <= 2 * n + 64

    @invariant()
    def registry(self) -> None:
        pool = self.pool
        assert self.bad_evictions == []
        assert len(pool._block_of) == len(pool._key_of)
        for b, key in pool._key_of.items():
            assert pool._block_of[key.hash] == b
            assert torch.equal(block_value(pool, b), key_data(key, self.block_size)), f"block {b} lost its K/V"
        assert set(pool.policy._candidates) == {b for b in pool._key_of if pool.ref_count(b) == 0}
        assert not set(pool._free) & set(pool._key_of)

    @invariant()
    def requests(self) -> None:
        pool = self.pool
        assert pool.num_pinned == sum(len(r.pinned_blocks) for r in self.waiting) <= pool.max_pinned
        for r in self.waiting:
            assert r.block_table == []
        for r in self.running:
            assert len(r.block_table) == self.pool.blocks_needed(r.num_tokens)
            assert not r.pinned_blocks
            keys = keys_of(r, self.block_size)
            for i in range(r.num_computed_tokens // self.block_size):  # nothing overwrote a held, computed block
                assert torch.equal(block_value(self.pool, r.block_table[i]), key_data(keys[i], self.block_size))
        assert self.pool.queried_tokens == sum(r.num_prompt_tokens for r in self.tried)
        assert self.pool.hit_tokens == sum(r.num_cached_tokens for r in self.tried)


def _machine(policy_cls: type, num_blocks: int, block_size: int) -> type[PoolMachine]:
    return type(f"Pool_{policy_cls.__name__}_{block_size}", (PoolMachine,), {
        "policy_cls": policy_cls, "num_blocks": num_blocks, "block_size": block_size,
    })


_SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestPoolLRU2 = _machine(LRUPolicy, 12, 2).TestCase
TestPoolLRU2.settings = _SETTINGS
TestPoolLFU2 = _machine(LFULRUPolicy, 8, 2).TestCase
TestPoolLFU2.settings = _SETTINGS
TestPoolLFU4 = _machine(LFULRUPolicy, 8, 4).TestCase
TestPoolLFU4.settings = _SETTINGS


# -- targeted examples ------------------------------------------------------------------------
def admit_and_run(pool: TokenPool, req: Request) -> list[int]:
    """What the batcher and the model do for one admitted request; returns the blocks it got."""
    assert pool.match_prefix(req)
    hits = list(req.block_table)
    new = pool.allocate(pool.blocks_needed(req.num_tokens) - len(hits))
    req.block_table.extend(new)
    keys = keys_of(req, pool.block_size)
    assert pool.kv is not None
    for i in range(len(hits), len(req.block_table)):
        fill = key_data(keys[i], pool.block_size) if i < len(keys) else torch.zeros(1, 2, pool.block_size, 1, 2)
        pool.kv.write_block(req.block_table[i], fill)
    req.num_computed_tokens = req.num_tokens
    pool.commit(req)
    return new


@pytest.mark.parametrize("policy_cls", [LRUPolicy, LFULRUPolicy])
def test_prefix_hit_shares_the_committed_blocks(policy_cls: type) -> None:
    pool = make_pool(policy_cls(), 8, 4)
    prompt = list(range(100, 112))  # exactly 3 full blocks
    first = make_request(prompt)
    assert admit_and_run(pool, first) == [0, 1, 2]
    assert first.num_cached_tokens == 0 and first.num_committed_blocks == 3
    second = make_request(prompt)
    assert pool.match_prefix(second) is True
    # The last prompt token is always computed: (12 - 1) // 4 = 2 full blocks come from the cache, and
    # the first 3 rows of the third from block 2, copied into the request's own block 3.
    assert second.block_table == [0, 1, 3]
    assert second.num_computed_tokens == second.num_cached_tokens == 11
    assert [pool.ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert torch.equal(block_value(pool, 3)[:, :, :3], block_value(pool, 2)[:, :, :3])
    assert not block_value(pool, 3)[:, :, 3:].any()  # the last row is the request's to compute
    second.num_computed_tokens = 12
    pool.commit(second)
    assert pool._block_of[keys_of(second, 4)[2].hash] == 2 and 3 not in pool._key_of  # block 3 stays private
    stats = pool.stats()
    assert (stats["prefix_cache_hit_tokens"], stats["prefix_cache_queried_tokens"]) == (11, 24)
    # One token more: all three blocks are a hit.
    third = make_request([*prompt, 7])
    assert pool.match_prefix(third) and third.block_table == [0, 1, 2] and third.num_computed_tokens == 12
    # Another tenant (cache_salt) shares nothing.
    other = make_request(prompt, salt="tenant-b")
    assert pool.match_prefix(other) and other.block_table == [] and other.num_computed_tokens == 0
    for r in (first, second, third, other):
        pool.release(r)
    assert pool.num_used == 0
    assert (pool.num_cached, pool.num_free) == (3, 5)  # 0, 1, 2 cached; the private copy 3 is free
    assert 3 in pool._free


@pytest.mark.parametrize("policy_cls", [LRUPolicy, LFULRUPolicy])
def test_cached_prefix_survives_its_owner(policy_cls: type) -> None:
    """A finished request's blocks stay cached and serve the next one; evicting them ends the hits."""
    pool = make_pool(policy_cls(), 8, 4)
    prompt = list(range(9))  # 2 full blocks + 1 token
    first = make_request(prompt)
    admit_and_run(pool, first)
    pool.release(first)
    assert (pool.num_used, pool.num_cached, pool.num_free) == (0, 2, 6)
    again = make_request(prompt)
    assert pool.match_prefix(again) and again.block_table == [0, 1]
    assert pool.num_cached == 0 and pool.num_used == 2
    pool.release(again)
    assert pool.evict_all() == 2
    late = make_request(prompt)
    assert pool.match_prefix(late) and late.block_table == []


def test_hash_collision_is_never_reused() -> None:
    """A block found under the request's hash but holding other tokens (or another parent) is not a hit."""
    pool = make_pool(LRUPolicy(), 8, 4)
    owner = make_request([1, 2, 3, 4, 5])
    admit_and_run(pool, owner)
    pool.release(owner)
    (stored,) = [k for b, k in pool._key_of.items() if b == 0]
    victim = make_request([9, 9, 9, 9, 9])
    victim_key = keys_of(victim, 4)[0]
    assert victim_key.hash != stored.hash
    # Forge a collision: the victim's hash points at block 0, which holds [1, 2, 3, 4].
    pool._block_of[victim_key.hash] = 0
    assert pool.match_prefix(victim) is True
    assert victim.block_table == [] and victim.num_computed_tokens == 0
    assert pool.ref_count(0) == 0 and 0 in pool.policy._candidates  # untouched, still cached
    del pool._block_of[victim_key.hash]


@pytest.mark.parametrize("field", ["tokens", "parent"])
def test_restored_colliding_block_is_never_reused(field: str) -> None:
    """A lower tier returns a block under the request's hash whose tokens (or parent) differ: the pool keeps it
    apart, and the request recomputes; restoring the genuine block under the taken hash is refused."""
    pool = make_pool(LFULRUPolicy(), 8, 4)
    req = make_request([5, 6, 7, 8, 1])
    real = keys_of(req, 4)[0]
    if field == "tokens":
        fake = BlockKey(real.hash, real.parent, (5, 6, 7, 9))
    else:
        fake = BlockKey(real.hash, b"\x00" * 16, real.tokens)
    assert pool.restore(fake, key_data(fake, 4), None) is True
    (block,) = pool._key_of
    assert pool._key_of[block] == fake
    assert pool.match_prefix(req) is True
    if field == "tokens":  # a block for (5, 6, 7, 9) after the same root: its first 3 rows are a partial hit
        assert req.block_table == [1] and req.num_computed_tokens == 3
        assert torch.equal(block_value(pool, 1)[:, :, :3], block_value(pool, block)[:, :, :3])
    else:
        assert req.block_table == [] and req.num_computed_tokens == 0
    assert pool.restore(real, key_data(real, 4), None) is False  # another block holds the hash
    waiting = make_request([5, 6, 7, 8, 1])
    assert pool.restore(real, key_data(real, 4), waiting) is False
    assert waiting.pinned_blocks == [] and pool.ref_count(block) == 0
    pool.release(req)
    assert pool.num_used == 0


def test_restores_for_queued_requests_pin_at_most_half_the_pool() -> None:
    """Past `max_pinned` pins a restored block comes back cached: evictable, still found at admission."""
    pool = make_pool(LRUPolicy(), 8, 2)
    first, second = make_request(list(range(1, 10))), make_request(list(range(20, 29)))
    for req in (first, second):
        for key in keys_of(req, 2):
            assert pool.restore(key, key_data(key, 2), req)
    assert pool.max_pinned == 4 and pool.num_pinned == 4 and first.pinned_blocks == [0, 1, 2, 3]
    assert second.pinned_blocks == [] and pool.num_cached == 4  # second's blocks: cached, not held
    assert pool.can_allocate(4)
    pool.release(first)
    assert pool.num_pinned == 0 and pool.num_used == 0 and pool.num_cached == 8


def test_restore_pins_for_a_request_until_admission() -> None:
    """Restored blocks are held for their request (never evicted meanwhile) and become its prefix hits."""
    pool = make_pool(LRUPolicy(), 4, 2)
    req = make_request([1, 2, 3, 4, 5])
    keys = keys_of(req, 2)
    assert pool.restore(keys[0], key_data(keys[0], 2), req)
    assert pool.restore(keys[1], key_data(keys[1], 2), req)
    assert req.pinned_blocks == [0, 1] and pool.num_used == 2 and pool.num_restored == 2
    assert not pool.can_allocate(3)  # pinned blocks are not evictable
    assert pool.allocate(2) == [2, 3]
    pool.free([2, 3])
    assert pool.match_prefix(req)
    assert req.block_table == [0, 1] and req.pinned_blocks == [] and req.num_computed_tokens == 4
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    pool.release(req)
    assert pool.num_used == 0 and pool.num_cached == 2
