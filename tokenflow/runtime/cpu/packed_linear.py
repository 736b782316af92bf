"""Linear layers on CPU with weights reordered once for oneDNN.

Why: `torch.nn.functional.linear` on CPU leaves the weight in its plain
row-major layout and hands the product to the BLAS library, which reads the
weights well below memory bandwidth for the few rows of a decode step.
oneDNN's blocked layout, packed once at load, streams them closer to it, so
decode steps (memory-bound: every token reads every weight) run faster, and
large batches about as fast as plain.

fp32 is packed, and bf16 where oneDNN has a bf16 path for this CPU. The cost is
a second copy of the linear weights (the model's parameters stay untouched, e.g.
for a tied embedding).

`PackedLinear` and `PackedGatedMLP` also run oneDNN's post-ops: the elementwise
work after a product (a residual add, SiLU, the gate's product) done on each
output tile while it is in cache, instead of as separate passes over the step's
activations (`PackedGatedMLP`: silu(gate(x)) * up(x), then down(.) + residual,
in three products and no other op).
"""

from __future__ import annotations

import functools
import logging

import torch

__all__ = ("PackedGatedMLP", "PackedLinear", "pack_linears", "packed_dtypes", "packed_linear",
           "packing_available", "post_ops_available")

log = logging.getLogger("tokenflow")

PACK_FOR_ROWS = 128  # oneDNN picks the blocked layout for this many rows; any row count still works


def packing_available() -> bool:
    """Whether this torch build has oneDNN's packed linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def packed_dtypes() -> frozenset[torch.dtype]:
    """The dtypes oneDNN packs on this CPU: fp32, and bf16 where it has a bf16 path (AVX512, AVX-NE-CONVERT)."""
    if not packing_available():
        return frozenset()
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return frozenset({torch.float32, torch.bfloat16} if bf16 else {torch.float32})


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear | None:
    """`x @ weight.T + bias` through a packed copy of `weight`; None where it does not apply."""
    if weight.device.type != "cpu" or weight.dtype not in packed_dtypes():
        return None  # plain linear still works
    return PackedLinear(weight, bias)


@functools.cache
def post_ops_available() -> bool:
    """Whether this torch build's packed linear fuses the post-ops `PackedGatedMLP` uses (swish, add, mul)."""
    if not packed_dtypes() or not hasattr(torch.ops.mkldnn._linear_pointwise, "binary"):
        return False
    try:
        x = torch.ones(2, 4)
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(3, 4), 2)
        torch.ops.mkldnn._linear_pointwise(x, w, None, "swish", [], "")
        torch.ops.mkldnn._linear_pointwise.binary(x, torch.ones(2, 3), w, None, "add")
    except RuntimeError:
        return False
    return True


class PackedLinear:
    """`x @ weight.T + bias` through a packed copy of `weight`, alone or with a fused post-op."""

    __slots__ = ("bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(self(x))`, the SiLU applied to the fp32 sums."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "swish", [], "")

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """`self(x) * other` in one product."""
        return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), other.contiguous(), self.packed, self.bias,
                                                         "mul")

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)` in one product (a new tensor)."""
        return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), residual.contiguous(), self.packed,
                                                         self.bias, "add")


class PackedGatedMLP:
    """A bias-free SiLU-gated MLP, `down(silu(gate(x)) * up(x))`, on oneDNN's post-ops.

    The SiLU is applied to the gate's fp32 sums and the product to the up projection's, each rounded once
    to the dtype: in bf16 that is one rounding fewer than transformers' separate ops (which round the gate
    before its SiLU), in fp32 the same values up to oneDNN's exp.
    """

    __slots__ = ("down", "gate", "up")

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate, self.up, self.down = PackedLinear(gate), PackedLinear(up), PackedLinear(down)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + down(silu(gate(x)) * up(x))`."""
        x = x.contiguous()
        return self.down.add_to(self.up.times(x, self.gate.silu(x)), residual)

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """`[gate(x) | up(x)]`: the concatenated projection, for the fused loop's other paths."""
        return torch.cat((self.gate(x), self.up(x)), dim=-1)


def pack_linears(model: torch.nn.Module) -> int:
    """Route every plain `nn.Linear` of `model` on CPU through a packed copy of its weight.

    Returns how many layers were packed. Inference only: the packed copy does not follow later
    changes to the parameter.
    """
    if not packing_available():
        return 0
    count = 0
    nbytes = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue  # subclasses (quantized, LoRA, ...) keep their own forward
        forward = packed_linear(module.weight, module.bias)
        if forward is None:
            continue
        module.forward = forward
        count += 1
        nbytes += module.weight.numel() * module.weight.element_size()
    if count:
        log.info("packed %d linear layers for oneDNN (%.0f MiB of weights copied)", count, nbytes / 2**20)
    return count
