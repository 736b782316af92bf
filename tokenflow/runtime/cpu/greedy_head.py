"""Greedy rows' tokens from an fp32 head without its logits (`few_rows_greedy_f32` in few_rows_linear.c).

Why: a greedy decode step needs each row's largest logit only, and on a CPU the fp32 head is the longest
product of a small model's decode step. A bf16 copy of the head estimates every logit within a bound
known per column (the C file derives it), so only the few columns that can still be the largest are
computed again in fp32, by the few-rows kernel's own tile: the token is the one the fp32 logits' argmax
gives, bit for bit (`bench-step --parts`, "head" column, measures the two). Where the estimates cannot
settle a row cheaply (near-uniform logits, a non-finite value) the step computes the logits instead.

The cost is a bf16 copy of the head's weight (half its fp32 size) and two norms per column.
"""

from __future__ import annotations

import torch

from tokenflow.runtime.cpu.few_rows_linear import FewRowsLinear, FewRowsWeight

__all__ = ("GreedyHead", "greedy_head_for")


class GreedyHead:
    """The greedy token of each row that `head` (an fp32 few-rows linear, no bias) would give."""

    def __init__(self, head: FewRowsLinear, weight: torch.Tensor, valid: int) -> None:
        self.head = head
        rounded = weight.detach().to(torch.bfloat16)
        self.estimate = FewRowsWeight(rounded, None)
        exact, estimate = weight.detach().double(), rounded.double()
        up = 1 + 2**-20  # past the cast to fp32: the bound wants them rounded up
        self.dw_norms = ((estimate - exact).norm(dim=1) * up).float()  # ||w~_c - w_c||, the rounding's residue
        self.w_norms = (torch.maximum(exact.norm(dim=1), estimate.norm(dim=1)) * up).float()
        self.valid = min(valid, head.weight.n)  # columns past the vocabulary are never chosen
        self._greedy = head.kernels.greedy_function
        self._scratch: dict[str, torch.Tensor] = {}

    def takes(self, rows: torch.Tensor) -> bool:
        """Whether the head's own forward of `rows` would be the few-rows kernel (whose logits this matches)."""
        return rows.shape[0] > 0 and self.head.takes(rows)

    def tokens(self, rows: torch.Tensor) -> list[int] | None:
        """Each row's token (-1 where the row is not finite, so neither are its logits), or None where the
        estimates do not settle it: then the logits are needed."""
        rows = rows.contiguous()
        m, weight = rows.shape[0], self.head.weight
        x_bf16 = self._buffer("x_bf16", m * weight.k, torch.bfloat16)
        estimates = self._buffer("estimates", m * weight.n, torch.float32)
        out = torch.empty(m, dtype=torch.int64)
        status = self._greedy(rows.data_ptr(), m, weight.k, self.estimate.packed.data_ptr(), weight.packed.data_ptr(),
                              self.dw_norms.data_ptr(), self.w_norms.data_ptr(), weight.n, weight.n_pad, self.valid,
                              x_bf16.data_ptr(), estimates.data_ptr(), out.data_ptr())
        if status == 1:
            return None
        if status != 0:
            raise ValueError(f"few_rows_greedy_f32 refused its arguments (status {status})")
        return out.tolist()

    def _buffer(self, name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
        """Scratch kept across steps: a fresh block of this size is mmapped and would page-fault every step."""
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < size:
            buf = self._scratch[name] = torch.empty(size, dtype=dtype)
        return buf


def greedy_head_for(head: object, weight: torch.Tensor, valid: int) -> GreedyHead | None:
    """A GreedyHead for an fp32 few-rows `head` of `weight` where this CPU has the bf16 kernel; else None."""
    if not isinstance(head, FewRowsLinear) or head.weight.bias is not None:
        return None
    if weight.dtype != torch.float32 or torch.bfloat16 not in head.kernels.dtypes or head.weight.k % 16:
        return None
    return GreedyHead(head, weight, valid)
