"""The fused layers' pointwise work on the GPU as one Triton kernel each (`cuda_triton_ops`).

Why: a small model's decode step on a GPU is bound by how many kernels it launches, not by their work (a CUDA
graph replays them back to back, but each still costs a few microseconds). With torch ops a layer runs ~29
kernels: a bf16 RMSNorm is four (upcast, norm, round, weight), RoPE six, the K/V write two, the SiLU product two.
Here each of those is one kernel, which brings a layer to ~13 (vLLM's rms_norm, rotary_embedding,
reshape_and_cache and silu_and_mul do the same, in CUDA C).

`TritonPointwise` has the contracts of the CPU's `NativeKernels` for the same work (`rms_norm`, `head_rms_norm_`,
`rope_`, `silu_mul`, `write_kv`), so the fused layers call either the same way; `add_rms_norm` also folds each
residual add into the norm after it (vLLM's fused_add_rms_norm), which takes a layer to ~11 kernels. Each kernel
rounds where the torch ops it replaces round (bf16: the residual sum, the normalised rows before the weight, each
RoPE product and their sum, the SiLU before the product), so outputs equal those of transformers' modules up to
the order of a sum (on Triton's interpreter, bit for bit in bf16); compiled for a GPU, its fast exp, rsqrt and
division can move a bf16 value by one unit in the last place.

Triton is imported when the first `TritonPointwise` is made (`gpu.triton_launch`).
"""

from __future__ import annotations

from typing import Any

import torch

from tokenflow.runtime.gpu.triton_launch import power_of_two, triton_kernels

__all__ = ("TritonPointwise",)

_FLOATS = (torch.bfloat16, torch.float32)
_ROWS = 4  # rows per program: fewer programs for a prefill chunk, none wasted on a decode row
_VALUES = 4096  # at most this many values per program (rows x padded width), so a tile stays in registers


