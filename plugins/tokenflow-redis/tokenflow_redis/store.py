"""The shared store: KV blocks and responses on several Redis nodes.

Keys are spread over the nodes by consistent hashing (`ring.py`). Values are
binary and checked when read, never pickled, and carry a MAC keyed by the
deployment's shared secret (keyed BLAKE2b over header and payload), so a
client that can write to Redis but lacks the secret cannot plant a value
that any replica accepts:
- a KV block is tokenflow's block entry (`tokenflow.kv.tiers.disk_store.encode_block`:
  magic, JSON header with key, parent, tokens, dtype and shape, the MAC, then
  the raw tensor bytes), read back with every check;
- a response is tokenflow's frame (`encode_frame`: magic, JSON header with
  name and length, the MAC), then the response as msgspec JSON
  (`tokenflow.stages.response_tier`).
A value that fails a check (another secret included) is a miss, counted and
deleted. Every write sets a TTL; a block read refreshes it (`GETEX`), so hot
prefixes stay.

Each node has a breaker. A connection error or a reply slower than
`timeout_s` trips it: for `retry_s` its keys are misses and its writes are
dropped without touching the network (so a dead or stalled Redis costs the
engine nothing), then the next operation on it probes it again. Methods do
network I/O and run in worker threads, except `available`, which only reads
the breaker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import msgspec
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokenflow.plugin_api import (
    BlockKey,
    CorruptEntry,
    StoredResponse,
    decode_block,
    decode_frame,
    decode_response,
    encode_block,
    encode_frame,
    mac_key,
)
from tokenflow_redis.ring import HashRing

__all__ = ("NodeBreaker", "RedisStore")

log = logging.getLogger("tokenflow.redis")

FETCH_BATCH = 8  # blocks asked for per round trip while walking a prefix


class NodeBreaker:
    """Closed (use the node) or open until `retry_s` after its last failure; thread-safe."""

    def __init__(self, name: str, retry_s: float) -> None:
        self.name = name
        self.retry_s = retry_s
        self.open_until = 0.0
        self.trips = 0
        self.recoveries = 0
        self._lock = threading.Lock()

    def allows(self) -> bool:
        return time.monotonic() >= self.open_until

    @property
    def is_open(self) -> bool:
        return self.open_until > 0.0

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            if not self.is_open:
                self.trips += 1
                log.warning("redis tier: node %s unusable (%s); bypassed for %.1f s", self.name, exc, self.retry_s)
            self.open_until = time.monotonic() + self.retry_s

    def succeeded(self) -> None:
        if not self.is_open:
            return
        with self._lock:
            if self.is_open:
                self.open_until = 0.0
                self.recoveries += 1
                log.warning("redis tier: node %s is back", self.name)


def _node_name(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or 6379}/{parts.path.strip('/') or '0'}"


class RedisStore:
    """KV blocks and responses on `urls`; `secret` (shared by every replica) keys the values' MACs."""

    def __init__(
        self, urls: Sequence[str], *, secret: str | bytes, namespace: str = "tokenflow", block_ttl_s: float = 3600.0,
        response_ttl_s: float = 600.0, timeout_s: float = 0.5, retry_s: float = 5.0, vnodes: int = 160,
    ) -> None:
        if not urls:
            raise ValueError("the redis tier needs at least one Redis URL")
        self._key = mac_key(secret)
        self.namespace = namespace
        self.block_ttl_ms = max(1, int(block_ttl_s * 1000))
        self.response_ttl_ms = max(1, int(response_ttl_s * 1000))
        self.clients: dict[str, redis.Redis] = {}
        self.breakers: dict[str, NodeBreaker] = {}
        for url in urls:
            name = _node_name(url)
            self.clients[name] = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0), health_check_interval=0,
            )
            self.breakers[name] = NodeBreaker(name, retry_s)
        self.ring = HashRing(self.clients, vnodes)
        self.errors = 0
        self.bypassed = 0
        self.corrupt_entries = 0

    # -- routing and the breaker -----------------------------------------------------------
    def _block_name(self, key: BlockKey) -> str:
        return f"{self.namespace}:kv:{key.hash.hex()}"

    def _response_name(self, key: str) -> str:
        return f"{self.namespace}:resp:{key}"

    def available(self, ring_key: bytes | str) -> bool:
        """Whether the node holding `ring_key` may be used now (no I/O)."""
        return self.breakers[self.ring.node_for(ring_key)].allows()

    def _call(self, node: str, fn: Any, default: Any) -> Any:
        """Run `fn(client)` on `node` under its breaker: `default` when open or on a Redis error."""
        breaker = self.breakers[node]
        if not breaker.allows():
            self.bypassed += 1
            return default
        try:
            result = fn(self.clients[node])
        except redis.RedisError as exc:
            self.errors += 1
            breaker.failed(exc)
            return default
        breaker.succeeded()
        return result

    # -- KV blocks -----------------------------------------------------------------------------
    def put_block(self, key: BlockKey, data: torch.Tensor) -> bool:
        """Publish a block unless the store has it already (then only its TTL is refreshed)."""
        name = self._block_name(key)

        def put(client: redis.Redis) -> bool:
            if client.pexpire(name, self.block_ttl_ms):
                return False  # there already (another replica computed it)
            return bool(client.set(name, encode_block(key, data, secret=self._key), px=self.block_ttl_ms, nx=True))

        return self._call(self.ring.node_for(key.hash), put, False)

    def get_blocks(self, keys: Sequence[BlockKey], dtype: torch.dtype, shape: tuple[int, ...]) -> list[
        tuple[BlockKey, torch.Tensor]
    ]:
        """The blocks of `keys` in order, stopping at the first missing or bad one."""
        loaded: list[tuple[BlockKey, torch.Tensor]] = []
        for start in range(0, len(keys), FETCH_BATCH):
            batch = keys[start:start + FETCH_BATCH]
            raws = self._fetch_batch(batch)
            for key in batch:
                raw = raws.get(key.hash)
                if raw is None:
                    return loaded
                try:
                    loaded.append((key, decode_block(raw, key, dtype, shape, secret=self._key)))
                except CorruptEntry as exc:
                    self._drop(key.hash, self._block_name(key), exc)
                    return loaded
        return loaded

    def _fetch_batch(self, keys: Sequence[BlockKey]) -> dict[bytes, bytes]:
        """One pipelined round trip per node holding some of `keys`; missing keys are absent."""
        by_node: dict[str, list[BlockKey]] = {}
        for key in keys:
            by_node.setdefault(self.ring.node_for(key.hash), []).append(key)
        found: dict[bytes, bytes] = {}
        for node, node_keys in by_node.items():
            def fetch(client: redis.Redis, node_keys: list[BlockKey] = node_keys) -> list[Any]:
                pipe = client.pipeline(transaction=False)
                for key in node_keys:
                    pipe.getex(self._block_name(key), px=self.block_ttl_ms)
                return pipe.execute()

            values = self._call(node, fetch, [])
            found.update((k.hash, v) for k, v in zip(node_keys, values) if v is not None)
        return found

    def delete_block(self, key: BlockKey) -> None:
        """Delete a block found unusable after it decoded (e.g. non-finite values)."""
        name = self._block_name(key)
        self._call(self.ring.node_for(key.hash), lambda client: client.delete(name), None)

    def _drop(self, ring_key: bytes | str, name: str, exc: Exception) -> None:
        self.corrupt_entries += 1
        log.warning("redis tier: dropping %s: %s", name, exc)
        self._call(self.ring.node_for(ring_key), lambda client: client.delete(name), None)

    # -- responses ---------------------------------------------------------------------------
    def put_response(self, key: str, stored: StoredResponse) -> bool:
        name = self._response_name(key)
        value = encode_frame(name, msgspec.json.encode(stored), secret=self._key)
        return bool(self._call(self.ring.node_for(key), lambda c: c.set(name, value, px=self.response_ttl_ms), False))

    def get_response(self, key: str) -> StoredResponse | None:
        name = self._response_name(key)
        raw = self._call(self.ring.node_for(key), lambda client: client.get(name), None)
        if raw is None:
            return None
        try:
            stored = decode_response(decode_frame(raw, name, secret=self._key))
        except CorruptEntry as exc:
            stored, error = None, exc
        else:
            error = CorruptEntry("response does not decode")
        if stored is None:
            self._drop(key, name, error)
        return stored

    # -- upkeep ---------------------------------------------------------------------------
    def ping(self) -> dict[str, bool]:
        """Probe every node (at start, for the log)."""
        return {node: bool(self._call(node, lambda client: client.ping(), False)) for node in self.clients}

    def close(self) -> None:
        for client in self.clients.values():
            client.close()

    def stats(self) -> dict[str, Any]:
        breakers = self.breakers.values()
        return {
            "redis_nodes": len(self.clients),
            "redis_nodes_available": sum(b.allows() for b in breakers),
            "redis_breaker_trips": sum(b.trips for b in breakers),
            "redis_breaker_recoveries": sum(b.recoveries for b in breakers),
            "redis_errors": self.errors,
            "redis_bypassed_ops": self.bypassed,
            "redis_corrupt_entries": self.corrupt_entries,
        }
