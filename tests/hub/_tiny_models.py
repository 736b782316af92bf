"""Tiny stand-ins for real models: a 2-layer random Llama as an HF folder or as a GGUF file.

They exercise the same code paths as SmolLM2 in milliseconds instead of a minute.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tokenflow.testing import TINY_CHAT_TEMPLATE as CHAT_TEMPLATE
from tokenflow.testing import add_byte_tokenizer, add_gguf_architecture, gguf_byte_vocabulary, tiny_config

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2


def make_hf_folder(folder: Path) -> Path:
    """A loadable HF folder: random tiny Llama + byte-level BPE tokenizer + chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(gguf_byte_vocabulary())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "t")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=len(vocab),
        max_position_embeddings=128,
        bos_token_id=vocab["<|im_start|>"],
        eos_token_id=vocab["<|im_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_gguf(path: Path, *, chat_template: str | None = CHAT_TEMPLATE, seed: int = 0) -> Path:
    """A tiny llama GGUF (f32 tensors, gpt2-style byte BPE vocabulary) that transformers can convert."""
    import gguf

    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    vocab_size = len(gguf_byte_vocabulary())
    add_gguf_architecture(writer, tiny_config("llama", vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=FFN,
                                              num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                              num_key_value_heads=KV_HEADS, max_position_embeddings=128),
                          rms_eps=1e-5)
    add_byte_tokenizer(writer, chat_template)

    kv_dim = HIDDEN // HEADS * KV_HEADS
    writer.add_tensor("token_embd.weight", rand(vocab_size, HIDDEN))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", rand(HIDDEN, HIDDEN))
        writer.add_tensor(f"blk.{i}.attn_k.weight", rand(kv_dim, HIDDEN))
        writer.add_tensor(f"blk.{i}.attn_v.weight", rand(kv_dim, HIDDEN))
        writer.add_tensor(f"blk.{i}.attn_output.weight", rand(HIDDEN, HIDDEN))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", rand(FFN, HIDDEN))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", rand(FFN, HIDDEN))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", rand(HIDDEN, FFN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
