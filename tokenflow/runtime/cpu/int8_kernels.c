/* int8 linear layers for tokenflow on CPU (AVX512-VNNI), called through ctypes.
 *
 * Built at first use by tokenflow/runtime/cpu/int8_linear.py (cc -O3 -march=native -fopenmp).
 *
 * y = x W^T + b with W quantised once to int8, symmetric per output channel, and x quantised on
 * the fly, symmetric per row (token): one scale per row keeps a row's outlier channels from
 * flattening every other row. A per-input-channel smoothing vector (SmoothQuant) is applied to x
 * while it is quantised; W was multiplied by its inverse before quantising, so the product is
 * unchanged and the activations' outlier channels move into the weights.
 *
 * VNNI multiplies unsigned by signed bytes (vpdpbusd), so a row's int8 values q in [-127, 127] are
 * stored as q + 128 and the product corrected by 128 * sum_k W[n, k] (precomputed per channel).
 *
 * Weights are packed as [n_pad / 16][k_pad / 4][16][4]: one 64-byte load gives 4 consecutive k of
 * 16 output channels, exactly one vpdpbusd operand. The product runs in register tiles of up to 8
 * rows x 32 channels (16 accumulators), the weight panel of 32 channels staying in cache while
 * the rows stream past it; up to 4 rows (decode steps, where the weights' stream is the cost), tiles
 * of 64 channels keep four weight streams in flight. OpenMP splits panels and row blocks between
 * torch's threads.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "rows.h"

#define MR 8  /* rows per register tile */
#define NR 32 /* output channels per register tile (two 16-wide vectors) */
#define WIDE_ROWS 4 /* up to this many rows, tiles of 64 channels (four vectors) */

int int8_available(void)
{
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

static inline __m512 load16(const void *x, int bf16, int64_t j, __mmask16 mask)
{
    if (bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + j);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(mask, (const float *)x + j);
}

/* One row: u8 codes (q + 128, padded with 128 = 0 up to k_pad) and its scale. */
static void quantize_row(const void *x, int bf16, const float *inv_smooth, int64_t k, int64_t k_pad, uint8_t *q,
                         float *scale)
{
    __m512 top = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) {
        __mmask16 mask = k - j >= 16 ? 0xFFFF : (__mmask16)((1u << (k - j)) - 1);
        __m512 v = _mm512_mul_ps(load16(x, bf16, j, mask), _mm512_maskz_loadu_ps(mask, inv_smooth + j));
        top = _mm512_max_ps(top, _mm512_abs_ps(v));
    }
    float amax = _mm512_reduce_max_ps(top);
    float s = amax > 0.f ? amax / 127.f : 1.f;
    __m512 inv = _mm512_set1_ps(1.f / s);
    __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), bias = _mm512_set1_epi32(128);
    for (int64_t j = 0; j < k; j += 16) {
        __mmask16 mask = k - j >= 16 ? 0xFFFF : (__mmask16)((1u << (k - j)) - 1);
        __m512 v = _mm512_mul_ps(load16(x, bf16, j, mask), _mm512_maskz_loadu_ps(mask, inv_smooth + j));
        __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv)); /* round to nearest even */
        r = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(r, lo), hi), bias);
        _mm_mask_storeu_epi8(q + j, mask, _mm512_cvtusepi32_epi8(r));
    }
    memset(q + k, 128, (size_t)(k_pad - k));
    *scale = s;
}

/* A gated MLP's row from its gate_up projection `[gate | up]`: silu(gate) * up in fp32, with torch's
 * roundings when `bf16` (silu rounded to bf16, then the product), as F.silu(gate).mul_(up) gives it.
 * `h` holds 2 * inter floats: the widened gate and up first, the result in its first half. */
