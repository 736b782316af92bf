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
 * bf16, 7 to 12 rows off the AMX tiles (tall_bf16): all the rows in one pass over 32 channels, so that each
 * weight line is read once for every row while the arithmetic runs, where 6-row passes over a 64-channel panel
 * stream it in the first and compute from cache in the second, one after the other (faster on an AVX512-BF16
 * CPU without AMX; past 12 rows, two such passes were slower than the 6-row tile's three: docs/benchmarks.md).
 * Same sums in the same order per output: bit for bit the 6-row tile's.
 *
 * bf16 on CPUs with AMX (few_rows_linear_tiles): past TILE_MIN_ROWS rows the same packed panels feed AMX
 * tiles (the packing is the tiles' pair layout), up to 16 rows x 64 channels per pass; the register tile's
 * dot products cannot keep up with the memory stream there (16 rows: ~3x slower than oneDNN's AMX product).
 * The caller picks the entry point: a prompt's prefill keeps few_rows_linear at every row count, so that a
 * prompt computes the same roundings whether part of it came from the prefix cache or not.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "amx.h"
#include "bf16.h"

#define MR 6  /* rows per register tile */
#define NV 4  /* 16-channel vectors per register tile */
#define NR 64 /* output channels per panel: NV * 16 */
/* bf16 rows past which few_rows_linear_tiles runs AMX tiles: at 2 rows the register tile is 1.5-3x faster than
 * oneDNN's AMX product, at 4 about even, at 8 1.1-1.8x slower (scripts/few_rows_crossover.py) */
#define TILE_MIN_ROWS 4

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

/* How far ahead of its use (in k-steps of one 64-byte line per sub-panel) a pass prefetches its panel */
#define STREAM_AHEAD 32

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
static inline __attribute__((always_inline)) void store_vector(__m512 v, __mmask16 mask, const void *residual,
                                                               void *out, int64_t at, int bf16)
{
#if defined(__AVX512BF16__)
    if (bf16) {
        __m256i y = (__m256i)_mm512_cvtneps_pbh(v);
        if (residual) {
            const __m256i add = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)residual + at);
            v = _mm512_add_ps(widen_bf16(y), widen_bf16(add));
            y = (__m256i)_mm512_cvtneps_pbh(v);
        }
        _mm256_mask_storeu_epi16((uint16_t *)out + at, mask, y);
        return;
    }
#endif
    if (residual)
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, (const float *)residual + at));
    _mm512_mask_storeu_ps((float *)out + at, mask, v);
}

