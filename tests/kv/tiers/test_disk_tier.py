"""The disk tier inside a running engine: faults never change outputs or stop the engine,
prefetching, and the response cache."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import anyio
import diskcache
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.runtime.test_openmp_team import native_threads, settled_threads
from tests.test_oracle import hf_greedy
from tokenflow import Engine
from tokenflow.protocols import StepPlan
from tokenflow.runtime.cpu.openmp_team import loaded_libgomp_paths

PROMPT = list(range(11, 11 + 120))  # 7 full blocks of 16, and a partial one
OTHERS = [[(7 * i + j) % 390 + 5 for j in range(90)] for i in range(6)]


def settings(cache_dir: Path, **kw):
    return {"max_num_seqs": 4, "max_batch_tokens": 64, "num_kv_blocks": 32, "cache_dir": str(cache_dir), **kw}


@pytest.fixture(scope="module")
def expected(tiny_model: Path) -> dict[str, list[int]]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return {"prompt": hf_greedy(model, PROMPT, 8), "others": [hf_greedy(model, p, 8) for p in OTHERS]}


async def warm_folder(tiny_model: Path, folder: Path) -> None:
    async with Engine(tiny_model, **settings(folder)) as engine:
        await engine.generate(PROMPT, max_tokens=8, temperature=0.0)
    assert len(list(folder.rglob("*.val"))) == 7


def entry_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.val"))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
async def test_corrupt_or_truncated_entries_are_misses(tiny_model, expected, tmp_path, damage) -> None:
    await warm_folder(tiny_model, tmp_path)
    for path in entry_files(tmp_path)[::2]:  # damage every other block of the chain
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[-10] ^= 0xFF
            path.write_bytes(bytes(data))
        else:
            path.write_bytes(bytes(data[: len(data) // 2]))
    async with Engine(tiny_model, **settings(tmp_path)) as engine:
        done = await engine.generate(PROMPT, max_tokens=8, temperature=0.0)
        stats = engine.stats()
        assert done.token_ids == expected["prompt"]
        assert stats["disk_corrupt_entries"] >= 1
        assert stats["disk_blocks_loaded"] < 7  # the chain stops at the first bad block
        assert done.usage.cached_tokens == 16 * stats["disk_blocks_loaded"]
        assert (await engine.generate(OTHERS[0], max_tokens=8, temperature=0.0)).token_ids == expected["others"][0]


async def test_folder_deleted_mid_run(tiny_model, expected, tmp_path) -> None:
    folder = tmp_path / "cache"
    async with Engine(tiny_model, **settings(folder, num_kv_blocks=12)) as engine:
        for i, prompt in enumerate(OTHERS[:3]):  # a small pool: evictions write to disk
            assert (await engine.generate(prompt, max_tokens=8, temperature=0.0)).token_ids == expected["others"][i]
        with anyio.fail_after(5):
            while engine.stats()["disk_blocks_written"] == 0:  # written behind, by the writer thread
                await anyio.sleep(0.01)
        while folder.exists():  # the writer thread may add a file while the folder is being deleted
            shutil.rmtree(folder, ignore_errors=True)
        for i, prompt in enumerate(OTHERS):
            assert (await engine.generate(prompt, max_tokens=8, temperature=0.0)).token_ids == expected["others"][i]
        assert (await engine.generate(PROMPT, max_tokens=8, temperature=0.0)).token_ids == expected["prompt"]
        with anyio.fail_after(5):
            while engine.stats()["disk_io_errors"] == 0:  # the writer noticed: the tier is off for a while
                await anyio.sleep(0.01)
        assert engine.stats()["state"] == "running"


async def test_read_only_or_full_disk_turns_the_tier_off(tiny_model, expected, tmp_path, monkeypatch) -> None:
    def refuse(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    async with Engine(tiny_model, **settings(tmp_path, disk_retry_s=60.0)) as engine:
        monkeypatch.setattr(diskcache.Disk, "store", refuse)
        for i, prompt in enumerate(OTHERS):  # the pool overflows: every eviction tries to write
            assert (await engine.generate(prompt, max_tokens=8, temperature=0.0)).token_ids == expected["others"][i]
        stats = engine.stats()
        assert stats["disk_io_errors"] == 1  # tripped once, then off: no retry storm
        assert stats["disk_available"] is False
        assert stats["pool_evictions"] > 0
        assert (await engine.generate(PROMPT, max_tokens=8, temperature=0.0)).token_ids == expected["prompt"]


async def test_read_only_folder_at_start(tiny_model, expected, tmp_path, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(diskcache, "Cache", refuse)
    async with Engine(tiny_model, **settings(tmp_path)) as engine:
        assert (await engine.generate(PROMPT, max_tokens=8, temperature=0.0)).token_ids == expected["prompt"]
        assert engine.stats()["disk_available"] is False


async def test_prefetch_in_time_while_queued(tiny_model, expected, tmp_path) -> None:
    """The prompt's blocks load while it waits behind a running request; the batcher finds them resident."""
    await warm_folder(tiny_model, tmp_path)
    async with Engine(tiny_model, **settings(tmp_path, max_num_seqs=1)) as engine:
        results = {}

        async def run(name, prompt, max_tokens):
            results[name] = await engine.generate(prompt, max_tokens=max_tokens, temperature=0.0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "busy", OTHERS[0], 120)  # ~120 steps: far longer than loading 7 small blocks
            await anyio.sleep(0.02)
            tg.start_soon(run, "prompt", PROMPT, 8)
        stats = engine.stats()
    assert results["prompt"].token_ids == expected["prompt"]
    assert results["prompt"].usage.cached_tokens == 112
    assert (stats["disk_prefetch_jobs"], stats["disk_prefetch_in_time"], stats["disk_prefetch_late"]) == (1, 1, 0)


