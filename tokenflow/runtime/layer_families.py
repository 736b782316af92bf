"""Per-family descriptions of one decoder layer, in the terms the fused loop (`fused_layers.py`) runs.

Why: the dense decoder families users run differ from Llama's layer in a few named places (where the Q, K, V
and gate/up weights live, extra norms, biases), not in their arithmetic's shape. Describing those places once
per family lets every family feed the same kernels and the same C decode loop, instead of a copy of the loop
per family or transformers' modules with their per-op overhead.

A family is matched by `model_type`, then every layer is checked against its description (`describes`), so a
checkpoint that differs (a bias where none is expected, another activation, a partial rotary) keeps running
through its HF modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenflow.runtime.cpu.rms_norm import is_plain_rms_norm
from tokenflow.runtime.gated_mlp import is_silu

__all__ = ("LayerFamily", "LayerWeights", "describes", "family_for", "layer_weights")


@dataclass(frozen=True, slots=True)
class LayerFamily:
    """Where a family's layer keeps what the fused layer runs: `norm(x)`, one QKV projection (biases allowed
    where `qkv_bias`), [per-head Q/K norms], RoPE, attention, the output projection plus the residual,
    `norm(x)`, one gate+up projection, SiLU product, the down projection plus the residual."""

    name: str
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # attention's projections, concatenated in this order
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")  # the MLP's gate then up projections
    activation: str = "act_fn"  # the MLP's activation attribute (must be SiLU)
    qkv_bias: bool = False  # Q, K and V may carry biases (all or none)
    head_norms: bool = False  # an RMSNorm over each Q head and each K head before RoPE (Qwen3)


LLAMA = LayerFamily("llama")
FAMILIES: dict[str, LayerFamily] = {
    "llama": LLAMA,
    "mistral": LayerFamily("mistral"),
    "qwen2": LayerFamily("qwen2", qkv_bias=True),
    "qwen3": LayerFamily("qwen3", head_norms=True),
    "phi3": LayerFamily("phi3", qkv=("qkv_proj",), gate_up=("gate_up_proj",), activation="activation_fn"),
}


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One layer's weights in the fused loop's concatenations."""

    qkv: torch.Tensor  # [(H + 2 KVH) D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor  # [2 I, hidden]: gate rows, then up rows
    down: torch.Tensor
    q_norm: torch.nn.Module | None  # per-head norms (head_norms)
    k_norm: torch.nn.Module | None


def family_for(config: object) -> LayerFamily | None:
    """The description of `config`'s family where the fused loop runs it: RoPE over the whole head, no window."""
    family = FAMILIES.get(str(getattr(config, "model_type", None)))
    if family is None or getattr(config, "sliding_window", None) is not None:  # HF's attention guards a window
        return None
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return None
    return family


def _linears(owner: object, names: tuple[str, ...]) -> list[torch.nn.Linear] | None:
    parts = [getattr(owner, name, None) for name in names]
    return parts if all(type(p) is torch.nn.Linear for p in parts) else None  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class _Parts:
    qkv: list[torch.nn.Linear]
    o: torch.nn.Linear
    gate_up: list[torch.nn.Linear]
    down: torch.nn.Linear
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None


def _parts(layer: torch.nn.Module, family: LayerFamily) -> _Parts | None:
    """`layer`'s modules as `family` describes them, or None where the layer does anything else."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    qkv, o = _linears(attn, family.qkv), _linears(attn, ("o_proj",))
    gate_up, down = _linears(mlp, family.gate_up), _linears(mlp, ("down_proj",))
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    if any(p.bias is not None for p in (*o, *gate_up, *down)) or not is_silu(getattr(mlp, family.activation, None)):
        return None
    with_bias = [p.bias is not None for p in qkv]
    if any(with_bias) and not (family.qkv_bias and all(with_bias)):
        return None
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if not all(is_plain_rms_norm(n) for n in norms):
        return None
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if family.head_norms != (q_norm is not None) or family.head_norms != (k_norm is not None):
        return None
    if family.head_norms and not (is_plain_rms_norm(q_norm) and is_plain_rms_norm(k_norm)):
        return None
    return _Parts(qkv, o[0], gate_up, down[0], q_norm, k_norm)


def describes(layer: torch.nn.Module, family: LayerFamily) -> bool:
    """Whether `layer` is exactly what `family` describes (nothing is concatenated)."""
    return _parts(layer, family) is not None


def layer_weights(layer: torch.nn.Module, family: LayerFamily) -> LayerWeights:
    """`layer`'s weights in the loop's concatenations (new tensors, for one layer at a time); `layer` must be one
    `family` describes."""
    parts = _parts(layer, family)
    if parts is None:
        raise ValueError(f"{type(layer).__name__} is not a {family.name} layer as the fused loop runs it")
    biases = [p.bias for p in parts.qkv if p.bias is not None]
    with torch.no_grad():
        return LayerWeights(
            qkv=_concatenated([p.weight for p in parts.qkv]),
            qkv_bias=_concatenated(biases) if biases else None,
            o=parts.o.weight,
            gate_up=_concatenated([p.weight for p in parts.gate_up]),
            down=parts.down.weight,
            q_norm=parts.q_norm,
            k_norm=parts.k_norm,
        )


def _concatenated(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked along their first dimension; a single part as it is (no copy)."""
    return torch.cat(parts) if len(parts) > 1 else parts[0]