static void gated_row(const void *gate_up, int bf16, int64_t inter, float *h)
{
    float *g = h, *u = h + inter;
    if (bf16) {
        const uint16_t *x = gate_up;
#pragma omp simd
        for (int64_t j = 0; j < 2 * inter; ++j)
            h[j] = bf16_to_float(x[j]);
    } else {
        memcpy(h, gate_up, sizeof(float) * (size_t)(2 * inter));
    }
#pragma omp simd
    for (int64_t j = 0; j < inter; ++j) {
        const float s = silu(g[j]);
        g[j] = bf16 ? round_to_bf16(round_to_bf16(s) * u[j]) : s * u[j];
    }
}

static inline void store16(void *out, int bf16, int64_t at, __m512 v, __mmask16 mask)
{
    if (bf16) {
#if defined(__AVX512BF16__)
        _mm256_mask_storeu_epi16((uint16_t *)out + at, mask, (__m256i)_mm512_cvtneps_pbh(v));
#else
        __m512i bits = _mm512_castps_si512(v); /* round to nearest even (inputs are finite) */
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
        _mm256_mask_storeu_epi16((uint16_t *)out + at, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
#endif
    } else {
        _mm512_mask_storeu_ps((float *)out + at, mask, v);
    }
}

/* Rows r0 .. r0 + mr of the output for channels n0 .. n0 + 16 * nv: nv 16-channel panels streamed side by
 * side (4 for a few rows: more loads in flight; 2 for up to 8 rows: 16 accumulators). */
static inline __attribute__((always_inline)) void tile(
    const int mr, const int nv, const uint8_t *a, int64_t k_pad, const float *a_scale, const int8_t *w,
    const float *w_scale, const int32_t *w_sum, const float *bias, int64_t n, int64_t n0, void *out, int bf16)
{
    __m512i acc[MR][4];
    for (int r = 0; r < mr; ++r)
        for (int h = 0; h < nv; ++h)
            acc[r][h] = _mm512_setzero_si512();
    const int64_t k4 = k_pad / 4;
    const int8_t *panel = w + (n0 / 16) * k4 * 64;
    for (int64_t kq = 0; kq < k4; ++kq) {
        __m512i wv[4];
        for (int h = 0; h < nv; ++h)
            wv[h] = _mm512_loadu_si512(panel + (h * k4 + kq) * 64);
#pragma GCC unroll 8
        for (int r = 0; r < mr; ++r) {
            int32_t four;
            memcpy(&four, a + r * k_pad + kq * 4, 4);
            __m512i av = _mm512_set1_epi32(four);
            for (int h = 0; h < nv; ++h)
                acc[r][h] = _mm512_dpbusd_epi32(acc[r][h], av, wv[h]);
        }
    }
    for (int h = 0; h < nv; ++h) {
        int64_t c = n0 + 16 * h;
        if (c >= n)
            break;
        __mmask16 mask = n - c >= 16 ? 0xFFFF : (__mmask16)((1u << (n - c)) - 1);
        __m512i correction = _mm512_slli_epi32(_mm512_loadu_si512(w_sum + c), 7); /* 128 * sum_k W */
        __m512 ws = _mm512_loadu_ps(w_scale + c);
        __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < mr; ++r) {
            __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][h], correction));
            v = _mm512_fmadd_ps(v, _mm512_mul_ps(ws, _mm512_set1_ps(a_scale[r])), b);
            store16(out, bf16, r * n + c, v, mask);
        }
    }
}

#define TILE(R, NV) tile(R, NV, a, k_pad, a_scale, w, w_scale, w_sum, bias, n, n0, o, bf16)