@pytest.mark.parametrize("prefetcher", [True, False])
async def test_requests_arriving_together_read_a_shared_prefix_once(tiny_model, expected, tmp_path,
                                                                    prefetcher) -> None:
    """Four requests on one warm 7-block prefix: one job reads it, the others wait for it and share it."""
    await warm_folder(tiny_model, tmp_path)
    async with Engine(tiny_model, **settings(tmp_path, prefetch=prefetcher)) as engine:
        results = []

        async def run() -> None:
            results.append(await engine.generate(PROMPT, max_tokens=8, temperature=0.0))

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(run)
        stats = engine.stats()
    assert [r.token_ids for r in results] == [expected["prompt"]] * 4
    assert [r.usage.cached_tokens for r in results] == [112] * 4
    assert (stats["disk_blocks_fetched"], stats["disk_blocks_loaded"]) == (7, 7)
    assert stats["disk_load_jobs"] + stats["disk_prefetch_jobs"] == 1


@pytest.mark.skipif(not loaded_libgomp_paths(), reason="torch here does not use libgomp")
async def test_a_load_leaves_no_openmp_helpers_behind(real_model, tmp_path) -> None:
    """A reader thread's torch ops on a real model's blocks start an OpenMP team; helpers left alive make
    every parallel region of the model thread sleep and wake (decode ran 2x slower for the rest of a
    warm-started engine's life)."""
    prompt = list(range(1000, 1250))  # 15 full blocks
    config = {"dtype": "float32", "cache_dir": str(tmp_path)}
    async with Engine(real_model, **config) as engine:
        cold = await engine.generate(prompt, max_tokens=4, temperature=0.0)
    async with Engine(real_model, **config) as engine:
        await engine.generate("the model thread's own team", max_tokens=2, temperature=0.0)
        before = native_threads()
        warm = await engine.generate(prompt, max_tokens=4, temperature=0.0)
        after = settled_threads(before, native_threads)
        assert engine.stats()["disk_blocks_fetched"] == 15
    assert warm.token_ids == cold.token_ids and warm.usage.cached_tokens == 240
    assert after == before


async def test_without_prefetcher_the_batcher_loads_on_admission(tiny_model, expected, tmp_path) -> None:
    await warm_folder(tiny_model, tmp_path)
    async with Engine(tiny_model, **settings(tmp_path, prefetch=False)) as engine:
        done = await engine.generate(PROMPT, max_tokens=8, temperature=0.0)
        stats = engine.stats()
    assert done.token_ids == expected["prompt"]
    assert (stats["disk_prefetch_jobs"], stats["disk_load_jobs"], stats["disk_blocks_loaded"]) == (0, 1, 7)


def _schedule_once_every_load_is_done(engine: Engine, num_requests: int) -> None:
    """Hold the scheduler until `num_requests` wait and all their tier loads have finished, so the pool
    installs every loaded block at once when it next looks (the case a queue of warm requests meets on a
    busy engine; left to timing, the head request is often admitted before the others' loads land)."""
    scheduler = engine.scheduler
    tier = scheduler.pool.lower_tiers[0]
    real = scheduler.schedule
    scanned = released = False

    def gated() -> StepPlan:
        nonlocal scanned, released
        if released:
            return real()
        if len(scheduler.waiting) < num_requests:
            return StepPlan()
        if not tier._jobs and not scanned:  # without the prefetcher, the batcher's scan starts the loads
            scanned = True
            return real()
        if any(not job.future.done() for job in tier._jobs.values()):
            return StepPlan()
        released = True
        return real()

    scheduler.schedule = gated


