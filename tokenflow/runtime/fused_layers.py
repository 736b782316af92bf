"""The decoder of Llama-like models (every family `layer_families.py` describes) as one flat loop of fused
operations.

Why: a step through the HF modules runs ~140 tensor ops and as many Python calls per layer (views,
transposes, RoPE's slices and concatenations, three projections for Q, K and V, two for the MLP),
and on a CPU that overhead, not the arithmetic, is most of a small model's decode step. This loop
reads the HF model's own weights (the model is not modified) and runs per layer: norm, one QKV
projection, RoPE on Q and K at once, paged attention, the output projection, norm, one gate+up
projection, SiLU-and-multiply, the down projection: about 20 ops (Qwen3: RMSNorm over each Q and K head
before RoPE).

Same arithmetic as transformers in the same order (a projection of concatenated weights computes
each output as the separate projection does; norms after selecting the sampled rows are row-wise),
so fp32 greedy output stays token-identical; the runner's self-check compares it with the model's
own attention at load. Models whose layers do anything their family's description does not say (logit
soft-capping, parallel blocks, another activation) are not matched and keep running through
their HF modules.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenflow.runtime.attention.paged import PagedAttentionMetadata, UnsupportedAttentionFeature
from tokenflow.runtime.cpu.decode_layers import DecodeLayerWeights, NativeDecodeLayers
from tokenflow.runtime.cpu.few_rows_linear import FEW_ROWS, FewRowsLinear, few_rows_linear
from tokenflow.runtime.cpu.gguf_linear import GGUFKernels, QuantizedLinear, StackedLinear
from tokenflow.runtime.cpu.greedy_head import greedy_head_for
from tokenflow.runtime.cpu.native_kernels import NativeKernels
from tokenflow.runtime.cpu.packed_linear import (
    PackedGatedMLP,
    PackedLinear,
    packed_dtypes,
    packed_linear,
    post_ops_available,
)
from tokenflow.runtime.cpu.resident_pages import drop_resident_pages
from tokenflow.runtime.cpu.rms_norm import is_plain_rms_norm
from tokenflow.runtime.gpu.triton_pointwise import TritonPointwise
from tokenflow.runtime.layer_families import (
    LayerFamily,
    LayerLinears,
    LayerWeights,
    describes,
    embedding_multiplier,
    family_for,
    final_norm_runs,
    head_weight,
    layer_linears,
    layer_weights,
    logits_divisor,
    model_window,
)
from tokenflow.runtime.sampler import GreedyTokens

PointwiseOps = NativeKernels | TritonPointwise  # RoPE, norms and the SiLU product as one call each

__all__ = ("FusedDecoder", "fused_decoder_for", "runs_own_copies")

Linear = Callable[[torch.Tensor], torch.Tensor]
Norm = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class _Layer:
    input_norm: Norm | None  # before attention (None: the family has none there, OLMo2)
    qkv: Linear  # [T, hidden] -> [T, (H + 2 KVH) D]
    o: Linear
    post_norm: Norm | None  # before the MLP
    gate_up: Linear  # [T, hidden] -> [T, 2 I]
    down: Linear
    scale: float
    q_norm: torch.nn.Module | None = None  # RMSNorm over each Q and each K head (Qwen3), or all of Q and K (OLMo2)
    k_norm: torch.nn.Module | None = None
    attention_out_norm: Norm | None = None  # OLMo2: on the output projection, before the residual add
    mlp_out_norm: Norm | None = None  # OLMo2: on the down projection, before the residual add
    activation: torch.nn.Module | None = None  # Gemma's GELU, called on the gate; None: SiLU
    rope: str | None = None  # the layer's RoPE by its layer type, where the model has one per type (Gemma 3)
    # oneDNN's post-op forms (CPU, packed weights): the output projection with the residual add, and the MLP
    o_residual: PackedLinear | None = None
    mlp: PackedGatedMLP | None = None


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, few_rows: bool) -> Linear:
    """`x @ weight.T + bias`, through oneDNN's packed layout (`pack`) and, for the few rows of a decode step,
    the few-rows kernel (`few_rows`), where they apply."""
    linear = packed_linear(weight, bias) if pack else None
    if linear is None:
        linear = lambda x: F.linear(x, weight, bias)  # noqa: E731
    return (few_rows_linear(weight, bias, linear) if few_rows else None) or linear


def _post_op_layer(weights: LayerWeights, pack: bool) -> tuple[PackedLinear, PackedGatedMLP] | None:
    """The output projection and MLP of a layer on oneDNN's post-ops, or None where they do not apply."""
    weight = weights.o
    if not pack or weight.device.type != "cpu" or weight.dtype not in packed_dtypes() or not post_ops_available():
        return None
    inter = weights.down.shape[1]
    return PackedLinear(weight), PackedGatedMLP(weights.gate_up[:inter], weights.gate_up[inter:], weights.down)


