"""The store on real Redis servers: checked binary values (MACs under the shared secret), TTLs,
sharding, and the per-node breaker."""

from __future__ import annotations

import hashlib
import pickle
import socket
import threading
import time

import redis
import torch

from tokenflow.kv.block_hash import block_keys, prefix_root
from tokenflow.kv.tiers.disk_store import encode_block, mac_key
from tokenflow.params import Chunk
from tokenflow.stages.response_tier import StoredResponse
from tokenflow_redis.store import RedisStore

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block size, KV heads, head dim
SECRET = "replicas-share-this"


def make_store(urls: list[str], **kw) -> RedisStore:
    return RedisStore(urls, secret=SECRET, **kw)


def make_blocks(n: int, seed: int = 0) -> tuple[list, list[torch.Tensor]]:
    keys = block_keys(list(range(seed, seed + 4 * n)), 4, prefix_root(b"model", None))
    generator = torch.Generator().manual_seed(seed)
    return keys, [torch.randn(SHAPE, generator=generator) for _ in keys]


def raw_client(store: RedisStore, ring_key: bytes | str) -> redis.Redis:
    return store.clients[store.ring.node_for(ring_key)]


def test_blocks_round_trip_exactly_spread_over_nodes_with_ttls(redis_urls) -> None:
    store = make_store(redis_urls, block_ttl_s=60)
    keys, blocks = make_blocks(24)
    assert all(store.put_block(k, b) for k, b in zip(keys, blocks))
    assert not store.put_block(keys[0], blocks[0])  # there already: only the TTL is refreshed
    loaded = store.get_blocks(keys, torch.float32, SHAPE)
    assert [k for k, _ in loaded] == keys
    assert all(torch.equal(a, b) for (_, a), b in zip(loaded, blocks))
    assert len({store.ring.node_for(k.hash) for k in keys}) == len(redis_urls)
    ttl = raw_client(store, keys[0].hash).pttl(f"tokenflow:kv:{keys[0].hash.hex()}")
    assert 50_000 < ttl <= 60_000


def test_a_prefix_stops_at_the_first_missing_block(redis_urls) -> None:
    store = make_store(redis_urls)
    keys, blocks = make_blocks(10)
    for i in (0, 1, 2, 4, 5):
        store.put_block(keys[i], blocks[i])
    assert [k for k, _ in store.get_blocks(keys, torch.float32, SHAPE)] == keys[:3]


def test_bad_values_are_misses_and_deleted(redis_urls) -> None:
    store = make_store(redis_urls)
    keys, blocks = make_blocks(4)
    for k, b in zip(keys, blocks):
        store.put_block(k, b)
    names = [f"tokenflow:kv:{k.hash.hex()}" for k in keys]
    raw_client(store, keys[1].hash).setrange(names[1], 200, b"\xff\xff")  # a flipped payload byte
    raw_client(store, keys[2].hash).set(names[2], pickle.dumps({"evil": True}))  # never unpickled
    raw_client(store, keys[3].hash).set(names[3], raw_client(store, keys[0].hash).get(names[0]))  # wrong key
    assert [k for k, _ in store.get_blocks(keys, torch.float32, SHAPE)] == keys[:1]
    assert store.get_blocks(keys[2:], torch.float32, SHAPE) == []
    assert store.get_blocks(keys[3:], torch.float32, SHAPE) == []
    assert store.corrupt_entries == 3
    assert [raw_client(store, k.hash).exists(n) for k, n in zip(keys[1:], names[1:])] == [0, 0, 0]
    assert store.get_blocks(keys[:1], torch.float16, SHAPE) == []  # a dtype the pool does not use


def test_values_written_without_the_secret_are_misses_and_deleted(redis_urls) -> None:
    """What a client of the same Redis without the secret can write: its own well-formed entries, or
    ours altered with an integrity field recomputed. No replica accepts either."""
    store = make_store(redis_urls)
    intruder = RedisStore(redis_urls, secret="a guess")
    keys, blocks = make_blocks(3)
    assert intruder.put_block(keys[0], blocks[0])
    assert store.put_block(keys[1], blocks[1])
    name = f"tokenflow:kv:{keys[1].hash.hex()}"
    client = raw_client(store, keys[1].hash)
    raw = bytearray(client.get(name))
    header_end = 9 + int.from_bytes(raw[5:9], "little")
    raw[-5] ^= 0xFF
    payload = bytes(raw[header_end + 32:])
    raw[header_end:header_end + 32] = hashlib.blake2b(bytes(raw[:header_end]) + payload, digest_size=32).digest()
    client.set(name, bytes(raw))
    assert store.get_blocks(keys[:1], torch.float32, SHAPE) == []
    assert store.get_blocks(keys[1:2], torch.float32, SHAPE) == []
    assert store.corrupt_entries == 2
    assert raw_client(store, keys[0].hash).exists(f"tokenflow:kv:{keys[0].hash.hex()}") == 0
    assert client.exists(name) == 0
    chunks = [Chunk(text="hi", token_ids=[5], finish_reason="stop")]
    assert intruder.put_response("abc", StoredResponse([1], chunks))
    assert store.get_response("abc") is None and store.corrupt_entries == 3
    # The entry format is tokenflow's own: a value encoded under the shared secret is accepted.
    raw_client(store, keys[2].hash).set(
        f"tokenflow:kv:{keys[2].hash.hex()}", encode_block(keys[2], blocks[2], secret=mac_key(SECRET))
    )
    assert [k for k, _ in store.get_blocks(keys[2:], torch.float32, SHAPE)] == keys[2:]


