"""`tokenflow bench --model-shape NAME`: the shapes of models users run, with random weights.

Why: the model hubs are out of reach here, and with EOS ignored an engine's speed depends on a model's
shapes (widths, layers, heads, vocabulary), not on its weights' values. Each shape is the architecture part of
the real model's published config; the vocabulary and tokenizer are the embedded model's (SmolLM2's 49,152
tokens), so prompts tokenize the same for every shape. The folder is built once (bf16 safetensors) in the
model cache and read by every engine of the run, peers included.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

__all__ = ("MODEL_SHAPES", "model_shape_folder")

# The architecture fields of each model's published config.json (vocabulary left out: the embedded one's).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "max_position_embeddings": 40960, "tie_word_embeddings": True,
        "attention_bias": False, "hidden_act": "silu",
    },
    "qwen2.5-0.5b": {
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "max_position_embeddings": 32768, "tie_word_embeddings": True, "hidden_act": "silu",
    },
    "llama-3.2-1b": {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 500000, "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "hidden_act": "silu",
    },
}
_VOCABULARY_FROM = "smollm2-135m"
_FORMAT = 1  # part of the cache key: a change in how the folder is built rebuilds it


def model_shape_folder(name: str) -> Path:
    """The folder of the random-weight model of shape `name` (built on first use)."""
    from tokenflow.errors import ConfigError
    from tokenflow.hub import resolve_model
    from tokenflow.hub.cache import ensure_folder, models_root

    shape = MODEL_SHAPES.get(name)
    if shape is None:
        raise ConfigError(f"unknown model shape {name!r}; known: {', '.join(sorted(MODEL_SHAPES))}")
    vocabulary = resolve_model(_VOCABULARY_FROM).path
    key = hashlib.sha256(json.dumps([_FORMAT, shape, _VOCABULARY_FROM], sort_keys=True).encode()).hexdigest()
    return ensure_folder(models_root() / f"shape-{name}", key, lambda tmp: _build(shape, vocabulary, tmp),
                         meta={"model_shape": name})


def _build(shape: dict[str, Any], vocabulary: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vocabulary)
    fields = {k: v for k, v in shape.items() if k != "model_type"}
    config = AutoConfig.for_model(shape["model_type"], **fields, vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # initializer_range's normal weights
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
