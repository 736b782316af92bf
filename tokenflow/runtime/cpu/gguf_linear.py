"""Linear layers and embeddings over a GGUF file's quantised tensors, kept as they are in the file.

Why: llama.cpp and ollama users run Q4_K_M / Q8_0 files as they are; dequantising them at load multiplies
their memory by 4–7 (fp32) and the bytes every decode step reads. Here the ggml blocks stay the weights
(`gguf_blocks.c`): a decode step's few rows are multiplied with four weight rows at a time dequantised in
registers, so memory holds the file's bytes and a step reads them once; a prefill chunk's many rows dequantise
the weight into a scratch and run oneDNN's product on it, where the arithmetic, not the bytes, is the cost.

Formats: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (what Q4_K_M / Q5_K_M / Q8_0 files hold), and the
dense F32 / F16 / BF16; others are dequantised once at load by the `gguf` package (`gguf_model.py`).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenflow.runtime.cpu.native_kernels import FLAGS, load_library

__all__ = ("DENSE_FORMATS", "FORMATS", "GGUFKernels", "QuantizedEmbedding", "QuantizedLinear", "QuantizedWeight",
           "StackedLinear", "load_gguf_kernels", "placeholder", "weight_supported")

SOURCE = Path(__file__).with_name("gguf_blocks.c")
# The ggml types gguf_blocks.c reads -> (name, values per block, bytes per block), from the gguf package's table
FORMATS: dict[int, tuple[str, int, int]] = {
    int(t): (t.name, *GGML_QUANT_SIZES[t])
    for t in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.Q4_0,
              GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
              GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
              GGMLQuantizationType.Q6_K)
}
# loaded as plain tensors (`gguf_model.py`), not kept as blocks
DENSE_FORMATS = frozenset(int(GGMLQuantizationType[name]) for name in ("F32", "F16", "BF16"))
# Up to this many rows a product runs gguf_few_rows (the weight's bytes stream once); above, the weight is
# dequantised into a scratch for oneDNN's product (the rows' arithmetic dominates)
FEW_ROWS = 16

_P = ctypes.c_void_p
_I = ctypes.c_int64


@dataclass(slots=True)
class QuantizedWeight:
    """A weight `[n, k]` as ggml blocks: `data` is `[n, row_bytes]` uint8 (the file's bytes, rows in order)."""

    data: torch.Tensor
    format: int  # ggml type id, a key of FORMATS
    n: int
    k: int

    @property
    def row_bytes(self) -> int:
        return self.data.shape[1]

    @property
    def format_name(self) -> str:
        return FORMATS.get(self.format, (f"ggml type {self.format}",))[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def weight_supported(format: int, k: int) -> bool:
    """Whether a weight of this format with rows of k values is kept as blocks (a quantised format gguf_blocks.c
    reads, whole blocks a row)."""
    shape = FORMATS.get(format)
    return shape is not None and format not in DENSE_FORMATS and k % shape[1] == 0


class GGUFKernels:
    """The loaded `gguf_blocks.c` library, one per process: each thread (each engine's model thread) has its own
    scratch buffer and its own `int8_rows` switch."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._dequantize = library.gguf_dequantize
        self._dequantize.argtypes = (ctypes.c_int, _P, _I, _I, _P, _I, _P, ctypes.c_int)
        self._dequantize.restype = ctypes.c_int
        self._few_rows = library.gguf_few_rows
        self._few_rows.argtypes = (ctypes.c_int, _P, _I, _I, _I, _P, ctypes.c_int, _I, _P, _P, _I, ctypes.c_int)
        self._few_rows.restype = ctypes.c_int
        library.gguf_few_rows_available.restype = ctypes.c_int
        library.gguf_int8_rows_available.restype = ctypes.c_int
        self.has_few_rows = bool(library.gguf_few_rows_available())
        # up to 16 bf16 rows against Q4_K / Q6_K / Q8_0: the rows quantised to int8 and multiplied by VNNI
        # (llama.cpp's arithmetic and rounding); False: the float tiles (the product as exact as torch's)
        self.has_int8_rows = bool(library.gguf_int8_rows_available())
        self._thread = threading.local()

    @property
    def int8_rows(self) -> bool:
        """Whether this thread's products of up to 16 bf16 rows against Q4_K / Q6_K / Q8_0 run in int8 (default:
        where the CPU can; the fused layers keep them to decode-only steps)."""
        return bool(getattr(self._thread, "int8_rows", self.has_int8_rows))

    @int8_rows.setter
    def int8_rows(self, on: bool) -> None:
        self._thread.int8_rows = on and self.has_int8_rows

    def dequantize(self, weight: QuantizedWeight, dtype: torch.dtype, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The weight's rows (all, or `ids`, int64) as `[rows, k]` in `dtype` (bf16 or fp32)."""
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"GGUF weights dequantise to bf16 or fp32, not {dtype}")
        count = weight.n if ids is None else ids.numel()
        out = torch.empty((count, weight.k), dtype=dtype)
        ids_ptr = None
        if ids is not None:
            ids = ids.to(torch.int64).contiguous()
            if count and (int(ids.min()) < 0 or int(ids.max()) >= weight.n):
                raise IndexError(f"row ids outside 0 .. {weight.n - 1}")
            ids_ptr = ids.data_ptr()
        status = self._dequantize(weight.format, weight.data.data_ptr(), weight.row_bytes, weight.k, ids_ptr, count,
                                  out.data_ptr(), dtype == torch.bfloat16)
        if status != 0:
            raise ValueError(f"gguf_dequantize refused a {weight.format_name} weight [{weight.n}, {weight.k}]")
        return out

    def few_rows(self, x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor) -> bool:
        """`out = x @ W^T` for contiguous 2-D `x` (bf16 or fp32) into `out` (x's dtype, rows may be a slice of a
        wider tensor); False where the kernel does not run (the caller takes the dequantised product)."""
        m, k = x.shape
        scratch = getattr(self._thread, "scratch", None)
        if scratch is None or scratch.numel() < m * k:
            scratch = self._thread.scratch = torch.empty(m * k)
        status = self._few_rows(weight.format, weight.data.data_ptr(), weight.row_bytes, weight.n, k, x.data_ptr(),
                                x.dtype == torch.bfloat16, m, scratch.data_ptr(), out.data_ptr(), out.stride(0),
                                self.int8_rows)
        return status == 0


