"""The Triton kernels of the GPU path, in one module that imports triton: imported only where they run
(`attention.triton_decode`, `gpu.triton_pointwise` import it on first use), since triton is optional.

Module-level functions, so that a kernel can call another (`bf16_rounded`) both when compiled and on Triton's
interpreter (`TRITON_INTERPRET=1`, which the CPU tests run; set before this module is imported).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bf16_rounded(x):
    """fp32 `x` rounded to bf16's precision, to nearest even (as torch rounds); kept in fp32. Written out
    because Triton's interpreter truncates where the GPU rounds, and the CPU tests run the interpreter."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def rms_norm(x_ptr, w_ptr, out_ptr, rows, x_stride, out_stride, eps, width,
             ROWS: tl.constexpr, WIDTH_PAD: tl.constexpr, HEADS: tl.constexpr, ROUND: tl.constexpr):
    """RMSNorm of `ROWS` rows (each of `HEADS` groups of `width` values normalised alone: Qwen3's head norms)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, WIDTH_PAD)
    live = (r < rows)[:, None] & (c < width)[None, :]
    w = tl.load(w_ptr + c, mask=c < width, other=0.0).to(tl.float32)
    for h in range(HEADS):
        at = r[:, None] * x_stride + h * width + c[None, :]
        x = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
        y = x * tl.math.rsqrt(tl.sum(x * x, axis=1) / width + eps)[:, None]
        out = y * w[None, :]
        if ROUND:  # transformers rounds the normalised rows to bf16, then multiplies by the weight
            out = bf16_rounded(bf16_rounded(y) * w[None, :])
        out_at = r[:, None] * out_stride + h * width + c[None, :]
        tl.store(out_ptr + out_at, out.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def rope(qkv_ptr, cos_ptr, sin_ptr, rows, qkv_stride, heads,
         ROWS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, ROUND: tl.constexpr):
    """x cos + rotate_half(x) sin in place on the first `heads` heads of each row."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, HALF_PAD)
    live = (r < rows)[:, None] & (c < HALF)[None, :]
    trig = r[:, None] * (2 * HALF) + c[None, :]
    cos1 = tl.load(cos_ptr + trig, mask=live, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + trig + HALF, mask=live, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + trig, mask=live, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + trig + HALF, mask=live, other=0.0).to(tl.float32)
    for h in range(heads):
        at = r[:, None] * qkv_stride + h * (2 * HALF) + c[None, :]
        x1 = tl.load(qkv_ptr + at, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(qkv_ptr + at + HALF, mask=live, other=0.0).to(tl.float32)
        a1, b1 = x1 * cos1, -x2 * sin1
        a2, b2 = x2 * cos2, x1 * sin2
        out1, out2 = a1 + b1, a2 + b2
        if ROUND:  # each product and the sum rounded, as the bf16 torch ops round them
            out1 = bf16_rounded(bf16_rounded(a1) + bf16_rounded(b1))
            out2 = bf16_rounded(bf16_rounded(a2) + bf16_rounded(b2))
        tl.store(qkv_ptr + at, out1.to(qkv_ptr.dtype.element_ty), mask=live)
        tl.store(qkv_ptr + at + HALF, out2.to(qkv_ptr.dtype.element_ty), mask=live)


@triton.jit
def silu_mul(gate_up_ptr, out_ptr, rows, inter,
             ROWS: tl.constexpr, COLUMNS: tl.constexpr, ROUND: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    live = (r < rows)[:, None] & (c < inter)[None, :]
    at = r[:, None] * (2 * inter) + c[None, :]
    gate = tl.load(gate_up_ptr + at, mask=live, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + at + inter, mask=live, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    if ROUND:  # F.silu's output is rounded before the product, and the product
        out = bf16_rounded(bf16_rounded(gate / (1.0 + tl.exp(-gate))) * up)
    tl.store(out_ptr + r[:, None] * inter + c[None, :], out.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def write_kv(k_ptr, v_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, rows, k_stride, v_stride, width,
             ROWS: tl.constexpr, WIDTH_PAD: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, WIDTH_PAD)
    live = (r < rows)[:, None] & (c < width)[None, :]
    slots = tl.load(slots_ptr + r, mask=r < rows, other=0).to(tl.int64)
    k = tl.load(k_ptr + r[:, None] * k_stride + c[None, :], mask=live)
    v = tl.load(v_ptr + r[:, None] * v_stride + c[None, :], mask=live)
    tl.store(k_cache_ptr + slots[:, None] * width + c[None, :], k, mask=live)
    tl.store(v_cache_ptr + slots[:, None] * width + c[None, :], v, mask=live)


@triton.jit
def paged_decode_split(
    q_ptr, k_ptr, v_ptr, table_ptr, lengths_ptr, out_ptr, acc_ptr, max_ptr, sum_ptr,
    scale, table_stride, blocks_per_split, block_stride, slot_stride, head_stride,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, MERGED: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    length = tl.load(lengths_ptr + row).to(tl.int32)  # the loop's bounds, one integer type
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    n = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g
    live = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + (row * NUM_HEADS + heads)[:, None] * HEAD_DIM + d[None, :], mask=live, other=0.0)
    q = q.to(tl.float32) * scale
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(length, BLOCK_SIZE))
    dims = (d < HEAD_DIM)[None, :]
    for b in range(first, last):
        block = tl.load(table_ptr + row * table_stride + b).to(tl.int64)
        at = block * block_stride + n[:, None] * slot_stride + kv_head * head_stride + d[None, :]
        keys = (b * BLOCK_SIZE + n) < length  # the block's slots past the length may hold anything: not read
        k = tl.load(k_ptr + at, mask=keys[:, None] & dims, other=0.0).to(tl.float32)  # [BLOCK_SIZE, DIM_PAD]
        v = tl.load(v_ptr + at, mask=keys[:, None] & dims, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_SIZE]
        scores = tl.where(keys[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # finite: a block holds a key below length
        probs = tl.exp(scores - new_max[:, None])
        rescale = tl.exp(running_max - new_max)
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.sum(probs[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max
    if MERGED:  # one split: the row's whole context, normalised here
        out = acc / running_sum[:, None]
        at_out = (row * NUM_HEADS + heads)[:, None] * HEAD_DIM + d[None, :]
        tl.store(out_ptr + at_out, out.to(out_ptr.dtype.element_ty), mask=live)
    else:
        part = (row * splits + split) * NUM_HEADS + heads  # [GROUP_PAD]
        tl.store(acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=(g < GROUP)[:, None])
        tl.store(max_ptr + part, running_max, mask=g < GROUP)
        tl.store(sum_ptr + part, running_sum, mask=g < GROUP)


@triton.jit
def paged_decode_merge(
    out_ptr, acc_ptr, max_ptr, sum_ptr, splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    part = (row * splits + s) * NUM_HEADS + head  # [SPLITS_PAD]
    present = s < splits
    maxes = tl.load(max_ptr + part, mask=present, other=float("-inf"))
    top = tl.max(maxes, axis=0)
    weights = tl.where(present, tl.exp(maxes - top), 0.0)  # an empty split (past the length) weighs 0
    total = tl.sum(tl.load(sum_ptr + part, mask=present, other=0.0) * weights, axis=0)
    acc = tl.load(acc_ptr + part[:, None] * DIM_PAD + d[None, :], mask=present[:, None], other=0.0)
    out = tl.sum(acc * weights[:, None], axis=0) / total
    tl.store(out_ptr + (row * NUM_HEADS + head) * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)
