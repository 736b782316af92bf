"""RMSNorm as one `F.rms_norm` call instead of HF's seven tensor ops.

Llama, Qwen2, Qwen3 and Mistral share one RMSNorm forward (upcast, square,
mean, add eps, rsqrt, multiply, multiply by the weight). `F.rms_norm` does the
same arithmetic in the same order, so in fp32 its output is bit-identical,
but as one op: measured on the 2-core CPU with SmolLM2-135M (61 norms per
forward), a batch-1 decode step 5.6% faster, batch-16 3.8%, a 512-token
prefill chunk 8.1%, with logits equal to the last bit. Other dtypes keep HF's
forward: HF rounds to the model dtype before multiplying by the weight and
`F.rms_norm` after, so they would differ.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ("fuse_rms_norms",)

# Classes whose forward is exactly `weight * (x * rsqrt(mean(x^2) + variance_epsilon))`.
_PLAIN_RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})


def _fused_forward(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(hidden_states, (hidden_states.shape[-1],), module.weight, module.variance_epsilon)


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Route each known fp32 RMSNorm of `model` through `F.rms_norm`; returns how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__ not in _PLAIN_RMS_NORMS:
            continue
        weight = getattr(module, "weight", None)
        if weight is None or weight.dtype != torch.float32 or not hasattr(module, "variance_epsilon"):
            continue
        module.forward = functools.partial(_fused_forward, module)
        count += 1
    return count
