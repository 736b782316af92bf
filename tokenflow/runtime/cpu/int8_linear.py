"""int8 linear layers on CPU (`quantization="int8"`): int8 weights, int8 activations, AVX512-VNNI products.

Why: a decode step reads every weight once, so int8 weights halve the bytes the memory-bound steps
read, and VNNI multiplies int8 at twice bf16's rate for the compute-bound prefill steps. torch's
own int8 paths measured slower than oneDNN's bf16 on these shapes for few rows (weight-only
`_weight_int8pack_mm`, `_int_mm`), and FBGEMM's dynamic linear quantises a whole batch with one
scale, which cost SmolLM2 ~60% perplexity; so the product is `int8_kernels.c` (one call per layer:
quantise each row, multiply, rescale).

Scheme: weights symmetric per output channel; activations symmetric per row (token), computed on
the fly; a SmoothQuant vector per input channel, `s = max|x|^alpha / max|W|^(1 - alpha)` from a
calibration pass, divides the activations and multiplies the weights before they are quantised,
moving the activations' outlier channels into the weights (exact before rounding).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tokenflow.runtime.cpu.native_kernels import FLAGS, load_library

__all__ = ("Int8Kernels", "Int8Linear", "Int8Weight", "WeightArgs", "load_int8_kernels", "quantize_weight",
           "reference_linear", "weight_args")

SOURCE = Path(__file__).with_name("int8_kernels.c")
SMOOTH_ALPHA = 0.5  # SmoothQuant's migration strength; 0.5 kept SmolLM2 within ~1.5% of bf16 perplexity

_P = ctypes.c_void_p
_I = ctypes.c_int64
_ACTIVATIONS = (torch.bfloat16, torch.float32)
# Up to this many rows the gated call saves torch's per-op costs; above, torch's silu (its own vectorised
# exp) is faster than the kernel's (libmvec's), so prefill chunks take the torch ops.
GATED_ROWS = 64
PLAIN, GATED, NORMED = 0, 1, 2  # what the rows given to the kernel are (int8_kernels.c)


@dataclass(slots=True)
class Int8Weight:
    """A weight quantised and packed for the kernel: `packed` is `[n_pad / 16, k_pad / 4, 16, 4]` int8."""

    packed: torch.Tensor
    scale: torch.Tensor  # [n_pad] fp32, per output channel
    sums: torch.Tensor  # [n_pad] int32: sum over k of each channel's int8 weights
    inv_smooth: torch.Tensor  # [k] fp32: the activations are multiplied by it before quantising
    bias: torch.Tensor | None  # [n] fp32
    n: int
    k: int

    @property
    def k_pad(self) -> int:
        return self.packed.shape[1] * 4

    @property
    def n_pad(self) -> int:
        return self.packed.shape[0] * 16

    @property
    def nbytes(self) -> int:
        tensors = [self.packed, self.scale, self.sums, self.inv_smooth] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def unpacked(self) -> torch.Tensor:
        """The int8 weight `[n, k]` (tests and the reference product)."""
        rows = self.packed.permute(0, 2, 1, 3).reshape(self.n_pad, self.k_pad)
        return rows[: self.n, : self.k]

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.packed": self.packed, f"{prefix}.scale": self.scale, f"{prefix}.sums": self.sums,
               f"{prefix}.inv_smooth": self.inv_smooth, f"{prefix}.shape": torch.tensor([self.n, self.k])}
        if self.bias is not None:
            out[f"{prefix}.bias"] = self.bias
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> Int8Weight:
        n, k = tensors[f"{prefix}.shape"].tolist()
        return cls(tensors[f"{prefix}.packed"], tensors[f"{prefix}.scale"], tensors[f"{prefix}.sums"],
                   tensors[f"{prefix}.inv_smooth"], tensors.get(f"{prefix}.bias"), int(n), int(k))


def quantize_weight(weight: torch.Tensor, bias: torch.Tensor | None = None, act_max: torch.Tensor | None = None,
                    alpha: float = SMOOTH_ALPHA) -> Int8Weight:
    """Quantise `weight [n, k]` per output channel, smoothed by `act_max [k]` (the largest |x| of each
    input channel over a calibration pass; None: no smoothing)."""
    w = weight.detach().float()
    n, k = w.shape
    if act_max is None:
        smooth = torch.ones(k)
    else:
        smooth = act_max.float().clamp_min(1e-5) ** alpha / w.abs().amax(0).clamp_min(1e-5) ** (1 - alpha)
        smooth = smooth.clamp(1e-3, 1e3)  # dead channels: keep the weight's own scale
    w = w * smooth
    scale = w.abs().amax(1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    n_pad, k_pad = -(-n // 32) * 32, -(-k // 4) * 4
    padded = torch.zeros(n_pad, k_pad, dtype=torch.int8)
    padded[:n, :k] = q
    packed = padded.view(n_pad // 16, 16, k_pad // 4, 4).permute(0, 2, 1, 3).contiguous()
    scales = torch.ones(n_pad)
    scales[:n] = scale
    return Int8Weight(
        packed=packed, scale=scales, sums=padded.sum(1, dtype=torch.int32), inv_smooth=(1.0 / smooth).contiguous(),
        bias=None if bias is None else bias.detach().float().contiguous(), n=n, k=k,
    )


def reference_linear(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """The kernel's arithmetic with torch ops (fp32 products of the int8 values): for tests."""
    xs = x.float() * weight.inv_smooth
    scale = xs.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xs * (1.0 / scale)).clamp(-127, 127)  # as the kernel: times the reciprocal
    y = (q @ weight.unpacked().float().T) * scale * weight.scale[: weight.n]
    if weight.bias is not None:
        y = y + weight.bias
    return y.to(x.dtype)


