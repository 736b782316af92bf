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
 *   four rows are dequantised into fp32 in the thread's scratch (L1/L2) and every input row is multiplied with
 *   them there, four input rows at a time (16 accumulators), so each weight byte is read once from memory.
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
    return half_to_float(h);
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
    case Q4_1: {
        const float d = half_at(b);
        const float m = format == Q4_1 ? half_at(b + 2) : -8.f * d;
        const uint8_t *q = b + (format == Q4_1 ? 4 : 2);
        for (int i = 0; i < 16; ++i) {
            y[i] = d * (float)(q[i] & 0xF) + m;
            y[i + 16] = d * (float)(q[i] >> 4) + m;
        }
        break;
    }
    case Q5_0:
    case Q5_1: {
        const float d = half_at(b);
        const float m = format == Q5_1 ? half_at(b + 2) : -16.f * d;
        const uint8_t *h = b + (format == Q5_1 ? 4 : 2);
        uint32_t high;
        memcpy(&high, h, sizeof high);
        const uint8_t *q = h + 4;
        for (int i = 0; i < 16; ++i) {
            const int lo = (q[i] & 0xF) | (int)(((high >> i) << 4) & 0x10);
            const int hi = (q[i] >> 4) | (int)((high >> (i + 12)) & 0x10);
            y[i] = d * (float)lo + m;
            y[i + 16] = d * (float)hi + m;
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

/* One row of k values (a whole number of blocks) into fp32. */
static void dequantize_row(int format, const uint8_t *row, int64_t k, float *restrict y)
{
    int64_t values, bytes;
    gguf_block_shape(format, &values, &bytes);
    if (format == F32) {
        memcpy(y, row, sizeof(float) * (size_t)k);
        return;
    }
    for (int64_t j = 0; j < k; j += values)
        dequantize_block(format, row + (j / values) * bytes, y + j);
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
                dequantize_row(format, src, k, (float *)out + r * k);
                continue;
            }
            dequantize_row(format, src, k, row);
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

/* Sums of rows x[0 .. xr] times weight rows w[0 .. wr] (fp32, k a multiple of 16, rows k apart) into
 * out[i * ldo + c], with the rounding to bf16 where `bf16`. */
static inline __attribute__((always_inline)) void tile(const int xr, const int wr, const float *x, const float *w,
                                                       int64_t k, void *out, int64_t ldo, int bf16)
{
    __m512 acc[XR][WR];
    for (int i = 0; i < XR; ++i)
        for (int c = 0; c < WR; ++c)
            acc[i][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) {
        __m512 wv[WR];
        for (int c = 0; c < wr; ++c)
            wv[c] = _mm512_loadu_ps(w + c * k + j);
        for (int i = 0; i < xr; ++i) {
            const __m512 xv = _mm512_loadu_ps(x + i * k + j);
            for (int c = 0; c < wr; ++c)
                acc[i][c] = _mm512_fmadd_ps(xv, wv[c], acc[i][c]);
        }
    }
    for (int i = 0; i < xr; ++i)
        for (int c = 0; c < wr; ++c) {
            const float s = _mm512_reduce_add_ps(acc[i][c]);
            if (bf16)
                ((uint16_t *)out)[i * ldo + c] = float_to_bf16(s);
            else
                ((float *)out)[i * ldo + c] = s;
        }
}

/* tile() for xr, wr known at compile time, so that the accumulators stay in registers. */
static void tile_any(int xr, int wr, const float *x, const float *w, int64_t k, void *out, int64_t ldo, int bf16)
{
#define TILE(A, B) tile(A, B, x, w, k, out, ldo, bf16)
    if (wr == WR) {
        switch (xr) {
        case 4: TILE(4, 4); return;
        case 3: TILE(3, 4); return;
        case 2: TILE(2, 4); return;
        default: TILE(1, 4); return;
        }
    }
    for (int c = 0; c < wr; ++c) /* the weight's last rows */
        switch (xr) {
        case 4: tile(4, 1, x, w + c * k, k, (char *)out + c * (bf16 ? 2 : 4), ldo, bf16); break;
        case 3: tile(3, 1, x, w + c * k, k, (char *)out + c * (bf16 ? 2 : 4), ldo, bf16); break;
        case 2: tile(2, 1, x, w + c * k, k, (char *)out + c * (bf16 ? 2 : 4), ldo, bf16); break;
        default: tile(1, 1, x, w + c * k, k, (char *)out + c * (bf16 ? 2 : 4), ldo, bf16); break;
        }
#undef TILE
}

#endif

/* y = x W^T: x [m][k] (bf16 or fp32, rows k apart), W [n][k] in `format` (rows `row_bytes` apart), y [m][n]
 * rows `ldo` apart in x's dtype. `scratch` holds m * k floats (the rows in fp32). 0, or -1 where it does not
 * run (no AVX-512, an unknown format, k not a multiple of 16 or of the format's block). */
int gguf_few_rows(int format, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const void *x, int x_bf16,
                  int64_t m, float *scratch, void *out, int64_t ldo)
{
#if defined(__AVX512F__)
    int64_t values, bytes;
    if (!gguf_block_shape(format, &values, &bytes) || k % values != 0 || k % 16 != 0 || k / values * bytes != row_bytes)
        return -1;
    for (int64_t i = 0; i < m * k; ++i)
        scratch[i] = x_bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    const int64_t passes = (n + WR - 1) / WR;
    const int size = x_bf16 ? 2 : 4;
#pragma omp parallel
    {
        float *rows = aligned_alloc(64, sizeof(float) * (size_t)(WR * k));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < passes; ++p) {
            const int64_t c0 = p * WR;
            const int wr = n - c0 < WR ? (int)(n - c0) : WR;
            for (int c = 0; c < wr; ++c)
                dequantize_row(format, w + (c0 + c) * row_bytes, k, rows + c * k);
            for (int64_t i = 0; i < m; i += XR) {
                const int xr = m - i < XR ? (int)(m - i) : XR;
                tile_any(xr, wr, scratch + i * k, rows, k, (char *)out + (i * ldo + c0) * size, ldo, x_bf16);
            }
        }
        free(rows);
    }
    return 0;
#else
    (void)format; (void)w; (void)row_bytes; (void)n; (void)k; (void)x; (void)x_bf16; (void)m; (void)scratch;
    (void)out; (void)ldo;
    return -1;
#endif
}
