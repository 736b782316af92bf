/* GGUF's quantised weights (ggml's block formats) as they are in the file, for tokenflow on CPU; called
 * through ctypes. Built at first use by tokenflow/runtime/cpu/gguf_linear.py (cc -O3 -march=native -fopenmp).
 *
 * A weight [n, k] is n rows of ggml blocks, each block a run of 32 or 256 values along k with its scales.
 * Nothing is repacked: the file's bytes are what the steps read (memory ~ the file's size), and a block is
 * turned into floats where it is used:
 *
 * - gguf_dequantize: rows into floats (fp32 or bf16, round to nearest even), for a prefill chunk's product
 *   (oneDNN on the dequantised weight), an embedding's rows, and the tests.
 * - gguf_few_rows: y = x W^T for the few rows of a decode step. Threads split the weight rows four at a time;
 *   up to four input rows, the four weight rows' blocks are dequantised 16 values at a time in registers and
 *   multiplied as they come (16 accumulators); more input rows, each chunk of the weight rows is dequantised once
 *   into an L1 buffer and groups of four input rows run over it. bf16 rows (up to 16) against Q4_K, Q6_K and Q8_0 go
 *   through int8 and VNNI instead (vnni_tile, vnni_q8_tile).
 *
 * Formats follow ggml's reference dequantisation (ggml-quants.c): value = d * q (+ offsets) per block, with
 * the K-quants' 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K) sub-block scales.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* ggml's type ids (ggml.h) */
enum {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30
};

#define QK 256  /* values per K-quant super-block */
#define WR 4    /* weight rows per pass of gguf_few_rows */
#define XR 4    /* input rows per register tile */
#define MAX_ROWS 64 /* input rows gguf_few_rows takes */
/* How far ahead of its use a weight row's bytes are prefetched: the streams are four rows at once, and a K-quant
 * block's dequantisation is long enough that the loads alone do not keep the memory busy */
#ifndef AHEAD
#define AHEAD 2048
#endif

static inline float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exponent = 113;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            --exponent;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float half_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h); /* one instruction; every block reads one or two */
#else
    return half_to_float(h);
#endif
}

/* Values per block and bytes per block of a format (0: not one of ours). */
int gguf_block_shape(int format, int64_t *values, int64_t *bytes)
{
    static const int64_t shapes[][3] = {
        {F32, 1, 4}, {F16, 1, 2}, {BF16, 1, 2}, {Q4_0, 32, 18}, {Q4_1, 32, 20}, {Q5_0, 32, 22}, {Q5_1, 32, 24},
        {Q8_0, 32, 34}, {Q4_K, QK, 144}, {Q5_K, QK, 176}, {Q6_K, QK, 210},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; ++i)
        if (shapes[i][0] == format) {
            *values = shapes[i][1];
            *bytes = shapes[i][2];
            return 1;
        }
    return 0;
}