def _grid(rows: int) -> tuple[int]:
    return (-(-rows // _ROWS),)


def _norm_tiling(width: int) -> tuple[int, int, int]:
    """A norm's program: its rows (four of a 576-wide model's, one of a 4,096-wide one's), the padded width, and
    its warps (eight past 1,024 values a row)."""
    width_pad = power_of_two(width)
    return max(1, min(_ROWS, _VALUES // width_pad)), width_pad, 4 if width_pad <= 1024 else 8


class TritonPointwise:
    """RMSNorm, Q/K head norms, RoPE, the SiLU product and the K/V write as one Triton kernel each, for bf16 and
    fp32 rows (the K/V write: any dtype); `NativeKernels`' contracts for the same calls."""

    def __init__(self, head_dim: int) -> None:
        self.head_dim = head_dim
        self.kernels: Any = triton_kernels()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Llama-family RMSNorm of contiguous `x [..., width]` with a `weight [width]` of x's dtype."""
        width = x.shape[-1]
        if x.dtype not in _FLOATS or weight.dtype != x.dtype or not x.is_contiguous() or weight.shape != (width,):
            raise ValueError("rms_norm needs contiguous bf16 or fp32 input and a weight [width] of its dtype")
        out = torch.empty_like(x)
        rows = x.numel() // width
        per, width_pad, warps = _norm_tiling(width)
        self.kernels.rms_norm[(-(-rows // per),)](x, weight, out, rows, width, width, eps, width, ROWS=per,
                                                  WIDTH_PAD=width_pad, HEADS=1, ROUND=x.dtype != torch.float32,
                                                  num_warps=warps)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual + x` (the next residual) and its RMSNorm, in one kernel: a layer's residual add and the norm
        after it (vLLM's fused_add_rms_norm); contiguous `[rows, width]` of one dtype, `weight [width]`."""
        rows, width = x.shape
        if not (x.dtype in _FLOATS and x.dtype == residual.dtype == weight.dtype and x.is_contiguous()
                and residual.is_contiguous() and residual.shape == x.shape and weight.shape == (width,)):
            raise ValueError("add_rms_norm needs contiguous bf16 or fp32 rows of one shape and a weight [width] of "
                             "their dtype")
        total, out = torch.empty_like(x), torch.empty_like(x)
        per, width_pad, warps = _norm_tiling(width)
        self.kernels.add_rms_norm[(-(-rows // per),)](x, residual, weight, total, out, rows, eps, width, ROWS=per,
                                                      WIDTH_PAD=width_pad, ROUND=x.dtype != torch.float32,
                                                      num_warps=warps)
        return total, out

    def head_rms_norm_(self, rows: torch.Tensor, heads: int, weight: torch.Tensor, eps: float) -> None:
        """RMSNorm in place over each of the first `heads` heads of `rows [n, >= heads * head_dim]` (a slice of a
        QKV projection), with a `weight [head_dim]` of their dtype: Qwen3's Q and K norms."""
        n = rows.shape[0]
        if rows.dtype not in _FLOATS or weight.dtype != rows.dtype or rows.stride(1) != 1 or weight.shape != (
                self.head_dim,):
            raise ValueError("head_rms_norm_ needs bf16 or fp32 rows of unit stride and a weight [head_dim] of "
                             "their dtype")
        self.kernels.rms_norm[_grid(n)](rows, weight, rows, n, rows.stride(0), rows.stride(0), eps, self.head_dim,
                                        ROWS=_ROWS, WIDTH_PAD=power_of_two(self.head_dim), HEADS=heads,
                                        ROUND=rows.dtype != torch.float32)

    def rope_(self, qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """RoPE in place on the first `heads` heads of `qkv [rows, >= heads * head_dim]` (rows of unit stride),
        with contiguous `cos`, `sin` `[rows, head_dim]` of its dtype."""
        rows = qkv.shape[0]
        if not (qkv.dtype in _FLOATS and qkv.dtype == cos.dtype == sin.dtype and qkv.stride(1) == 1
                and cos.is_contiguous()
                and sin.is_contiguous() and cos.shape == sin.shape == (rows, self.head_dim)):
            raise ValueError("rope_ needs bf16 or fp32 rows of unit stride and contiguous cos, sin [rows, head_dim] "
                             "of their dtype")
        half = self.head_dim // 2
        self.kernels.rope[_grid(rows)](qkv, cos, sin, rows, qkv.stride(0), heads, ROWS=_ROWS, HALF=half,
                                       HALF_PAD=power_of_two(half), ROUND=qkv.dtype != torch.float32)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of a gated MLP's contiguous `gate_up [rows, 2 * inter]`: `[rows, inter]`."""
        rows, width = gate_up.shape
        if gate_up.dtype not in _FLOATS or not gate_up.is_contiguous() or width % 2:
            raise ValueError(f"silu_mul needs contiguous bf16 or fp32 rows of even width, got {gate_up.dtype} "
                             f"{tuple(gate_up.shape)}")
        inter = width // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
        columns = min(1024, power_of_two(inter))
        self.kernels.silu_mul[(-(-rows // _ROWS), -(-inter // columns))](
            gate_up, out, rows, inter, ROWS=_ROWS, COLUMNS=columns, ROUND=gate_up.dtype != torch.float32)
        return out

    def write_kv(self, k_slots: torch.Tensor, v_slots: torch.Tensor, slots: torch.Tensor, k_new: torch.Tensor,
                 v_new: torch.Tensor) -> bool:
        """`k_slots[slots] = k_new` and the same for values, for contiguous caches `[num_slots, KVH, D]` and rows
        `[T, KVH, D]` whose heads are contiguous (views of a QKV projection); False (nothing written) where the
        layouts differ."""
        rows = k_new.shape[0]
        width = k_slots[0].numel()
        if not (k_new.dtype == v_new.dtype == k_slots.dtype == v_slots.dtype and k_slots.is_contiguous()
                and v_slots.is_contiguous() and slots.shape == (rows,) and k_new.shape == v_new.shape
                and k_new.shape[1:] == k_slots.shape[1:] and k_new[0].is_contiguous() and v_new[0].is_contiguous()):
            return False
        if rows:
            self.kernels.write_kv[_grid(rows)](k_new, v_new, slots, k_slots, v_slots, rows, k_new.stride(0),
                                               v_new.stride(0), width, ROWS=_ROWS, WIDTH_PAD=power_of_two(width))
        return True
