"""Tiny random-weight models for fast tests (ours and apps').

`build_tiny_model(folder)` writes a complete HF model folder (config,
safetensors weights, a byte-level BPE fast tokenizer trained on a few
sentences, a chat template) in well under a second. It exercises the same
code paths as a real model, at milliseconds per step. No download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ("TINY_CHAT_TEMPLATE", "build_tiny_model", "tiny_config")

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Tokenflow runs language models inside Python applications with asyncio.",
    "天空为什么是蓝色的？因为瑞利散射。日本語のテキストも少し。emoji 🙂🚀",
    "def add(a, b):\n    return a + b\n",
]


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def tiny_config(arch: str = "llama", vocab_size: int = 512, **overrides: Any) -> Any:
    """A 2-layer config with GQA (4 heads, 2 KV heads, hidden 64) for `arch`."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
        "phi3": transformers.Phi3Config,
        "gemma": transformers.GemmaConfig,
        "granite": transformers.GraniteConfig,
        "olmo2": transformers.Olmo2Config,
    }
    base: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    if arch == "mistral":
        base["sliding_window"] = None
    if arch == "phi3":
        base["pad_token_id"] = None  # its default (32000) lies past a tiny vocabulary
    if arch == "granite":  # multipliers away from 1, as Granite 3's: each one left out changes the output
        base.update(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=2.5)
    if arch == "gemma":
        base["head_dim"] = 16  # its default (256) is not hidden / heads
    base.update(overrides)
    return classes[arch](**base)


def build_tiny_model(folder: str | Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random-weight model + tokenizer to `folder` and return it."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    tokenizer = _train_tokenizer(vocab_size=overrides.pop("tokenizer_vocab_size", 400))
    config = tiny_config(arch, vocab_size=max(len(tokenizer), 512), **overrides)
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random weights give near-uniform logits; a wider init makes greedy choices decisive.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