def _product(kernels: GGUFKernels, x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor) -> None:
    """`out = x @ W^T` for 2-D contiguous x: the few-rows kernel, or oneDNN's product on the dequantised weight."""
    if x.shape[0] <= FEW_ROWS and kernels.has_few_rows and kernels.few_rows(x, weight, out):
        return
    dense = kernels.dequantize(weight, x.dtype)
    if out.is_contiguous():
        torch.mm(x, dense.T, out=out)
    else:
        out.copy_(x @ dense.T)


def placeholder(n: int, k: int, dtype: torch.dtype) -> torch.nn.Parameter:
    """A `[n, k]` parameter of one stored value (a zero, expanded): what code that reads a weight's shape, dtype
    and device sees of a GGUF module, whose product reads its blocks instead."""
    return torch.nn.Parameter(torch.zeros((), dtype=dtype).expand(n, k), requires_grad=False)


class QuantizedLinear(torch.nn.Linear):
    """An `nn.Linear` whose weight is a GGUF tensor (`.weight` is a `placeholder` of its shape; the product
    reads `.quantized`)."""

    def __init__(self, quantized: QuantizedWeight, kernels: GGUFKernels, dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = quantized.k, quantized.n
        self.weight = placeholder(quantized.n, quantized.k, dtype)
        self.bias = None if bias is None else torch.nn.Parameter(bias.to(dtype), requires_grad=False)
        self.quantized = quantized
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"GGUF linears take bf16 or fp32 activations, got {rows.dtype}")
        out = torch.empty((rows.shape[0], self.out_features), dtype=rows.dtype)
        self.into(rows.contiguous(), out)
        return out.view(*x.shape[:-1], self.out_features)

    def into(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """`out = rows @ W^T + bias` for contiguous 2-D `rows` (`out` may be columns of a wider tensor)."""
        _product(self.kernels, rows, self.quantized, out)
        if self.bias is not None:
            out += self.bias

    def extra_repr(self) -> str:
        return f"{self.quantized.format_name}, in_features={self.in_features}, out_features={self.out_features}"


class StackedLinear:
    """Linears over one input with their outputs side by side (the fused loop's QKV and gate+up), each part a
    `QuantizedLinear` or a dense `nn.Linear`, times `scale` (Granite's residual multiplier)."""

    __slots__ = ("bounds", "parts", "scale", "width")

    def __init__(self, parts: list[torch.nn.Linear], scale: float = 1.0) -> None:
        self.parts = parts
        self.scale = scale
        edges = [0]
        for part in parts:
            edges.append(edges[-1] + part.out_features)
        self.bounds = list(itertools.pairwise(edges))
        self.width = edges[-1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty((rows.shape[0], self.width), dtype=rows.dtype)
        for part, (start, stop) in zip(self.parts, self.bounds, strict=True):
            if isinstance(part, QuantizedLinear):
                part.into(rows, out[:, start:stop])
            else:
                out[:, start:stop] = part(rows)
        if self.scale != 1.0:
            out *= self.scale
        return out.view(*x.shape[:-1], self.width)


class QuantizedEmbedding(torch.nn.Embedding):
    """An `nn.Embedding` whose table is a GGUF tensor: the rows looked up are dequantised."""

    def __init__(self, quantized: QuantizedWeight, kernels: GGUFKernels, dtype: torch.dtype) -> None:
        torch.nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = quantized.n, quantized.k
        self.padding_idx, self.max_norm, self.norm_type = None, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.weight = placeholder(quantized.n, quantized.k, dtype)
        self.quantized = quantized
        self.kernels = kernels
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.kernels.dequantize(self.quantized, self.dtype, ids.reshape(-1))
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.quantized.format_name}, {self.num_embeddings}, {self.embedding_dim}"


@functools.cache
def load_gguf_kernels() -> GGUFKernels | None:
    """The library, or None where it cannot be built (no compiler, another OpenMP runtime: logged)."""
    loaded = load_library(SOURCE, "gguf_blocks", FLAGS, "tokenflow: building GGUF block kernels")
    return None if loaded is None else GGUFKernels(*loaded)