/* Rows 0 .. rows of the output for channels n0 .. n0 + 64 from fp32 sums `acc` (rows `stride` floats apart). */
static inline __attribute__((always_inline)) void store_rows(const int rows, const float *acc, int64_t stride,
                                                             const float *bias, int64_t n, int64_t n0,
                                                             const void *residual, void *out, int bf16)
{
    for (int h = 0; h < NV; ++h) {
        const int64_t c = n0 + 16 * h;
        if (c >= n)
            break;
        const __mmask16 mask = n - c >= 16 ? 0xFFFF : (__mmask16)((1u << (n - c)) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
        for (int r = 0; r < rows; ++r)
            store_vector(_mm512_add_ps(_mm512_loadu_ps(acc + r * stride + 16 * h), b), mask, residual, out,
                         r * n + c, bf16);
    }
}

/* The register tile's rows, through store_rows. */
static inline __attribute__((always_inline)) void store_tile(const int mr, __m512 acc[MR][NV], const float *bias,
                                                             int64_t n, int64_t n0, const void *residual, void *out,
                                                             int bf16)
{
    float sums[MR][NR];
    for (int r = 0; r < mr; ++r)
        for (int h = 0; h < NV; ++h)
            _mm512_storeu_ps(sums[r] + 16 * h, acc[r][h]);
    store_rows(mr, sums[0], NR, bias, n, n0, residual, out, bf16);
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
        else /* as tile_bf16's (1 and 4 rows: 5-15% more GB/s) */
            for (int h = 0; h < NV; ++h)
                __builtin_prefetch(panel + (h * k + j + STREAM_AHEAD) * 16, 0, 2);
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
/* Row r's inputs 2 j and 2 j + 1 (bf16, rows k apart) broadcast as one vdpbf16ps operand. */
static inline __attribute__((always_inline)) __m512bh input_pair(const uint16_t *x, int64_t k, int r, int64_t j)
{
    int32_t pair;
    memcpy(&pair, x + r * k + 2 * j, 4);
    return (__m512bh)_mm512_set1_epi32(pair);
}

static inline __attribute__((always_inline)) void tile_bf16(const int mr, const uint16_t *x, int64_t k,
                                                            const uint16_t *w, const float *bias, int64_t n,
                                                            int64_t n0, const uint16_t *residual, Ahead ahead,
                                                            int out_bf16, void *out)
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
        else /* the panel's first pass streams it from memory: each sub-panel's line STREAM_AHEAD k-steps on, into
              * L2 (1, 4, 12 rows: 10-20% more GB/s than the hardware prefetcher alone) */
            for (int h = 0; h < NV; ++h)
                __builtin_prefetch(panel + (h * k2 + j + STREAM_AHEAD) * 32, 0, 2);
        __m512bh wv[NV];
        for (int h = 0; h < NV; ++h)
            wv[h] = (__m512bh)_mm512_loadu_si512(panel + (h * k2 + j) * 32);
#pragma GCC unroll 6
        for (int r = 0; r < mr; ++r) {
            const __m512bh xv = input_pair(x, k, r, j);
            for (int h = 0; h < NV; ++h)
                acc[r][h] = _mm512_dpbf16_ps(acc[r][h], xv, wv[h]);
        }
    }
    store_tile(mr, acc, bias, n, n0, residual, out, out_bf16);
}

/* Rows 0 .. R (7 .. 12) of the two 16-channel sub-panels s0, s0 + 1 in one pass: each weight line is read once
 * for all the rows while their 2 R accumulators take its products. */
static inline __attribute__((always_inline)) void tall_bf16(const int R, const uint16_t *x, int64_t k,
                                                            const uint16_t *w, const float *bias, int64_t n,
                                                            int64_t s0, const uint16_t *residual, int out_bf16,
                                                            void *out)
{
    enum { V = 2 };
    __m512 acc[12][2];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v)
            acc[r][v] = _mm512_setzero_ps();
    const int64_t k2 = k / 2;
    const uint16_t *sub = w + s0 * k2 * 32;
    for (int64_t j = 0; j < k2; ++j) {
        __m512bh wv[2];
        for (int v = 0; v < V; ++v) {
            __builtin_prefetch(sub + (v * k2 + j + STREAM_AHEAD) * 32, 0, 2);
            wv[v] = (__m512bh)_mm512_loadu_si512(sub + (v * k2 + j) * 32);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const __m512bh xv = input_pair(x, k, r, j);
            for (int v = 0; v < V; ++v)
                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);
        }
    }
    for (int v = 0; v < V; ++v) {
        const int64_t c = 16 * (s0 + v);
        if (c >= n)
            break;
        const __mmask16 mask = n - c >= 16 ? 0xFFFF : (__mmask16)((1u << (n - c)) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
            store_vector(_mm512_add_ps(acc[r][v], b), mask, residual, out, r * n + c, out_bf16);
    }
}

/* The bf16 product of 7 .. 12 rows by tall_bf16's passes, OpenMP over the pairs of sub-panels. */
static void tall_product(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, const float *bias, int64_t n,
                         int64_t n_pad, const uint16_t *residual, int out_bf16, void *out)
{
    const int64_t pairs = n_pad / 32;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < pairs; ++g) {
#define TALL(R) tall_bf16(R, x, k, w, bias, n, 2 * g, residual, out_bf16, out)
        switch (m) {
        case 7: TALL(7); break;
        case 8: TALL(8); break;
        case 9: TALL(9); break;
        case 10: TALL(10); break;
        case 11: TALL(11); break;
        default: TALL(12); break;
        }
#undef TALL
    }
}

#endif


/* ------------------------------------------------------------------------------------------------
 * AMX tiles (bf16): tmm0-3 the 4 accumulators of a 64-channel panel (rows x 16 fp32 each), tmm4 the rows'
 * next 32 k, tmm5-7 the panel's weights for them (16 k-pairs x 16 channels: one packed run of 1 KiB).
 * --------------------------------------------------------------------------------------------- */