@pytest.mark.parametrize("prefetcher", [True, False])
async def test_restored_prefixes_of_queued_requests_never_fail_the_queue(tiny_model, tmp_path, prefetcher) -> None:
    """Eight queued requests whose 18-block prefixes are on disk, one sequence at a time, a pool of 40 blocks:
    their restored blocks cannot all be held for them, and a shortage of blocks while nothing runs used to
    fail the head request ("needs 1 KV blocks but only 0 exist"; 3 to 7 of 8 failed). All eight are served,
    each with the tier-less engine's output."""
    prompts = [[(13 * i + 7 * j) % 390 + 5 for j in range(290)] for i in range(8)]
    base = {"max_model_len": 512, "num_threads": 1, "max_batch_tokens": 512}
    async with Engine(tiny_model, num_kv_blocks=256, **base) as engine:  # no tier: the reference
        expected = [(await engine.generate(p, max_tokens=4, temperature=0.0)).token_ids for p in prompts]
    async with Engine(tiny_model, num_kv_blocks=256, cache_dir=str(tmp_path), **base) as engine:
        for p in prompts:
            await engine.generate(p, max_tokens=1, temperature=0.0)
    async with Engine(tiny_model, num_kv_blocks=40, max_num_seqs=1, cache_dir=str(tmp_path), prefetch=prefetcher,
                      **base) as engine:
        _schedule_once_every_load_is_done(engine, len(prompts))
        results = [None] * len(prompts)

        async def run(i: int) -> None:
            results[i] = await engine.generate(prompts[i], max_tokens=4, temperature=0.0)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(run, i)
        stats = engine.stats()
    assert [r.token_ids for r in results] == expected
    assert stats["num_failed"] == 0 and stats["disk_blocks_loaded"] >= 18
    assert sum(r.usage.cached_tokens > 0 for r in results) >= 2  # restored prefixes were used, not all dropped


# -- the response cache ---------------------------------------------------------------
async def test_response_cache_serves_repeats_without_the_model(tiny_model) -> None:
    async with Engine(tiny_model, response_cache=True) as engine:
        first = await engine.generate("hello there", max_tokens=12, temperature=0.0, ignore_eos=True)
        steps = engine.stats()["num_steps"]
        again = await engine.generate("hello there", max_tokens=12, temperature=0.0, ignore_eos=True)
        stats = engine.stats()
        assert stats["num_steps"] == steps  # never reached the model
        assert stats["response_cache_memory_hits"] == 1
        assert (again.text, again.token_ids, again.finish_reason) == (first.text, first.token_ids, first.finish_reason)
        assert again.usage == first.usage and again.prompt_token_ids == first.prompt_token_ids
        streamed = [c async for c in engine.stream("hello there", max_tokens=12, temperature=0.0, ignore_eos=True)]
        assert len(streamed) == 12  # replayed chunk by chunk
        assert "".join(c.text for c in streamed) == first.text
        assert streamed[-1].finish_reason == "length"
        # Different parameters, sampling without a seed, or an opt-out: computed.
        await engine.generate("hello there", max_tokens=5, temperature=0.0)
        await engine.generate("hello there", max_tokens=12, temperature=0.8)
        await engine.generate("hello there", max_tokens=12, temperature=0.0, ignore_eos=True, cache_response=False)
        assert engine.stats()["response_cache_memory_hits"] == 2
        seeded = [await engine.generate("hi", max_tokens=6, temperature=0.9, seed=3) for _ in range(2)]
        assert seeded[0].token_ids == seeded[1].token_ids
        assert engine.stats()["response_cache_memory_hits"] == 3


async def test_response_cache_is_opt_in_and_survives_restart(tiny_model, tmp_path) -> None:
    async with Engine(tiny_model, cache_dir=str(tmp_path)) as engine:
        await engine.generate("a question", max_tokens=6, temperature=0.0)
        await engine.generate("a question", max_tokens=6, temperature=0.0)
        assert engine.stats()["response_cache_memory_hits"] == 0  # off by default
        first = await engine.generate("a question", max_tokens=6, temperature=0.0, cache_response=True)
    async with Engine(tiny_model, cache_dir=str(tmp_path), response_cache=True) as engine:
        again = await engine.generate("a question", max_tokens=6, temperature=0.0)
        stats = engine.stats()
    assert again.token_ids == first.token_ids and again.text == first.text
    assert stats["response_cache_disk_hits"] == 1 and stats["num_steps"] == 0