def _normed_linear(linear: Linear, norm: Norm | None, x: torch.Tensor) -> torch.Tensor:
    """`linear(norm(x))` (`linear(x)` without a norm): one call where the linear forms its input's norm itself
    (int8's `normed`)."""
    if norm is None:
        return linear(x)
    normed = getattr(linear, "normed", None) if is_plain_rms_norm(norm) else None
    return normed(x, norm) if normed is not None else linear(norm(x))


def _add_linear(linear: Linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`residual + linear(x)`: one call where the few-rows kernel adds as it stores its output."""
    if isinstance(linear, FewRowsLinear):
        return linear.add_to(x, residual)
    return residual + linear(x)


def _gated_product(gate_up: torch.Tensor, inter: int, activation: torch.nn.Module | None,
                   native: PointwiseOps | None) -> torch.Tensor:
    """`act(gate) * up` of `gate_up [T, 2 I]`: SiLU (`activation` None) in one native pass or two torch ops; the
    layer's own GELU module, then the product (transformers' roundings)."""
    if activation is not None:
        return activation(gate_up[:, :inter]).mul_(gate_up[:, inter:])
    if native is None:
        return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
    return native.silu_mul(gate_up)


def _gated_down(layer: _Layer, gate_up: torch.Tensor, inter: int, residual: torch.Tensor,
                native: PointwiseOps | None) -> torch.Tensor:
    """`residual + down(act(gate) * up)` (`residual + out_norm(down(...))` with the layer's MLP out norm): one call
    where the linear forms the SiLU product itself (int8's `gated`), else the product and the down projection with
    the add."""
    down, out_norm = layer.down, layer.mlp_out_norm
    gated = getattr(down, "gated", None) if layer.activation is None else None
    if gated is not None:
        out = gated(gate_up)
        return residual + (out_norm(out) if out_norm is not None else out)
    product = _gated_product(gate_up, inter, layer.activation, native)
    if out_norm is not None:
        return residual + out_norm(down(product))
    return _add_linear(down, product, residual)


def _add_norm(ops: TritonPointwise, x: torch.Tensor, residual: torch.Tensor, norm: torch.nn.Module
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual + x` and `norm` of it, in one kernel (a plain RMSNorm: `FusedDecoder.fused_adds`)."""
    return ops.add_rms_norm(x, residual, norm.weight, float(norm.variance_epsilon))


def _head_norms(qkv: torch.Tensor, q_norm: torch.nn.Module, k_norm: torch.nn.Module, heads: int, kv_heads: int,
                native: PointwiseOps | None) -> None:
    """Qwen3's RMSNorm over each Q head and each K head of `qkv [T, (H + 2 KVH) D]`, in place (transformers
    norms the projections viewed as `[T, heads, D]`; the same arithmetic per head)."""
    t, d = qkv.shape[0], qkv.shape[1] // (heads + 2 * kv_heads)
    q_end = heads * d
    if (native is not None and qkv.dtype == q_norm.weight.dtype and is_plain_rms_norm(q_norm)
            and is_plain_rms_norm(k_norm)):
        native.head_rms_norm_(qkv, heads, q_norm.weight, float(q_norm.variance_epsilon))
        native.head_rms_norm_(qkv[:, q_end:], kv_heads, k_norm.weight, float(k_norm.variance_epsilon))
        return
    q = qkv[:, :q_end].view(t, heads, d)
    k = qkv[:, q_end:q_end + kv_heads * d].view(t, kv_heads, d)
    q.copy_(q_norm(q.contiguous()))
    k.copy_(k_norm(k.contiguous()))


def _width_norms(qkv: torch.Tensor, q_norm: torch.nn.Module, k_norm: torch.nn.Module, q_end: int, k_end: int) -> None:
    """OLMo2's RMSNorm over all of Q and all of K of `qkv`, in place (transformers norms each projection whole,
    before splitting it into heads)."""
    qkv[:, :q_end] = q_norm(qkv[:, :q_end])
    qkv[:, q_end:k_end] = k_norm(qkv[:, q_end:k_end])


def _float_linears(w: LayerWeights, pack: bool, few_rows: bool, post_ops: bool
                   ) -> tuple[Linear, Linear, Linear, Linear, tuple[PackedLinear, PackedGatedMLP] | None]:
    """A layer's QKV, o, gate+up and down linears over its float weights, and oneDNN's post-op forms of the output
    projection and the MLP where they apply (they add the residual to the projection itself: not where a norm
    comes between, nor for another activation than SiLU)."""
    _, attention_out, _, mlp_out = w.norms
    qkv = _linear(w.qkv, w.qkv_bias, pack, few_rows)
    plain = attention_out is None and mlp_out is None and w.activation is None
    fused_ops = _post_op_layer(w, pack) if post_ops and plain else None
    if fused_ops is None:
        o, gate_up, down = (_linear(x, None, pack, few_rows) for x in (w.o, w.gate_up, w.down))
        return qkv, o, gate_up, down, None
    o_residual, packed_mlp = fused_ops  # the few-rows kernel in front of the post-ops' packed weights (no third copy)
    o, gate_up, down = ((few_rows and few_rows_linear(x, None, fallback)) or fallback
                        for x, fallback in ((w.o, o_residual), (w.gate_up, packed_mlp.gate_up),
                                            (w.down, packed_mlp.down)))
    return qkv, o, gate_up, down, fused_ops


def _stacked_linears(parts: LayerLinears) -> tuple[Linear, Linear, Linear, Linear]:
    """A GGUF layer's QKV, o, gate+up and down linears over its modules."""
    scale = parts.residual_multiplier
    o = parts.o if scale == 1.0 else StackedLinear([parts.o], scale)
    down = parts.down if scale == 1.0 else StackedLinear([parts.down], scale)
    return StackedLinear(parts.qkv), o, StackedLinear(parts.gate_up), down


def _native_layers(layers: list[_Layer], family: LayerFamily, native: NativeKernels | None,
                   inter: int) -> NativeDecodeLayers | None:
    """The C loop over `layers` (`tokenflow.runtime.cpu.decode_layers`) where every one is a norm-before SiLU layer
    (Llama's placement, per-head Q/K norms at most, one RoPE), runs its four linears on the few-rows kernel, and its
    norms share one epsilon; else None."""
    if native is None or not layers or family.width_norms:
        return None
    weights = []
    epsilons = set()
    for layer in layers:
        linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
        if not all(isinstance(f, FewRowsLinear) for f in linears):
            return None
        if (layer.attention_out_norm is not None or layer.mlp_out_norm is not None or layer.activation is not None
                or layer.rope is not None):
            return None
        head_norms = (layer.q_norm, layer.k_norm) if layer.q_norm is not None else ()
        norms = [n for n in (layer.input_norm, layer.post_norm, *head_norms) if is_plain_rms_norm(n)]
        if len(norms) != 2 + len(head_norms):
            return None
        epsilons.update(float(n.variance_epsilon) for n in norms)
        weights.append(DecodeLayerWeights(norms[0].weight, norms[1].weight, *linears, scale=layer.scale,
                                          q_norm=head_norms[0].weight if head_norms else None,
                                          k_norm=head_norms[1].weight if head_norms else None))
    dtype = weights[0].qkv.weight.packed.dtype
    norm_weights = [n for w in weights for n in (w.input_norm, w.post_norm, w.q_norm, w.k_norm) if n is not None]
    if len(epsilons) != 1 or any(n.dtype != dtype or not n.is_contiguous() for n in norm_weights):
        return None
    return NativeDecodeLayers(native, weights, epsilons.pop(), weights[0].o.weight.n, inter, dtype)


def _gguf_kernels(model: torch.nn.Module) -> GGUFKernels | None:
    """The GGUF kernels `model`'s linears run on (a GGUF model's), or None."""
    return next((m.kernels for m in model.modules() if isinstance(m, QuantizedLinear)), None)


def runs_own_copies(model: torch.nn.Module, pack: bool) -> bool:
    """Whether a FusedDecoder over `model` (with `pack`) runs every layer linear from copies of its own (oneDNN's
    packed layout, the few-rows panels), so that the HF layers' weights can go once nothing else reads them."""
    head = model.get_output_embeddings()
    if head is None:
        return False
    weight = head.weight
    return (pack and _gguf_kernels(model) is None and weight.device.type == "cpu"
            and weight.dtype in packed_dtypes())


def _release_layer(layer: torch.nn.Module, family: LayerFamily) -> int:
    """Empty `layer`'s linear weights (as `family` names them) and drop their resident pages; their bytes."""
    attention, mlp = layer.self_attn, layer.mlp
    modules = [getattr(attention, name) for name in (*family.qkv, "o_proj")]
    modules += [getattr(mlp, name) for name in (*family.gate_up, "down_proj")]
    weights = [module.weight.detach() for module in modules]
    for module in modules:
        module.weight = torch.nn.Parameter(torch.empty(0, dtype=module.weight.dtype), requires_grad=False)
    drop_resident_pages(weights)  # a checkpoint's mapping outlives them (the embedding holds it)
    return sum(w.numel() * w.element_size() for w in weights)


def fused_decoder_for(model: torch.nn.Module, *, pack: bool, few_rows: bool = False, post_ops: bool = False,
                      native: NativeKernels | None = None, pointwise: TritonPointwise | None = None,
                      max_context: int | None = None, release_layers: bool = False) -> FusedDecoder | None:
    """A FusedDecoder over `model`'s weights, or None when its layers are not the shape it runs (`max_context`:
    the longest context the runner allows; a model-native window at least that long masks nothing;
    `release_layers`: see FusedDecoder)."""
    family = family_for(model.config, max_context)
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    lm_head = getattr(model, "lm_head", None)
    if family is None or layers is None or not isinstance(lm_head, torch.nn.Linear) or lm_head.bias is not None:
        return None
    if getattr(base, "rotary_emb", None) is None or not final_norm_runs(model, family):
        return None
    if not all(describes(layer, family) for layer in layers):
        return None
    with torch.no_grad():
        return FusedDecoder(model, family, pack=pack, few_rows=few_rows, post_ops=post_ops, native=native,
                            pointwise=pointwise, release_layers=release_layers)


class FusedDecoder:
    """Runs `model`'s decoder and head on a packed step; see the module doc."""

    def __init__(self, model: torch.nn.Module, family: LayerFamily, *, pack: bool, few_rows: bool = False,
                 post_ops: bool = False, native: NativeKernels | None = None,
                 pointwise: TritonPointwise | None = None, release_layers: bool = False) -> None:
        """`model`'s layers are ones `family` describes (`layer_families.describes`). With `release_layers`, each
        HF layer's linear weights go as soon as the loop holds its copies of them (`release_layer_weights`, one
        layer at a time: the load's peak holds two copies of the weights, not three)."""
        base = model.model
        # a GGUF model's linears are ggml blocks: they run as they are (no packed copies, no few-rows panels);
        # bf16 decode rows against K-quants in int8 (gguf_blocks.c) on decode-only steps, as the AMX tiles below
        self._gguf_kernels = _gguf_kernels(model)
        quantized = self._gguf_kernels is not None
        if quantized:
            pack = few_rows = post_ops = False
        release = release_layers and runs_own_copies(model, pack)
        self.native = native  # bf16, fp32: RoPE on Q and K and the SiLU product as one C call each
        # the same calls on the GPU, as Triton kernels (`cuda_triton_ops`)
        self.pointwise: PointwiseOps | None = native or pointwise
        self.model = model
        self.released = release  # the HF layers' linear weights (release_layer_weights)
        self.released_bytes = 0  # of them, where the loop runs copies of them
        self.family = family
        self.embed = base.embed_tokens
        self.embed_multiplier = embedding_multiplier(model, family)
        self.rotary = base.rotary_emb
        self.final_norm = base.norm
        self.head_weight = head_weight(model, family)
        if quantized:
            divisor = logits_divisor(model, family)
            self.lm_head = model.lm_head if divisor == 1.0 else StackedLinear([model.lm_head], 1.0 / divisor)
        else:
            self.lm_head = _linear(self.head_weight, None, pack, few_rows)
        # greedy steps' tokens without the fp32 head's logits (fp32 few-rows head, AVX512-BF16)
        self.greedy_head = greedy_head_for(self.lm_head, self.head_weight, int(model.config.vocab_size))
        self.num_heads = model.config.num_attention_heads
        self.head_dim = base.layers[0].self_attn.head_dim
        # a model-native window is run only where it masks nothing (no context longer), as the HF path guards it
        self.window: int | None = model_window(model.config)
        # Gemma 3's RoPE differs by layer type (its rotary module takes the type): one cos/sin per type and step
        per_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        layer_types = getattr(model.config, "layer_types", None) if per_type else None
        self.layers: list[_Layer] = []
        for index, layer in enumerate(base.layers):
            w: LayerLinears | LayerWeights
            if quantized:  # GGUF's blocks are not concatenated (Q, K and V may be in different formats)
                w = layer_linears(layer, family)
                (qkv, o, gate_up, down), fused_ops = _stacked_linears(w), None
            else:  # one layer's concatenations at a time: the linears pack copies of their own
                w = layer_weights(layer, family)
                qkv, o, gate_up, down, fused_ops = _float_linears(w, pack, few_rows, post_ops)
            attention_in, attention_out, mlp_in, mlp_out = w.norms
            self.layers.append(_Layer(
                input_norm=attention_in, qkv=qkv, o=o, post_norm=mlp_in, gate_up=gate_up, down=down,
                scale=float(layer.self_attn.scaling), q_norm=w.q_norm, k_norm=w.k_norm,
                attention_out_norm=attention_out, mlp_out_norm=mlp_out, activation=w.activation,
                rope=layer_types[index] if layer_types else None,
                o_residual=fused_ops and fused_ops[0], mlp=fused_ops and fused_ops[1],
            ))
            if release:
                del w  # the layer's own tensors, in its concatenations
                self.released_bytes += _release_layer(layer, family)
        modules = layer_linears(base.layers[-1], family)
        self.intermediate = modules.down.in_features
        self.num_kv_heads = (sum(p.out_features for p in modules.qkv) // self.head_dim - self.num_heads) // 2
        # the few-rows kernel's linears, kept here: callers may wrap the layers' callables (bench-step --parts)
        self._few_rows = [f for f in self.linears().values() if isinstance(f, FewRowsLinear)]
        self.post_ops_on = True  # steps of more rows than the few-rows kernel takes run the post-op forms
        # decode-only steps run the few-rows linears on AMX tiles past a few bf16 rows, where the CPU has them;
        # steps with a prefill chunk keep the register tile (one arithmetic for a prompt, cached or not)
        self._tiles_on = False
        self._tiles_possible = any(f.kernels.has_tiles for f in self._few_rows)
        # decode steps that run entirely through the few-rows and native kernels: all layers in one C call
        self.native_layers = _native_layers(self.layers, family, native, self.intermediate)
        # the GPU's Triton ops: each residual add and the norm after it as one kernel, where the layers are plain
        # (RMSNorms before attention and MLP, SiLU, no extra norms, no fused post-ops)
        self.fused_adds = isinstance(self.pointwise, TritonPointwise) and is_plain_rms_norm(self.final_norm) and all(
            layer.attention_out_norm is None and layer.mlp_out_norm is None and layer.activation is None
            and layer.o_residual is None and layer.mlp is None
            and is_plain_rms_norm(layer.input_norm) and is_plain_rms_norm(layer.post_norm) for layer in self.layers)

    def linear_weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of every linear the loop runs, by name (`layers.<i>.qkv` / `.o` / `.gate_up` /
        `.down`, `lm_head`), in the concatenations the loop uses: for quantising them."""
        if self.released:
            raise RuntimeError("the HF layers' weights were released (release_layer_weights)")
        out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for i, layer in enumerate(self.model.model.layers):
            w = layer_weights(layer, self.family)
            out[f"layers.{i}.qkv"] = (w.qkv, w.qkv_bias)
            out[f"layers.{i}.o"] = (w.o, None)
            out[f"layers.{i}.gate_up"] = (w.gate_up, None)
            out[f"layers.{i}.down"] = (w.down, None)
        out["lm_head"] = (self.head_weight, None)
        return out

    def release_layer_weights(self) -> None:
        """Drop the HF layers' linear weights (each module's weight becomes an empty tensor) once every layer
        linear was swapped for one holding weights of its own (int8's): a second model-sized copy is memory an
        embedding app needs. The HF modules cannot run after this, nor `linear_weights`."""
        if not self.released:
            for layer in self.model.model.layers:
                _release_layer(layer, self.family)
            self.released = True

    def linears(self) -> dict[str, Linear]:
        """The callables the loop runs, by the names of `linear_weights`."""
        out = {"lm_head": self.lm_head}
        for i, layer in enumerate(self.layers):
            out.update({f"layers.{i}.{part}": getattr(layer, part) for part in ("qkv", "o", "gate_up", "down")})
        return out

    @contextlib.contextmanager
    def without_few_rows_kernel(self) -> Iterator[None]:
        """Run every linear through its fallback (oneDNN), the arithmetic of the HF modules' own linears: for
        the runner's self-check, which in bf16 tells a wrong mask from rounding only when the linears match
        the reference bit for bit (another, equally exact, summation order moves bf16 logits by ~1e-2)."""
        for f in self._few_rows:
            f.enabled = False
        self.post_ops_on = False
        try:
            yield
        finally:
            for f in self._few_rows:
                f.enabled = True
            self.post_ops_on = True

    def _switch_tiles(self, on: bool) -> None:
        for f in self._few_rows:
            f.tiles = on
        self._tiles_on = on

    def set_linear(self, name: str, linear: Linear) -> None:
        """Run `linear` in place of the linear `name` (see `linears`)."""
        if name == "lm_head":
            self.lm_head = linear
            self.greedy_head = None  # it estimates the head being replaced (and holds its weights)
            return
        _, index, part = name.split(".")
        layer = self.layers[int(index)]
        setattr(layer, part, linear)
        if part == "o":
            layer.o_residual = None  # the post-op forms run the weights being replaced
        else:
            layer.mlp = None
        self.native_layers = None  # it runs the few-rows weights being replaced

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor,
                 meta: PagedAttentionMetadata, greedy: bool = False, hidden: bool = False
                 ) -> torch.Tensor | GreedyTokens:
        """Logits `[len(logits_to_keep), vocab]` in the model's dtype for the packed step (`[1, T]` inputs);
        with `greedy` (every row samples its argmax and nothing else), the rows' tokens where the greedy
        head settles them; with `hidden`, the final norm's output of the kept rows instead (embeddings)."""
        if self.window is not None and self.window < meta.max_context:
            raise UnsupportedAttentionFeature(
                f"sliding_window={self.window} (context {meta.max_context}) is not implemented by paged attention")
        h = self.embed(input_ids[0])  # [T, hidden]
        if self.embed_multiplier != 1.0:
            h = h * self.embed_multiplier
        native = self.pointwise if h.dtype in (torch.bfloat16, torch.float32) else None
        ropes = {rope: self._rope(h, position_ids, rope, native) for rope in {layer.rope for layer in self.layers}}
        t = h.shape[0]
        if self._tiles_possible and self._tiles_on != (not meta.prefills):
            self._switch_tiles(not meta.prefills)
        if self._gguf_kernels is not None:
            self._gguf_kernels.int8_rows = self._gguf_kernels.has_int8_rows and not meta.prefills
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        q_end, k_end = heads * d, (heads + kv_heads) * d
        half = d // 2
        inter = self.intermediate
        # oneDNN's post-op forms for the steps the few-rows kernel does not take (prefill chunks)
        post_ops = self.post_ops_on and (t > FEW_ROWS or not self._few_rows)
        if not hidden and self.native_layers is not None and self.native_layers.takes(h, meta):
            cos, sin, _ = ropes[None]
            self.native_layers.run(h, cos, sin, meta)  # the loop below, in C
            return self._logits(h.index_select(0, logits_to_keep), greedy)
        last = len(self.layers) - 1
        attention = meta.attention
        assert attention is not None
        adds = native if self.fused_adds and isinstance(native, TritonPointwise) else None  # `fused_adds`' kernels
        normed: torch.Tensor | None = None  # with them, the next norm's output, formed with the residual add
        for index, layer in enumerate(self.layers):
            # [T, (H + 2 KVH) D]; with `adds` past the first layer, the input norm came with the residual add
            qkv = layer.qkv(normed) if normed is not None else _normed_linear(layer.qkv, layer.input_norm, h)
            if layer.q_norm is not None and layer.k_norm is not None:
                if self.family.width_norms:
                    _width_norms(qkv, layer.q_norm, layer.k_norm, q_end, k_end)
                else:
                    _head_norms(qkv, layer.q_norm, layer.k_norm, heads, kv_heads, native)
            cos, sin, native_rope = ropes[layer.rope]
            if native_rope:  # the same roundings as the torch ops below, in one pass, in place
                native.rope_(qkv, heads + kv_heads, cos, sin)
                q, k = qkv[:, :q_end].view(t, heads, d), qkv[:, q_end:k_end].view(t, kv_heads, d)
            else:
                qk = qkv[:, :k_end].view(t, heads + kv_heads, d)
                # RoPE on Q and K in one pass, as transformers' apply_rotary_pos_emb: x cos + rotate_half(x) sin
                rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
                qk = (qk * cos + rotated * sin).to(h.dtype)  # [T, H + KVH, D]; OLMo2 rotates in fp32, then rounds
                q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, k_end:].view(t, kv_heads, d)
            out = attention(index, q, k, v, meta, layer.scale)  # [T, H, D]
            if index == last:
                # Past the last layer's attention only the sampled rows are read (its K/V are written): a
                # prefill chunk's other rows skip the output projection and MLP. Rows are row-wise from here.
                if len(logits_to_keep) == 0:  # no chunk of the step ends its prompt
                    return self.final_norm(h[:0]) if hidden else self._logits(h[:0], False)
                out, h = out.index_select(0, logits_to_keep), h.index_select(0, logits_to_keep)
                t = h.shape[0]
            if adds is not None:
                h, normed = _add_norm(adds, layer.o(out.reshape(t, q_end)), h, layer.post_norm)
                product = adds.silu_mul(layer.gate_up(normed))
                after = self.layers[index + 1].input_norm if index < last else self.final_norm
                h, normed = _add_norm(adds, layer.down(product), h, after)
                continue
            if layer.attention_out_norm is not None:
                h = h + layer.attention_out_norm(layer.o(out.reshape(t, q_end)))
            elif post_ops and layer.o_residual is not None:
                h = layer.o_residual.add_to(out.reshape(t, q_end), h)
            else:
                h = _add_linear(layer.o, out.reshape(t, q_end), h)
            if post_ops and layer.mlp is not None and layer.post_norm is not None:
                h = layer.mlp(layer.post_norm(h), h)
                continue
            gate_up = _normed_linear(layer.gate_up, layer.post_norm, h)  # [T, 2 I]
            h = _gated_down(layer, gate_up, inter, h, native)
        if normed is not None:  # `adds`: the final norm's output, formed with the last residual add
            return normed if hidden else self._head(normed, greedy)
        return self.final_norm(h) if hidden else self._logits(h, greedy)

    def _rope(self, h: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None,
              native: PointwiseOps | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """cos and sin of the step's positions for the layers of `layer_type` (None: the model has one RoPE), and
        whether the native kernel applies them: `[T, D]` each for it, else `[T, 1, D]` (one row per token, for
        every head)."""
        if layer_type is None:
            cos, sin = self.rotary(h, position_ids)  # [1, T, D] each, in h's dtype (OLMo2: fp32 at every dtype)
        else:
            cos, sin = self.rotary(h, position_ids, layer_type)
        if native is not None and cos.dtype == h.dtype:
            return cos[0].contiguous(), sin[0].contiguous(), True
        return cos[0].unsqueeze(1), sin[0].unsqueeze(1), False

    def _logits(self, rows: torch.Tensor, greedy: bool) -> torch.Tensor | GreedyTokens:
        """The head over the final norm of the rows to sample; with `greedy`, their tokens where the greedy head
        settles them."""
        if greedy and self.greedy_head is not None:
            return self._head(self.final_norm(rows), greedy)
        return _normed_linear(self.lm_head, self.final_norm, rows)

    def _head(self, normed: torch.Tensor, greedy: bool) -> torch.Tensor | GreedyTokens:
        """The head over rows already through the final norm (`_logits`)."""
        head = self.greedy_head
        if greedy and head is not None and head.takes(normed):
            tokens = head.tokens(normed)
            if tokens is not None:
                return GreedyTokens(tokens)
        return self.lm_head(normed)