/* out[m, n] from the rows' u8 codes and scales: the products, rescaled, plus bias. */
static void product(const uint8_t *codes, const float *scales, int64_t m, const int8_t *w, const float *w_scale,
                    const int32_t *w_sum, const float *bias, int64_t n, int64_t k_pad, int64_t n_pad, void *out,
                    int bf16)
{
    const int wide = m <= WIDE_ROWS && n_pad % (2 * NR) == 0; /* 64-channel tiles */
    const int64_t width = wide ? 2 * NR : NR, panels = n_pad / width, blocks = (m + MR - 1) / MR;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        for (int64_t blk = 0; blk < blocks; ++blk) {
            const int64_t r0 = blk * MR, n0 = p * width;
            const int rows = (int)(m - r0 < MR ? m - r0 : MR);
            const uint8_t *a = codes + r0 * k_pad;
            const float *a_scale = scales + r0;
            void *o = (char *)out + r0 * n * (bf16 ? 2 : 4);
            if (wide) {
                switch (rows) {
                case 4: TILE(4, 4); break;
                case 3: TILE(3, 4); break;
                case 2: TILE(2, 4); break;
                default: TILE(1, 4); break;
                }
                continue;
            }
            switch (rows) { /* a constant row count per case: the tile's loops unroll into registers */
            case 8: TILE(8, 2); break;
            case 7: TILE(7, 2); break;
            case 6: TILE(6, 2); break;
            case 5: TILE(5, 2); break;
            case 4: TILE(4, 2); break;
            case 3: TILE(3, 2); break;
            case 2: TILE(2, 2); break;
            default: TILE(1, 2); break;
            }
        }
    }
}

enum { PLAIN = 0, GATED = 1, NORMED = 2 };

/* out[m, n] = x[m, k] W^T + bias, x and out bf16 (`bf16`) or fp32. What the rows are (`mode`):
 *   PLAIN   the layer's input;
 *   GATED   a gated MLP's gate_up rows `[m, 2k]`: the product is of silu(gate) * up;
 *   NORMED  the rows before the layer's RMSNorm (`norm_weight` in x's dtype, `eps`): normed here.
 * GATED and NORMED form the input as the rows are quantised: one call instead of torch ops (or a norm
 * call) and the linear. `scratch` holds m * (k_pad + 4) bytes, m * (k_pad + 4 + 8 * k) for the others. */
int int8_linear(const void *x, int bf16, int mode, const void *norm_weight, float eps, int64_t m, int64_t k,
                const float *inv_smooth, const int8_t *w, const float *w_scale, const int32_t *w_sum, const float *bias,
                int64_t n, int64_t k_pad, int64_t n_pad, uint8_t *scratch, void *out)
{
    if (k_pad % 4 || n_pad % NR || k > k_pad || n > n_pad || mode < PLAIN || mode > NORMED)
        return 1;
    uint8_t *codes = scratch;
    float *scales = (float *)(scratch + m * k_pad);
    float *rows = scales + m; /* GATED, NORMED: each row's input formed in fp32 (2k floats a row) */
    const int64_t row_bytes = (mode == GATED ? 2 : 1) * k * (bf16 ? 2 : 4);
#pragma omp parallel for schedule(static) if (m * k > 16384)
    for (int64_t r = 0; r < m; ++r) {
        const char *row = (const char *)x + r * row_bytes;
        float *h = rows + r * 2 * k;
        if (mode == PLAIN) {
            quantize_row(row, bf16, inv_smooth, k, k_pad, codes + r * k_pad, scales + r);
            continue;
        }
        if (mode == GATED)
            gated_row(row, bf16, k, h);
        else
            normed_row(row, bf16, norm_weight, eps, k, h);
        quantize_row(h, 0, inv_smooth, k, k_pad, codes + r * k_pad, scales + r);
    }
    product(codes, scales, m, w, w_scale, w_sum, bias, n, k_pad, n_pad, out, bf16);
    return 0;
}

#else /* no AVX512-VNNI: int8_available() says 0 and nothing calls this */

int int8_linear(const void *x, int bf16, int mode, const void *norm_weight, float eps, int64_t m, int64_t k,
                const float *inv_smooth, const int8_t *w, const float *w_scale, const int32_t *w_sum, const float *bias,
                int64_t n, int64_t k_pad, int64_t n_pad, uint8_t *scratch, void *out)
{
    return 2;
}

#endif