/* Q4_K / Q5_K: sub-block j's 6-bit scale and min from the block's 12 packed bytes. */
static inline void scale_min_k4(int j, const uint8_t *q, int *scale, int *min)
{
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* A Q4_0 / Q4_1 / Q5_0 / Q5_1 block's parts: value = d * q + m, q's low four bits at `codes` (value i < 16: the
 * low nibble of byte i, value 16 + i: its high nibble), the fifth bit of value i bit i of `high` (Q5 only). */
typedef struct {
    float d, m;
    uint32_t high;
    const uint8_t *codes;
} LegacyBlock;

static inline LegacyBlock legacy_block(int format, const uint8_t *b)
{
    const int one = format == Q4_1 || format == Q5_1, five = format == Q5_0 || format == Q5_1;
    LegacyBlock block = {half_at(b), 0.f, 0, b + 2 + 2 * one + 4 * five};
    block.m = one ? half_at(b + 2) : (five ? -16.f : -8.f) * block.d;
    if (five)
        memcpy(&block.high, b + 2 + 2 * one, sizeof block.high);
    return block;
}

/* One block of `format` at `b` into `y` (the block's values, fp32). */
static inline void dequantize_block(int format, const uint8_t *b, float *restrict y)
{
    switch (format) {
    case Q8_0: {
        const float d = half_at(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int i = 0; i < 32; ++i)
            y[i] = d * (float)q[i];
        break;
    }
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
        const LegacyBlock block = legacy_block(format, b);
        for (int i = 0; i < 16; ++i) {
            const int lo = (block.codes[i] & 0xF) | (int)(((block.high >> i) & 1) << 4);
            const int hi = (block.codes[i] >> 4) | (int)(((block.high >> (i + 16)) & 1) << 4);
            y[i] = block.d * (float)lo + block.m;
            y[i + 16] = block.d * (float)hi + block.m;
        }
        break;
    }
    case Q4_K:
    case Q5_K: {
        const float d = half_at(b), dmin = half_at(b + 2);
        const uint8_t *scales = b + 4;
        const uint8_t *high = b + 16;  /* Q5_K: the fifth bits, 32 bytes */
        const uint8_t *q = b + (format == Q5_K ? 48 : 16);
        const int five = format == Q5_K;
        for (int j = 0; j < 4; ++j) { /* 64 values: 32 low nibbles, then 32 high nibbles */
            int s0, m0, s1, m1;
            scale_min_k4(2 * j, scales, &s0, &m0);
            scale_min_k4(2 * j + 1, scales, &s1, &m1);
            const float d0 = d * (float)s0, o0 = dmin * (float)m0, d1 = d * (float)s1, o1 = dmin * (float)m1;
            for (int i = 0; i < 32; ++i) {
                const int lo = (q[i] & 0xF) + (five ? ((high[i] >> (2 * j)) & 1) << 4 : 0);
                const int hi = (q[i] >> 4) + (five ? ((high[i] >> (2 * j + 1)) & 1) << 4 : 0);
                y[64 * j + i] = d0 * (float)lo - o0;
                y[64 * j + 32 + i] = d1 * (float)hi - o1;
            }
            q += 32;
        }
        break;
    }
    case Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        for (int half = 0; half < 2; ++half) { /* 128 values from 64 low-nibble bytes and 32 high-bit bytes */
            float *out = y + 128 * half;
            for (int i = 0; i < 32; ++i) {
                const int s = i / 16;
                const int q1 = ((ql[i] & 0xF) | ((qh[i] & 3) << 4)) - 32;
                const int q2 = ((ql[i + 32] & 0xF) | (((qh[i] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[i] >> 4) | (((qh[i] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[i + 32] >> 4) | (((qh[i] >> 6) & 3) << 4)) - 32;
                out[i] = d * (float)sc[s] * (float)q1;
                out[i + 32] = d * (float)sc[s + 2] * (float)q2;
                out[i + 64] = d * (float)sc[s + 4] * (float)q3;
                out[i + 96] = d * (float)sc[s + 6] * (float)q4;
            }
            ql += 64;
            qh += 32;
            sc += 8;
        }
        break;
    }
    case F32:
        memcpy(y, b, sizeof(float));
        break;
    case F16:
        y[0] = half_at(b);
        break;
    case BF16: {
        uint16_t v;
        memcpy(&v, b, sizeof v);
        y[0] = bf16_to_float(v);
        break;
    }
    }
}

#if defined(__AVX512F__)
/* AVX-512 forms of dequantize_block (the same values: d * q is exact in fp32 for every format but Q6_K, whose
 * (d * scale) * q rounds as the scalar form's), 16 values at a time: `block_scales` once per block, then
 * `block_slice` for values 16 s .. 16 s + 16, in registers; the tiles multiply the slices as they come. */

/* 16 bytes as 16 int32 lanes. */
static inline __m512i bytes16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

/* A K-quant block's sub-block scales (Q4_K, Q5_K: d * scale and dmin * min of 8 sub-blocks, from the 12 packed
 * bytes, four sub-blocks per 32-bit word at once; Q6_K: d * scale of 16); nothing for the others. */
static inline __attribute__((always_inline)) void block_scales(const int format, const uint8_t *b, float *scale,
                                                               float *minimum)
{
    if (format == Q4_K || format == Q5_K) {
        uint32_t w[3];
        memcpy(w, b + 4, sizeof w);
        const uint32_t low6 = 0x3F3F3F3Fu, low4 = 0x0F0F0F0Fu, top2 = 0xC0C0C0C0u;
        const uint32_t s_lo = w[0] & low6, m_lo = w[1] & low6; /* sub-blocks 0 .. 3 */
        const uint32_t s_hi = (w[2] & low4) | ((w[0] & top2) >> 2), m_hi = ((w[2] >> 4) & low4) | ((w[1] & top2) >> 2);
        const __m256 sv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)s_lo, (int)s_hi, 0, 0)));
        const __m256 mv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)m_lo, (int)m_hi, 0, 0)));
        _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(half_at(b)), sv));
        _mm256_storeu_ps(minimum, _mm256_mul_ps(_mm256_set1_ps(half_at(b + 2)), mv));
    } else if (format == Q6_K) {
        const __m512 sv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))));
        _mm512_storeu_ps(scale, _mm512_mul_ps(_mm512_set1_ps(half_at(b + 208)), sv));
    }
}

