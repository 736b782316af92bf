"""A transformers model over a GGUF file's tensors, the quantised ones kept as ggml blocks (`cpu/gguf_linear.py`).

The model's modules come from its config (built on the meta device, so no float copy of a weight is ever
made); then every tensor is read from the file by the `gguf` package's name map: linears and the embedding
become `QuantizedLinear` / `QuantizedEmbedding` over the file's blocks, norms and other small tensors are
dequantised into the model's dtype. The blocks are the file's pages, mapped read-only as llama.cpp maps them
(memory: the file's size, shared with the page cache; a file changed while an engine runs changes its weights).
llama.cpp's converter permutes the Q and K rows of Llama-architecture files for its RoPE; those rows are put
back in transformers' order here (whole rows move, so the blocks stay intact). Architectures whose files need
more than that (other permutations, shifted norms) are not kept quantised: the loader dequantises them once.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenflow.errors import ModelLoadError
from tokenflow.runtime.cpu.gguf_linear import (
    GGUFKernels,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    load_gguf_kernels,
    weight_supported,
)

__all__ = ("GGUF_ARCHITECTURES", "load_gguf_model", "quantized_bytes")

log = logging.getLogger("tokenflow")

# GGUF architectures kept quantised -> whether llama.cpp's converter permuted their Q/K rows (transformers names
# the model_type after the file's architecture)
GGUF_ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}


def _architecture(reader: Any) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelLoadError("the GGUF has no general.architecture: not a model file")
    return bytes(field.parts[field.data[0]]).decode()


def _unpermute_rows(data: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a Q or K weight back in transformers' order (llama.cpp's converter interleaved each head's halves)."""
    n = data.shape[0]
    half = n // heads // 2
    return data.reshape(heads, half, 2, *data.shape[1:]).transpose(1, 2).reshape(data.shape).contiguous()


class _Tensors:
    """The file's tensors by name: quantised ones as QuantizedWeight, others as float tensors."""

    def __init__(self, gguf_file: Path) -> None:
        from gguf import GGUFReader

        self.reader = GGUFReader(str(gguf_file))
        self.by_name = {t.name: t for t in self.reader.tensors}
        self._blocks: dict[str, QuantizedWeight] = {}  # a tied head reads the embedding's blocks, not a copy

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.by_name[name].shape))  # ggml lists the fastest dimension first

    def blocks(self, name: str) -> QuantizedWeight | None:
        """`name` as ggml blocks where gguf_blocks.c reads its format, else None."""
        if name in self._blocks:
            return self._blocks[name]
        tensor = self.by_name[name]
        shape = self.shape(name)
        if len(shape) != 2 or not weight_supported(int(tensor.tensor_type), shape[1]):
            return None
        with warnings.catch_warnings():  # read-only: nothing writes the blocks
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            raw = torch.from_numpy(tensor.data.view(np.uint8))  # the file's mapped pages, no copy (llama.cpp's mmap)
        blocks = self._blocks[name] = QuantizedWeight(raw.reshape(shape[0], -1), int(tensor.tensor_type), *shape)
        return blocks

    def dense(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """`name` dequantised by the gguf package, in `dtype`."""
        from gguf import quants

        tensor = self.by_name[name]
        values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(self.shape(name)).to(dtype)


def load_gguf_model(folder: Path, gguf_file: Path, dtype: torch.dtype) -> Any:
    """The model of `folder`'s config (written from the file's metadata by `hub.resolve`) with `gguf_file`'s
    tensors, on CPU in `dtype` (bf16 or fp32: the activations' dtype; quantised weights stay as they are)."""
    import gguf
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    kernels = load_gguf_kernels()
    if kernels is None:
        raise ModelLoadError("keeping GGUF weights quantised needs the C kernels (a C compiler, torch's libgomp): "
                             "see the log, or pass gguf_weights='dequantized'")
    tensors = _Tensors(gguf_file)  # reading the metadata (the vocabulary's strings) takes seconds: once
    architecture = _architecture(tensors.reader)
    if architecture not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {architecture!r} is not kept quantised (only "
                             f"{', '.join(GGUF_ARCHITECTURES)}); pass gguf_weights='dequantized'")
    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    arch_id = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[architecture]
    names = gguf.get_tensor_name_map(arch_id, int(config.num_hidden_layers))
    permuted = GGUF_ARCHITECTURES[architecture]

    def file_name(hf_name: str) -> str:
        found = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if found is None or found not in tensors.by_name:
            if hf_name == "lm_head.weight" and "token_embd.weight" in tensors.by_name:
                return "token_embd.weight"  # a head tied to the embedding
            raise ModelLoadError(f"{gguf_file.name} has no tensor for {hf_name} (looked for {found})")
        return found

    quantized = 0
    for module_name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear):
            replacement = _linear(module_name, module, tensors, file_name, kernels, dtype, config, permuted)
        elif isinstance(module, torch.nn.Embedding):
            replacement = _embedding(module_name, tensors, file_name, kernels, dtype)
        else:
            for param_name, param in list(module.named_parameters(recurse=False)):
                full = f"{module_name}.{param_name}" if module_name else param_name
                value = tensors.dense(file_name(full), dtype)
                if tuple(value.shape) != tuple(param.shape):
                    raise ModelLoadError(f"{gguf_file.name}: {full} is {tuple(value.shape)}, the config says "
                                         f"{tuple(param.shape)}")
                setattr(module, param_name, torch.nn.Parameter(value, requires_grad=False))
            continue
        quantized += isinstance(replacement, (QuantizedLinear, QuantizedEmbedding))
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise ModelLoadError(f"{gguf_file.name}: no tensors for {', '.join(leftover[:4])}")
    model.eval()
    model.requires_grad_(False)
    log.info("GGUF %s: %d linears and embeddings kept as ggml blocks (%.1f MiB)", gguf_file.name, quantized,
             quantized_bytes(model) / 2**20)
    return model


