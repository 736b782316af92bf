"""Load an HF causal LM and its fast tokenizer onto the chosen device and dtype."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenflow.config import EngineConfig
from tokenflow.errors import ModelLoadError
from tokenflow.progress import on_terminal, quiet_transformers
from tokenflow.runtime.cpu.features import has_native_bf16
from tokenflow.runtime.cpu.malloc_tuning import keep_freed_memory

__all__ = ("LoadedModel", "load_model", "resolve_device", "resolve_dtype")

log = logging.getLogger("tokenflow")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} was asked for but CUDA is not available on this machine")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 where the hardware computes in it (CUDA with bf16, CPUs with AVX512-BF16 or AMX:
    the faster default, as in vLLM), fp16 on older CUDA GPUs, fp32 elsewhere (emulated bf16 is slower)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and has_native_bf16():
        return torch.bfloat16
    return torch.float32


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int


def weight_bytes(path: Path, dtype: torch.dtype) -> int:
    """Bytes the checkpoint's tensors take in `dtype`, read from the safetensors headers (0 when it has none)."""
    from safetensors import safe_open

    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += math.prod(f.get_slice(name).get_shape()) * size
    return total


def gguf_kept_quantized(config: EngineConfig, device: torch.device, dtype: torch.dtype, folder: Path,
                        gguf_file: Path) -> bool:
    """Whether a .gguf model (its config in `folder`) runs its tensors as the file holds them (else they are
    dequantised once), logged where it was asked for but cannot."""
    import json

    from tokenflow.runtime.gguf_model import GGUF_ARCHITECTURES

    if config.gguf_weights != "quantized":
        return False
    reasons = []
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        reasons.append(f"it runs on CPU in bf16 or fp32, not {device.type} {dtype}")
    if config.backend != "paged" or config.quantization:
        reasons.append("it runs on the paged backend without quantization='int8'")
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if model_type not in GGUF_ARCHITECTURES:
        reasons.append(f"architecture {model_type!r} is not one of {', '.join(GGUF_ARCHITECTURES)}")
    if reasons:
        log.warning("%s: GGUF weights dequantised to fp32 (%s)", gguf_file.name, "; ".join(reasons))
    return not reasons


def load_model(path: Path, config: EngineConfig, gguf_file: Path | None = None) -> LoadedModel:
    """Blocking: run in a worker thread. `gguf_file`: the weights of a .gguf model (`path` holds its config
    and tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if device.type == "cpu" and config.cpu_keep_freed_memory:
        keep_freed_memory()
    quantized_gguf = gguf_file is not None and gguf_kept_quantized(config, device, dtype, path, gguf_file)
    if gguf_file is not None and not quantized_gguf:
        from tokenflow.hub.resolve import dequantized_gguf

        path = dequantized_gguf(gguf_file, progress=on_terminal())
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if quantized_gguf:
            from tokenflow.runtime.gguf_model import load_gguf_model

            assert gguf_file is not None
            model = load_gguf_model(path, gguf_file, dtype)
        else:
            # device_map loads each tensor straight onto the device (accelerate), so on CUDA the weights
            # never sit in host RAM first; one code path for every device
            with quiet_transformers(not on_terminal()):
                model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": str(device)})
    except torch.OutOfMemoryError as exc:
        needed, name = weight_bytes(path, dtype) / 2**30, str(dtype).removeprefix("torch.")
        raise ModelLoadError(
            f"out of memory loading the weights of {path} ({needed:.2f} GiB in {name} on {device}): pick a "
            f"smaller dtype (bfloat16 or float16), a smaller model, or another device; {exc}"
        ) from exc
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"could not load the model from {path}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{path}: tokenflow needs a fast (Rust) tokenizer (tokenizer.json)")
    model.eval()
    model.requires_grad_(False)

    model_len = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    max_model_len = min(config.max_model_len or model_len, model_len)
    if config.attention_policy.window is not None and config.max_model_len:
        max_model_len = config.max_model_len  # distances stay within the window: past the trained context is fine
    elif config.max_model_len and config.max_model_len > model_len:
        log.warning("max_model_len=%d is beyond the model's %d; using %d", config.max_model_len, model_len, model_len)
    eos: set[int] = set()
    for source in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(source, int):
            eos.add(source)
        elif source:
            eos.update(int(t) for t in source)
    vocab_size = int(model.config.vocab_size)
    return LoadedModel(model, tokenizer, device, dtype, max_model_len, frozenset(eos), vocab_size)
