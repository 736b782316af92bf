"""`quantization="int8"`: the fused decoder's linear layers as int8.

On CPU (`runtime.cpu.int8_linear`): int8 weights and per-token int8 activations on VNNI. At load, once
per model: a calibration pass over `calibration.txt` (chat turns written for this purpose: prose, code,
lists, JSON, numbers, several languages) through the runner records the largest |x| of each input
channel of each linear; each weight is then smoothed and quantised, and the result is saved under
`tokenflow_home()/quantized`, keyed by the model's fingerprint, the text and the scheme, so the next
start loads it instead. The model's own float weights of the quantised layers are released afterwards
(the int8 copies are what the steps read).

On CUDA: weight-only int8 through torchao (`Int8WeightOnlyConfig`, symmetric per output channel),
the activations stay bf16; no calibration, so nothing is cached.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenflow.errors import ModelLoadError
from tokenflow.extras import require
from tokenflow.kv.kv_cache import KVCache
from tokenflow.runtime.cpu.int8_linear import SMOOTH_ALPHA, Int8Linear, Int8Weight, load_int8_kernels, quantize_weight

if TYPE_CHECKING:
    from tokenflow.runtime.fused_layers import FusedDecoder
    from tokenflow.runtime.paged_runner import PagedModelRunner

__all__ = ("activation_maxima", "calibration_tokens", "quantize_runner", "quantize_weight_only")

log = logging.getLogger("tokenflow")

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
SCHEME = f"int8-w-per-channel-a-per-token-smooth{SMOOTH_ALPHA}-v1"
CALIBRATION_CHUNK = 512


def calibration_tokens(tokenizer: Any) -> list[int]:
    """The calibration text as the model sees chats: its turns through the chat template, when there is one."""
    messages = []
    for line in CALIBRATION_TEXT.read_text().split("\n"):
        role, sep, content = line.partition(": ")
        if sep and role in ("user", "assistant"):
            messages.append({"role": role, "content": content})
        elif messages:
            messages[-1]["content"] += "\n" + line
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    else:
        text = "\n".join(m["content"] for m in messages)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def activation_maxima(runner: PagedModelRunner, tokens: list[int]) -> dict[str, torch.Tensor]:
    """The largest |x| of every input channel of every fused linear over `tokens` (a prefill through the
    runner in a scratch cache; every position's logits, so the head sees every row too)."""
    from tokenflow.runtime.paged_runner import SeqChunk

    fused = runner.fused
    assert fused is not None
    maxima: dict[str, torch.Tensor] = {}
    originals = fused.linears()

    def recorder(name: str, linear: Any) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            seen = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()
            maxima[name] = torch.maximum(maxima[name], seen) if name in maxima else seen
            return linear(x)

        return forward

    cache = runner.kv_cache
    bs = cache.block_size
    scratch = KVCache(num_layers=cache.num_layers, num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim,
                      num_blocks=-(-len(tokens) // bs) + 1, block_size=bs, dtype=cache.dtype, device=cache.device)
    table = list(range(scratch.num_blocks))
    try:
        for name, linear in originals.items():
            fused.set_linear(name, recorder(name, linear))
        # one sequence, or sequences no longer than a model-native window (the fused layers run none past it)
        length = fused.window or len(tokens)
        for sequence in range(0, len(tokens), length):
            text = tokens[sequence:sequence + length]
            for start in range(0, len(text), CALIBRATION_CHUNK):
                piece = text[start:start + CALIBRATION_CHUNK]
                step = runner.prepare([SeqChunk(piece, start, table, True, len(piece))], scratch)
                runner._forward(step)
    finally:
        for name, linear in originals.items():
            fused.set_linear(name, linear)
    return maxima


def _cache_path(folder: Path, model_key: bytes, tokens: list[int]) -> Path:
    h = hashlib.blake2b(model_key, digest_size=16)
    h.update(SCHEME.encode())
    h.update(repr(tokens).encode())
    return folder / f"{h.hexdigest()}.safetensors"


def quantize_runner(runner: PagedModelRunner, tokenizer: Any, model_key: bytes, folder: Path) -> int:
    """Swap the runner's fused linears for int8 ones (calibrated and quantised, or loaded from `folder`);
    returns the bytes of the int8 weights."""
    from safetensors.torch import load_file, save_file

    fused = runner.fused
    if fused is None:
        raise ModelLoadError("quantization='int8' runs Llama-family models (the fused layers)")
    if runner.device.type == "cuda":
        return quantize_weight_only(fused)
    if runner.device.type != "cpu":
        raise ModelLoadError(f"quantization='int8' runs on CPU and CUDA, not {runner.device.type}")
    kernels = load_int8_kernels()
    if kernels is None:
        raise ModelLoadError("quantization='int8' needs a CPU with AVX512-VNNI and a C compiler (see the log)")
    tokens = calibration_tokens(tokenizer)
    path = _cache_path(folder, model_key, tokens)
    names = list(fused.linears())
    weights: dict[str, Int8Weight] = {}
    if path.exists():
        try:
            stored = load_file(str(path))
            weights = {name: Int8Weight.from_tensors(stored, name) for name in names}
        except Exception as exc:  # a damaged or foreign file: quantise again and replace it
            log.warning("int8 weights at %s unreadable (%s); quantising again", path, exc)
            weights = {}
    if not weights:
        maxima = activation_maxima(runner, tokens)
        for name, (weight, bias) in fused.linear_weights().items():
            weights[name] = quantize_weight(weight, bias, maxima[name])
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({k: v for name, w in weights.items() for k, v in w.tensors(name).items()}, str(tmp))
        tmp.replace(path)
        log.info("int8 weights quantised and saved to %s", path)
    for name in names:
        fused.set_linear(name, Int8Linear(weights[name], kernels))
    _release_float_weights(fused)
    return sum(w.nbytes for w in weights.values())


def quantize_weight_only(fused: FusedDecoder) -> int:
    """Swap `fused`'s linears for torchao's weight-only int8 ones (the CUDA form; any device runs it);
    returns the bytes of the int8 weights and their scales."""
    torchao_quantization = require("torchao.quantization", "cuda-int8", "quantization='int8' on CUDA")
    Int8WeightOnlyConfig, quantize_ = torchao_quantization.Int8WeightOnlyConfig, torchao_quantization.quantize_
    total = 0
    for name, (weight, bias) in fused.linear_weights().items():
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        layer.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
        if bias is not None:
            layer.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
        quantize_(layer, Int8WeightOnlyConfig(set_inductor_config=False))
        fused.set_linear(name, layer)
        total += layer.weight.qdata.nbytes + layer.weight.scale.nbytes
    _release_float_weights(fused)
    return total


def _release_float_weights(fused: FusedDecoder) -> None:
    """Drop the float weights the int8 layers replace (not a head tied to the embedding, still read)."""
    model = fused.model
    embedding = model.get_input_embeddings().weight
    fused.release_layer_weights()
    if model.lm_head.weight.data_ptr() != embedding.data_ptr():
        model.lm_head.weight = torch.nn.Parameter(torch.empty(0, dtype=embedding.dtype), requires_grad=False)
