"""Lower tiers under hostile or failing conditions, in running engines: a hung load, poisoned KV
values, response keys that must not cross serving setups, response expiry, and a shutdown flush
bounded in time that keeps the hottest blocks."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import anyio
import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engines import stage_of
from tests.test_oracle import hf_greedy
from tokenflow import Engine
from tokenflow.kv.block_hash import BlockKey
from tokenflow.kv.tiers.disk import DiskTier
from tokenflow.kv.tiers.disk_store import DiskStore, encode_block

PROMPT = list(range(11, 11 + 120))  # 7 full blocks of 16, and a partial one
OTHERS = [[(7 * i + j) % 390 + 5 for j in range(90)] for i in range(3)]
HOT = list(range(20, 68))  # 3 full blocks
BLOCK_SHAPE = (2, 2, 16, 2, 16)  # the tiny model's [layers, K/V, block_size, kv_heads, head_dim]


def settings(cache_dir: Path, **kw):
    return {"max_num_seqs": 4, "max_batch_tokens": 64, "num_kv_blocks": 64, "cache_dir": str(cache_dir), **kw}


@pytest.fixture(scope="module")
def expected(tiny_model: Path) -> dict[str, list]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return {"prompt": hf_greedy(model, PROMPT, 8), "others": [hf_greedy(model, p, 8) for p in OTHERS]}


async def warm_folder(tiny_model: Path, folder: Path, prompts: list[list[int]]) -> None:
    async with Engine(tiny_model, **settings(folder)) as engine:
        for prompt in prompts:
            await engine.generate(prompt, max_tokens=8, temperature=0.0)


def stored_chain(folder: Path) -> tuple[DiskStore, list[BlockKey]]:
    """The folder's store and the keys of its blocks, read back from the entries, in chain order
    (PROMPT's chain: the folder holds only it)."""
    store = DiskStore(folder, 2**30)
    assert store._cache is not None
    keys = {}
    for name in store._cache.iterkeys():
        raw = store._cache.get(name)
        header = msgspec.json.decode(raw[9:9 + int.from_bytes(raw[5:9], "little")])
        keys[header["parent"]] = BlockKey(bytes.fromhex(header["key"]), bytes.fromhex(header["parent"]),
                                          tuple(header["tokens"]))
    chain = [next(k for k in keys.values() if k.parent.hex() not in {x.hash.hex() for x in keys.values()})]
    while chain[-1].hash.hex() in keys:
        chain.append(keys[chain[-1].hash.hex()])
    return store, chain


# -- loads ---------------------------------------------------------------------------------
class Stall:
    """A tier read that blocks until `release` is set, counting the reads blocked in it right now."""

    def __init__(self, real_fetch) -> None:
        self.release = threading.Event()
        self.real_fetch = real_fetch
        self.blocked = 0
        self._lock = threading.Lock()

    def fetch(self, tier, keys):
        with self._lock:
            self.blocked += 1
        try:
            self.release.wait(600)  # bounded only so that no thread outlives a broken test for ever
        finally:
            with self._lock:
                self.blocked -= 1
        return self.real_fetch(tier, keys)


async def test_a_hung_load_times_out_the_request_recomputes(
    tiny_model, expected, tmp_path, monkeypatch, caplog
) -> None:
    """A load stuck in the store is abandoned after `tier_load_timeout_s`: the request completes (recomputed,
    right tokens) while the load is still stuck, the tier counts and logs the timeout, starts no new job while
    that thread is busy, and closing the engine does not wait for it either. The stuck read is released only by
    the test, so a request or a close that waited for it fails on the hang guard."""
    caplog.set_level("WARNING", logger="tokenflow")
    await warm_folder(tiny_model, tmp_path, [PROMPT, *OTHERS[:2]])
    stall = Stall(DiskTier.fetch_blocks)
    monkeypatch.setattr(DiskTier, "fetch_blocks", lambda self, keys: stall.fetch(self, keys))
    try:
        with anyio.fail_after(120):  # a hang guard, not a speed limit
            async with Engine(tiny_model, **settings(tmp_path, tier_load_timeout_s=0.5)) as engine:
                tier = stage_of(engine, DiskTier)
                done = await engine.generate(PROMPT, max_tokens=8, temperature=0.0)
                assert stall.blocked == 1, "the request must finish while its load is still stuck"
                assert done.token_ids == expected["prompt"] and done.usage.cached_tokens == 0
                assert engine.stats()["disk_load_timeouts"] == 1
                assert any("abandoned, the prefix is recomputed" in r.getMessage() for r in caplog.records)
                # The abandoned thread is still stuck: no new job starts, the next request recomputes at once.
                jobs = engine.stats()["disk_prefetch_jobs"] + engine.stats()["disk_load_jobs"]
                again = await engine.generate(OTHERS[0], max_tokens=8, temperature=0.0)
                assert again.token_ids == expected["others"][0] and again.usage.cached_tokens == 0
                assert engine.stats()["disk_prefetch_jobs"] + engine.stats()["disk_load_jobs"] == jobs
                assert stall.blocked == 1 and engine.stats()["disk_load_timeouts"] == 1
                stall.release.set()
                while tier._hung():
                    await anyio.sleep(0.01)
                loaded = await engine.generate(OTHERS[1], max_tokens=8, temperature=0.0)  # loading again
                assert loaded.token_ids == expected["others"][1] and loaded.usage.cached_tokens == 80
                stall.release.clear()  # hang once more, and close while the thread is stuck: stop does not wait
                tier.pool.evict_all()  # PROMPT is on disk only again
                done = await engine.generate(PROMPT, max_tokens=8, temperature=0.0)
                assert done.token_ids == expected["prompt"] and done.usage.cached_tokens == 0
                stats = engine.stats()
                assert stats["disk_load_timeouts"] == 2 and stats["kv_blocks_used"] == 0
                assert stall.blocked == 1
        assert engine.stats()["state"] == "closed"
        assert stall.blocked == 1 and not stall.release.is_set(), "closed only once the stuck load returned"
    finally:
        stall.release.set()


async def test_non_finite_kv_from_disk_is_dropped(tiny_model, expected, tmp_path) -> None:
    await warm_folder(tiny_model, tmp_path, [PROMPT])
    store, chain = stored_chain(tmp_path)
    assert len(chain) == 7
    poisoned = torch.zeros(BLOCK_SHAPE)
    poisoned.view(-1)[5] = float("nan")
    store._cache.set("kv:" + chain[2].hex, encode_block(chain[2], poisoned, secret=store._key))
    store.close()
    async with Engine(tiny_model, **settings(tmp_path)) as engine:
        done = await engine.generate(PROMPT, max_tokens=8, temperature=0.0)
        stats = engine.stats()
    assert done.token_ids == expected["prompt"]
    assert stats["disk_nonfinite_blocks"] == 1 and stats["disk_blocks_loaded"] == 2
    assert done.usage.cached_tokens == 32
    assert stats["kv_blocks_used"] == 0
    healed = DiskStore(tmp_path, 2**30)  # deleted, then the recomputed block was flushed in its place
    assert bool(torch.isfinite(healed.get_block(chain[2], torch.float32, BLOCK_SHAPE)).all())
    healed.close()


# -- the response cache ----------------------------------------------------------------------
def _change(model: Path, change: str) -> dict:
    """Change one serving detail of the model folder in place (same weights, same path); returns
    engine settings for the change."""
    if change == "max_model_len":
        return {"max_model_len": 1024}
    if change == "chat_template":
        path = model / "chat_template.jinja"
        path.write_text(path.read_text().replace("<|im_start|>assistant", "<|im_start|>assistant\nSure:"))
    else:
        path = model / "generation_config.json"
        config = json.loads(path.read_text())
        config["eos_token_id"] = [config["eos_token_id"], 7]
        path.write_text(json.dumps(config))
    return {}


@pytest.mark.parametrize("change", ["chat_template", "max_model_len", "eos_ids"])
async def test_cached_responses_never_cross_serving_setups(tiny_model, tmp_path, change) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    cache = {"cache_dir": str(tmp_path / "cache"), "response_cache": True}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    async with Engine(model, **cache) as engine:
        await engine.chat(messages, max_tokens=6, temperature=0.0)
    original = {p: p.read_bytes() for p in model.iterdir()}
    changed = _change(model, change)
    async with Engine(model, **cache, **changed) as engine:
        await engine.chat(messages, max_tokens=6, temperature=0.0)
        stats = engine.stats()
    assert (stats["response_cache_disk_hits"], stats["response_cache_misses"]) == (0, 1)
    for path, data in original.items():
        path.write_bytes(data)
    async with Engine(model, **cache) as engine:  # control: the first setup again does hit
        await engine.chat(messages, max_tokens=6, temperature=0.0)
        assert engine.stats()["response_cache_disk_hits"] == 1


async def test_disk_responses_expire_after_the_ttl(tiny_model, tmp_path) -> None:
    async with Engine(tiny_model, cache_dir=str(tmp_path), response_cache=True, response_cache_ttl_s=1.0) as engine:
        await engine.generate("a question", max_tokens=6, temperature=0.0)
        await anyio.sleep(1.2)  # past the TTL: gone from memory and from disk
        await engine.generate("a question", max_tokens=6, temperature=0.0)
        stats = engine.stats()
    assert (stats["response_cache_memory_hits"], stats["response_cache_disk_hits"]) == (0, 0)
    assert stats["response_cache_misses"] == 2


# -- the shutdown flush ------------------------------------------------------------------------
async def _hot_and_cold(engine: Engine) -> None:
    """HOT used six times, then three one-off prompts: every block still in the pool."""
    for i in range(6):
        await engine.generate([*HOT, 400 + i], max_tokens=4, temperature=0.0)
    for prompt in OTHERS:
        await engine.generate(prompt, max_tokens=4, temperature=0.0)


async def test_shutdown_flush_writes_the_hottest_blocks_first_within_its_budget(
    tiny_model, tmp_path, monkeypatch
) -> None:
    """With writes slower than the budget allows, the flush writes the hot prefix's head first and then gives up:
    a few writes out of the many the pool holds, none left running once the close returned."""
    written: list[BlockKey] = []
    running = 0
    real_put = DiskStore.put_block

    def slow_put(self, key, data):
        nonlocal running
        written.append(key)
        running += 1
        try:
            time.sleep(0.15)  # 0.4 s of budget: three such writes start, never the pool's twenty or so
            return real_put(self, key, data)
        finally:
            running -= 1

    with anyio.fail_after(60):  # a hang guard, not a speed limit
        async with Engine(tiny_model, **settings(tmp_path, disk_flush_timeout_s=0.4)) as engine:
            await _hot_and_cold(engine)
            held = engine.stats()["kv_blocks_cached"]
            assert held >= 3 + 3 * 5
            before = engine.stats()["disk_blocks_written"]
            monkeypatch.setattr(DiskStore, "put_block", slow_put)
    assert running == 0, "a flush write was still running after the close"
    assert 1 <= len(written) <= 4 < held, (len(written), held)  # gave up at its budget, far from done
    assert [k.tokens for k in written[:2]] == [tuple(HOT[:16]), tuple(HOT[16:32])]  # the hot prefix's head
    assert engine.stats()["disk_blocks_written"] - before == len(written)


async def test_a_zero_flush_budget_writes_nothing_and_closes_at_once(tiny_model, tmp_path, monkeypatch) -> None:
    """A zero budget: the close starts no write at all (nothing reaches the store, no file on disk)."""
    puts: list[BlockKey] = []
    real_put = DiskStore.put_block

    def counting_put(self, key, data):
        puts.append(key)
        return real_put(self, key, data)

    with anyio.fail_after(60):  # a hang guard, not a speed limit
        async with Engine(tiny_model, **settings(tmp_path, disk_flush_timeout_s=0.0)) as engine:
            await _hot_and_cold(engine)
            assert engine.stats()["kv_blocks_cached"] >= 3 + 3 * 5  # plenty it could have written
            monkeypatch.setattr(DiskStore, "put_block", counting_put)
    assert puts == []
    assert engine.stats()["disk_blocks_written"] == 0 and list(tmp_path.rglob("*.val")) == []
