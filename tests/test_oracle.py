"""The correctness oracle on a tiny model: greedy outputs are token-identical
to `transformers` `generate(do_sample=False)`, whatever the batching."""

from __future__ import annotations

import random

import anyio
import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenflow import Engine


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def make_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


async def run_concurrently(engine: Engine, prompts, max_tokens: int, stagger_s: float = 0.0):
    results: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        await anyio.sleep(stagger_s * i)  # later arrivals join while others decode
        done = await engine.generate(prompts[i], max_tokens=max_tokens, temperature=0.0)
        results[i] = done.token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return [results[i] for i in range(len(prompts))]


@pytest.mark.parametrize(("backend", "packed", "fused"), [
    ("hf", False, False), ("paged", True, True), ("paged", False, True), ("paged", True, False),
    ("paged", False, False),
])
async def test_greedy_equals_transformers_generate(tiny_model, backend, packed, fused) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts = make_prompts(400, [3, 9, 17, 33, 64, 100, 150, 230, 301, 47])
    async with Engine(tiny_model, backend=backend, max_num_seqs=8, max_batch_tokens=128,
                      pack_cpu_weights=packed, fused_layers=fused) as engine:
        if backend == "paged":
            runner = engine._loop.backend.runner
            assert (runner.fused is not None) == fused  # the tiny Llama is a shape the fused layers run
            # without the fused layers, packed HF layers route their forward through oneDNN
            linears = [m for m in runner.model.modules() if type(m) is torch.nn.Linear]
            assert linears and all(("forward" in vars(m)) == (packed and not fused) for m in linears)
        outputs = await run_concurrently(engine, prompts, max_tokens=24, stagger_s=0.01)
        assert engine.stats().get("kv_blocks_used", 0) == 0
    for prompt, got in zip(prompts, outputs):
        assert got == hf_greedy(model, prompt, 24)


async def test_fixed_shape_decodes_equal_transformers_generate(tiny_model, monkeypatch) -> None:
    """Decode steps at the fixed (batch, context) shapes CUDA graphs replay, run eagerly on the CPU:
    staggered arrivals give every batch bucket and padding rows, and long prompts larger context buckets."""
    monkeypatch.setattr("tokenflow.runtime.backends.paged.decode_graph_mode", lambda config, device: "eager")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts = make_prompts(400, [3, 9, 17, 33, 64, 100, 150, 230, 301, 47])
    async with Engine(tiny_model, max_num_seqs=8, max_batch_tokens=128) as engine:
        outputs = await run_concurrently(engine, prompts, max_tokens=24, stagger_s=0.01)
        stats = engine.stats()
    assert stats["fixed_shape_decode_steps"] >= 24 and stats["kv_blocks_used"] == 0
    for prompt, got in zip(prompts, outputs):
        assert got == hf_greedy(model, prompt, 24)


