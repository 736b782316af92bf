"""Tiny random-weight models for fast tests (ours and apps').

`build_tiny_model(folder)` writes a complete HF model folder (config,
safetensors weights, a byte-level BPE fast tokenizer trained on a few
sentences, a chat template) in well under a second. It exercises the same
code paths as a real model, at milliseconds per step. No download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ("GGUF_SPECIALS", "TINY_CHAT_TEMPLATE", "add_byte_tokenizer", "add_gguf_architecture", "build_tiny_model",
           "gguf_byte_vocabulary", "random_ggml_blocks", "tiny_config", "write_tiny_gguf")

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

    if arch == "gpt2":  # learned absolute positions, Conv1D projections, no GQA, biases everywhere
        names = dict(n_embd=64, n_layer=2, n_head=4, n_positions=2048, vocab_size=vocab_size)
        return transformers.GPT2Config(**{**names, **overrides})
    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
        "phi3": transformers.Phi3Config,
        "gemma": transformers.GemmaConfig,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
        "phi": transformers.PhiConfig,
        "granite": transformers.GraniteConfig,
        "olmo2": transformers.Olmo2Config,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "mixtral": transformers.MixtralConfig,
        "olmoe": transformers.OlmoeConfig,
    }
    base: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    if arch in ("mistral", "mixtral"):
        base["sliding_window"] = None
    # mixture-of-experts: 4 experts of 32, 2 per token (Qwen2-MoE also a shared expert, gated; Qwen3-MoE
    # normalises the top-k weights, Mixtral and OLMoE as their configs say)
    if arch in ("qwen2_moe", "qwen3_moe"):
        base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "qwen2_moe":
        base["shared_expert_intermediate_size"] = 48
    if arch == "qwen3_moe":
        base["norm_topk_prob"] = True
    if arch == "mixtral":
        base.update(num_local_experts=4, num_experts_per_tok=2)
    if arch == "olmoe":
        base.update(num_experts=4, num_experts_per_tok=2, intermediate_size=32)
    if arch == "phi3":
        base["pad_token_id"] = None  # its default (32000) lies past a tiny vocabulary
    if arch == "granite":  # multipliers away from 1, as Granite 3's: each one left out changes the output
        base.update(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=2.5)
    if arch in ("gemma", "gemma2", "gemma3"):
        base["head_dim"] = 16  # its default (256) is not hidden / heads
    if arch == "gemma3":  # one local and one global layer: a RoPE base each (10k and 1M), a window past the context
        base["layer_types"] = ["sliding_attention", "full_attention"]
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


# A format's random blocks: (fp16 field offsets, scale of its `d` for weights of std ~sigma, min as a multiple of d)
_BLOCK_FIELDS: dict[str, tuple[int, float, float | None]] = {
    "Q8_0": (0, 1 / 74, None), "Q4_0": (0, 1 / 4.6, None), "Q4_1": (0, 1 / 4.6, -7.5), "Q5_0": (0, 1 / 9.2, None),
    "Q5_1": (0, 1 / 9.2, -15.5), "Q4_K": (0, 1 / 200, 7.5), "Q5_K": (0, 1 / 400, 15.5), "Q6_K": (208, 1 / 1332, None),
}


def random_ggml_blocks(format_name: str, n: int, k: int, seed: int = 0, sigma: float = 0.1) -> Any:
    """`[n, row_bytes]` uint8 (numpy): n rows of k values in ggml's `format_name` blocks with random codes and
    sub-block scales, the fp16 scales set so that the values' spread is about `sigma` (random bytes there could
    be NaN or huge). For tests of GGUF readers: no quantiser needed, every bit pattern of the codes occurs."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[format_name]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)
    offset, unit, minimum = _BLOCK_FIELDS[format_name]
    d = (sigma * unit * rng.uniform(0.5, 1.5, size=(n, k // values))).astype(np.float16)
    blocks[:, :, offset:offset + 2] = d.view(np.uint8).reshape(n, k // values, 2)
    if minimum is not None:  # Q4_1/Q5_1: the block's minimum (negative); K-quants: dmin
        m = (d.astype(np.float32) * minimum).astype(np.float16)
        blocks[:, :, offset + 2:offset + 4] = m.view(np.uint8).reshape(n, k // values, 2)
    return blocks.reshape(n, -1)


GGUF_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def gguf_byte_vocabulary() -> list[str]:
    """A byte-level BPE vocabulary (GPT-2's byte alphabet, three specials, one merge) for tiny GGUF files."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [*GGUF_SPECIALS, *sorted(bytes_to_unicode().values()), "Ġt"]


def add_byte_tokenizer(writer: Any, chat_template: str | None = TINY_CHAT_TEMPLATE) -> int:
    """Write `gguf_byte_vocabulary` as a GGUF's gpt2-style tokenizer (`<|im_start|>` BOS, `<|im_end|>` EOS, the
    chat template); returns the vocabulary's size."""
    tokens = gguf_byte_vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(GGUF_SPECIALS) + [1] * (len(tokens) - len(GGUF_SPECIALS)))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    return len(tokens)


def add_gguf_architecture(writer: Any, config: Any, rms_eps: float) -> None:
    """A decoder's shapes as a GGUF's architecture metadata (what transformers reads back into a config)."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(rms_eps)
    writer.add_vocab_size(config.vocab_size)


def write_tiny_gguf(path: str | Path, tokenizer_gguf: str | Path | None = None, arch: str = "qwen3",
                    formats: tuple[str, ...] = ("Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q4_0", "Q5_K", "Q4_1", "Q5_1"),
                    seed: int = 0) -> Path:
    """A 2-layer GGUF of `arch` (llama, qwen2, qwen3; hidden 256, so that K-quants fit; 2 heads of 128, one KV
    head) with random weights: the
    linears in `formats` in turn, the embedding Q8_0, norms F32; the vocabulary, merges and chat template copied
    from `tokenizer_gguf` (a real model's file), else `add_byte_tokenizer`'s."""
    import gguf
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    source = gguf.GGUFReader(str(tokenizer_gguf)) if tokenizer_gguf is not None else None
    vocab_size = len(source.fields["tokenizer.ggml.tokens"].contents()) if source else len(gguf_byte_vocabulary())
    # head_dim = hidden / heads: transformers reads no key_length from a GGUF (Qwen3's default is 128)
    config = tiny_config(arch, vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=128, tie_word_embeddings=True)
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    writer = gguf.GGUFWriter(str(path), arch)
    add_gguf_architecture(writer, config, rms_eps=1e-6)
    writer.add_key_length(128)
    writer.add_value_length(128)
    if source is None:
        add_byte_tokenizer(writer)
    for key, field in source.fields.items() if source else ():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    rng = np.random.default_rng(seed)
    turn = 0
    for hf_name, shape in shapes.items():
        if hf_name == "lm_head.weight":
            continue  # tied: the file has no output tensor
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if len(shape) == 1:  # norms near 1, biases near 0
            centre = 0.0 if hf_name.endswith(".bias") else 1.0
            writer.add_tensor(name, (centre + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        kind = "Q8_0" if "embed" in hf_name else formats[turn % len(formats)]
        turn += "embed" not in hf_name
        sigma = 0.2 if "embed" in hf_name else 0.1
        blocks = random_ggml_blocks(kind, shape[0], shape[1], seed=seed + turn, sigma=sigma)
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
