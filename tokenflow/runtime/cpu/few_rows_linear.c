/* Linear layers for the few rows of a decode step (bf16 with AVX512-BF16, fp32 with AVX512F), called
 * through ctypes. Built at first use by tokenflow/runtime/cpu/few_rows_linear.py (cc -O3 -march=native
 * -fopenmp).
 *
 * y = x W^T + b for m rows, m small. A decode step reads every weight once for a handful of rows, so
 * the product is a stream of the weights: they are packed once so that each output panel of 64
 * channels is one contiguous run of memory, read front to back while the rows' accumulators stay in
 * registers (a tile of up to 6 rows x 64 channels: 24 accumulators).
 *
 * bf16: W packed [n_pad / 16][k / 2][16][2]. One 64-byte load gives 2 consecutive k of 16 channels,
 * one vdpbf16ps operand; a row's pair x[k], x[k + 1] is broadcast as one 32-bit value. Products
 * accumulate in fp32 and are rounded to bf16 once, at the end.
 * fp32: W packed [n_pad / 16][k][16], one FMA per k and 16 channels.
 * A residual row block may be added as the tile is stored (a layer's `h + o(x)`), saving the separate add.
 * OpenMP splits the panels between torch's threads.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define MR 6  /* rows per register tile */
#define NV 4  /* 16-channel vectors per register tile */
#define NR 64 /* output channels per panel: NV * 16 */

int few_rows_bf16_available(void)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

int few_rows_f32_available(void)
{
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)

/* 16 bf16 values as floats (exact). */
static inline __m512 widen_bf16(__m256i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)); }

/* Lines of the next panel a pass fetches into L2 (`lines` from `at`), spread evenly over its k-steps. */
typedef struct {
    const char *at;
    int64_t lines, done;
} Ahead;

static inline __attribute__((always_inline)) void fetch_ahead(Ahead *a, int64_t j, int64_t steps)
{
    while (a->done * steps < a->lines * (j + 1)) {
        __builtin_prefetch(a->at + 64 * a->done, 0, 2);
        ++a->done;
    }
}

/* Rows 0 .. mr of the tile's output for channels n0 .. n0 + 64, from its fp32 accumulators; with a
 * `residual` (rows like the output's), the output is residual + product, the product rounded to the
 * dtype first: the roundings of a separate add. */
static inline __attribute__((always_inline)) void store_tile(const int mr, __m512 acc[MR][NV], const float *bias,
                                                             int64_t n, int64_t n0, const void *residual, void *out,
                                                             int bf16)
{
    for (int h = 0; h < NV; ++h) {
        const int64_t c = n0 + 16 * h;
        if (c >= n)
            break;
        const __mmask16 mask = n - c >= 16 ? 0xFFFF : (__mmask16)((1u << (n - c)) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
        for (int r = 0; r < mr; ++r) {
            __m512 v = _mm512_add_ps(acc[r][h], b);
#if defined(__AVX512BF16__)
            if (bf16) {
                __m256i y = (__m256i)_mm512_cvtneps_pbh(v);
                if (residual) {
                    const __m256i add = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)residual + r * n + c);
                    v = _mm512_add_ps(widen_bf16(y), widen_bf16(add));
                    y = (__m256i)_mm512_cvtneps_pbh(v);
                }
                _mm256_mask_storeu_epi16((uint16_t *)out + r * n + c, mask, y);
                continue;
            }
#endif
            if (residual)
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, (const float *)residual + r * n + c));
            _mm512_mask_storeu_ps((float *)out + r * n + c, mask, v);
        }
    }
}

static inline __attribute__((always_inline)) void tile_f32(const int mr, const float *x, int64_t k, const float *w,
                                                           const float *bias, int64_t n, int64_t n0,
                                                           const float *residual, Ahead ahead, float *out)
{
    __m512 acc[MR][NV];
    for (int r = 0; r < mr; ++r)
        for (int h = 0; h < NV; ++h)
            acc[r][h] = _mm512_setzero_ps();
    const float *panel = w + (n0 / 16) * k * 16;
    for (int64_t j = 0; j < k; ++j) {
        if (ahead.lines)
            fetch_ahead(&ahead, j, k);
        __m512 wv[NV];
        for (int h = 0; h < NV; ++h)
            wv[h] = _mm512_loadu_ps(panel + (h * k + j) * 16);
#pragma GCC unroll 6
        for (int r = 0; r < mr; ++r) {
            const __m512 xv = _mm512_set1_ps(x[r * k + j]);
            for (int h = 0; h < NV; ++h)
                acc[r][h] = _mm512_fmadd_ps(xv, wv[h], acc[r][h]);
        }
    }
    store_tile(mr, acc, bias, n, n0, residual, out, 0);
}

