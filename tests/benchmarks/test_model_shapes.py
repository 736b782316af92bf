"""`tokenflow bench --model-shape`: real models' shapes with random weights and the embedded vocabulary."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tokenflow import Engine
from tokenflow.benchmarks.model_shapes import MODEL_SHAPES, _build

# Non-embedding parameters as the models' cards publish them (Qwen3-0.6B: 0.44B; Qwen2.5-0.5B: 0.36B), and
# Llama-3.2-1B's 1.24B total less its 128,256 x 2,048 tied embedding.
PUBLISHED_NON_EMBEDDING = {"qwen3-0.6b": 0.44e9, "qwen2.5-0.5b": 0.36e9, "llama-3.2-1b": 1.236e9 - 128256 * 2048}


@pytest.mark.parametrize("name", sorted(MODEL_SHAPES))
def test_each_shape_has_its_models_size(name: str) -> None:
    shape = MODEL_SHAPES[name]
    config = AutoConfig.for_model(shape["model_type"], **{k: v for k, v in shape.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embedding = model.get_input_embeddings().weight.numel()
    non_embedding = sum(p.numel() for p in model.parameters()) - embedding
    assert abs(non_embedding / PUBLISHED_NON_EMBEDDING[name] - 1) < 0.03, non_embedding


async def test_a_shape_folder_takes_the_vocabulary_and_runs_on_the_fused_layers(tiny_model, tmp_path) -> None:
    """A small shape of Qwen3's family, built as the bench builds the real ones: the vocabulary and tokenizer
    are the given model's, and the engine runs it on its fused layers (Qwen3's per-head Q/K norms)."""
    shape = {**MODEL_SHAPES["qwen3-0.6b"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    _build(shape, tiny_model, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.model_type == "qwen3" and config.vocab_size == len(tokenizer)
    assert AutoTokenizer.from_pretrained(tmp_path)("the engine")["input_ids"] == tokenizer("the engine")["input_ids"]
    async with Engine(str(tmp_path), dtype="bfloat16") as engine:
        assert engine._loop.backend.runner.fused is not None
        out = await engine.generate("the engine", max_tokens=8, ignore_eos=True)
    assert out.usage.completion_tokens == 8