/* Values 16 s .. 16 s + 16 of the block at `b` (`scale`, `minimum`: its block_scales). */
static inline __attribute__((always_inline)) __m512 block_slice(const int format, const uint8_t *b, const int s,
                                                                const float *scale, const float *minimum)
{
    const __m512i low4 = _mm512_set1_epi32(0xF);
    switch (format) {
    case Q8_0: {
        const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * s)));
        return _mm512_mul_ps(_mm512_set1_ps(half_at(b)), _mm512_cvtepi32_ps(q));
    }
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
        const LegacyBlock block = legacy_block(format, b);
        const __m512i raw = bytes16(block.codes);
        __m512i q = s == 0 ? _mm512_and_si512(raw, low4) : _mm512_srli_epi32(raw, 4);
        const __mmask16 fifth = (__mmask16)(s == 0 ? block.high & 0xFFFF : block.high >> 16); /* 0 for Q4 */
        q = _mm512_mask_add_epi32(q, fifth, q, _mm512_set1_epi32(16));
        return _mm512_fmadd_ps(_mm512_set1_ps(block.d), _mm512_cvtepi32_ps(q), _mm512_set1_ps(block.m));
    }
    case Q4_K:
    case Q5_K: { /* 64 values per 32 bytes: the low nibbles are sub-block 2 j, the high ones sub-block 2 j + 1 */
        const int j = s / 4, upper = (s % 4) / 2, h = s % 2, sub = 2 * j + upper;
        const __m512i raw = bytes16(b + (format == Q5_K ? 48 : 16) + 32 * j + 16 * h);
        __m512i q = upper ? _mm512_srli_epi32(raw, 4) : _mm512_and_si512(raw, low4);
        if (format == Q5_K) {
            const __m512i bits = _mm512_srli_epi32(bytes16(b + 16 + 16 * h), sub);
            q = _mm512_add_epi32(q, _mm512_slli_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(1)), 4));
        }
        return _mm512_fmadd_ps(_mm512_set1_ps(scale[sub]), _mm512_cvtepi32_ps(q), _mm512_set1_ps(-minimum[sub]));
    }
    case Q6_K: { /* 128 values per half: 64 low-nibble bytes (quarters 0, 2 from the first 32, 1, 3 from the next) */
        const int half = s / 8, quarter = (s % 8) / 2, h = s % 2;
        const uint8_t *ql = b + 64 * half + 32 * (quarter & 1) + 16 * h, *qh = b + 128 + 32 * half + 16 * h;
        const __m512i raw = bytes16(ql);
        const __m512i nibble = quarter >= 2 ? _mm512_srli_epi32(raw, 4) : _mm512_and_si512(raw, low4);
        const __m512i top = _mm512_and_si512(_mm512_srli_epi32(bytes16(qh), 2 * quarter), _mm512_set1_epi32(3));
        const __m512i q = _mm512_sub_epi32(_mm512_or_si512(nibble, _mm512_slli_epi32(top, 4)), _mm512_set1_epi32(32));
        return _mm512_mul_ps(_mm512_set1_ps(scale[8 * half + h + 2 * quarter]), _mm512_cvtepi32_ps(q));
    }
    default:
        return _mm512_setzero_ps();
    }
}

static inline __attribute__((always_inline)) void dequantize_block_avx512(const int format, const int64_t values,
                                                                         const uint8_t *b, float *restrict y)
{
    float scale[16], minimum[8];
    block_scales(format, b, scale, minimum);
    for (int s = 0; s < values / 16; ++s)
        _mm512_storeu_ps(y + 16 * s, block_slice(format, b, s, scale, minimum));
}
#endif

/* One row of k values (a whole number of blocks of `values` values in `bytes` bytes) into fp32. */
static void dequantize_row(int format, int64_t values, int64_t bytes, const uint8_t *row, int64_t k, float *restrict y)
{
    if (format == F32) {
        memcpy(y, row, sizeof(float) * (size_t)k);
        return;
    }
    for (int64_t j = 0; j < k; j += values)
#if defined(__AVX512F__)
        if (format == F16 || format == BF16)
            dequantize_block(format, row + (j / values) * bytes, y + j);
        else
            dequantize_block_avx512(format, values, row + (j / values) * bytes, y + j);
#else
        dequantize_block(format, row + (j / values) * bytes, y + j);
#endif
}

/* Rows `ids[0 .. count]` (or rows 0 .. count where `ids` is NULL) of the weight at `w` (rows `row_bytes`
 * apart, k values each) into `out` [count][k], fp32 or bf16. 0, or -1 for a format it does not know. */
int gguf_dequantize(int format, const uint8_t *w, int64_t row_bytes, int64_t k, const int64_t *ids, int64_t count,
                    void *out, int out_bf16)
{
    int64_t values, bytes;
    if (!gguf_block_shape(format, &values, &bytes) || k % values != 0 || k / values * bytes != row_bytes)
        return -1;
#pragma omp parallel
    {
        float *row = out_bf16 ? malloc(sizeof(float) * (size_t)k) : NULL;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < count; ++r) {
            const uint8_t *src = w + (ids ? ids[r] : r) * row_bytes;
            if (!out_bf16) {
                dequantize_row(format, values, bytes, src, k, (float *)out + r * k);
                continue;
            }
            dequantize_row(format, values, bytes, src, k, row);
            uint16_t *dst = (uint16_t *)out + r * k;
#pragma omp simd
            for (int64_t j = 0; j < k; ++j)
                dst[j] = float_to_bf16(row[j]);
        }
        free(row);
    }
    return 0;
}

int gguf_few_rows_available(void)
{
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)

/* The sum of `acc`'s lanes into out[at], rounded to bf16 where `bf16`. */
static inline void store_sum(__m512 acc, void *out, int64_t at, int bf16)
{
    const float s = _mm512_reduce_add_ps(acc);
    if (bf16)
        ((uint16_t *)out)[at] = float_to_bf16(s);
    else
        ((float *)out)[at] = s;
}