#if HAVE_TILES
/* Rows r0 .. r0 + rows (<= 16) of channels n0 .. n0 + 64, k a multiple of 32; tiles configured for `rows`. */
static void tile_pass(int rows, const uint16_t *x, int64_t k, const uint16_t *w, const float *bias, int64_t n,
                      int64_t n0, const void *residual, void *out, int out_bf16)
{
    const int64_t k2 = k / 2, stride = k * 2;
    const uint16_t *panel = w + (n0 / 16) * k2 * 32;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < k2; j += 16) {
        _tile_loadd(4, x + 2 * j, stride);
        _tile_loadd(5, panel + j * 32, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, panel + (k2 + j) * 32, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, panel + (2 * k2 + j) * 32, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, panel + (3 * k2 + j) * 32, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    float acc[TILE_ROWS][NR];
    _tile_stored(0, acc[0], NR * 4);
    _tile_stored(1, acc[0] + 16, NR * 4);
    _tile_stored(2, acc[0] + 32, NR * 4);
    _tile_stored(3, acc[0] + 48, NR * 4);
    store_rows(rows, acc[0], NR, bias, n, n0, residual, out, out_bf16);
}

/* The product of `product` on the tiles: OpenMP over (panel, 16-row block), each thread configuring its
 * tiles for the block's row count and releasing them at the end. */
static void tiles_product(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, const float *bias, int64_t n,
                          int64_t n_pad, const uint16_t *residual, uint16_t *out)
{
    const int64_t panels = n_pad / NR, blocks = (m + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp parallel
    {
        int configured = 0;
#pragma omp for collapse(2) schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            for (int64_t blk = 0; blk < blocks; ++blk) {
                const int64_t r0 = blk * TILE_ROWS;
                const int rows = (int)(m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS);
                if (rows != configured) {
                    configure_tiles(rows);
                    configured = rows;
                }
                tile_pass(rows, x + r0 * k, k, w, bias, n, p * NR, residual ? residual + r0 * n : NULL,
                          out + r0 * n, 1);
            }
        }
        if (configured)
            _tile_release();
    }
}
#endif

int few_rows_tiles_available(void)
{
#if HAVE_TILES
    return tiles_permitted();
#else
    return 0;
#endif
}

#define TILES(CALL)                                                                                              \
    switch (rows) { /* a constant row count per case: the tile's loops unroll into registers */                 \
    case 6: CALL(6); break;                                                                                      \
    case 5: CALL(5); break;                                                                                      \
    case 4: CALL(4); break;                                                                                      \
    case 3: CALL(3); break;                                                                                      \
    case 2: CALL(2); break;                                                                                      \
    default: CALL(1); break;                                                                                     \
    }

/* few_rows_linear, and with `out_f32` fp32 output from bf16 inputs (the greedy head's estimates); with `tiles`,
 * on AMX tiles past TILE_MIN_ROWS bf16 rows where this CPU has them. */
static int product(const void *x, int bf16, int64_t m, int64_t k, const void *w, const float *bias, int64_t n,
                   int64_t n_pad, const void *residual, int out_f32, int tiles, void *out)
{
    if (!(bf16 ? few_rows_bf16_available() : few_rows_f32_available()))
        return 2;
    if ((bf16 && k % 2) || n_pad % NR || n > n_pad)
        return 1;
#if HAVE_TILES
    if (tiles && bf16 && !out_f32 && m > TILE_MIN_ROWS && k % 32 == 0 && tiles_permitted()) {
        tiles_product(x, m, k, w, bias, n, n_pad, residual, out);
        return 0;
    }
#else
    (void)tiles;
#endif
#if defined(__AVX512BF16__)
    if (bf16 && m > MR && m <= 12) {
        tall_product(x, m, k, w, bias, n, n_pad, residual, !out_f32, out);
        return 0;
    }
#endif
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
                         residual ? (const uint16_t *)residual + r0 * n : NULL, ahead, !out_f32,                 \
                         out_f32 ? (void *)((float *)out + r0 * n) : (void *)((uint16_t *)out + r0 * n))
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

