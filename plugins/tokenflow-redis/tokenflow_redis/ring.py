"""Consistent hashing: which Redis node holds a key.

Each node is placed on a 64-bit ring at `vnodes` pseudo-random points (hashes
of `"node#i"`); a key belongs to the first point clockwise from its own hash.
Adding an (N+1)-th node takes over only the arcs in front of its points, so
about 1/(N+1) of the keys move and none move between the old nodes; many
virtual nodes per node keep the shares even. `bench_ring` measures both.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Sequence

__all__ = ("HashRing", "moved_fraction")


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, nodes: Iterable[str] = (), vnodes: int = 160) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be at least 1")
        self.vnodes = vnodes
        self.nodes: list[str] = []
        self._points: list[int] = []
        self._owners: list[str] = []
        for node in nodes:
            self.add(node)

    def add(self, node: str) -> None:
        if node in self.nodes:
            raise ValueError(f"node {node!r} is already on the ring")
        self.nodes.append(node)
        for i in range(self.vnodes):
            point = _point(f"{node}#{i}".encode())
            at = bisect.bisect(self._points, point)
            self._points.insert(at, point)
            self._owners.insert(at, node)

    def remove(self, node: str) -> None:
        self.nodes.remove(node)
        kept = [(p, o) for p, o in zip(self._points, self._owners) if o != node]
        self._points = [p for p, _ in kept]
        self._owners = [o for _, o in kept]

    def node_for(self, key: bytes | str) -> str:
        if not self._points:
            raise LookupError("the ring has no nodes")
        data = key.encode() if isinstance(key, str) else key
        at = bisect.bisect(self._points, _point(data)) % len(self._points)
        return self._owners[at]

    def __len__(self) -> int:
        return len(self.nodes)


def moved_fraction(before: HashRing, after: HashRing, keys: Sequence[bytes]) -> float:
    """The share of `keys` whose node differs between two rings."""
    return sum(before.node_for(k) != after.node_for(k) for k in keys) / len(keys)
