"""Every Triton kernel of the GPU path compiles for NVIDIA GPUs (Ampere sm_80, Hopper sm_90), down to a cubin
by the ptxas that ships with triton, on this machine without a GPU.

The interpreter tests (test_triton_decode.py, test_triton_pointwise.py) check what the kernels compute; they
run Python, so they accept code the GPU compiler would refuse (types, shapes, a helper it cannot resolve). This
compiles each kernel as the engine launches it, in a process without the interpreter, so that a GPU session
starts from kernels that build. Needs `scripts/install.sh --dev-all` (triton).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# kernel -> (signature, constexprs): the argument types as the launchers pass them (bf16 rows, int64 indices)
SCRIPT = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tokenflow.runtime.gpu import triton_kernels as k

def compile_all(bf16: str) -> int:
    cases = [
        (k.rms_norm, ["*" + bf16, "*" + bf16, "*" + bf16, "i32", "i32", "i32", "fp32", "i32"],
         dict(ROWS=4, WIDTH_PAD=1024, HEADS=1, ROUND=bf16 == "bf16")),
        (k.rms_norm, ["*" + bf16, "*" + bf16, "*" + bf16, "i32", "i32", "i32", "fp32", "i32"],
         dict(ROWS=4, WIDTH_PAD=128, HEADS=32, ROUND=bf16 == "bf16")),
        (k.add_rms_norm, ["*" + bf16] * 5 + ["i32", "fp32", "i32"], dict(ROWS=1, WIDTH_PAD=4096, ROUND=bf16 == "bf16")),
        (k.rope, ["*" + bf16, "*" + bf16, "*" + bf16, "i32", "i32", "i32"],
         dict(ROWS=4, HALF=64, HALF_PAD=64, ROUND=bf16 == "bf16")),
        (k.silu_mul, ["*" + bf16, "*" + bf16, "i32", "i32"], dict(ROWS=4, COLUMNS=1024, ROUND=bf16 == "bf16")),
        (k.write_kv, ["*" + bf16, "*" + bf16, "*i64", "*" + bf16, "*" + bf16, "i32", "i32", "i32", "i32"],
         dict(ROWS=4, WIDTH_PAD=1024)),
        (k.paged_decode_split, ["*" + bf16] * 3 + ["*i64", "*i64", "*" + bf16, "*fp32", "*fp32", "*fp32", "fp32"]
         + ["i32"] * 6, dict(NUM_HEADS=32, GROUP=4, GROUP_PAD=4, HEAD_DIM=128, DIM_PAD=128, BLOCK_SIZE=16,
                             BLOCK_PAD=16, MERGED=False)),
        (k.paged_decode_split, ["*" + bf16] * 3 + ["*i64", "*i64", "*" + bf16, "*fp32", "*fp32", "*fp32", "fp32"]
         + ["i32"] * 6, dict(NUM_HEADS=9, GROUP=3, GROUP_PAD=4, HEAD_DIM=64, DIM_PAD=64, BLOCK_SIZE=12,
                             BLOCK_PAD=16, MERGED=True)),
        (k.paged_decode_merge, ["*" + bf16, "*fp32", "*fp32", "*fp32", "i32"],
         dict(NUM_HEADS=32, HEAD_DIM=128, DIM_PAD=128, SPLITS_PAD=16)),
        (k.paged_varlen_attention, ["*" + bf16] * 4 + ["*i32"] * 3 + ["fp32"] + ["i32"] * 5,
         dict(NUM_HEADS=32, GROUP=4, GROUP_PAD=4, HEAD_DIM=128, DIM_PAD=128, BLOCK_SIZE=16, BLOCK_Q=16, BLOCK_N=32,
              PRECISION="tf32" if bf16 == "bf16" else "ieee")),
        (k.paged_varlen_attention, ["*" + bf16] * 4 + ["*i32"] * 3 + ["fp32"] + ["i32"] * 5,
         dict(NUM_HEADS=9, GROUP=3, GROUP_PAD=4, HEAD_DIM=64, DIM_PAD=64, BLOCK_SIZE=16, BLOCK_Q=4, BLOCK_N=32,
              PRECISION="tf32" if bf16 == "bf16" else "ieee")),
    ]
    built = 0
    for arch in (80, 90):
        for fn, types, constexprs in cases:
            names = fn.arg_names
            signature = dict(zip(names, types + ["constexpr"] * len(constexprs)))
            positions = {(names.index(name),): value for name, value in constexprs.items()}
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=positions),
                                    target=GPUTarget("cuda", arch, 32))
            assert kernel.asm["cubin"], (fn.__name__, arch)
            built += 1
    return built

print("built", compile_all("bf16") + compile_all("fp32"))
'''


def test_every_kernel_compiles_for_ampere_and_hopper() -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "built 44" in done.stdout
