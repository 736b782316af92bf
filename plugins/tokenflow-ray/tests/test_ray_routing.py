"""The routing policy without Ray running: keys, rendezvous hashing, overload fallback."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve.request_router")

from tokenflow.errors import ConfigError
from tokenflow_ray import build_app
from tokenflow_ray.routing import PrefixAffinityRouter, rank_replicas, replica_order, routing_key

REPLICAS = ["a1b2c3d4", "e5f6g7h8", "i9j0k1l2", "m3n4o5p6"]
KEYS = [f"user {i} asks about topic {i * 7919 % 1000}" for i in range(4000)]


def test_keys_come_from_the_start_of_the_prompt() -> None:
    assert routing_key({"prompt": "x" * 300 + "tail"}, 256) == "x" * 256
    assert routing_key({"prompt": ["hello world"]}, 5) == "hello"  # a batch of one
    assert routing_key({"prompt": [11, 22, 33]}) == "11 22 33"
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert routing_key(chat) == "<system>Be brief.\n<user>hi\n"
    # Same system prompt, different questions: same key once the key is shorter than the shared start.
    other = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "bye"}]}
    assert routing_key(chat, 17) == routing_key(other, 17)
    assert routing_key({}) == "" and routing_key({"prompt": 3}) == ""


def test_order_is_stable_and_independent_of_listing_order() -> None:
    first = replica_order("some prompt", REPLICAS)
    assert sorted(first) == sorted(REPLICAS)
    assert replica_order("some prompt", list(reversed(REPLICAS))) == first
    # The hash is not Python's salted hash(): this value holds in every process and on every machine.
    assert replica_order("some prompt", ["r1", "r2", "r3"]) == ["r3", "r1", "r2"]


def test_keys_spread_evenly() -> None:
    counts = Counter(replica_order(key, REPLICAS)[0] for key in KEYS)
    share = len(KEYS) / len(REPLICAS)
    assert set(counts) == set(REPLICAS)
    assert all(0.85 * share < n < 1.15 * share for n in counts.values()), counts


def test_adding_a_replica_moves_about_one_in_n_plus_one_keys_all_to_it() -> None:
    before = {key: replica_order(key, REPLICAS)[0] for key in KEYS}
    after = {key: replica_order(key, [*REPLICAS, "newcomer"])[0] for key in KEYS}
    moved = [key for key in KEYS if before[key] != after[key]]
    assert all(after[key] == "newcomer" for key in moved)
    assert 0.8 / 5 < len(moved) / len(KEYS) < 1.2 / 5


def test_removing_a_replica_moves_only_its_keys() -> None:
    before = {key: replica_order(key, REPLICAS)[0] for key in KEYS}
    after = {key: replica_order(key, REPLICAS[1:])[0] for key in KEYS}
    assert all(before[key] == REPLICAS[0] for key in KEYS if before[key] != after[key])


def test_ranks_prefer_the_hashed_replica_unless_it_is_overloaded() -> None:
    order = replica_order("k", REPLICAS)
    preferred, others = order[0], order[1:]
    assert rank_replicas("k", REPLICAS) == [[preferred], others]  # queue lengths unknown: affinity
    balanced = {replica: 3 for replica in REPLICAS}
    assert rank_replicas("k", REPLICAS, balanced, max_imbalance=8) == [[preferred], others]
    busy = {**balanced, preferred: 3 + 8}
    assert rank_replicas("k", REPLICAS, busy, max_imbalance=8) == [[preferred], others]  # at the limit: keep it
    busy[preferred] += 1
    assert rank_replicas("k", REPLICAS, busy, max_imbalance=8) == [order]  # beyond: Serve takes the least loaded
    assert rank_replicas("k", ["only"]) == [["only"]]
    assert rank_replicas("k", []) == []


async def test_router_reads_the_request_argument_and_returns_serve_replicas() -> None:
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid)) for rid in REPLICAS]
    no_queue_info = SimpleNamespace(get=lambda replica_id: None)
    router = SimpleNamespace(prefix_chars=8, max_imbalance=8, replica_queue_len_cache=no_queue_info)

    async def choose(*args: object, **kwargs: object) -> list[list[str]]:
        request = SimpleNamespace(args=list(args), kwargs=kwargs, routing_context=SimpleNamespace(should_backoff=False))
        ranks = await PrefixAffinityRouter.choose_replicas(router, replicas, request)
        assert request.routing_context.should_backoff  # or Serve retries full replicas in a busy loop
        return [[replica.replica_id.unique_id for replica in rank] for rank in ranks]

    expected = rank_replicas("shared p", REPLICAS)
    assert await choose({"prompt": "shared prefix, question one"}) == expected
    assert await choose(body={"prompt": "shared prefix, question two"}) == expected
    assert await choose("not a request") == [REPLICAS]  # e.g. stats(): one rank, Serve picks the least loaded


def test_build_app_checks_engine_settings_before_deploying() -> None:
    with pytest.raises(ConfigError):
        build_app("smollm2-135m", num_replicas=2, max_num_seqz=4)
    assert build_app("smollm2-135m", num_replicas=3, max_num_seqs=4) is not None  # builds, starts nothing