class Int8Kernels:
    """The loaded `int8_kernels.c` library. Calls come from the model thread only (one scratch buffer)."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._linear = library.int8_linear
        self._linear.argtypes = (_P, ctypes.c_int, ctypes.c_int, _P, ctypes.c_float, _I, _I,
                                 _P, _P, _P, _P, _P, _I, _I, _I, _P, _P)
        self._linear.restype = ctypes.c_int
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._scratch_ptr = self._scratch.data_ptr()

    def linear(self, x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
        """`x [..., k]` (bf16 or fp32) times the int8 weight: `[..., n]` in x's dtype."""
        if x.dtype not in _ACTIVATIONS:
            raise ValueError(f"int8 linear takes bf16 or fp32 activations, got {x.dtype}")
        rows = x.reshape(-1, weight.k)
        return self.product(rows.contiguous(), weight.k, weight_args(weight)).view(*x.shape[:-1], weight.n)

    def product(self, rows: torch.Tensor, k: int, args: WeightArgs, mode: int = PLAIN,
                norm: torch.nn.Module | None = None) -> torch.Tensor:
        """`linear` for contiguous `rows` the caller has checked, with `weight_args(weight)` (the layers' hot
        path: a decode step makes ~120 of these calls). `mode` says what the rows are: PLAIN `[m, k]`, the
        layer's input; GATED `[m, 2k]`, a gated MLP's `[gate | up]` (the input is silu(gate) * up); NORMED
        `[m, k]`, the rows before `norm` (a plain RMSNorm with a weight in the rows' dtype)."""
        m = rows.shape[0]
        need = m * (args.k_pad + 4 + (8 * k if mode != PLAIN else 0))  # codes and a scale a row; fp32 rows
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8)
            self._scratch_ptr = self._scratch.data_ptr()
        out = torch.empty((m, args.n), dtype=rows.dtype)
        norm_weight, eps = (norm.weight.data_ptr(), norm.variance_epsilon) if norm is not None else (None, 0.0)
        status = self._linear(rows.data_ptr(), rows.dtype == torch.bfloat16, mode, norm_weight, eps, m, k, *args,
                              self._scratch_ptr, out.data_ptr())
        if status != 0:
            raise ValueError(f"int8_linear refused its arguments (status {status})")
        return out


class WeightArgs(NamedTuple):
    """The kernel's arguments that come from the weight, in its order from `inv_smooth` to `n_pad`."""

    inv_smooth: int
    packed: int
    scale: int
    sums: int
    bias: int | None
    n: int
    k_pad: int
    n_pad: int


def weight_args(weight: Int8Weight) -> WeightArgs:
    """The weight's pointers and sizes, for `Int8Kernels.product` (the tensors must outlive their use)."""
    return WeightArgs(weight.inv_smooth.data_ptr(), weight.packed.data_ptr(), weight.scale.data_ptr(),
                      weight.sums.data_ptr(), weight.bias.data_ptr() if weight.bias is not None else None,
                      weight.n, weight.k_pad, weight.n_pad)


class Int8Linear:
    """A linear layer's forward through the kernel (the fused layers call it like their other linears)."""

    __slots__ = ("args", "kernels", "weight")

    def __init__(self, weight: Int8Weight, kernels: Int8Kernels) -> None:
        self.weight = weight
        self.kernels = kernels
        self.args = weight_args(weight)  # the weight's tensors live as long as this layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous() and x.dtype in _ACTIVATIONS and x.shape[1] == self.weight.k:
            return self.kernels.product(x, self.weight.k, self.args)
        return self.kernels.linear(x, self.weight)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """A gated MLP's down projection from its gate_up output `[m, 2k]`: `self(F.silu(gate) * up)`, one call."""
        k = self.weight.k
        if (gate_up.dim() == 2 and gate_up.shape[0] <= GATED_ROWS and gate_up.is_contiguous()
                and gate_up.dtype in _ACTIVATIONS and gate_up.shape[1] == 2 * k):
            return self.kernels.product(gate_up, k, self.args, GATED)
        hidden = F.silu(gate_up[..., :k])
        return self(hidden.mul_(gate_up[..., k:]))

    def normed(self, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        """`self(norm(x))` for a plain RMSNorm `norm` (the fused layers' kind), the norm formed as the rows
        are quantised: one call instead of two."""
        if (x.dim() == 2 and x.is_contiguous() and x.dtype in _ACTIVATIONS and x.shape[1] == self.weight.k
                and norm.weight.dtype == x.dtype and norm.weight.is_contiguous()):
            return self.kernels.product(x, self.weight.k, self.args, NORMED, norm)
        return self(norm(x))


@functools.cache
def load_int8_kernels() -> Int8Kernels | None:
    """The library, or None where it cannot be built or this CPU has no AVX512-VNNI."""
    loaded = load_library(SOURCE, "int8_kernels", FLAGS, "tokenflow: building int8 CPU kernels")
    if loaded is None:
        return None
    library, path = loaded
    library.int8_available.restype = ctypes.c_int
    return Int8Kernels(library, path) if library.int8_available() else None