def _randomize_norms(folder) -> None:
    """Norm weights away from their initial ones, so that a norm applied with the wrong weight (or not at all:
    Qwen3's per-head Q/K norms) changes the output."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=generator))
    model.save_pretrained(folder)


# qwen3: per-head Q/K norms; phi3: Q, K, V and gate/up stored as single projections; granite: embedding, residual,
# attention and logit multipliers; olmo2: norms on the sublayers' outputs and over all of Q and K; gemma: (1 + w)
# norms in fp32, GELU, scaled embeddings; gemma3: also norms on both sides of each sublayer, per-head Q/K norms,
# a RoPE per layer type and query_pre_attn_scalar; phi: not a family the fused layers run (its HF modules); gpt2:
# learned absolute positions and Conv1D projections (its HF modules)
@pytest.mark.parametrize(("arch", "fused"), [("qwen2", True), ("qwen3", True), ("mistral", True), ("phi3", True),
                                             ("granite", True), ("olmo2", True), ("gemma", True), ("gemma3", True),
                                             ("phi", False), ("gpt2", False)])
async def test_paged_greedy_on_other_architectures(tmp_path, arch, fused) -> None:
    from tokenflow.testing import build_tiny_model

    folder = build_tiny_model(tmp_path / arch, arch=arch)
    _randomize_norms(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = make_prompts(400, [5, 40, 90, 13], seed=1)
    async with Engine(folder, max_batch_tokens=32) as engine:  # chunked prefill over several steps
        assert (engine._loop.backend.runner.fused is not None) == fused
        if fused:  # the loop runs packed copies: the HF layers' weights are gone, and the answers below are exact
            assert engine._loop.backend.runner.fused.released
            assert all(p.numel() == 0 for n, p in engine._loop.backend.runner.model.named_parameters()
                       if n.endswith("proj.weight"))
        outputs = await run_concurrently(engine, prompts, max_tokens=12)
    for prompt, got in zip(prompts, outputs):
        assert got == hf_greedy(model, prompt, 12)


# mixture-of-experts on the paged backend: the HF modules' routers and transformers' grouped expert matmuls
# (`grouped_mm`, one product per expert group, not a loop over tokens); qwen2_moe's config keeps
# `sliding_window=0` with `use_sliding_window` off (no window), and every MoE layer passes
# `output_router_logits` on to attention
@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe"])
async def test_paged_greedy_on_mixture_of_experts(tmp_path, arch) -> None:
    from tokenflow.testing import build_tiny_model

    folder = build_tiny_model(tmp_path / arch, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = make_prompts(400, [5, 40, 90, 13, 60, 27], seed=2)
    want = [hf_greedy(model, prompt, 12) for prompt in prompts]
    async with Engine(folder, max_batch_tokens=32) as engine:
        runner = engine._loop.backend.runner
        assert runner.fused is None and runner.model.config._experts_implementation == "grouped_mm"
        assert await run_concurrently(engine, prompts, max_tokens=12, stagger_s=0.01) == want
    # a pool too small for all of them at once: requests are preempted and recomputed, answers unchanged
    async with Engine(folder, max_batch_tokens=32, num_kv_blocks=10, kv_high_watermark=1.0,
                      prefix_caching=False) as engine:
        assert await run_concurrently(engine, prompts, max_tokens=12) == want
        assert engine.stats()["num_preemptions"] > 0


# the model's own sliding window, shorter than the prompts: mistral (every layer), qwen2 with use_sliding_window
# (layers from max_window_layers on), gemma2 (alternate layers, and attention logit soft-capping) and gemma3
# (alternate layers, a RoPE base each); their HF modules pass each layer's window to paged attention
WINDOWED = {"mistral": dict(sliding_window=16), "gemma2": dict(sliding_window=16), "gemma3": dict(sliding_window=16),
            "qwen2": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)}


@pytest.mark.parametrize("arch", sorted(WINDOWED))
async def test_paged_greedy_with_the_models_own_sliding_window(tmp_path, arch) -> None:
    from tokenflow.testing import build_tiny_model

    folder = build_tiny_model(tmp_path / arch, arch=arch, **WINDOWED[arch])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = make_prompts(400, [5, 40, 90, 13, 60], seed=3)
    want = [hf_greedy(model, prompt, 24) for prompt in prompts]
    dense = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, sliding_window=10**6).eval()
    assert any(hf_greedy(dense, prompt, 24) != w for prompt, w in zip(prompts, want)), "the window must matter"
    async with Engine(folder, max_batch_tokens=32) as engine:
        assert await run_concurrently(engine, prompts, max_tokens=24, stagger_s=0.01) == want
    blocks = 6 if arch == "mistral" else 14  # mistral's requests hold only their window's blocks
    async with Engine(folder, max_batch_tokens=32, num_kv_blocks=blocks, kv_high_watermark=1.0,
                      prefix_caching=False) as engine:  # preempted and recomputed
        assert await run_concurrently(engine, prompts, max_tokens=24) == want
        assert engine.stats()["num_preemptions"] > 0


async def test_blocks_behind_a_window_every_layer_uses_are_freed(tmp_path) -> None:
    """Mistral's window covers every layer: a long generation holds the window's blocks, not its length's."""
    from tokenflow.testing import build_tiny_model

    folder = build_tiny_model(tmp_path / "mistral", arch="mistral", sliding_window=32)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = make_prompts(400, [70], seed=4)[0]
    async with Engine(folder, block_size=16) as engine:
        assert engine.ctx.model_window == 32
        used = []
        tokens = []
        async for chunk in engine.stream(prompt, max_tokens=300, temperature=0.0, ignore_eos=True):
            tokens += chunk.token_ids
            used.append(engine.stats()["kv_blocks_used"])
    assert tokens == hf_greedy(model, prompt, 300)
    assert max(used[5:]) <= 32 // 16 + 2 < (70 + 300) // 16, used  # the window's blocks and the one being filled
