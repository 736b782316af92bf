"""Eviction policies of the token pool: the order in which cached blocks are given up."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from tokenflow.kv.eviction import EvictionPolicy, LFULRUPolicy, LRUPolicy, create_lfu_lru, create_lru

POLICIES = [LRUPolicy, LFULRUPolicy]


def make_evictable(policy: EvictionPolicy, block: int, depth: int, tick: int, uses: int = 1) -> None:
    """What the pool does for a block a request used `uses` times and then let go of."""
    for _ in range(uses):
        policy.on_access(block, depth, tick)
    policy.on_evictable(block)


def drain(policy: EvictionPolicy) -> list[int]:
    order = []
    while len(policy):
        order.append(policy.evict())
    return order


@pytest.mark.parametrize("cls", POLICIES)
def test_protocol_and_empty_evict(cls: type) -> None:
    """Both built-ins satisfy the protocol; `evict()` on no candidates raises LookupError."""
    policy = cls()
    assert isinstance(policy, EvictionPolicy)
    assert len(policy) == 0
    with pytest.raises(LookupError):
        policy.evict()
    make_evictable(policy, 7, 0, 1)
    assert policy.evict() == 7
    with pytest.raises(LookupError):
        policy.evict()


def test_lru_evicts_least_recently_used_first() -> None:
    """Ticks decide, not insertion order nor block id."""
    policy = LRUPolicy()
    for block, tick in ((5, 30), (1, 10), (9, 40), (3, 20)):
        make_evictable(policy, block, 0, tick)
    assert len(policy) == 4
    assert drain(policy) == [1, 3, 5, 9]


@pytest.mark.parametrize("cls", POLICIES)
def test_same_tick_tail_before_head(cls: type) -> None:
    """Blocks one request touched share a tick: the chain's tail (deepest) goes first, its head last."""
    policy = cls()
    chain = [20, 21, 22, 23]  # depth 0..3
    for depth, block in enumerate(chain):
        make_evictable(policy, block, depth, tick=5)
    make_evictable(policy, 99, 0, tick=6)  # a newer, shallow block: after the whole older chain
    assert drain(policy) == [23, 22, 21, 20, 99]


@pytest.mark.parametrize("cls", POLICIES)
def test_referenced_candidate_is_never_evicted(cls: type) -> None:
    """`on_referenced` withdraws a candidate: its stale heap entry is skipped, never returned."""
    policy = cls()
    for block, tick in ((1, 1), (2, 2), (3, 3)):
        make_evictable(policy, block, 0, tick)
    policy.on_referenced(1)  # the oldest: would have been first
    policy.on_referenced(1)  # twice is harmless
    assert len(policy) == 2
    assert policy.evict() == 2
    assert policy.evict() == 3
    assert len(policy) == 0
    with pytest.raises(LookupError):
        policy.evict()  # block 1's stale entry is still in the heap but must not come back


@pytest.mark.parametrize("cls", POLICIES)
def test_candidate_again_after_reference_is_evicted_once(cls: type) -> None:
    """Evictable -> referenced -> evictable leaves two heap entries; the block is still returned only once."""
    policy = cls()
    make_evictable(policy, 4, 0, 1)
    policy.on_referenced(4)
    make_evictable(policy, 4, 0, 2)
    policy.on_evictable(4)  # a repeated on_evictable is a no-op
    assert len(policy) == 1
    assert policy.evict() == 4
    with pytest.raises(LookupError):
        policy.evict()


def test_lru_reaccess_moves_block_to_the_back() -> None:
    """A block used again (new tick) after being referenced is evicted after blocks used in between."""
    policy = LRUPolicy()
    make_evictable(policy, 1, 0, 1)
    make_evictable(policy, 2, 0, 2)
    policy.on_referenced(1)
    make_evictable(policy, 1, 0, 3)
    assert drain(policy) == [2, 1]


def test_lfu_lru_keeps_frequent_block_over_once_used() -> None:
    """A block used 3 times outlives newer blocks used once; LRU would have evicted it first."""
    lfu, lru = LFULRUPolicy(), LRUPolicy()
    for policy in (lfu, lru):
        for tick in (1, 2, 3):
            policy.on_access(10, 0, tick)
        policy.on_evictable(10)
        make_evictable(policy, 11, 0, 4)
        make_evictable(policy, 12, 0, 5)
    assert drain(lru) == [10, 11, 12]
    assert drain(lfu) == [11, 12, 10]


def test_lfu_lru_ties_go_to_recency() -> None:
    """Equal use counts: the least recently used goes first."""
    policy = LFULRUPolicy()
    make_evictable(policy, 1, 0, 8, uses=2)
    make_evictable(policy, 2, 0, 3, uses=2)
    make_evictable(policy, 3, 0, 5, uses=2)
    assert drain(policy) == [2, 3, 1]


def test_lfu_lru_score_is_decayed_frequency() -> None:
    """score = H * log2(sum of 2^(tick / H)) over the uses: one use sorts at its tick, a doubling of
    the uses at one tick adds H, and a use H ticks older counts half."""
    policy = LFULRUPolicy(half_life=8.0)
    policy.on_access(1, 0, 5)
    assert policy._score[1] == 5.0
    policy.on_access(2, 0, 5)
    policy.on_access(2, 0, 5)
    assert policy._score[2] == pytest.approx(13.0)
    for _ in range(2):
        policy.on_access(2, 0, 5)
    assert policy._score[2] == pytest.approx(21.0)  # 4 uses = two doublings
    policy.on_access(3, 0, 2)
    policy.on_access(3, 0, 10)  # 8 ticks apart: the old use weighs half
    assert policy._score[3] == pytest.approx(10.0 + 8.0 * math.log2(1.5))