/* Stores the sums acc[i][c] of input row i and weight row c into out[i * ldo + c]. */
static inline __attribute__((always_inline)) void store_sums(const int xr, const int wr, __m512 acc[XR][WR], void *out,
                                                             int64_t ldo, int bf16)
{
    for (int i = 0; i < xr; ++i)
        for (int c = 0; c < wr; ++c)
            store_sum(acc[i][c], out, i * ldo + c, bf16);
}

/* Rows x[0 .. xr] (fp32, k apart) times weight rows 0 .. wr starting at `w` (`row_bytes` apart, `format`): the wr
 * rows' blocks are dequantised 16 values at a time in registers and multiplied at once, the sums staying in
 * registers. The format is a constant where this is inlined (tile_<format>), so each block's form is chosen once. */
static inline __attribute__((always_inline)) void tile_blocks(const int format, const int64_t values,
                                                              const int64_t bytes, const int xr, const int wr,
                                                              const float *x, const uint8_t *w, int64_t row_bytes,
                                                              int64_t k, void *out, int64_t ldo, int bf16)
{
    __m512 acc[XR][WR];
    for (int i = 0; i < XR; ++i)
        for (int c = 0; c < WR; ++c)
            acc[i][c] = _mm512_setzero_ps();
    float scale[WR][16], minimum[WR][8];
    for (int64_t j = 0; j < k; j += values) {
        const int64_t at = (j / values) * bytes;
        for (int c = 0; c < wr; ++c) {
            for (int64_t line = 0; line < bytes; line += 64) /* every line of the row's stream, AHEAD bytes on */
                __builtin_prefetch(w + c * row_bytes + at + AHEAD + line, 0, 0);
            block_scales(format, w + c * row_bytes + at, scale[c], minimum[c]);
        }
        for (int s = 0; s < values / 16; ++s) {
            __m512 wv[WR];
            for (int c = 0; c < wr; ++c)
                wv[c] = block_slice(format, w + c * row_bytes + at, s, scale[c], minimum[c]);
            for (int i = 0; i < xr; ++i) {
                const __m512 xv = _mm512_loadu_ps(x + i * k + j + 16 * s);
                for (int c = 0; c < wr; ++c)
                    acc[i][c] = _mm512_fmadd_ps(xv, wv[c], acc[i][c]);
            }
        }
    }
    store_sums(xr, wr, acc, out, ldo, bf16);
}

/* Up to XR rows x[0 .. xr] (fp32, k apart) times wr weight rows `wv`-loaded from buf (`chunk` values each, QK
 * apart) into the sums `sums` [xr][WR] (vectors in memory, read and written back): one chunk of tile_chunks. */
static inline __attribute__((always_inline)) void chunk_group(const int xr, const int wr, const float *x, int64_t k,
                                                              const float (*buf)[QK], int64_t chunk, __m512 *sums)
{
    __m512 acc[XR][WR];
    for (int i = 0; i < xr; ++i)
        for (int c = 0; c < wr; ++c)
            acc[i][c] = sums[i * WR + c];
    for (int64_t v = 0; v < chunk; v += 16) {
        __m512 wv[WR];
        for (int c = 0; c < wr; ++c)
            wv[c] = _mm512_load_ps(buf[c] + v);
        for (int i = 0; i < xr; ++i) {
            const __m512 xv = _mm512_loadu_ps(x + i * k + v);
            for (int c = 0; c < wr; ++c)
                acc[i][c] = _mm512_fmadd_ps(xv, wv[c], acc[i][c]);
        }
    }
    for (int i = 0; i < xr; ++i)
        for (int c = 0; c < wr; ++c)
            sums[i * WR + c] = acc[i][c];
}

/* More than XR input rows (up to MAX_ROWS) times weight rows 0 .. wr: each chunk of up to QK values of the wr rows
 * is dequantised once into an L1 buffer, then every group of XR input rows runs over it (their sums kept in L1
 * between chunks), so the weight rows' blocks are read and dequantised once for all the rows. */
static inline __attribute__((always_inline)) void tile_chunks(const int format, const int64_t values,
                                                              const int64_t bytes, const int64_t m, const int wr,
                                                              const float *x, const uint8_t *w, int64_t row_bytes,
                                                              int64_t k, void *out, int64_t ldo, int bf16)
{
    __attribute__((aligned(64))) float buf[WR][QK];
    __m512 sums[MAX_ROWS * WR];
    for (int64_t i = 0; i < m * WR; ++i)
        sums[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += QK) {
        const int64_t chunk = k - j < QK ? k - j : QK;
        for (int c = 0; c < wr; ++c) {
            const uint8_t *row = w + c * row_bytes + (j / values) * bytes;
            for (int64_t line = 0; line < chunk / values * bytes; line += 64)
                __builtin_prefetch(row + AHEAD + line, 0, 0);
            for (int64_t b = 0; b < chunk / values; ++b)
                dequantize_block_avx512(format, values, row + b * bytes, buf[c] + b * values);
        }
        for (int64_t i = 0; i < m; i += XR) {
            const int xr = m - i < XR ? (int)(m - i) : XR;
            const float *rows = x + i * k + j;
            __m512 *group = sums + i * WR;
            if (wr == WR && xr == XR)
                chunk_group(XR, WR, rows, k, (const float (*)[QK])buf, chunk, group);
            else
                for (int r = 0; r < xr; ++r) /* the last rows: one at a time */
                    for (int c = 0; c < wr; ++c)
                        chunk_group(1, 1, rows + r * k, k, (const float (*)[QK])buf + c, chunk, group + r * WR + c);
        }
    }
    for (int64_t i = 0; i < m; ++i)
        for (int c = 0; c < wr; ++c)
            store_sum(sums[i * WR + c], out, i * ldo + c, bf16);
}

