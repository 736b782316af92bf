"""SiLU-gated MLPs (`down(silu(gate(x)) * up(x))`) computed in place.

HF's Llama / Qwen / Mistral MLP allocates two fresh intermediate tensors per
layer (the SiLU output and the product). Doing both in the gate projection's
own output buffer is the same arithmetic, so the result is bit-identical, and
it keeps the data in cache instead of touching two fresh buffers per layer.
Inference only: in-place ops would break autograd.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ("inplace_gated_mlps", "is_gated_silu_mlp", "is_gelu", "is_silu")


def is_gated_silu_mlp(module: torch.nn.Module) -> bool:
    """Whether `module` is a bias-free `down(silu(gate(x)) * up(x))` MLP (the Llama shape)."""
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, torch.nn.Linear) and p.bias is None for p in parts):
        return False
    return is_silu(getattr(module, "act_fn", None))


def is_silu(module: object) -> bool:
    """Whether `module` is torch's SiLU or transformers' SiLUActivation."""
    return isinstance(module, torch.nn.SiLU) or type(module).__name__ in ("SiLUActivation", "SiLU")


# transformers' GELU modules (exact and tanh-approximated) and torch's own: element-wise, run as the modules run
_GELUS = ("GELUActivation", "GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation", "GELU")


def is_gelu(module: object) -> bool:
    """Whether `module` is one of the element-wise GELU modules (Gemma's MLP activation)."""
    return isinstance(module, torch.nn.GELU) or type(module).__name__ in _GELUS


def _inplace_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    hidden = module.gate_proj(x)  # a fresh tensor: safe to overwrite
    F.silu(hidden, inplace=True)
    hidden.mul_(module.up_proj(x))
    return module.down_proj(hidden)


def inplace_gated_mlps(model: torch.nn.Module) -> int:
    """Route every SiLU-gated MLP of `model` through the in-place forward; returns how many."""
    count = 0
    for module in model.modules():
        if is_gated_silu_mlp(module):
            module.forward = functools.partial(_inplace_forward, module)
            count += 1
    return count