/* out[m, n] = x[m, k] W^T + bias (+ residual[m, n], when given): x, W, residual and out bf16 (`bf16`, k even)
 * or fp32. Returns 0; 1 for shapes it does not take; 2 when this build lacks the dtype (see
 * few_rows_*_available). */
int few_rows_linear(const void *x, int bf16, int64_t m, int64_t k, const void *w, const float *bias, int64_t n,
                    int64_t n_pad, const void *residual, void *out)
{
    return product(x, bf16, m, k, w, bias, n, n_pad, residual, 0, 0, out);
}

/* few_rows_linear on AMX tiles past TILE_MIN_ROWS bf16 rows (where this CPU has them; see the top). */
int few_rows_linear_tiles(const void *x, int bf16, int64_t m, int64_t k, const void *w, const float *bias,
                          int64_t n, int64_t n_pad, const void *residual, void *out)
{
    return product(x, bf16, m, k, w, bias, n, n_pad, residual, 0, 1, out);
}

/* ------------------------------------------------------------------------------------------------
 * few_rows_greedy_f32: the greedy token of each fp32 row of a head's input, without the fp32 head.
 *
 * Why: a greedy decode step needs each row's largest logit, not the logits. The fp32 head of a small
 * model is the longest product of its decode step (SmolLM2: 49152 x 576 weights, 113 MB); its bf16 copy
 * is half the memory and twice the multiply rate. Its estimates settle the argmax exactly: each estimate
 * a_c is within B_c of the fp32 logit e_c the few-rows kernel computes (bound below), so only the columns
 * whose estimate comes within B_c + B_m of the best lower bound a_m - B_m can hold the largest logit, and
 * those (a few per row) are computed again in fp32 the way the few-rows kernel's tile computes them (one
 * FMA chain per channel over k, in order), bit for bit its logits.
 *
 * Bound: with x~, w~ the bf16 roundings and dx = x~ - x, dw_c = w~_c - w_c,
 *   a_c - e_c = (a_c - x~.w~_c) + dx.w~_c + x.dw_c + (x.w_c - e_c), so by Cauchy-Schwarz
 *   |a_c - e_c| <= ||x|| ||dw_c|| + ||dx|| ||w~_c|| + g (||x~|| ||w~_c|| + ||x|| ||w_c||),
 * g = k u / (1 - k u), u = 2^-24: both sums are k fp32 roundings (vdpbf16ps's products of bf16 are exact;
 * the fp32 logit is an FMA chain). ||dw_c|| and max(||w_c||, ||w~_c||) are kept per column (`dw_norms`,
 * `w_norms`, rounded up), the row's norms are taken in fp64; B_c gets a margin of 2^-10 of itself for the
 * roundings of the comparisons and an absolute 1e-20 for bf16's flushed denormals. The rounding residues
 * are far below the worst case 2^-8 of each value: candidates are a few columns per row.
 *   x [m, k] fp32; w_bf16, w_f32: the head packed for few_rows_linear in both dtypes; dw_norms, w_norms
 *   [n]; columns >= valid are never chosen; x_bf16 [m, k] and estimates [m, n]: scratch; out [m]: token
 *   ids, -1 for a row whose x is not finite (its logits are not: NaN or infinite, as the sampler
 *   reports them).
 * Returns 0; 1 when the estimates cannot settle a row cheaply (candidates in more than GREEDY_GROUPS
 * groups of 16 columns, a non-finite estimate or logit; then compute the logits instead), 2 without
 * AVX512-BF16, 3 for shapes it does not take.
 * --------------------------------------------------------------------------------------------- */
#define GREEDY_GROUPS 64
#define GREEDY_MARGIN (1.f + 0x1p-10f)
#define GREEDY_ABS 1e-20f

static inline int finite_bits(float v)
{
    uint32_t b;
    memcpy(&b, &v, 4);
    return (b & 0x7f800000u) != 0x7f800000u;
}

/* The fp32 logits of columns 16 g .. 16 g + 15 for row x, each the FMA chain tile_f32 computes (up to the
 * sign of a zero, which no comparison sees). */
