"""BlockPool: O(1) bookkeeping of KV block ids."""

from __future__ import annotations

import random

import pytest

from tokenflow.kv.block_pool import BlockPool, OutOfBlocks


def test_fresh_pool() -> None:
    pool = BlockPool(8, 16)
    assert (pool.num_blocks, pool.block_size, pool.num_free, pool.num_used) == (8, 16, 8, 0)
    assert pool.allocate(3) == [0, 1, 2]  # predictable order


def test_blocks_needed() -> None:
    pool = BlockPool(4, 16)
    assert [pool.blocks_needed(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        pool.blocks_needed(-1)


def test_allocate_free_invariants() -> None:
    pool = BlockPool(32, 4)
    rng = random.Random(0)
    held: list[list[int]] = []
    for _ in range(500):
        if held and rng.random() < 0.45:
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(0, 6)
            if pool.can_allocate(n):
                held.append(pool.allocate(n))
            else:
                with pytest.raises(OutOfBlocks):
                    pool.allocate(n)
        owned = [b for ids in held for b in ids]
        assert len(owned) == len(set(owned)), "a block was handed out twice"
        assert pool.num_used == len(owned)
        assert pool.num_free + pool.num_used == pool.num_blocks
        assert all(pool.ref_count(b) == 1 for b in owned)
    for ids in held:
        pool.free(ids)
    assert pool.num_free == 32 and pool.num_used == 0
    assert sorted(pool.allocate(32)) == list(range(32))


def test_out_of_blocks_is_all_or_nothing() -> None:
    pool = BlockPool(4, 8)
    pool.allocate(3)
    assert not pool.can_allocate(2)
    with pytest.raises(OutOfBlocks) as info:
        pool.allocate(2)
    assert (info.value.requested, info.value.free) == (2, 1)
    assert pool.num_free == 1
    assert pool.allocate(0) == []


def test_double_free_raises_and_leaves_pool_unchanged() -> None:
    pool = BlockPool(4, 8)
    a = pool.allocate(2)
    b = pool.allocate(1)
    pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free([b[0], b[0]])  # the same block twice in one call
    with pytest.raises(ValueError, match="double free"):
        pool.free([b[0], a[0]])  # a valid id next to a freed one: nothing is freed
    assert pool.ref_count(b[0]) == 1 and pool.num_used == 1
    with pytest.raises(ValueError, match="out of range"):
        pool.free([4])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        BlockPool(0, 16)
    with pytest.raises(ValueError):
        BlockPool(4, 0)
    with pytest.raises(ValueError):
        BlockPool(4, 16).allocate(-1)


def test_truncate_gives_up_the_tail_ids() -> None:
    pool = BlockPool(8, 16)
    held = pool.allocate(3)  # 0, 1, 2
    pool.truncate(5)
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (5, 2, 3)
    assert sorted(pool.allocate(2)) == [3, 4]  # never an id past the new end
    assert not pool.can_allocate(1)
    pool.free(held)
    with pytest.raises(ValueError, match="in use"):
        pool.truncate(4)  # block 4 is still referenced
    assert pool.num_blocks == 5  # a refused truncate changes nothing
    with pytest.raises(ValueError):
        pool.truncate(0)
