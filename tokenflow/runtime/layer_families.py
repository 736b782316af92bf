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

from tokenflow.runtime.cpu.gguf_linear import QuantizedLinear
from tokenflow.runtime.cpu.rms_norm import is_plain_rms_norm
from tokenflow.runtime.gated_mlp import is_gelu, is_silu

__all__ = ("LayerFamily", "LayerLinears", "LayerWeights", "describes", "embedding_multiplier", "family_for",
           "final_norm_runs", "head_weight", "layer_linears", "layer_weights", "logits_divisor")


@dataclass(frozen=True, slots=True)
class LayerFamily:
    """Where a family's layer keeps what the fused layer runs: [`norm(x)`], one QKV projection (biases allowed
    where `qkv_bias`), [Q/K norms], RoPE, attention, the output projection [normed] plus the residual, [`norm(x)`],
    one gate+up projection, SiLU (or GELU: Gemma) product, the down projection [normed] plus the residual. The
    norms in brackets are the ones the family names (Llama: before each sublayer; OLMo2: on each sublayer's output;
    Gemma 3: both)."""

    name: str
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # attention's projections, concatenated in this order
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")  # the MLP's gate then up projections
    activation: str = "act_fn"  # the MLP's activation attribute (SiLU, or a GELU module the loop calls)
    qkv_bias: bool = False  # Q, K and V may carry biases (all or none)
    head_norms: bool = False  # an RMSNorm over each Q head and each K head before RoPE (Qwen3)
    width_norms: bool = False  # an RMSNorm over all of Q and all of K before RoPE (OLMo2)
    attention_in_norm: str | None = "input_layernorm"  # the layer's norms by attribute, where the family has them
    attention_out_norm: str | None = None
    mlp_in_norm: str | None = "post_attention_layernorm"
    mlp_out_norm: str | None = None
    other_norm: str | None = None  # an RMSNorm class of other roundings than Llama's, run as its own module
    # Granite's multipliers: the embeddings times the model's `embedding_multiplier`, each sublayer's output times
    # the layer's `residual_multiplier` before its residual add (folded into the o and down weights here), the
    # logits divided by the config's `logits_scaling` (folded into the head's weights by the fused decoder)
    multipliers: bool = False