/* tile_blocks (up to XR input rows: xr and wr known at compile time, the sums in registers) or tile_chunks (more
 * rows), for one format. */
#define TILE_ROWS(F, V, B)                                                                                          \
    static void tile_##F(int64_t m, int wr, const float *x, const uint8_t *w, int64_t row_bytes, int64_t k,       \
                         void *out, int64_t ldo, int bf16)                                                          \
    {                                                                                                               \
        if (m > XR) {                                                                                               \
            tile_chunks(F, V, B, m, wr, x, w, row_bytes, k, out, ldo, bf16);                                        \
            return;                                                                                                 \
        }                                                                                                           \
        if (wr == WR) {                                                                                             \
            switch (m) {                                                                                            \
            case 4: tile_blocks(F, V, B, 4, 4, x, w, row_bytes, k, out, ldo, bf16); return;                       \
            case 3: tile_blocks(F, V, B, 3, 4, x, w, row_bytes, k, out, ldo, bf16); return;                       \
            case 2: tile_blocks(F, V, B, 2, 4, x, w, row_bytes, k, out, ldo, bf16); return;                       \
            default: tile_blocks(F, V, B, 1, 4, x, w, row_bytes, k, out, ldo, bf16); return;                      \
            }                                                                                                       \
        }                                                                                                           \
        for (int c = 0; c < wr; ++c) /* the weight's last rows, one at a time */                                    \
            tile_blocks(F, V, B, (int)m, 1, x, w + c * row_bytes, row_bytes, k, (char *)out + c * (bf16 ? 2 : 4),   \
                        ldo, bf16);                                                                                 \
    }
TILE_ROWS(Q8_0, 32, 34)
TILE_ROWS(Q4_0, 32, 18)
TILE_ROWS(Q4_1, 32, 20)
TILE_ROWS(Q5_0, 32, 22)
TILE_ROWS(Q5_1, 32, 24)
TILE_ROWS(Q4_K, QK, 144)
TILE_ROWS(Q5_K, QK, 176)
TILE_ROWS(Q6_K, QK, 210)
#undef TILE_ROWS

typedef void (*TileRows)(int64_t, int, const float *, const uint8_t *, int64_t, int64_t, void *, int64_t, int);

static TileRows tile_rows_for(int format)
{
    switch (format) {
    case Q8_0: return tile_Q8_0;
    case Q4_0: return tile_Q4_0;
    case Q4_1: return tile_Q4_1;
    case Q5_0: return tile_Q5_0;
    case Q5_1: return tile_Q5_1;
    case Q4_K: return tile_Q4_K;
    case Q5_K: return tile_Q5_K;
    case Q6_K: return tile_Q6_K;
    default: return NULL;
    }
}


#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* bf16 decode rows against Q4_K and Q6_K weights (what Q4_K_M files hold) as llama.cpp runs them: each input row
 * quantised to int8 per 256 values (one scale, as ggml's Q8_K), the weight's 4- or 6-bit codes multiplied with it as
 * unsigned bytes by VNNI's dot products (64 products per instruction, exact int32 sums), the sub-block scales and
 * offsets applied to the sums. Four times fewer instructions per weight byte than dequantising to floats, at the
 * price of the activations' int8 rounding (llama.cpp's own). fp32 steps keep the float tiles (exact products). */
#define VNNI_ROWS 16 /* bf16 rows the int8 path takes: groups of XR over each pass's weight rows (in L1 by then) */

typedef struct {
    float d;          /* the 256 values' scale: value ~ d * q */
    float sums[16];   /* d * the sum of q per sub-block (Q4_K: 8 of 32 values; Q6_K: 16 of 16) */
    int8_t q[QK];     /* in the order the format's dot products read them (see quantize_rows) */
} QuantizedX;

/* n bf16 values into int8 codes q = round(x * 127 / max|x|); returns their scale d = max|x| / 127. */
static float quantize_values(const uint16_t *x, int n, int8_t *q)
{
    float v[QK], amax = 0.f;
    for (int i = 0; i < n; ++i) {
        v[i] = bf16_to_float(x[i]);
        const float a = v[i] < 0 ? -v[i] : v[i];
        amax = a > amax ? a : amax;
    }
    const float inverse = amax > 0 ? 127.f / amax : 0.f;
    for (int i = 0; i < n; ++i)
        q[i] = (int8_t)__builtin_lrintf(v[i] * inverse);
    return amax / 127.f;
}

/* Row x (k values, bf16) into k / QK blocks at `out`. Q4_K reads 128 values as two 64-byte vectors of codes: the
 * low nibbles of bytes 0..63 are values 0..31 and 64..95, the high ones 32..63 and 96..127, so its q holds each
 * 128 values in that order; Q6_K reads them in order. */
