"""Linear layers for the few rows of a decode step on CPU (`few_rows_linear.c`), oneDNN for the rest.

Why: a decode step reads every weight once for a handful of rows, so it runs at the speed the
weights stream from memory. oneDNN's packed product (`packed_linear`) reads them well below that
for 1–64 rows; a kernel that streams each 64-channel panel front to back with the rows'
accumulators in registers ran SmolLM2's linears 1.7× faster at one row and ~1.3× at 16 in bf16
(docs/benchmarks.md, "Where the CPU speed comes from"). Steps with more rows (prefill chunks) are compute-bound,
where oneDNN's cache-blocked product stays faster, so they keep it.

On CPUs with AMX, decode-only bf16 steps of more than a few rows run the same packed panels on AMX tiles
(`few_rows_linear_tiles`), where the register tile's dot products fall behind the weight stream; steps with a
prefill chunk keep the register tile, so a prompt's roundings do not depend on the prefix cache.

The cost is a second packed copy of the linear weights, beside oneDNN's.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from tokenflow.runtime.cpu.native_kernels import FLAGS, load_library

__all__ = ("FEW_ROWS", "FewRowsKernels", "FewRowsLinear", "FewRowsWeight", "few_rows_linear", "load_few_rows_kernels")

SOURCE = Path(__file__).with_name("few_rows_linear.c")
FEW_ROWS = 64  # up to this many rows the kernel (1.1–1.3x oneDNN at 32–64 rows); above, the fallback (oneDNN)
PANEL = 64  # output channels per packed panel (the C kernel's NR)

_P = ctypes.c_void_p
_I = ctypes.c_int64

Linear = Callable[[torch.Tensor], torch.Tensor]


class FewRowsWeight:
    """A weight `[n, k]` packed for the kernel: bf16 `[n_pad / 16, k / 2, 16, 2]`, fp32 `[n_pad / 16, k, 16]`."""

    __slots__ = ("bias", "k", "n", "n_pad", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        n, k = weight.shape
        n_pad = -(-n // PANEL) * PANEL
        padded = torch.zeros(n_pad, k, dtype=weight.dtype)
        padded[:n] = weight.detach()
        if weight.dtype == torch.bfloat16:
            self.packed = padded.view(n_pad // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        else:
            self.packed = padded.view(n_pad // 16, 16, k).permute(0, 2, 1).contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.n, self.k, self.n_pad = n, k, n_pad


class FewRowsKernels:
    """The loaded `few_rows_linear.c` library and the dtypes this CPU runs it for."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        available = {}
        for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
            check = getattr(library, f"few_rows_{name}_available")
            check.restype = ctypes.c_int
            available[dtype] = bool(check())
        self.dtypes = frozenset(dtype for dtype, ok in available.items() if ok)
        self._linear = library.few_rows_linear
        self._tiles = library.few_rows_linear_tiles
        for function in (self._linear, self._tiles):
            function.argtypes = (_P, ctypes.c_int, _I, _I, _P, _P, _I, _I, _P, _P)
            function.restype = ctypes.c_int
        tiles_available = library.few_rows_tiles_available
        tiles_available.restype = ctypes.c_int
        self.has_tiles = bool(tiles_available())  # AMX tiles past a few bf16 rows (`few_rows_linear_tiles`)
        self.linear_function = self._linear  # for native loops that call the kernel themselves (decode_layers)
        self.tiles_function = self._tiles  # the same, on AMX tiles past a few bf16 rows: for decode-only steps
        self.greedy_function = library.few_rows_greedy_f32  # greedy rows' tokens of an fp32 head (greedy_head)
        self.greedy_function.argtypes = (_P, _I, _I, _P, _P, _P, _P, _I, _I, _I, _P, _P, _P)
        self.greedy_function.restype = ctypes.c_int

    def linear(self, x: torch.Tensor, weight: FewRowsWeight) -> torch.Tensor:
        """`x [m, k]` (the weight's dtype) times the weight: `[m, n]`."""
        if x.dtype != weight.packed.dtype or x.dim() != 2 or x.shape[1] != weight.k:
            want = f"[m, {weight.k}] {weight.packed.dtype}"
            raise ValueError(f"few-rows linear wants {want}, got {x.dtype} {tuple(x.shape)}")
        return self.product(x, weight)

    def product(self, x: torch.Tensor, weight: FewRowsWeight, residual: torch.Tensor | None = None,
                tiles: bool = False) -> torch.Tensor:
        """`linear` for an `x` the caller has checked (the layers' hot path); plus a contiguous `residual
        [m, n]` of x's dtype when given (each product rounded to the dtype, then added: a separate add's
        roundings); with `tiles`, on AMX tiles past a few bf16 rows where the CPU has them (other roundings
        than the register tile's: for decode-only steps, see the C file's top)."""
        if not x.is_contiguous():
            x = x.contiguous()
        m = x.shape[0]
        out = torch.empty((m, weight.n), dtype=x.dtype)
        bias = weight.bias.data_ptr() if weight.bias is not None else None
        added = residual.data_ptr() if residual is not None else None
        function = self._tiles if tiles else self._linear
        status = function(x.data_ptr(), x.dtype == torch.bfloat16, m, weight.k, weight.packed.data_ptr(), bias,
                          weight.n, weight.n_pad, added, out.data_ptr())
        if status != 0:
            raise ValueError(f"few_rows_linear refused its arguments (status {status})")
        return out


@functools.cache
def load_few_rows_kernels() -> FewRowsKernels | None:
    """The library, or None where it cannot be built or this CPU lacks AVX512."""
    loaded = load_library(SOURCE, "few_rows_linear", FLAGS, "tokenflow: building few-rows linear kernels")
    if loaded is None:
        return None
    kernels = FewRowsKernels(*loaded)
    return kernels if kernels.dtypes else None


class FewRowsLinear:
    """A linear layer's forward: the kernel for up to `FEW_ROWS` rows (while `enabled`), `fallback` otherwise;
    with `tiles` (set by the decoder for decode-only steps), AMX tiles past a few bf16 rows."""

    __slots__ = ("enabled", "fallback", "kernels", "tiles", "weight")

    def __init__(self, weight: FewRowsWeight, kernels: FewRowsKernels, fallback: Linear) -> None:
        self.weight = weight
        self.kernels = kernels
        self.fallback = fallback
        self.enabled = True
        self.tiles = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.takes(x):
            return self.fallback(x)
        return self.kernels.product(x, self.weight, tiles=self.tiles)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)`, the add done as the kernel stores its output (a new tensor)."""
        if not (self.takes(x) and residual.shape == (x.shape[0], self.weight.n) and residual.dtype == x.dtype
                and residual.is_contiguous()):
            return residual + self(x)
        return self.kernels.product(x, self.weight, residual, self.tiles)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` runs on the kernel (else on the fallback)."""
        weight = self.weight
        return (self.enabled and x.dim() == 2 and x.shape[0] <= FEW_ROWS and x.dtype == weight.packed.dtype
                and x.shape[1] == weight.k)


def few_rows_linear(weight: torch.Tensor, bias: torch.Tensor | None, fallback: Linear) -> FewRowsLinear | None:
    """`x @ weight.T + bias` through the kernel for up to `FEW_ROWS` rows and `fallback` above; None where
    the kernel does not apply (not on CPU, a dtype it lacks here, odd `k` in bf16)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    kernels = load_few_rows_kernels()
    if kernels is None or weight.dtype not in kernels.dtypes:
        return None
    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2:
        return None
    return FewRowsLinear(FewRowsWeight(weight, bias), kernels, fallback)
