"""Time the few-rows kernel against oneDNN's packed product at decode row counts, for real models' widths.

    python scripts/few_rows_crossover.py

Prints kernel time / oneDNN time per (dtype, linear, rows): below 1 the kernel is faster. Where the bf16 row of
a CPU with AMX crosses 1 is `AMX_BF16_ROWS` in tokenflow/runtime/cpu/few_rows_linear.py.
"""

from __future__ import annotations

import time

import torch

from tokenflow.runtime.cpu.few_rows_linear import FEW_ROWS, few_rows_linear
from tokenflow.runtime.cpu.packed_linear import packed_linear

# (in, out) of linears of SmolLM2-135M, Qwen3-0.6B and Llama-3.2-1B
SHAPES = {"smollm2 gate_up": (576, 3072), "smollm2 down": (1536, 576), "qwen3-0.6b gate_up": (1024, 6144),
          "qwen3-0.6b down": (3072, 1024), "llama-3.2-1b gate_up": (2048, 16384)}
ROWS = (1, 2, 4, 6, 8, 12, 16, 32)


def _ms(f, x: torch.Tensor, repeats: int = 20) -> float:
    f(x), f(x)
    start = time.perf_counter()
    for _ in range(repeats):
        f(x)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    torch.manual_seed(0)
    print("kernel / oneDNN time by rows: " + " ".join(f"{m:>5d}" for m in ROWS))
    for dtype in (torch.bfloat16, torch.float32):
        for name, (k, n) in SHAPES.items():
            w = (torch.randn(n, k) * 0.02).to(dtype)
            onednn = packed_linear(w, None)
            kernel = few_rows_linear(w, None, onednn) if onednn is not None else None
            if kernel is None:
                print(f"{name}: no few-rows kernel or oneDNN packing for {dtype} here")
                continue
            kernel.max_rows = FEW_ROWS  # the kernel itself, whatever the engine's limit
            ratios = [_ms(kernel, x) / _ms(onednn, x) for x in (torch.randn(m, k).to(dtype) for m in ROWS)]
            print(f"{str(dtype)[6:]:8s} {name:22s} " + " ".join(f"{r:5.2f}" for r in ratios), flush=True)


if __name__ == "__main__":
    main()