LLAMA = LayerFamily("llama")
FAMILIES: dict[str, LayerFamily] = {
    "llama": LLAMA,
    "mistral": LayerFamily("mistral"),
    "qwen2": LayerFamily("qwen2", qkv_bias=True),
    "qwen3": LayerFamily("qwen3", head_norms=True),
    "phi3": LayerFamily("phi3", qkv=("qkv_proj",), gate_up=("gate_up_proj",), activation="activation_fn"),
    "granite": LayerFamily("granite", multipliers=True),
    "olmo2": LayerFamily("olmo2", width_norms=True, attention_in_norm=None,
                         attention_out_norm="post_attention_layernorm", mlp_in_norm=None,
                         mlp_out_norm="post_feedforward_layernorm", other_norm="Olmo2RMSNorm"),
    # Gemma's norms scale by (1 + weight) in fp32 and its embeddings by sqrt(hidden) (inside its embedding module)
    "gemma": LayerFamily("gemma", other_norm="GemmaRMSNorm"),
    "gemma3_text": LayerFamily("gemma3_text", head_norms=True, attention_out_norm="post_attention_layernorm",
                               mlp_in_norm="pre_feedforward_layernorm", mlp_out_norm="post_feedforward_layernorm",
                               other_norm="Gemma3RMSNorm"),
}


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One layer's weights in the fused loop's concatenations."""

    qkv: torch.Tensor  # [(H + 2 KVH) D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor  # [2 I, hidden]: gate rows, then up rows
    down: torch.Tensor
    q_norm: torch.nn.Module | None  # per-head (head_norms) or whole-width (width_norms) norms
    k_norm: torch.nn.Module | None
    norms: tuple[torch.nn.Module | None, ...]  # attention in, attention out, MLP in, MLP out (None: none there)
    activation: torch.nn.Module | None  # a GELU module the loop calls on the gate; None: SiLU (the native product)


def model_window(config: object) -> int | None:
    """The sliding window `config` declares, or None: Qwen2-MoE and others keep `sliding_window` (0 in
    Qwen2-MoE's defaults) while `use_sliding_window` is off, and a window of 0 masks nothing either."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def family_for(config: object, max_context: int | None = None) -> LayerFamily | None:
    """The description of `config`'s family where the fused loop runs it: RoPE over the whole head, no window
    shorter than `max_context` (the longest context the runner allows), no logit soft-capping."""
    family = FAMILIES.get(str(getattr(config, "model_type", None)))
    if family is None:
        return None
    window = model_window(config)  # HF's attention guards a window; here it must mask nothing
    if window is not None and (max_context is None or window < max_context):
        return None
    if any(getattr(config, name, None) is not None for name in ("attn_logit_softcapping", "final_logit_softcapping")):
        return None
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return None
    return family


def _linears(owner: object, names: tuple[str, ...]) -> list[torch.nn.Linear] | None:
    """The linears `names` of `owner`: plain `nn.Linear`s or GGUF ones (ggml blocks), nothing else."""
    parts = [getattr(owner, name, None) for name in names]
    return parts if all(type(p) in (torch.nn.Linear, QuantizedLinear) for p in parts) else None  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class LayerLinears:
    """One layer's modules as its family names them: the linears (for the fused loop's concatenations, or as
    they are where they cannot be concatenated: GGUF's blocks), the Q/K norms and the norms by place."""

    qkv: list[torch.nn.Linear]
    o: torch.nn.Linear
    gate_up: list[torch.nn.Linear]
    down: torch.nn.Linear
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None
    residual_multiplier: float  # Granite's: times the o and down outputs
    norms: tuple[torch.nn.Module | None, ...]  # as LayerWeights'
    activation: torch.nn.Module | None  # as LayerWeights'


def _parts(layer: torch.nn.Module, family: LayerFamily) -> LayerLinears | None:
    """`layer`'s modules as `family` describes them, or None where the layer does anything else."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    qkv, o = _linears(attn, family.qkv), _linears(attn, ("o_proj",))
    gate_up, down = _linears(mlp, family.gate_up), _linears(mlp, ("down_proj",))
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    activation = getattr(mlp, family.activation, None)
    if any(p.bias is not None for p in (*o, *gate_up, *down)) or not (is_silu(activation) or is_gelu(activation)):
        return None
    with_bias = [p.bias is not None for p in qkv]
    if any(with_bias) and not (family.qkv_bias and all(with_bias)):
        return None
    places = (family.attention_in_norm, family.attention_out_norm, family.mlp_in_norm, family.mlp_out_norm)
    norms = tuple(getattr(layer, name, None) if name else None for name in places)
    if not all(_is_norm(n, family) for name, n in zip(places, norms, strict=True) if name):
        return None
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    qk_norms = family.head_norms or family.width_norms
    if qk_norms != (q_norm is not None) or qk_norms != (k_norm is not None):
        return None
    if qk_norms and not (_is_norm(q_norm, family) and _is_norm(k_norm, family)):
        return None
    multiplier = getattr(layer, "residual_multiplier", None) if family.multipliers else 1.0
    if not isinstance(multiplier, (int, float)):
        return None
    return LayerLinears(qkv, o[0], gate_up, down[0], q_norm, k_norm, float(multiplier), norms,
                        None if is_silu(activation) else activation)


def _is_norm(module: object, family: LayerFamily) -> bool:
    """An RMSNorm the fused loop runs: one of Llama's roundings, or the family's own class (as its module)."""
    if is_plain_rms_norm(module):
        return True
    return (family.other_norm is not None and type(module).__name__ == family.other_norm
            and getattr(module, "weight", None) is not None)


def final_norm_runs(model: torch.nn.Module, family: LayerFamily) -> bool:
    """Whether the model's final norm is one the fused loop runs for `family`."""
    return _is_norm(getattr(model.model, "norm", None), family)


def describes(layer: torch.nn.Module, family: LayerFamily) -> bool:
    """Whether `layer` is exactly what `family` describes (nothing is concatenated)."""
    return _parts(layer, family) is not None


def layer_weights(layer: torch.nn.Module, family: LayerFamily) -> LayerWeights:
    """`layer`'s weights in the loop's concatenations (new tensors, for one layer at a time); `layer` must be one
    `family` describes."""
    parts = layer_linears(layer, family)
    biases = [p.bias for p in parts.qkv if p.bias is not None]
    scale = parts.residual_multiplier
    with torch.no_grad():
        return LayerWeights(
            qkv=_concatenated([p.weight for p in parts.qkv]),
            qkv_bias=_concatenated(biases) if biases else None,
            o=parts.o.weight if scale == 1.0 else parts.o.weight * scale,
            gate_up=_concatenated([p.weight for p in parts.gate_up]),
            down=parts.down.weight if scale == 1.0 else parts.down.weight * scale,
            q_norm=parts.q_norm,
            k_norm=parts.k_norm,
            norms=parts.norms,
            activation=parts.activation,
        )


def layer_linears(layer: torch.nn.Module, family: LayerFamily) -> LayerLinears:
    """`layer`'s linear modules; `layer` must be one `family` describes."""
    parts = _parts(layer, family)
    if parts is None:
        raise ValueError(f"{type(layer).__name__} is not a {family.name} layer as the fused loop runs it")
    return parts


def embedding_multiplier(model: torch.nn.Module, family: LayerFamily) -> float:
    """What the family multiplies the embeddings by (Granite's `embedding_multiplier`; 1 elsewhere)."""
    return float(getattr(model.model, "embedding_multiplier", 1.0)) if family.multipliers else 1.0


def head_weight(model: torch.nn.Module, family: LayerFamily) -> torch.Tensor:
    """The head's weight with the family's logit scaling folded in (Granite divides the logits by
    `logits_scaling`): the model's own tensor where there is none."""
    divisor = logits_divisor(model, family)
    weight = model.lm_head.weight
    if divisor == 1.0:
        return weight
    with torch.no_grad():
        return weight / divisor


def logits_divisor(model: torch.nn.Module, family: LayerFamily) -> float:
    """What the family divides the logits by (Granite's `logits_scaling`; 1 elsewhere)."""
    return float(getattr(model.config, "logits_scaling", 1.0) or 1.0) if family.multipliers else 1.0


def _concatenated(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked along their first dimension; a single part as it is (no copy)."""
    return torch.cat(parts) if len(parts) > 1 else parts[0]