def test_responses_round_trip_and_damage_is_a_miss(redis_urls) -> None:
    store = make_store(redis_urls, response_ttl_s=30)
    chunks = [Chunk(text="hi", token_ids=[5]), Chunk(text="!", token_ids=[6], finish_reason="stop")]
    stored = StoredResponse([1, 2, 3], chunks)
    assert store.put_response("abc", stored)
    assert store.get_response("abc") == stored
    client, name = raw_client(store, "abc"), "tokenflow:resp:abc"
    assert 25_000 < client.pttl(name) <= 30_000
    client.setrange(name, len(client.get(name)) - 3, b"zzz")
    assert store.get_response("abc") is None and client.exists(name) == 0
    assert store.get_response("never-stored") is None


class Watchdog:
    """A hang guard for a stalled server: resumes it after `limit_s` (so a call that waited on it returns, and
    the test fails on what it returned and on `fired`, instead of hanging)."""

    def __init__(self, server, limit_s: float = 30.0) -> None:
        self.fired = False
        self._server = server
        self._timer = threading.Timer(limit_s, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.fired = True
        self._server.resume()

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


def _accepted(listener: socket.socket) -> int:
    """How many connections reached `listener` (the kernel completes them without accept())."""
    listener.setblocking(False)
    count = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


def test_a_dead_node_is_bypassed_then_used_again(own_redis) -> None:
    """A node that refused a connection is bypassed: while its breaker is open, operations on it are misses and
    dropped writes without any network I/O (a listener on its port sees no connection), then it is used again."""
    store = make_store([own_redis.url], timeout_s=0.2, retry_s=0.5)
    keys, blocks = make_blocks(3)
    assert store.put_block(keys[0], blocks[0])
    own_redis.stop()
    assert store.get_blocks(keys, torch.float32, SHAPE) == []  # connection refused: trips
    assert store.stats()["redis_breaker_trips"] == 1 and not store.available(keys[0].hash)
    before = store.stats()
    # Something listens on the port again: a store that did try the network now reaches it.
    with socket.create_server(("127.0.0.1", own_redis.port)) as listener:
        for _ in range(100):
            assert not store.put_block(keys[1], blocks[1])
        assert _accepted(listener) == 0  # bypassed: no network at all
    after = store.stats()
    assert after["redis_bypassed_ops"] - before["redis_bypassed_ops"] == 100
    assert after["redis_errors"] == before["redis_errors"] and after["redis_breaker_trips"] == 1
    own_redis.start()
    time.sleep(0.6)
    assert store.available(keys[0].hash)
    assert store.put_block(keys[0], blocks[0])  # the restarted server is empty
    assert [k for k, _ in store.get_blocks(keys[:1], torch.float32, SHAPE)] == keys[:1]
    assert store.stats()["redis_breaker_recoveries"] == 1


def test_a_stalled_node_trips_within_the_timeout(own_redis, caplog) -> None:
    """A node that stops answering: the read gives up on its own timeout (a miss, the breaker trips) while the
    node is still stalled, and the next operation on it is bypassed instead of waiting again."""
    caplog.set_level("WARNING", logger="tokenflow.redis")
    store = make_store([own_redis.url], timeout_s=0.2, retry_s=0.5)
    keys, blocks = make_blocks(2)
    store.put_block(keys[0], blocks[0])
    own_redis.pause()
    with Watchdog(own_redis) as watchdog:
        assert store.get_blocks(keys, torch.float32, SHAPE) == []
        stats = store.stats()
        assert not store.put_block(keys[1], blocks[1])  # bypassed: no second wait on the stalled node
    assert not watchdog.fired, "the read waited for the stalled node instead of timing out"
    assert stats["redis_breaker_trips"] == 1 and stats["redis_errors"] == 1
    assert any("Timeout" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert store.stats()["redis_bypassed_ops"] == stats["redis_bypassed_ops"] + 1
    own_redis.resume()
    time.sleep(0.6)
    assert [k for k, _ in store.get_blocks(keys, torch.float32, SHAPE)] == keys[:1]
