"""Consistent hashing: adding a node moves about 1/(N+1) of the keys, and only onto the new node."""

from __future__ import annotations

import hashlib

import pytest

from tokenflow_redis.ring import HashRing, moved_fraction

KEYS = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(20_000)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_adding_a_node_moves_about_one_in_n_plus_one_keys(n: int) -> None:
    nodes = [f"10.0.0.{i}:6379/0" for i in range(n)]
    before, after = HashRing(nodes), HashRing([*nodes, "10.0.0.99:6379/0"])
    moved = moved_fraction(before, after, KEYS)
    assert moved == pytest.approx(1 / (n + 1), abs=0.04)
    for key in KEYS:  # nothing moves between the old nodes
        if before.node_for(key) != after.node_for(key):
            assert after.node_for(key) == "10.0.0.99:6379/0"


def test_virtual_nodes_keep_shares_even() -> None:
    ring = HashRing([f"node{i}" for i in range(4)])
    shares = {node: 0 for node in ring.nodes}
    for key in KEYS:
        shares[ring.node_for(key)] += 1
    assert all(abs(count / len(KEYS) - 0.25) < 0.05 for count in shares.values()), shares
    assert max(shares.values()) / min(shares.values()) > 1.0  # not a trivial round robin


def test_removing_a_node_restores_the_old_mapping() -> None:
    ring = HashRing(["a", "b", "c"])
    mapping = [ring.node_for(k) for k in KEYS[:2000]]
    ring.add("d")
    ring.remove("d")
    assert [ring.node_for(k) for k in KEYS[:2000]] == mapping


def test_bad_rings_are_refused() -> None:
    with pytest.raises(LookupError):
        HashRing().node_for(b"x")
    with pytest.raises(ValueError):
        HashRing(["a", "a"])
    with pytest.raises(ValueError):
        HashRing(["a"], vnodes=0)
