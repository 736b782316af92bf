"""RMSNorm as one `F.rms_norm` call instead of HF's chain of tensor ops.

Llama, Qwen2, Qwen3 and Mistral share one RMSNorm forward (upcast to fp32, square,
mean, add eps, rsqrt, multiply, round to the model dtype, multiply by the weight).
`F.rms_norm` does the fp32 part with the same arithmetic in the same order, as one op,
so the output is bit-identical in every dtype:

* fp32: `F.rms_norm(x, weight)`: one op instead of a chain, and each layer runs two norms,
  so the saved op overhead adds up over a forward, with logits equal to the last bit.
* bf16 / fp16: `weight * F.rms_norm(x.float()).to(dtype)`: HF rounds to the model dtype
  before multiplying by the weight, so the weight stays outside (four ops instead of eight).
* bf16 and fp32 on CPU with tokenflow's native kernels (`native_kernels`): one C call per
  norm (`NativeKernels.rms_norm`), the same arithmetic with the sum of squares in another
  order, so outputs can differ from HF's in the last bit; one pass over the row instead of
  several ops that each read it (F.rms_norm on CPU is itself a chain of ops). fp32 steps'
  norms took ~2.7 ms of a 16-row decode step with F.rms_norm.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from tokenflow.runtime.cpu.native_kernels import NativeKernels
    from tokenflow.runtime.gpu.triton_pointwise import TritonPointwise

__all__ = ("fuse_rms_norms", "is_plain_rms_norm")

# Classes whose forward is exactly `weight * (x * rsqrt(mean(x^2) + variance_epsilon))`.
_PLAIN_RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "Phi3RMSNorm",
                              "GraniteRMSNorm"})


def _fused_forward(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(hidden_states, (hidden_states.shape[-1],), module.weight, module.variance_epsilon)


def _fused_forward_rounded(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    normed = F.rms_norm(hidden_states.float(), (hidden_states.shape[-1],), None, module.variance_epsilon)
    return module.weight * normed.to(hidden_states.dtype)


def _native_forward(module: torch.nn.Module, native: NativeKernels | TritonPointwise,
                    hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != module.weight.dtype or not hidden_states.is_contiguous():
        fallback = _fused_forward if module.weight.dtype == torch.float32 else _fused_forward_rounded
        return fallback(module, hidden_states)
    return native.rms_norm(hidden_states, module.weight, module.variance_epsilon)


def is_plain_rms_norm(module: object) -> TypeGuard[torch.nn.Module]:
    """Whether `module` is one of the RMSNorms whose forward is exactly the one above."""
    return (type(module).__name__ in _PLAIN_RMS_NORMS and getattr(module, "weight", None) is not None
            and hasattr(module, "variance_epsilon"))


def fuse_rms_norms(model: torch.nn.Module, native: NativeKernels | TritonPointwise | None = None) -> int:
    """Route each known RMSNorm of `model` through `F.rms_norm` (bf16 and fp32 ones through `native`'s kernel when
    given: the CPU's C kernels, or the GPU's Triton ones); returns how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__ not in _PLAIN_RMS_NORMS:
            continue
        weight = getattr(module, "weight", None)
        if weight is None or not hasattr(module, "variance_epsilon"):
            continue
        if native is not None and weight.dtype in (torch.bfloat16, torch.float32):
            module.forward = functools.partial(_native_forward, module, native)
        else:
            forward = _fused_forward if weight.dtype == torch.float32 else _fused_forward_rounded
            module.forward = functools.partial(forward, module)
        count += 1
    return count