static void quantize_row(const int format, const uint16_t *x, int64_t k, QuantizedX *out)
{
    for (int64_t b = 0; b < k / QK; ++b) {
        QuantizedX *block = out + b;
        int8_t q[QK];
        const float d = quantize_values(x + b * QK, QK, q);
        const int group = format == Q4_K ? 32 : 16;
        for (int s = 0; s < QK / group; ++s) {
            int sum = 0;
            for (int i = 0; i < group; ++i)
                sum += q[s * group + i];
            block->sums[s] = d * (float)sum;
        }
        block->d = d;
        if (format == Q6_K) {
            memcpy(block->q, q, QK);
            continue;
        }
        for (int c = 0; c < QK; c += 128) {
            memcpy(block->q + c, q + c, 32);
            memcpy(block->q + c + 32, q + c + 64, 32);
            memcpy(block->q + c + 64, q + c + 32, 32);
            memcpy(block->q + c + 96, q + c + 96, 32);
        }
    }
}

/* Lanes 0..7 of the result `v[a]`, lanes 8..15 `v[b]` (a Q4_K dot vector's two sub-blocks). */
static inline __m512 two_scales(const __m256 v, const int a, const int b)
{
    const __m512i index = _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
    return _mm512_permutexvar_ps(index, _mm512_castps256_ps512(v));
}

/* The dot products of one weight block (Q4_K or Q6_K, at `b`) with xr quantised input blocks xb[i], added to
 * acc[i] (lane sums are the results). */
static inline __attribute__((always_inline)) void vnni_block(const int format, const int xr, const uint8_t *b,
                                                             const QuantizedX *const *xb, __m512 *acc)
{
    const __m512i low4 = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    if (format == Q4_K) {
        float scale[8], minimum[8];
        block_scales(Q4_K, b, scale, minimum);
        const __m256 sv = _mm256_loadu_ps(scale), mv = _mm256_loadu_ps(minimum);
        const __m512 s[4] = {two_scales(sv, 0, 2), two_scales(sv, 1, 3), two_scales(sv, 4, 6), two_scales(sv, 5, 7)};
        const __m512i raw0 = _mm512_loadu_si512(b + 16), raw1 = _mm512_loadu_si512(b + 80);
        const __m512i codes[4] = {_mm512_and_si512(raw0, low4), _mm512_and_si512(_mm512_srli_epi16(raw0, 4), low4),
                                  _mm512_and_si512(raw1, low4), _mm512_and_si512(_mm512_srli_epi16(raw1, 4), low4)};
        for (int i = 0; i < xr; ++i) {
            __m512 sum = _mm512_setzero_ps();
            for (int v = 0; v < 4; ++v) {
                const __m512i dot = _mm512_dpbusd_epi32(zero, codes[v], _mm512_loadu_si512(xb[i]->q + 64 * v));
                sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s[v], sum);
            }
            /* - dmin * min_j * (sum of x over sub-block j), the x sums already times x's d */
            const __m256 offsets = _mm256_mul_ps(mv, _mm256_loadu_ps(xb[i]->sums));
            sum = _mm512_sub_ps(_mm512_mul_ps(sum, _mm512_set1_ps(xb[i]->d)), _mm512_zextps256_ps512(offsets));
            acc[i] = _mm512_add_ps(acc[i], sum);
        }
        return;
    }
    /* Q6_K: per half, 64 bytes of low four bits (values 0..63 in the low nibbles, 64..127 in the high ones) and 32
     * bytes of the top two bits (bits 0-1: values 0..31, 2-3: 32..63, 4-5: 64..95, 6-7: 96..127) */
    float scale[16], unused[8];
    block_scales(Q6_K, b, scale, unused);
    const __m512 sv = _mm512_loadu_ps(scale);
    const __m512i low2 = _mm512_set1_epi8(0x03), shifts = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    __m512i codes[4];
    __m512 s[4];
    for (int half = 0; half < 2; ++half) {
        const __m512i raw = _mm512_loadu_si512(b + 64 * half);
        const __m512i top = _mm512_srlv_epi64(
            _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half))), shifts);
        const __m512i top_lo = _mm512_slli_epi16(_mm512_and_si512(top, low2), 4);
        const __m512i top_hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(top, 4), low2), 4);
        codes[2 * half] = _mm512_or_si512(_mm512_and_si512(raw, low4), top_lo);
        codes[2 * half + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low4), top_hi);
        for (int v = 0; v < 2; ++v) { /* 4 lanes per 16 values: sub-blocks 8 half + 4 v .. + 4 */
            const int f = 8 * half + 4 * v;
            const __m512i index = _mm512_setr_epi32(f, f, f, f, f + 1, f + 1, f + 1, f + 1, f + 2, f + 2, f + 2,
                                                    f + 2, f + 3, f + 3, f + 3, f + 3);
            s[2 * half + v] = _mm512_permutexvar_ps(index, sv);
        }
    }
    for (int i = 0; i < xr; ++i) {
        __m512 sum = _mm512_setzero_ps();
        for (int v = 0; v < 4; ++v) {
            const __m512i dot = _mm512_dpbusd_epi32(zero, codes[v], _mm512_loadu_si512(xb[i]->q + 64 * v));
            sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s[v], sum);
        }
        /* the codes are q + 32: - 32 * d * scale_s * (sum of x over sub-block s) */
        const __m512 offsets = _mm512_mul_ps(_mm512_mul_ps(sv, _mm512_loadu_ps(xb[i]->sums)), _mm512_set1_ps(32.f));
        acc[i] = _mm512_add_ps(acc[i], _mm512_fmsub_ps(sum, _mm512_set1_ps(xb[i]->d), offsets));
    }
}

