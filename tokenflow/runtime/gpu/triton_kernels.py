"""The Triton kernels of the GPU path, in one module that imports triton: imported on first use
(`gpu.triton_launch.triton_kernels`), since triton is optional.

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
def add_rms_norm(x_ptr, res_ptr, w_ptr, sum_ptr, out_ptr, rows, eps, width,
                 ROWS: tl.constexpr, WIDTH_PAD: tl.constexpr, ROUND: tl.constexpr):
    """`residual + x` (stored: the next residual) and its RMSNorm, in one pass over `ROWS` contiguous rows."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, WIDTH_PAD)
    live = (r < rows)[:, None] & (c < width)[None, :]
    at = r[:, None] * width + c[None, :]
    w = tl.load(w_ptr + c, mask=c < width, other=0.0).to(tl.float32)
    total = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32) + tl.load(res_ptr + at, mask=live,
                                                                                other=0.0).to(tl.float32)
    if ROUND:  # the bf16 sum, as transformers' residual add rounds it; the norm reads the rounded sum
        total = bf16_rounded(total)
    tl.store(sum_ptr + at, total.to(sum_ptr.dtype.element_ty), mask=live)
    y = total * tl.math.rsqrt(tl.sum(total * total, axis=1) / width + eps)[:, None]
    out = y * w[None, :]
    if ROUND:
        out = bf16_rounded(bf16_rounded(y) * w[None, :])
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=live)


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
    scale, q_stride, table_stride, blocks_per_split, block_stride, slot_stride, head_stride,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr, MERGED: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    length = tl.load(lengths_ptr + row).to(tl.int32)  # the loop's bounds, one integer type
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    n = tl.arange(0, BLOCK_PAD)  # a block's slots (BLOCK_SIZE of them; tl.arange takes powers of two)
    heads = kv_head * GROUP + g
    live = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row * q_stride + heads[:, None] * HEAD_DIM + d[None, :], mask=live, other=0.0)
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
        # the block's slots past the length may hold anything: not read
        keys = (n < BLOCK_SIZE) & (b * BLOCK_SIZE + n < length)
        k = tl.load(k_ptr + at, mask=keys[:, None] & dims, other=0.0).to(tl.float32)  # [BLOCK_PAD, DIM_PAD]
        v = tl.load(v_ptr + at, mask=keys[:, None] & dims, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_PAD]
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


@triton.jit
def paged_varlen_attention(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, seq_lens_ptr, query_start_ptr,
    scale, q_stride, table_stride, block_stride, slot_stride, head_stride,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (sequence, tile of its queries, KV head) of a packed step: the tile's queries (times the G query heads
    of the KV head, as rows) against the sequence's keys up to each query's position, read through its block
    table. A decode row is a sequence of one query."""
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_begin = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_begin
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
        context = seq_len - q_len  # keys cached before this step's queries
        r = tl.arange(0, BLOCK_Q * GROUP_PAD)
        tok = q_tile * BLOCK_Q + r // GROUP_PAD
        g = r % GROUP_PAD
        rows = (tok < q_len) & (g < GROUP)
        d = tl.arange(0, DIM_PAD)
        dims = d < HEAD_DIM
        heads = kv_head * GROUP + g
        at_head = heads[:, None] * HEAD_DIM + d[None, :]
        q = tl.load(q_ptr + (q_begin + tok)[:, None] * q_stride + at_head, mask=rows[:, None] & dims[None, :],
                    other=0.0).to(tl.float32)
        pos = context + tok  # each row's query position: it sees keys 0..pos
        last_key = tl.minimum(seq_len, context + (q_tile + 1) * BLOCK_Q)
        running_max = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], tl.float32)
        n = tl.arange(0, BLOCK_N)
        for start in range(0, last_key, BLOCK_N):
            keys = start + n
            present = keys < last_key
            blocks = tl.load(table_ptr + seq * table_stride + keys // BLOCK_SIZE, mask=present, other=0).to(tl.int64)
            at = (blocks[:, None] * block_stride + (keys % BLOCK_SIZE)[:, None] * slot_stride + kv_head * head_stride
                  + d[None, :])
            k = tl.load(k_ptr + at, mask=present[:, None] & dims[None, :], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + at, mask=present[:, None] & dims[None, :], other=0.0).to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [rows, BLOCK_N]
            scores = tl.where((keys[None, :] <= pos[:, None]) & present[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row that sees no key yet (padding)
            probs = tl.exp(scores - shift[:, None])
            rescale = tl.exp(running_max - shift)
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            acc = acc * rescale[:, None] + tl.dot(probs, v, input_precision=PRECISION)
            running_max = new_max
        out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        at_out = (q_begin + tok)[:, None] * (NUM_HEADS * HEAD_DIM) + at_head
        tl.store(out_ptr + at_out, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] & dims[None, :])
