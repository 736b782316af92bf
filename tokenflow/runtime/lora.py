"""LoRA adapters (PEFT folders) served beside the base model: one batch holds rows of several adapters and
of none.

Each linear layer of the decoder gets a forward that adds, for the rows of each adapter in the step,
`scale * (x A^T) B^T` (the rows gathered per adapter, as Punica's and vLLM's segmented products do; never a
merge into the base weights, which would serve one adapter per step). The runner names the step's rows per
adapter (`step_rows`) around its forward; without rows the layer is the base layer. Adapters run on the
transformers modules: the fused CPU layers run packed copies of the base weights and are off while LoRA is
(`enable_lora`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenflow.errors import InvalidRequest

__all__ = ("LoraAdapter", "install_lora_layers", "load_adapter", "step_rows")

# PEFT options whose arithmetic differs from plain LoRA: refused by name rather than run wrong
_REFUSED = {"use_dora": "DoRA (use_dora)", "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
            "modules_to_save": "modules_to_save (whole modules replaced)", "alpha_pattern": "alpha_pattern",
            "lora_bias": "lora_bias"}
_PREFIX = "base_model.model."


@dataclass(eq=False)
class LoraAdapter:
    name: str
    path: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # module name -> (A [r, in], B [out, r], scale)
    key: bytes  # content hash: prefix-cache and response-cache keys of its requests


def load_adapter(name: str, folder: str | Path, model: torch.nn.Module) -> LoraAdapter:
    """A PEFT LoRA folder (`adapter_config.json`, `adapter_model.safetensors`) for `model`, in its dtype and
    device; `InvalidRequest` (field `lora`) naming what does not fit."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"LoRA adapter {name!r}: cannot read a PEFT folder at {folder}: {exc}",
                             field="lora") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise InvalidRequest(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA", field="lora")
    for option, what in _REFUSED.items():
        if config.get(option):
            raise InvalidRequest(f"LoRA adapter {name!r} uses {what}, which tokenflow does not run", field="lora")
    if config.get("bias", "none") != "none":
        raise InvalidRequest(f"LoRA adapter {name!r}: bias={config['bias']!r} is not run (only 'none')", field="lora")
    alpha = float(config.get("lora_alpha", 8))
    parameter = next(model.parameters())
    modules = dict(model.named_modules())
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    digest = hashlib.blake2b(digest_size=16, person=b"tokenflow-lora")
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for key in sorted(tensors):
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise InvalidRequest(f"LoRA adapter {name!r}: unexpected tensor {key}", field="lora")
            continue
        module_name = key.removeprefix(_PREFIX).removesuffix(".lora_A.weight")
        a, b = tensors[key], tensors.get(key.replace(".lora_A.", ".lora_B."))
        module = modules.get(module_name)
        if b is None or not isinstance(module, torch.nn.Linear):
            raise InvalidRequest(f"LoRA adapter {name!r}: {module_name} is not a linear layer of this model "
                                 "(an adapter for another model?)", field="lora")
        rank = a.shape[0]
        if a.shape != (rank, module.in_features) or b.shape != (module.out_features, rank):
            raise InvalidRequest(f"LoRA adapter {name!r}: {module_name} has A {tuple(a.shape)}, B {tuple(b.shape)}; "
                                 f"the layer is {module.in_features} -> {module.out_features}", field="lora")
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank  # per module: rank_pattern
        digest.update(key.encode() + a.float().numpy().tobytes() + b.float().numpy().tobytes())
        weights[module_name] = (a.to(parameter.dtype).to(parameter.device), b.to(parameter.dtype).to(parameter.device),
                                scale)
    if not weights:
        raise InvalidRequest(f"LoRA adapter {name!r}: no LoRA weights in {folder}", field="lora")
    return LoraAdapter(name, str(folder), weights, digest.digest())


_active = threading.local()  # the rows of the step being run on this thread, per adapter


@contextlib.contextmanager
def step_rows(rows: list[tuple[LoraAdapter, torch.Tensor]]) -> Iterator[None]:
    """Within: the LoRA layers add each adapter's product to its rows (`[n]` long packed row indices)."""
    previous = getattr(_active, "rows", None)
    _active.rows = rows
    try:
        yield
    finally:
        _active.rows = previous


class _LoraForward:
    """A linear layer's forward plus the step's adapters' products on their rows."""

    __slots__ = ("base", "name")

    def __init__(self, base: Any, name: str) -> None:
        self.base = base
        self.name = name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        rows: list[tuple[LoraAdapter, torch.Tensor]] | None = getattr(_active, "rows", None)
        if not rows:
            return out
        flat_x = x.reshape(-1, x.shape[-1])
        flat_out = out.view(-1, out.shape[-1])
        for adapter, index in rows:
            pair = adapter.weights.get(self.name)
            if pair is None:
                continue
            a, b, scale = pair
            delta = (flat_x.index_select(0, index) @ a.t()) @ b.t()
            flat_out.index_add_(0, index, delta, alpha=scale)
        return out


def install_lora_layers(model: torch.nn.Module) -> int:
    """Give every linear layer of the decoder (not the head) the LoRA forward; returns how many."""
    head = model.get_output_embeddings()
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            module.forward = _LoraForward(module.forward, name)
            count += 1
    return count