/* xr quantised rows (k / QK blocks each, `x` row after row) times weight rows 0 .. wr starting at `w`. */
static inline __attribute__((always_inline)) void vnni_tile(const int format, const int xr, const int wr,
                                                            const QuantizedX *x, const uint8_t *w, int64_t row_bytes,
                                                            int64_t k, void *out, int64_t ldo)
{
    const int64_t bytes = format == Q4_K ? 144 : 210, blocks = k / QK;
    __m512 acc[XR][WR];
    for (int i = 0; i < XR; ++i)
        for (int c = 0; c < WR; ++c)
            acc[i][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < blocks; ++j) {
        const QuantizedX *xb[XR];
        for (int i = 0; i < xr; ++i)
            xb[i] = x + i * blocks + j;
        for (int c = 0; c < wr; ++c) {
            const uint8_t *b = w + c * row_bytes + j * bytes;
            for (int64_t line = 0; line < bytes; line += 64)
                __builtin_prefetch(b + AHEAD + line, 0, 0);
            __m512 part[XR];
            for (int i = 0; i < xr; ++i)
                part[i] = acc[i][c];
            vnni_block(format, xr, b, xb, part);
            for (int i = 0; i < xr; ++i)
                acc[i][c] = part[i];
        }
    }
    store_sums(xr, wr, acc, out, ldo, 1);
}

/* Q8_0 weights against bf16 rows in int8 (llama.cpp's Q8_0 x Q8_0 dot): each row quantised per 32 values (one scale
 * each: d = max|x| / 127), stored 64 values at a time as unsigned codes q + 128 beside their two scales spread over
 * the lanes that read them; VNNI multiplies them by the weight's signed codes, and 128 times the weight's code sums
 * (a VNNI product with ones) is taken off the exact int32 sums before both scales apply. */
typedef struct {
    float scales[16]; /* lanes 0..7: the first 32 values' d, 8..15: the second 32's */
    uint8_t q[64];    /* q + 128 */
} QuantizedX64;

static void quantize_row_q8(const uint16_t *x, int64_t k, QuantizedX64 *out)
{
    for (int64_t c = 0; c < k / 64; ++c)
        for (int half = 0; half < 2; ++half) {
            int8_t q[32];
            const float d = quantize_values(x + 64 * c + 32 * half, 32, q);
            for (int i = 0; i < 8; ++i)
                out[c].scales[8 * half + i] = d;
            for (int i = 0; i < 32; ++i)
                out[c].q[32 * half + i] = (uint8_t)(q[i] + 128);
        }
}

/* xr quantised rows (k / 64 chunks each) times Q8_0 weight rows 0 .. wr starting at `w` (34-byte blocks). */
static inline __attribute__((always_inline)) void vnni_q8_tile(const int xr, const int wr, const QuantizedX64 *x,
                                                               const uint8_t *w, int64_t row_bytes, int64_t k,
                                                               void *out, int64_t ldo)
{
    const __m512i ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
    const int64_t chunks = k / 64;
    __m512 acc[XR][WR];
    for (int i = 0; i < XR; ++i)
        for (int c = 0; c < WR; ++c)
            acc[i][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < chunks; ++j) {
        for (int c = 0; c < wr; ++c) {
            const uint8_t *b = w + c * row_bytes + j * 68; /* two blocks: 2 bytes of scale, 32 codes, twice */
            __builtin_prefetch(b + AHEAD, 0, 0);
            __builtin_prefetch(b + AHEAD + 64, 0, 0);
            const __m512i codes = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2))),
                _mm256_loadu_si256((const __m256i *)(b + 36)), 1);
            const __m512i offset = _mm512_slli_epi32(_mm512_dpbusd_epi32(zero, ones, codes), 7);
            const __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(half_at(b)), _mm256_set1_ps(half_at(b + 34)), 1);
            for (int i = 0; i < xr; ++i) {
                const QuantizedX64 *xc = x + i * chunks + j;
                const __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, _mm512_loadu_si512(xc->q), codes),
                                                     offset);
                acc[i][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                            _mm512_mul_ps(scale, _mm512_loadu_ps(xc->scales)), acc[i][c]);
            }
        }
    }
    store_sums(xr, wr, acc, out, ldo, 1);
}

/* A VNNI tile in TileRows' form (x: the quantised rows, ROW structs of VALUES values), xr and wr known at compile
 * time where they are the common ones; more than XR rows go in groups of XR over the same weight rows (in L1 after
 * the first). TILE(xr, wr, rows, w, row_bytes, k, out, ldo) calls the tile. */
