"""Device out-of-memory, injected as the error the CUDA allocator raises (`torch.OutOfMemoryError`): a step
that does not fit is retried smaller (preempting by recompute) until it does, only a request that cannot
run even alone fails, with a clear EngineError, and the engine neither hangs nor dies; at load, a clear
ModelLoadError says how much memory was needed and what to lower. Every caller's outcome is checked and no
KV block leaks."""

from __future__ import annotations

import anyio
import pytest
import torch

from tokenflow import Engine
from tokenflow.errors import EngineError, ModelLoadError


def _prompts(count: int) -> list[list[int]]:
    return [[5 + (i * 31 + j * 7) % 390 for j in range(20 + 3 * i)] for i in range(count)]


async def _run_all(engine: Engine, prompts: list[list[int]], **params) -> list:
    results: list = [None] * len(prompts)

    async def one(i: int) -> None:
        try:
            results[i] = await engine.generate(prompts[i], **params)
        except Exception as exc:  # each caller's outcome is asserted by the test
            results[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


def _device_fits(engine: Engine, fits) -> dict[str, int]:
    """Make the backend raise OOM for every plan `fits(plan)` refuses; counts the injected errors."""
    backend = engine._loop.backend
    real = backend.execute
    count = {"ooms": 0}

    def execute(plan):
        if not fits(plan):
            count["ooms"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(plan)

    backend.execute = execute
    return count


async def test_repeated_out_of_memory_at_batch_16_shrinks_until_the_step_fits(tiny_model) -> None:
    prompts = _prompts(16)
    params = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    async with Engine(tiny_model, num_kv_blocks=256, max_num_seqs=16) as engine:
        reference = [c.token_ids for c in await _run_all(engine, prompts, **params)]
    async with Engine(tiny_model, num_kv_blocks=256, max_num_seqs=16, debug_leaks=True) as engine:
        kv_bytes = engine.stats()["kv_cache_bytes"]
        count = _device_fits(engine, lambda plan: len(plan.chunks) <= 3)  # the "device" fits 3 sequences
        results = await _run_all(engine, prompts, **params)
        stats = engine.stats()
        cache_blocks = engine._loop.backend.runner.kv_cache.num_blocks
    assert [r.token_ids for r in results] == reference  # every caller got its own, unchanged output
    assert count["ooms"] >= 2 and stats["num_oom_recoveries"] == count["ooms"]  # repeated: halved until it fits
    assert stats["num_preemptions"] >= 8 and stats["num_failed"] == 0 and stats["num_oom_failures"] == 0
    assert stats["max_num_seqs_effective"] <= 3 and not stats["dead"]
    assert stats["kv_blocks_used"] == 0
    # the failure repeated: the KV pool gave a quarter of its blocks (and their memory) back, once
    assert stats["num_kv_pool_shrinks"] == 1 and stats["kv_blocks_total"] == 192
    assert stats["kv_blocks_free"] + stats["kv_blocks_cached"] == 192
    assert cache_blocks == 192
    assert stats["kv_cache_bytes"] == kv_bytes * 192 // 256


async def test_only_a_request_that_cannot_run_alone_fails(tiny_model) -> None:
    """Plans holding a 'huge' prompt never fit: it fails alone with an EngineError naming the memory, the
    others are served, three such requests in a row do not kill the engine, and the limits shrunk for
    them come back."""
    prompts = _prompts(6)
    huge = [[7 + j % 300 for j in range(400 + k)] for k in range(3)]
    huge_ids = {tuple(h) for h in huge}
    params = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    async with Engine(tiny_model, num_kv_blocks=256, max_num_seqs=8) as engine:
        reference = [c.token_ids for c in await _run_all(engine, prompts, **params)]
    async with Engine(tiny_model, num_kv_blocks=256, max_num_seqs=8, debug_leaks=True) as engine:
        before = engine.stats()
        _device_fits(engine, lambda plan: not any(tuple(c.request.prompt_token_ids or ()) in huge_ids
                                                  for c in plan.chunks))
        results = await _run_all(engine, [*huge, *prompts], **params)
        for h in huge:  # one after the other as well: each fails alone, the engine lives on
            with pytest.raises(EngineError, match="out of memory"):
                await engine.generate(h, **params)
        after = await engine.generate(prompts[0], **params)
        stats = engine.stats()
    for failed in results[:3]:
        assert isinstance(failed, EngineError) and "out of memory running request" in str(failed)
    assert [r.token_ids for r in results[3:]] == reference
    assert after.token_ids == reference[0]
    assert stats["num_oom_failures"] == 6 and not stats["dead"] and stats["kv_blocks_used"] == 0
    assert stats["num_kv_pool_shrinks"] >= 1 and stats["kv_blocks_total"] >= 128  # never below half
    assert stats["max_batch_tokens_effective"] == before["max_batch_tokens_effective"]
    assert stats["max_num_seqs_effective"] == before["max_num_seqs_effective"]


async def test_out_of_memory_at_load_names_what_to_lower(tiny_model, monkeypatch) -> None:
    import transformers

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (simulated)")

    with monkeypatch.context() as patch:
        patch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_room)
        with pytest.raises(ModelLoadError, match=r"out of memory loading the weights .* GiB in float32.*dtype"):
            async with Engine(tiny_model, dtype="float32"):
                pass
    with monkeypatch.context() as patch:
        patch.setattr("tokenflow.kv.kv_cache.KVCache.__init__", no_room)
        with pytest.raises(ModelLoadError, match=r"out of memory allocating the KV cache: 64 blocks.*num_kv_blocks"):
            async with Engine(tiny_model, num_kv_blocks=64):
                pass
    async with Engine(tiny_model, num_kv_blocks=64) as engine:  # nothing was left half-loaded
        assert (await engine.generate("hello", max_tokens=2)).usage.completion_tokens == 2


async def test_pool_shrink_moves_the_fixed_shape_decodes_scratch_block(tiny_model, monkeypatch) -> None:
    """With decode steps at fixed shapes (as CUDA graphs replay them; eager here), the scratch block of
    padding rows lives past the pool: after the pool shrinks it moves to the new end, and outputs stay."""
    monkeypatch.setattr("tokenflow.runtime.backends.paged.decode_graph_mode", lambda config, device: "eager")
    prompts = _prompts(16)
    params = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    async with Engine(tiny_model, num_kv_blocks=256, max_num_seqs=16) as engine:
        reference = [c.token_ids for c in await _run_all(engine, prompts, **params)]
    async with Engine(tiny_model, num_kv_blocks=256, max_num_seqs=16, debug_leaks=True) as engine:
        graphs = engine._loop.backend.runner.graphs
        assert graphs is not None and graphs.scratch_block == 256
        _device_fits(engine, lambda plan: len(plan.chunks) <= 3)
        results = await _run_all(engine, prompts, **params)
        stats = engine.stats()
        cache_blocks = engine._loop.backend.runner.kv_cache.num_blocks
    assert [r.token_ids for r in results] == reference
    assert stats["num_kv_pool_shrinks"] == 1 and graphs.scratch_block == 192
    assert stats["fixed_shape_decode_steps"] >= 12  # the decodes ran through the fixed-shape path
    assert cache_blocks == 193 and stats["kv_blocks_used"] == 0