def test_lfu_lru_score_does_not_overflow() -> None:
    """Ticks far beyond 2^1024 half-lives: the running score stays finite and exact enough to order blocks."""
    policy = LFULRUPolicy(half_life=0.5)
    for tick in (10**6, 10**6 + 3, 10**6 + 3):
        policy.on_access(1, 0, tick)
    assert math.isfinite(policy._score[1])
    # Two uses at the last tick plus one 6 half-lives older: H * log2(2 + 2^-6) above the last tick.
    assert policy._score[1] == pytest.approx(10**6 + 3 + 0.5 * math.log2(2 + 2**-6), abs=1e-6)
    make_evictable(policy, 2, 0, 10**6 + 4)
    policy.on_evictable(1)
    assert drain(policy) == [1, 2]


def test_lfu_lru_aging_evicts_a_block_hot_long_ago() -> None:
    """A block used 4 times at tick 1 (half_life 4: two doublings = 8 ticks of extra life, score 9)
    outlives single-use newcomers while their tick is below 9, then leaves: its uses have decayed."""
    policy = LFULRUPolicy(half_life=4.0)
    make_evictable(policy, 100, 0, tick=1, uses=4)
    assert policy._score[100] == pytest.approx(9.0)
    victims = []
    for block, tick in enumerate((2, 4, 6, 8, 10, 12)):
        make_evictable(policy, block, 0, tick)
        victims.append(policy.evict())
    # Newcomers at ticks 2..8 rank below the hot block and leave; the one at tick 10 outranks it.
    assert victims == [0, 1, 2, 3, 100, 4]
    assert drain(policy) == [5]
    # Plain LRU would have evicted the hot block at once.
    lru = LRUPolicy()
    make_evictable(lru, 100, 0, tick=1, uses=4)
    make_evictable(lru, 0, 0, tick=2)
    assert lru.evict() == 100


def test_lfu_lru_reuse_after_a_pause_counts_both_uses() -> None:
    """A block referenced again after being a candidate keeps its history: one more use lifts it by the old
    use's decayed weight, so it outlives a block used once at the same tick."""
    policy = LFULRUPolicy(half_life=4.0)
    make_evictable(policy, 1, 0, tick=4)
    policy.on_referenced(1)
    make_evictable(policy, 1, 0, tick=8)  # uses at 4 and 8: 8 + 4 * log2(1.5)
    make_evictable(policy, 2, 0, tick=8)
    make_evictable(policy, 3, 0, tick=10)
    assert policy._score[1] == pytest.approx(8 + 4 * math.log2(1.5))
    assert drain(policy) == [2, 3, 1]


def test_lfu_lru_half_life_must_be_positive() -> None:
    with pytest.raises(ValueError):
        LFULRUPolicy(half_life=0.0)
    with pytest.raises(ValueError):
        LFULRUPolicy(half_life=-1.0)
    assert create_lfu_lru(SimpleNamespace(eviction_half_life=3.0)).half_life == 3.0
    assert create_lfu_lru(None).half_life == 64.0
    assert isinstance(create_lru(None), LRUPolicy)


@pytest.mark.parametrize("cls", POLICIES)
def test_heap_stays_bounded_under_churn(cls: type) -> None:
    """Lazy deletion never lets stale entries pile up: the heap stays O(candidates) over 20000 cycles."""
    policy = cls()
    rng = random.Random(1)
    stable = list(range(10))
    for b in stable:
        make_evictable(policy, b, 0, b)
    churn = list(range(100, 140))
    peak = 0
    for step in range(20_000):
        b = rng.choice(churn)
        if b not in policy._candidates:
            make_evictable(policy, b, rng.randrange(4), 100 + step)
            # a push rebuilds once stale entries outnumber live ones (with 64 of slack)
            assert len(policy._heap) <= 2 * len(policy) + 64
        else:
            policy.on_referenced(b)  # only marks the entry stale
        peak = max(peak, len(policy._heap))
    # 10000 pushes, yet never more than twice the 50 blocks that can be candidates (plus the slack)
    assert peak <= 2 * (len(stable) + len(churn)) + 65
    # Still correct after all the rebuilds: every live candidate comes out exactly once.
    live = set(policy._candidates)
    assert set(stable) <= live
    out = drain(policy)
    assert sorted(out) == sorted(live)
    with pytest.raises(LookupError):
        policy.evict()


@pytest.mark.parametrize("cls", POLICIES)
def test_evict_forgets_the_block(cls: type) -> None:
    """An evicted block carries no history into its next life: a fresh single use ranks as new."""
    policy = cls()
    make_evictable(policy, 1, 3, 1, uses=4)
    assert policy.evict() == 1
    assert 1 not in policy._tick and 1 not in policy._depth
    if isinstance(policy, LFULRUPolicy):
        assert 1 not in policy._score
    make_evictable(policy, 1, 0, 20)
    make_evictable(policy, 2, 0, 10)
    assert drain(policy) == [2, 1]