def _linear(name: str, module: torch.nn.Linear, tensors: _Tensors, file_name: Any, kernels: GGUFKernels,
            dtype: torch.dtype, config: Any, permuted: bool) -> torch.nn.Linear:
    """A QuantizedLinear over the file's tensor for `module` (a dense nn.Linear where its format is not one of
    gguf_blocks.c's)."""
    weight_name = file_name(f"{name}.weight")
    bias = tensors.dense(file_name(f"{name}.bias"), dtype) if module.bias is not None else None
    heads = 0
    if permuted and name.endswith("q_proj"):
        heads = int(config.num_attention_heads)
    elif permuted and name.endswith("k_proj"):
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    shape = tensors.shape(weight_name)
    if shape != (module.out_features, module.in_features):
        raise ModelLoadError(f"{weight_name} is {shape}, {name} needs {(module.out_features, module.in_features)}")
    blocks = tensors.blocks(weight_name)
    if blocks is not None:
        if heads:
            blocks = QuantizedWeight(_unpermute_rows(blocks.data, heads), blocks.format, blocks.n, blocks.k)
        return QuantizedLinear(blocks, kernels, dtype, bias)
    weight = tensors.dense(weight_name, dtype)
    if heads:
        weight = _unpermute_rows(weight, heads)
    dense = torch.nn.Linear(module.in_features, module.out_features, bias=bias is not None, dtype=dtype)
    dense.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        dense.bias = torch.nn.Parameter(bias, requires_grad=False)
    return dense


def _embedding(name: str, tensors: _Tensors, file_name: Any, kernels: GGUFKernels,
               dtype: torch.dtype) -> torch.nn.Embedding:
    weight_name = file_name(f"{name}.weight")
    blocks = tensors.blocks(weight_name)
    if blocks is not None:
        return QuantizedEmbedding(blocks, kernels, dtype)
    return torch.nn.Embedding.from_pretrained(tensors.dense(weight_name, dtype), freeze=True)


def quantized_bytes(model: torch.nn.Module) -> int:
    """Bytes of the ggml blocks the model's modules hold (a tied head shares the embedding's)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            seen[module.quantized.data.data_ptr()] = module.quantized.nbytes
    return sum(seen.values())