#define VNNI_ROWS_OF(NAME, ROW, VALUES, TILE)                                                                       \
    static void NAME(int64_t m, int wr, const float *x, const uint8_t *w, int64_t row_bytes, int64_t k, void *out,  \
                     int64_t ldo, int bf16)                                                                         \
    {                                                                                                               \
        (void)bf16; /* bf16 rows only */                                                                            \
        for (int64_t i = 0; i < m; i += XR) {                                                                       \
            const ROW *rows = (const ROW *)x + i * (k / VALUES);                                                    \
            uint16_t *to = (uint16_t *)out + i * ldo;                                                               \
            const int64_t xr = m - i < XR ? m - i : XR;                                                             \
            if (wr == WR) {                                                                                         \
                switch (xr) {                                                                                       \
                case 4: TILE(4, 4, rows, w, row_bytes, k, to, ldo); continue;                                       \
                case 3: TILE(3, 4, rows, w, row_bytes, k, to, ldo); continue;                                       \
                case 2: TILE(2, 4, rows, w, row_bytes, k, to, ldo); continue;                                       \
                default: TILE(1, 4, rows, w, row_bytes, k, to, ldo); continue;                                      \
                }                                                                                                   \
            }                                                                                                       \
            for (int c = 0; c < wr; ++c) /* the weight's last rows, one at a time */                                \
                TILE((int)xr, 1, rows, w + c * row_bytes, row_bytes, k, to + c, ldo);                               \
        }                                                                                                           \
    }
#define TILE_Q4_K(...) vnni_tile(Q4_K, __VA_ARGS__)
#define TILE_Q6_K(...) vnni_tile(Q6_K, __VA_ARGS__)
VNNI_ROWS_OF(vnni_Q4_K, QuantizedX, QK, TILE_Q4_K)
VNNI_ROWS_OF(vnni_Q6_K, QuantizedX, QK, TILE_Q6_K)
VNNI_ROWS_OF(vnni_Q8_0, QuantizedX64, 64, vnni_q8_tile)
#undef TILE_Q4_K
#undef TILE_Q6_K
#undef VNNI_ROWS_OF
#endif
#endif

int gguf_int8_rows_available(void)
{
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

/* y = x W^T: x [m][k] (bf16 or fp32, rows k apart), W [n][k] in a quantised `format` (rows `row_bytes` apart),
 * y [m][n] rows `ldo` apart in x's dtype. `scratch` holds m * k floats (the rows in fp32, or quantised). Threads
 * split the weight rows four at a time (tile_blocks, tile_chunks; with `int8_rows`, up to VNNI_ROWS bf16 rows
 * against Q4_K or Q6_K: vnni_tile, the rows quantised into `scratch`). 0, or -1 where it does not run (no AVX-512, more than MAX_ROWS rows, a dense or
 * unknown format, k not a whole number of blocks). */
int gguf_few_rows(int format, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const void *x, int x_bf16,
                  int64_t m, float *scratch, void *out, int64_t ldo, int int8_rows)
{
#if defined(__AVX512F__)
    int64_t values, bytes;
    const TileRows tile_rows = tile_rows_for(format);
    if (tile_rows == NULL || m > MAX_ROWS || !gguf_block_shape(format, &values, &bytes) || k % values != 0
        || k / values * bytes != row_bytes)
        return -1;
    if (m <= 0 || n <= 0) /* a step whose chunks end no prompt asks its head for no rows */
        return 0;
    TileRows tile = tile_rows;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (x_bf16 && (format == Q4_K || format == Q6_K) && m <= VNNI_ROWS && int8_rows) { /* the rows in int8 */
        for (int64_t i = 0; i < m; ++i)
            quantize_row(format, (const uint16_t *)x + i * k, k, (QuantizedX *)scratch + i * (k / QK));
        tile = format == Q4_K ? vnni_Q4_K : vnni_Q6_K;
    }
    if (x_bf16 && format == Q8_0 && k % 64 == 0 && m <= VNNI_ROWS && int8_rows) { /* 2 bytes of scratch a value */
        for (int64_t i = 0; i < m; ++i)
            quantize_row_q8((const uint16_t *)x + i * k, k, (QuantizedX64 *)scratch + i * (k / 64));
        tile = vnni_Q8_0;
    }
#endif
    if (tile == tile_rows) /* the rows in fp32 */
        for (int64_t i = 0; i < m * k; ++i)
            scratch[i] = x_bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    const int64_t passes = (n + WR - 1) / WR;
    const int size = x_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < passes; ++p) {
        const int64_t c0 = p * WR;
        const int wr = n - c0 < WR ? (int)(n - c0) : WR;
        tile(m, wr, scratch, w + c0 * row_bytes, row_bytes, k, (char *)out + c0 * size, ldo, x_bf16);
    }
    return 0;
#else
    (void)format; (void)w; (void)row_bytes; (void)n; (void)k; (void)x; (void)x_bf16; (void)m; (void)scratch;
    (void)out; (void)ldo; (void)int8_rows;
    return -1;
#endif
}