static inline __m512 group_logits(const float *x, int64_t k, const float *w_f32, int64_t g)
{
    const float *group = w_f32 + g * k * 16;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; ++j)
        acc = _mm512_fmadd_ps(_mm512_set1_ps(x[j]), _mm512_loadu_ps(group + j * 16), acc);
    return acc;
}

int few_rows_greedy_f32(const float *x, int64_t m, int64_t k, const uint16_t *w_bf16, const float *w_f32,
                        const float *dw_norms, const float *w_norms, int64_t n, int64_t n_pad, int64_t valid,
                        uint16_t *x_bf16, float *estimates, int64_t *out)
{
#if defined(__AVX512BF16__)
    if (k % 16 || n_pad % NR || n > n_pad || valid > n || valid < 1)
        return 3;
    for (int64_t i = 0; i < m * k; i += 16)
        _mm256_storeu_si256((__m256i *)(x_bf16 + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    product(x_bf16, 1, m, k, w_bf16, NULL, n, n_pad, NULL, 1, 0, estimates);
    const double g = k * 0x1p-24 / (1.0 - k * 0x1p-24);
    int unsettled = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t r = 0; r < m; ++r) {
        const float *xr = x + r * k, *est = estimates + r * n; /* the product's rows are n apart */
        double xx = 0.0, dd = 0.0, tt = 0.0;
        int finite = 1;
        for (int64_t j = 0; j < k; ++j) {
            const double v = xr[j], t = bf16_to_float(x_bf16[r * k + j]);
            finite &= finite_bits(xr[j]);
            xx += v * v;
            dd += (t - v) * (t - v);
            tt += t * t;
        }
        if (!finite) {
            out[r] = -1;
            continue;
        }
        const double x_norm = sqrt(xx), t_norm = sqrt(tt);
        const float by_dw = (float)(x_norm * (1.0 + 0x1p-20)) * GREEDY_MARGIN;
        const float by_w = (float)((sqrt(dd) + g * (t_norm + x_norm)) * (1.0 + 0x1p-20)) * GREEDY_MARGIN;
#define BOUND(c) (by_dw * dw_norms[c] + by_w * w_norms[c] + GREEDY_ABS)
        float low = -3e38f;
        int ok = 1;
        for (int64_t c = 0; c < valid; ++c) {
            ok &= finite_bits(est[c]);
            const float below = est[c] - BOUND(c);
            low = below > low ? below : low;
        }
        int64_t best = -1, groups = 0, group = -1;
        float top = 0.f, logits[16];
        for (int64_t c = 0; ok && c < valid; ++c) {
            if (est[c] + BOUND(c) < low)
                continue;
            if (c / 16 != group) {
                if (++groups > GREEDY_GROUPS) {
                    ok = 0;
                    break;
                }
                group = c / 16;
                _mm512_storeu_ps(logits, group_logits(xr, k, w_f32, group));
            }
            const float logit = logits[c % 16];
            ok &= finite_bits(logit);
            if (best < 0 || logit > top) {
                best = c;
                top = logit;
            }
        }
#undef BOUND
        if (!ok || best < 0) {
#pragma omp atomic write
            unsettled = 1;
            continue;
        }
        out[r] = best;
    }
    return unsettled;
#else
    return 2;
#endif
}

#else /* no AVX512: both few_rows_*_available() say 0 and nothing calls these */

int few_rows_tiles_available(void) { return 0; }

int few_rows_linear(const void *x, int bf16, int64_t m, int64_t k, const void *w, const float *bias, int64_t n,
                    int64_t n_pad, const void *residual, void *out)
{
    return 2;
}

int few_rows_linear_tiles(const void *x, int bf16, int64_t m, int64_t k, const void *w, const float *bias,
                          int64_t n, int64_t n_pad, const void *residual, void *out)
{
    return 2;
}

int few_rows_greedy_f32(const float *x, int64_t m, int64_t k, const uint16_t *w_bf16, const float *w_f32,
                        const float *dw_norms, const float *w_norms, int64_t n, int64_t n_pad, int64_t valid,
                        uint16_t *x_bf16, float *estimates, int64_t *out)
{
    return 2;
}

#endif