#if defined(__AVX512BF16__)
static inline __attribute__((always_inline)) void tile_bf16(const int mr, const uint16_t *x, int64_t k,
                                                            const uint16_t *w, const float *bias, int64_t n,
                                                            int64_t n0, const uint16_t *residual, Ahead ahead,
                                                            uint16_t *out)
{
    __m512 acc[MR][NV];
    for (int r = 0; r < mr; ++r)
        for (int h = 0; h < NV; ++h)
            acc[r][h] = _mm512_setzero_ps();
    const int64_t k2 = k / 2;
    const uint16_t *panel = w + (n0 / 16) * k2 * 32;
    for (int64_t j = 0; j < k2; ++j) {
        if (ahead.lines)
            fetch_ahead(&ahead, j, k2);
        __m512bh wv[NV];
        for (int h = 0; h < NV; ++h)
            wv[h] = (__m512bh)_mm512_loadu_si512(panel + (h * k2 + j) * 32);
#pragma GCC unroll 6
        for (int r = 0; r < mr; ++r) {
            int32_t pair;
            memcpy(&pair, x + r * k + 2 * j, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int h = 0; h < NV; ++h)
                acc[r][h] = _mm512_dpbf16_ps(acc[r][h], xv, wv[h]);
        }
    }
    store_tile(mr, acc, bias, n, n0, residual, out, 1);
}

#endif

#define TILES(CALL)                                                                                              \
    switch (rows) { /* a constant row count per case: the tile's loops unroll into registers */                 \
    case 6: CALL(6); break;                                                                                      \
    case 5: CALL(5); break;                                                                                      \
    case 4: CALL(4); break;                                                                                      \
    case 3: CALL(3); break;                                                                                      \
    case 2: CALL(2); break;                                                                                      \
    default: CALL(1); break;                                                                                     \
    }

/* out[m, n] = x[m, k] W^T + bias (+ residual[m, n], when given): x, W, residual and out bf16 (`bf16`, k even)
 * or fp32. Returns 0; 1 for shapes it does not take; 2 when this build lacks the dtype (see
 * few_rows_*_available). */
int few_rows_linear(const void *x, int bf16, int64_t m, int64_t k, const void *w, const float *bias, int64_t n,
                    int64_t n_pad, const void *residual, void *out)
{
    if (!(bf16 ? few_rows_bf16_available() : few_rows_f32_available()))
        return 2;
    if ((bf16 && k % 2) || n_pad % NR || n > n_pad)
        return 1;
    const int64_t panels = n_pad / NR, blocks = (m + MR - 1) / MR;
    const int64_t panel_bytes = k * NR * (bf16 ? 2 : 4), panel_lines = panel_bytes / 64, later = m - MR;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        for (int64_t blk = 0; blk < blocks; ++blk) {
            const int64_t r0 = blk * MR, n0 = p * NR;
            const int rows = (int)(m - r0 < MR ? m - r0 : MR);
            /* A panel's first row block streams it from memory; the later ones read it from L2. With more than
             * MR rows after the first block, their arithmetic outlasts a panel's memory time, so they fetch the
             * next panel meanwhile, each block a share in proportion to its rows, and that memory time
             * overlaps (16 rows: 6% faster bf16 steps, 3% fp32). With fewer rows the passes wait on the fetch
             * (12 rows: 5% slower in fp32). */
            Ahead ahead = {NULL, 0, 0};
            if (blk > 0 && later > MR && p + 1 < panels) {
                const int64_t first = (r0 - MR) * panel_lines / later, last = (r0 - MR + rows) * panel_lines / later;
                ahead.at = (const char *)w + (p + 1) * panel_bytes + 64 * first;
                ahead.lines = last - first;
            }
#if defined(__AVX512BF16__)
            if (bf16) {
#define BF16(R) tile_bf16(R, (const uint16_t *)x + r0 * k, k, w, bias, n, n0,                                   \
                         residual ? (const uint16_t *)residual + r0 * n : NULL, ahead, (uint16_t *)out + r0 * n)
                TILES(BF16)
                continue;
            }
#endif
#define F32(R) tile_f32(R, (const float *)x + r0 * k, k, w, bias, n, n0,                                        \
                       residual ? (const float *)residual + r0 * n : NULL, ahead, (float *)out + r0 * n)
            TILES(F32)
        }
    }
    return 0;
}

#else /* no AVX512: both few_rows_*_available() say 0 and nothing calls this */

int few_rows_linear(const void *x, int bf16, int64_t m, int64_t k, const void *w, const float *bias, int64_t n,
                    int64_t n_pad, const void *residual, void *out)
{
    return 2;
}

#endif
