"""`quantization="int8"`: int8 linears in the fused layers, calibrated at load and cached, on a tiny model
(the real model's quality is `tokenflow bench-quality`'s table, and a slow test below)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tokenflow import Engine
from tokenflow.errors import ModelLoadError
from tokenflow.runtime.cpu.int8_linear import Int8Linear, load_int8_kernels

pytestmark = pytest.mark.skipif(load_int8_kernels() is None, reason="no AVX512-VNNI or no C compiler here")

PROMPT = [5 + (7 * j) % 300 for j in range(40)]


async def _prompt_logprobs(engine: Engine) -> list[float]:
    done = await engine.generate(PROMPT, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    return [entry[token] for token, entry in zip(PROMPT[1:], done.prompt_logprobs[1:])]


async def test_int8_engine_serves_close_to_float(tiny_model, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOKENFLOW_HOME", str(tmp_path))
    async with Engine(tiny_model, dtype="float32") as engine:
        exact = await _prompt_logprobs(engine)
        float_stats = engine.stats()
    async with Engine(tiny_model, dtype="float32", quantization="int8", debug_leaks=True) as engine:
        fused = engine._loop.backend.runner.fused
        assert all(isinstance(linear, Int8Linear) for linear in fused.linears().values())
        approx = await _prompt_logprobs(engine)
        done = await engine.generate(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
        stats = engine.stats()
    assert len(done.token_ids) == 12 and stats["kv_blocks_used"] == 0
    assert stats["quantization"] == "int8" and float_stats["quantization"] == "none"
    assert stats["weight_bytes"] < 0.65 * float_stats["weight_bytes"]  # int8 layers; the fp32 embedding stays
    drift = sum(abs(a - b) for a, b in zip(approx, exact)) / len(exact)
    assert drift < 0.1, drift  # mean |logprob difference| per prompt token (bf16: 0.03, of a 7.5-nat mean)
    assert math.isfinite(sum(approx))
    assert list((tmp_path / "quantized").glob("*.safetensors"))  # saved for the next start


async def test_the_next_start_loads_the_saved_int8_weights(tiny_model, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOKENFLOW_HOME", str(tmp_path))
    async with Engine(tiny_model, dtype="float32", quantization="int8") as engine:
        first = await _prompt_logprobs(engine)

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated again instead of loading the saved weights")

    monkeypatch.setattr("tokenflow.runtime.quantize.activation_maxima", no_calibration)
    async with Engine(tiny_model, dtype="float32", quantization="int8") as engine:
        assert await _prompt_logprobs(engine) == first
    saved = next((tmp_path / "quantized").glob("*.safetensors"))
    saved.write_bytes(b"not a safetensors file")  # a damaged file: quantised again, not trusted
    monkeypatch.undo()
    monkeypatch.setenv("TOKENFLOW_HOME", str(tmp_path))
    async with Engine(tiny_model, dtype="float32", quantization="int8") as engine:
        assert await _prompt_logprobs(engine) == first


async def test_int8_blocks_never_share_keys_with_float_ones(tiny_model, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOKENFLOW_HOME", str(tmp_path))
    async with Engine(tiny_model, dtype="float32") as engine:
        plain = engine.ctx.model_key
    async with Engine(tiny_model, dtype="float32", quantization="int8") as engine:
        assert engine.ctx.model_key != plain  # a disk or Redis tier never serves one's KV to the other


@pytest.mark.parametrize("arch", ["phi3", "granite", "olmo2", "gemma3"])
async def test_int8_runs_every_fused_family(arch, tmp_path, monkeypatch) -> None:
    """Other families' weight names (Phi-3's single QKV projection), folded multipliers (Granite), norms on
    the sublayers' outputs (OLMo2) and Gemma's (1 + w) norms and GELU quantise and serve close to their float
    selves."""
    from tokenflow.testing import build_tiny_model

    monkeypatch.setenv("TOKENFLOW_HOME", str(tmp_path))
    folder = build_tiny_model(tmp_path / arch, arch=arch)
    async with Engine(folder, dtype="float32") as engine:
        exact = await _prompt_logprobs(engine)
    async with Engine(folder, dtype="float32", quantization="int8") as engine:
        fused = engine._loop.backend.runner.fused
        assert all(isinstance(linear, Int8Linear) for linear in fused.linears().values())
        approx = await _prompt_logprobs(engine)
    drift = sum(abs(a - b) for a, b in zip(approx, exact)) / len(exact)
    assert drift < 0.1, (arch, drift)


async def test_models_the_int8_layers_cannot_run_are_refused(tmp_path, monkeypatch) -> None:
    from tokenflow.testing import build_tiny_model

    monkeypatch.setenv("TOKENFLOW_HOME", str(tmp_path))
    phi = build_tiny_model(tmp_path / "phi", arch="phi")  # not a family the fused layers run (parallel blocks)
    with pytest.raises(ModelLoadError, match="int8"):
        async with Engine(phi, quantization="int8"):
            pass


@pytest.mark.slow
@pytest.mark.parametrize(("settings", "bound"), [({"quantization": "int8"}, 1.03), ({"kv_cache_dtype": "int8"}, 1.02)],
                         ids=["int8-weights", "int8-kv"])
async def test_real_model_int8_perplexity_against_bf16(settings, bound) -> None:
    """The issue's quality bars (weights within 3%, KV within 2% of bf16), on 2,048 tokens of a text the
    calibration never saw, prefilled in 512-token chunks (later chunks read the cache)."""
    from transformers import AutoTokenizer

    from tokenflow.hub import resolve_model

    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    model = resolve_model("smollm2-135m").path
    ids = AutoTokenizer.from_pretrained(model)(text, add_special_tokens=False)["input_ids"][:2048]

    async def perplexity(**extra) -> float:
        async with Engine(model, prefix_caching=False, dtype="bfloat16", max_batch_tokens=512, **extra) as engine:
            nll = 0.0
            for start in range(0, len(ids), 1024):
                window = ids[start:start + 1024]
                done = await engine.generate(window, max_tokens=1, prompt_logprobs=0)
                nll -= sum(entry[t] for t, entry in zip(window[1:], done.prompt_logprobs[1:]))
            return math.exp(nll / (len(ids) - 2))

    bf16 = await perplexity()
    quantized = await perplexity(**settings)
    assert quantized / bf16 < bound, (quantized, bf16)
    assert torch.isfinite(torch.tensor(quantized))
