"""`compile=True`: static decode batch shapes and a compiled MLP.

Decode-only steps are padded to a few batch sizes (`decode_buckets`: 1, 2, 4, 8, ...
up to `max_num_seqs`) with dummy rows that write into a scratch KV block no
sequence owns and are never sampled, so a compiler sees a handful of shapes.
Every decoder layer's gated MLP (`down(act(gate(x)) * up(x))`, the Llama /
Qwen / Mistral shape) then runs through one `torch.compile`d function that
takes the weights as arguments: one graph per bucket shared by all layers,
not one per layer. On CUDA the mode is `reduce-overhead` (CUDA graphs).

Attention stays eager: its context length changes every step. Off by default:
on CPU the MLP's time is in its matrix products, which compiling does not
speed up (it only fuses the small elementwise part), while the padding adds
rows and compiling delays startup; `tokenflow bench-step` measures both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tokenflow.runtime.gated_mlp import is_gated_silu_mlp

__all__ = ("compile_mlps", "decode_buckets", "padded_size")

log = logging.getLogger("tokenflow")


def doubling_buckets(largest: int, smallest: int = 1) -> list[int]:
    """`smallest`, twice it, four times it, ... below `largest`, and `largest` itself: the padded sizes of
    fixed-shape steps (batch rows, context blocks, step tokens)."""
    sizes, n = [], smallest
    while n < largest:
        sizes.append(n)
        n *= 2
    return [*sizes, largest]


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two below `max_num_seqs`, and `max_num_seqs` itself."""
    return doubling_buckets(max_num_seqs)


def padded_size(n: int, buckets: list[int]) -> int:
    """The smallest bucket holding `n` rows (`n` itself beyond the largest)."""
    for size in buckets:
        if size >= n:
            return size
    return n


def _gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def compile_mlps(model: torch.nn.Module, row_counts: set[int]) -> int:
    """Route every SiLU-gated, bias-free MLP of `model` through one compiled function for inputs of
    `row_counts` rows (other shapes stay eager, so prefill chunks never trigger a recompile).
    Returns how many MLPs were routed."""
    device = next(model.parameters()).device
    mode = "reduce-overhead" if device.type == "cuda" else None
    compiled = torch.compile(_gated_mlp, dynamic=False, mode=mode)
    count = 0
    for module in model.modules():
        if not is_gated_silu_mlp(module):
            continue
        module.forward = _routed(module, module.forward, compiled, row_counts)
        count += 1
    log.info("compile: %d MLPs routed through torch.compile for decode batches of %s rows",
             count, sorted(row_counts))
    return count


def _routed(module: Any, eager: Callable[..., torch.Tensor], compiled: Callable[..., torch.Tensor],
            row_counts: set[int]) -> Callable[..., torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and x.shape[0] == 1 and x.shape[1] in row_counts:
            return compiled(x, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight)
        return eager(x)

    return forward
