/* bf16 kernels for tokenflow on CPU, called through ctypes.
 *
 * Built at first use by tokenflow/runtime/cpu/native_kernels.py (cc -O3 -march=native -ffast-math
 * -fopenmp -DHEAD_DIM=... -DGROUP=..., linked without -ffast-math) for one model's head size
 * and query heads per KV head: constants let the compiler unroll every row loop.
 *
 * - paged_decode_bf16: single-token attention over the paged KV cache. Compared with torch ops
 *   it skips the gather of every sequence's blocks into a padded, head-major copy and the padding
 *   itself; with AVX512-BF16 it reads the rows in place with bf16 dot products, elsewhere each
 *   sequence's blocks are copied once into a buffer the core's cache holds and widened to fp32.
 * - paged_decode_f32: the same in fp32.
 * - paged_decode_i8: the same over an int8 cache with per-slot, per-head scales, dequantised as read.
 * - paged_prefill_i8: paged_prefill_f32 over an int8 cache, dequantised as the keys and values are packed.
 * - causal_softmax_bf16: the middle of a prefill tile's attention (scale, causal mask, softmax,
 *   rounding) in one pass over the scores instead of four torch ops.
 * - paged_prefill_f32: causal attention of an fp32 prefill chunk over the paged cache, register-blocked
 *   products around an exact softmax (see below).
 * - rms_norm: the Llama-family RMSNorm in one pass instead of ~9 torch ops (bf16) or F.rms_norm's several.
 * - silu_mul: a gated MLP's silu(gate) * up in one pass instead of two torch ops.
 * - write_kv: a step's new K/V rows into their cache slots (two index_copy_ calls otherwise).
 * - rope: RoPE on a QKV projection's Q and K heads in place (five torch ops otherwise).
 *
 * Arithmetic follows transformers' eager bf16 modules: attention scores accumulated in fp32 and
 * rounded to bf16, scaled, softmax in fp32, probabilities rounded to bf16, the weighted sum of
 * values accumulated in fp32 and rounded to bf16; RMSNorm in fp32, rounded before and after the
 * weight. Only the order of fp32 sums, exp and rsqrt differ.
 *
 * OpenMP: loaded into a process where torch already mapped its libgomp.so.1, this library's
 * libgomp.so.1 dependency resolves to that same runtime, so the parallel loops use the calling
 * thread's existing team.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "rows.h"

#if !defined(HEAD_DIM) || !defined(GROUP)
#error "build with -DHEAD_DIM=<head_dim> -DGROUP=<query heads per KV head>"
#endif


#if defined(__AVX512F__)
/* exp of 16 floats, inline (no libmvec call per vector): 2^k * e^r with k = round(x / ln 2),
 * |r| <= ln(2) / 2, e^r by its degree-7 Taylor polynomial (error about 5e-9 relative, under fp32's
 * rounding). Inputs below -87.3 give e^-87.3 (~1e-38), which a softmax sum cannot tell from 0; NaN stays NaN. */
static inline __m512 exp16(__m512 x)
{
    x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x); /* a NaN x is the result (max returns its second operand) */
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145752f), x); /* ln 2 in two parts: r exact */
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860677e-06f), r);
    __m512 e = _mm512_set1_ps(1.f / 5040.f);
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 720.f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 120.f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 24.f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 6.f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(e, k);
}

/* Softmax's middle, in place on `n` scores: subtract their max, exponentiate; returns the sum. */
static inline float exp_minus_max(float *s, int64_t n)
{
    __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        top = _mm512_mask_max_ps(top, live, top, _mm512_maskz_loadu_ps(live, s + j));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), m));
        _mm512_mask_storeu_ps(s + j, live, e);
        sum = _mm512_mask_add_ps(sum, live, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}
#else
/* Softmax's middle, in place on `n` scores: subtract their max, exponentiate; returns the sum. */
static inline float exp_minus_max(float *s, int64_t n)
{
    float top = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < n; ++j)
        top = s[j] > top ? s[j] : top;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
        s[j] = expf(s[j] - top);
        sum += s[j];
    }
    return sum;
}
#endif

/* In place: softmax over the first `length` scores of each of `rows` rows spaced `stride` apart. */
static inline void softmax_rows(float *scores, int64_t rows, int64_t length, int64_t stride)
{
    for (int64_t h = 0; h < rows; ++h) {
        float *p = scores + h * stride;
        const float inv = 1.f / exp_minus_max(p, length);
#pragma omp simd
        for (int64_t t = 0; t < length; ++t)
            p[t] *= inv;
    }
}

/* One head's row of bf16 keys or values, widened to fp32 once for the GROUP query heads that use it. */
static inline void load_row(float row[HEAD_DIM], const uint16_t *src)
{
#pragma omp simd
    for (int64_t x = 0; x < HEAD_DIM; ++x)
        row[x] = bf16_to_float(src[x]);
}

/* Copy a sequence's first `length` slots of one cache, block by block, into `stage` (contiguous). */
static inline void stage_blocks(uint16_t *stage, const uint16_t *cache, const int64_t *table, int64_t length,
                                int64_t block_size, int64_t slot_stride)
{
    for (int64_t start = 0; start < length; start += block_size) {
        const int64_t count = length - start < block_size ? length - start : block_size;
        memcpy(stage + start * slot_stride, cache + table[start / block_size] * block_size * slot_stride,
               sizeof(uint16_t) * (size_t)(count * slot_stride));
    }
}

/* One query token per sequence.
 *   q        [n, kv_heads, group, head_dim]      bf16, each sequence's heads contiguous, `q_stride` elements
 *                                                apart (the query rows of a step's QKV projection, in place)
 *   k_cache  [num_slots, kv_heads, head_dim]     bf16 (slot = block * block_size + offset)
 *   v_cache  [num_slots, kv_heads, head_dim]     bf16
 *   tables   [n, max_blocks]                     int64: each sequence's blocks, in order
 *   lengths  [n]                                 int64: keys each sequence attends to (>= 1)
 *   scratch  [n, heads * (2 * head_dim + 2 * max_length + 2)]  fp32 work space (max_length >= every length)
 *   out      [n, kv_heads, group, head_dim]      bf16
 * One sequence per work item, all its heads together. Its keys, then its values, are first copied
 * block by block into a per-thread buffer: plain copies keep many cache misses in flight, and the
 * arithmetic then reads the buffer from the core's cache instead of chasing scattered blocks.
 * Returns 0; -1 when group or head_dim differ from the build's GROUP and HEAD_DIM, -2 when out of
 * memory (nothing is guaranteed written then).
 */
static int paged_decode_widening_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *tables,
                      int64_t max_blocks, const int64_t *lengths, int64_t n, int64_t kv_heads, int64_t group_arg,
                      int64_t head_dim_arg, int64_t block_size, int64_t max_length, float scale, float *scratch,
                      uint16_t *out)
{
    if (head_dim_arg != HEAD_DIM || group_arg != GROUP)
        return -1;
    const int64_t heads = kv_heads * GROUP, slot_stride = kv_heads * HEAD_DIM;
    int failed = 0;

#pragma omp parallel
    {
        uint16_t *stage = malloc(sizeof(uint16_t) * (size_t)(max_length * slot_stride)); /* [length, kv_heads, D] */
        if (stage == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t seq = 0; seq < n; ++seq) {
            if (stage == NULL)
                continue;
            const int64_t length = lengths[seq];
            const int64_t *table = tables + seq * max_blocks;
            float *query = scratch + seq * heads * (2 * HEAD_DIM + max_length); /* [heads, head_dim] */
            float *acc = query + heads * HEAD_DIM;                               /* [heads, head_dim] */
            float *probs = acc + heads * HEAD_DIM;                               /* [heads, max_length] */

            const uint16_t *q_seq = q + seq * q_stride;
            for (int64_t x = 0; x < heads * HEAD_DIM; ++x) {
                query[x] = bf16_to_float(q_seq[x]);
                acc[x] = 0.f;
            }

            /* scores */
            stage_blocks(stage, k_cache, table, length, block_size, slot_stride);
            for (int64_t kh = 0; kh < kv_heads; ++kh) {
                float qv[GROUP][HEAD_DIM] __attribute__((aligned(64)));
                memcpy(qv, query + kh * GROUP * HEAD_DIM, sizeof qv);
                for (int64_t t = 0; t < length; ++t) {
                    float row[HEAD_DIM] __attribute__((aligned(64)));
                    load_row(row, stage + t * slot_stride + kh * HEAD_DIM);
                    for (int64_t g = 0; g < GROUP; ++g) {
                        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t x = 0; x < HEAD_DIM; ++x)
                            dot += qv[g][x] * row[x];
                        probs[(kh * GROUP + g) * max_length + t] = round_to_bf16(dot) * scale;
                    }
                }
            }

            /* softmax per query head, in fp32; probabilities rounded to bf16 */
            for (int64_t h = 0; h < heads; ++h) {
                float *p = probs + h * max_length;
                const float inv = 1.f / exp_minus_max(p, length);
#pragma omp simd
                for (int64_t t = 0; t < length; ++t)
                    p[t] = round_to_bf16(p[t] * inv);
            }

            /* weighted sum of values; the GROUP accumulators of a KV head stay in registers */
            stage_blocks(stage, v_cache, table, length, block_size, slot_stride);
            for (int64_t kh = 0; kh < kv_heads; ++kh) {
                float a[GROUP][HEAD_DIM] __attribute__((aligned(64)));
                memcpy(a, acc + kh * GROUP * HEAD_DIM, sizeof a);
                for (int64_t t = 0; t < length; ++t) {
                    float row[HEAD_DIM] __attribute__((aligned(64)));
                    load_row(row, stage + t * slot_stride + kh * HEAD_DIM);
                    for (int64_t g = 0; g < GROUP; ++g) {
                        const float weight = probs[(kh * GROUP + g) * max_length + t];
#pragma omp simd
                        for (int64_t x = 0; x < HEAD_DIM; ++x)
                            a[g][x] += weight * row[x];
                    }
                }
                memcpy(acc + kh * GROUP * HEAD_DIM, a, sizeof a);
            }

            uint16_t *out_seq = out + seq * heads * HEAD_DIM;
            for (int64_t x = 0; x < heads * HEAD_DIM; ++x)
                out_seq[x] = float_to_bf16(acc[x]);
        }
        free(stage);
    }
    return failed ? -2 : 0;
}

#if defined(__AVX512F__) && HEAD_DIM % 16 == 0
#define TOKEN_TILE 16 /* keys per tile: one vector of scores */

/* Lane t of the result: the sum of v[t]'s 16 lanes (a tile's dot products, each a vector of partial sums,
 * reduced together); lanes `count` and up are 0 (v[t] past `count` is set to 0). */
static inline __m512 tile_sums(__m512 v[TOKEN_TILE], int64_t count)
{
    for (int64_t t = count; t < TOKEN_TILE; ++t)
        v[t] = _mm512_setzero_ps();
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* The cache slots of keys first .. first + count - 1 (count <= TOKEN_TILE; 0 reads no table entry). */
static inline void tile_slots(int64_t slots[TOKEN_TILE], const int64_t *table, int64_t first, int64_t count,
                              int64_t block_size)
{
    for (int64_t t = 0; t < count; ++t)
        slots[t] = table[(first + t) / block_size] * block_size + (first + t) % block_size;
}

/* Fetch `lines` cache lines from `at` into L2 ahead of their use. */
static inline void prefetch_lines(const void *at, int64_t lines)
{
    for (int64_t l = 0; l < lines; ++l)
        __builtin_prefetch((const char *)at + 64 * l, 0, 2);
}

/* A walk over one sequence's keys by tiles of TOKEN_TILE: the tile's cache slots, and the next tile's,
 * for the prefetches issued while this one is read. */
typedef struct {
    const int64_t *table;
    int64_t length, block_size;
    int64_t first, count, later; /* the tile's first key, its keys, the keys past it */
    int64_t slots[TOKEN_TILE], next[TOKEN_TILE];
} KeyTiles;

static inline void key_tiles_at(KeyTiles *w, int64_t first)
{
    w->first = first;
    w->count = w->length - first < TOKEN_TILE ? w->length - first : TOKEN_TILE;
    w->later = w->length - first - w->count;
    tile_slots(w->next, w->table, first + w->count, w->later < TOKEN_TILE ? w->later : TOKEN_TILE, w->block_size);
}

static inline KeyTiles key_tiles(const int64_t *table, int64_t length, int64_t block_size)
{
    KeyTiles w = {.table = table, .length = length, .block_size = block_size};
    tile_slots(w.slots, table, 0, length < TOKEN_TILE ? length : TOKEN_TILE, block_size);
    key_tiles_at(&w, 0);
    return w;
}

static inline void key_tiles_advance(KeyTiles *w)
{
    memcpy(w->slots, w->next, sizeof w->slots);
    key_tiles_at(w, w->first + w->count);
}
#endif

#if defined(__AVX512BF16__) && HEAD_DIM % 32 == 0
/* The same attention with AVX512-BF16 dot products on the cache's bf16 rows (no widening, no staging):
 * scores as q . k over bf16 pairs, the weighted sum two tokens at a time (their value rows interleaved,
 * their bf16 probabilities as the pair of weights). Keys go by tiles of 16 as in paged_decode_f32: rows
 * read front to back with the next tile's fetched meanwhile, each dot product a vector of partial sums
 * reduced 16 at a time. */
static int paged_decode_dot_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *tables,
                      int64_t max_blocks, const int64_t *lengths, int64_t n, int64_t kv_heads, int64_t group_arg,
                      int64_t head_dim_arg, int64_t block_size, int64_t max_length, float scale, float *scratch,
                      uint16_t *out)
{
    if (head_dim_arg != HEAD_DIM || group_arg != GROUP)
        return -1;
    const int64_t heads = kv_heads * GROUP, slot_stride = kv_heads * HEAD_DIM;
    const int64_t row_lines = slot_stride * 2 / 64, head_lines = HEAD_DIM * 2 / 64;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t seq = 0; seq < n; ++seq) {
        const int64_t length = lengths[seq];
        const int64_t *table = tables + seq * max_blocks;
        float *probs = scratch + seq * heads * (2 * max_length + 2 + HEAD_DIM); /* [heads, max_length] fp32 */
        uint16_t *pb = (uint16_t *)(probs + heads * max_length);                /* [heads, max_length + 1] bf16 */
        float *acc = probs + heads * (max_length + (max_length + 2) / 2);       /* [heads, HEAD_DIM] */
        const uint16_t *q_seq = q + seq * q_stride;
        __m512 part[heads][TOKEN_TILE];

        /* scores: q . k with bf16 dot products (fp32 sums), rounded to bf16, scaled */
        for (KeyTiles w = key_tiles(table, length, block_size); w.count > 0; key_tiles_advance(&w)) {
            const int64_t first = w.first, count = w.count, later = w.later;
            const int64_t *slots = w.slots, *next = w.next;
            for (int64_t t = 0; t < count; ++t) {
                if (t < later)
                    prefetch_lines(k_cache + next[t] * slot_stride, row_lines);
                const uint16_t *krow = k_cache + slots[t] * slot_stride;
                for (int64_t kh = 0; kh < kv_heads; ++kh) {
                    __m512bh k[HEAD_DIM / 32];
                    for (int c = 0; c < HEAD_DIM / 32; ++c)
                        k[c] = (__m512bh)_mm512_loadu_si512(krow + kh * HEAD_DIM + 32 * c);
                    for (int64_t g = 0; g < GROUP; ++g) {
                        const uint16_t *qh = q_seq + (kh * GROUP + g) * HEAD_DIM;
                        __m512 dot = _mm512_setzero_ps();
                        for (int c = 0; c < HEAD_DIM / 32; ++c)
                            dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(qh + 32 * c), k[c]);
                        part[kh * GROUP + g][t] = dot;
                    }
                }
            }
            for (int64_t h = 0; h < heads; ++h) {
                float sums[TOKEN_TILE] __attribute__((aligned(64)));
                _mm512_store_ps(sums, tile_sums(part[h], count));
                for (int64_t t = 0; t < count; ++t)
                    probs[h * max_length + first + t] = round_to_bf16(sums[t]) * scale;
            }
        }

        /* softmax per query head, in fp32; probabilities rounded to bf16 (one zero past the end) */
        for (int64_t h = 0; h < heads; ++h) {
            float *p = probs + h * max_length;
            uint16_t *ph = pb + h * (max_length + 1);
            const float inv = 1.f / exp_minus_max(p, length);
#pragma omp simd
            for (int64_t t = 0; t < length; ++t)
                ph[t] = float_to_bf16(p[t] * inv);
            ph[length] = 0;
        }

        /* weighted sum of values, two tokens per bf16 dot product: their value rows interleaved */
        memset(acc, 0, sizeof(float) * (size_t)(heads * HEAD_DIM));
        for (KeyTiles w = key_tiles(table, length, block_size); w.count > 0; key_tiles_advance(&w)) {
            const int64_t first = w.first, count = w.count, later = w.later;
            const int64_t *slots = w.slots, *next = w.next;
            for (int64_t kh = 0; kh < kv_heads; ++kh) {
                __m512 a[GROUP][HEAD_DIM / 16];
                memcpy(a, acc + kh * GROUP * HEAD_DIM, sizeof a);
                for (int64_t t = 0; t < count; t += 2) {
                    for (int64_t u = t; u < t + 2 && u < later; ++u)
                        prefetch_lines(v_cache + next[u] * slot_stride + kh * HEAD_DIM, head_lines);
                    const uint16_t *r0 = v_cache + slots[t] * slot_stride + kh * HEAD_DIM;
                    const uint16_t *r1 = t + 1 < count ? v_cache + slots[t + 1] * slot_stride + kh * HEAD_DIM
                                                       : r0; /* past the end: its weight is 0 */
                    for (int c = 0; c < HEAD_DIM / 32; ++c) {
                        const __m512i x = _mm512_loadu_si512(r0 + 32 * c), y = _mm512_loadu_si512(r1 + 32 * c);
                        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
                        for (int g = 0; g < GROUP; ++g) {
                            const uint16_t *ph = pb + (kh * GROUP + g) * (max_length + 1) + first + t;
                            const uint32_t pair = (uint32_t)ph[0] | ((uint32_t)ph[1] << 16);
                            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pair);
                            a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], lo, w);
                            a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], hi, w);
                        }
                    }
                }
                memcpy(acc + kh * GROUP * HEAD_DIM, a, sizeof a);
            }
        }
        /* lane 4L + j of a[g][2c] holds x = 32c + 8L + j; of a[g][2c + 1], x = 32c + 8L + 4 + j */
        for (int64_t h = 0; h < heads; ++h) {
            const float *a = acc + h * HEAD_DIM;
            uint16_t *o = out + (seq * heads + h) * HEAD_DIM;
            for (int c = 0; c < HEAD_DIM / 32; ++c)
                for (int L = 0; L < 4; ++L)
                    for (int j = 0; j < 4; ++j) {
                        o[32 * c + 8 * L + j] = float_to_bf16(a[32 * c + 4 * L + j]);
                        o[32 * c + 8 * L + 4 + j] = float_to_bf16(a[32 * c + 16 + 4 * L + j]);
                    }
        }
    }
    return 0;
}

#endif

int paged_decode_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *tables,
                      int64_t max_blocks, const int64_t *lengths, int64_t n, int64_t kv_heads, int64_t group_arg,
                      int64_t head_dim_arg, int64_t block_size, int64_t max_length, float scale, float *scratch,
                      uint16_t *out)
{
#if defined(__AVX512BF16__) && HEAD_DIM % 32 == 0
    return paged_decode_dot_bf16(q, q_stride, k_cache, v_cache, tables, max_blocks, lengths, n, kv_heads, group_arg,
                                 head_dim_arg, block_size, max_length, scale, scratch, out);
#else
    return paged_decode_widening_bf16(q, q_stride, k_cache, v_cache, tables, max_blocks, lengths, n, kv_heads, group_arg,
                                      head_dim_arg, block_size, max_length, scale, scratch, out);
#endif
}

#if defined(__AVX512F__) && HEAD_DIM % 16 == 0
/* The same single-token attention in fp32 (fp32 caches and queries, no rounding, exact softmax).
 * scratch [n, heads * (max_length + HEAD_DIM)] fp32. Keys go by tiles of 16. The scores pass reads each
 * tile's rows front to back, all heads of a row together, each dot product left as a vector of partial
 * sums, the tile's 16 reduced at once per head; the values pass goes one KV head at a time with its GROUP
 * accumulators in registers. Each pass prefetches the next tile's rows in step with the ones it reads:
 * front-to-back reads and fetches ahead keep the memory streaming while the arithmetic runs (README,
 * "Where the CPU speed comes from"). Returns 0, or -1 when group or head_dim differ from the build's. */
int paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache, const int64_t *tables,
                     int64_t max_blocks, const int64_t *lengths, int64_t n, int64_t kv_heads, int64_t group_arg,
                     int64_t head_dim_arg, int64_t block_size, int64_t max_length, float scale, float *scratch,
                     float *out)
{
    if (head_dim_arg != HEAD_DIM || group_arg != GROUP)
        return -1;
    const int64_t heads = kv_heads * GROUP, slot_stride = kv_heads * HEAD_DIM;
    const int64_t row_lines = slot_stride * 4 / 64, head_lines = HEAD_DIM * 4 / 64;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t seq = 0; seq < n; ++seq) {
        const int64_t length = lengths[seq];
        const int64_t *table = tables + seq * max_blocks;
        float *probs = scratch + seq * heads * (max_length + HEAD_DIM); /* [heads, max_length] */
        float *acc = probs + heads * max_length;                         /* [heads, HEAD_DIM] */
        const float *q_seq = q + seq * q_stride;
        __m512 part[heads][TOKEN_TILE];

        /* scores */
        for (KeyTiles w = key_tiles(table, length, block_size); w.count > 0; key_tiles_advance(&w)) {
            const int64_t first = w.first, count = w.count, later = w.later;
            const int64_t *slots = w.slots, *next = w.next;
            for (int64_t t = 0; t < count; ++t) {
                if (t < later)
                    prefetch_lines(k_cache + next[t] * slot_stride, row_lines);
                const float *krow = k_cache + slots[t] * slot_stride;
                for (int64_t h = 0; h < heads; ++h) {
                    const float *k = krow + (h / GROUP) * HEAD_DIM, *qh = q_seq + h * HEAD_DIM;
                    __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(k)), s1 = _mm512_setzero_ps();
                    for (int c = 1; c < HEAD_DIM / 16; ++c) {
                        if (c % 2)
                            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), _mm512_loadu_ps(k + 16 * c), s1);
                        else
                            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), _mm512_loadu_ps(k + 16 * c), s0);
                    }
                    part[h][t] = _mm512_add_ps(s0, s1);
                }
            }
            const __mmask16 live = (__mmask16)((1u << count) - 1);
            for (int64_t h = 0; h < heads; ++h)
                _mm512_mask_storeu_ps(probs + h * max_length + first, live,
                                      _mm512_mul_ps(tile_sums(part[h], count), _mm512_set1_ps(scale)));
        }

        softmax_rows(probs, heads, length, max_length);

        /* weighted sum of values */
        memset(acc, 0, sizeof(float) * (size_t)(heads * HEAD_DIM));
        for (KeyTiles w = key_tiles(table, length, block_size); w.count > 0; key_tiles_advance(&w)) {
            const int64_t first = w.first, count = w.count, later = w.later;
            const int64_t *slots = w.slots, *next = w.next;
            for (int64_t kh = 0; kh < kv_heads; ++kh) {
                __m512 a[GROUP][HEAD_DIM / 16];
                memcpy(a, acc + kh * GROUP * HEAD_DIM, sizeof a);
                for (int64_t t = 0; t < count; ++t) {
                    if (t < later)
                        prefetch_lines(v_cache + next[t] * slot_stride + kh * HEAD_DIM, head_lines);
                    const float *v = v_cache + slots[t] * slot_stride + kh * HEAD_DIM;
                    for (int g = 0; g < GROUP; ++g) {
                        const __m512 w = _mm512_set1_ps(probs[(kh * GROUP + g) * max_length + first + t]);
                        for (int c = 0; c < HEAD_DIM / 16; ++c)
                            a[g][c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * c), a[g][c]);
                    }
                }
                memcpy(acc + kh * GROUP * HEAD_DIM, a, sizeof a);
            }
        }
        memcpy(out + seq * heads * HEAD_DIM, acc, sizeof(float) * (size_t)(heads * HEAD_DIM));
    }
    return 0;
}
#else
/* paged_decode_f32 without AVX-512: rows read in place with the next ones prefetched. */
int paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache, const int64_t *tables,
                     int64_t max_blocks, const int64_t *lengths, int64_t n, int64_t kv_heads, int64_t group_arg,
                     int64_t head_dim_arg, int64_t block_size, int64_t max_length, float scale, float *scratch,
                     float *out)
{
    if (head_dim_arg != HEAD_DIM || group_arg != GROUP)
        return -1;
    const int64_t heads = kv_heads * GROUP, slot_stride = kv_heads * HEAD_DIM;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t seq = 0; seq < n; ++seq) {
        const int64_t length = lengths[seq];
        const int64_t *table = tables + seq * max_blocks;
        float *probs = scratch + seq * heads * max_length; /* [heads, max_length] */
        const float *q_seq = q + seq * q_stride;
        for (int64_t t = 0; t < length; ++t) {
            const int64_t slot = table[t / block_size] * block_size + t % block_size;
            if (t + 8 < length) {
                const int64_t ahead = table[(t + 8) / block_size] * block_size + (t + 8) % block_size;
                const char *pk = (const char *)(k_cache + ahead * slot_stride);
                const char *pv = (const char *)(v_cache + ahead * slot_stride);
                for (int64_t c = 0; c < slot_stride * 4; c += 64) {
                    __builtin_prefetch(pk + c, 0, 0);
                    __builtin_prefetch(pv + c, 0, 1);
                }
            }
            const float *krow = k_cache + slot * slot_stride;
            for (int64_t h = 0; h < heads; ++h) {
                const float *k = krow + (h / GROUP) * HEAD_DIM, *qh = q_seq + h * HEAD_DIM;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t x = 0; x < HEAD_DIM; ++x)
                    dot += qh[x] * k[x];
                probs[h * max_length + t] = dot * scale;
            }
        }
        softmax_rows(probs, heads, length, max_length);
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
            float acc[GROUP][HEAD_DIM] __attribute__((aligned(64)));
            memset(acc, 0, sizeof acc);
            for (int64_t t = 0; t < length; ++t) {
                const float *v = v_cache + (table[t / block_size] * block_size + t % block_size) * slot_stride
                                 + kh * HEAD_DIM;
                for (int64_t g = 0; g < GROUP; ++g) {
                    const float w = probs[(kh * GROUP + g) * max_length + t];
#pragma omp simd
                    for (int64_t x = 0; x < HEAD_DIM; ++x)
                        acc[g][x] += w * v[x];
                }
            }
            memcpy(out + (seq * heads + kh * GROUP) * HEAD_DIM, acc, sizeof acc);
        }
    }
    return 0;
}

#endif

/* The same single-token attention over an int8 cache (kv_cache_dtype="int8"): K/V rows of int8 codes with
 * one fp32 scale per slot and KV head (`k_scale`, `v_scale`: [num_slots, kv_heads]), dequantised as they
 * are read; queries and output bf16 (`bf16`) or fp32, arithmetic in fp32. scratch: [n, heads * max_length +
 * heads * HEAD_DIM] fp32. Returns 0, or -1 when group or head_dim differ from the build's. */
int paged_decode_i8(const void *q, int bf16, const int8_t *k_cache, const int8_t *v_cache, const float *k_scale,
                    const float *v_scale, const int64_t *tables, int64_t max_blocks, const int64_t *lengths, int64_t n,
                    int64_t kv_heads, int64_t group_arg, int64_t head_dim_arg, int64_t block_size, int64_t max_length,
                    float scale, float *scratch, void *out)
{
    if (head_dim_arg != HEAD_DIM || group_arg != GROUP)
        return -1;
    const int64_t heads = kv_heads * GROUP, slot_stride = kv_heads * HEAD_DIM;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t seq = 0; seq < n; ++seq) {
        const int64_t length = lengths[seq];
        const int64_t *table = tables + seq * max_blocks;
        float *probs = scratch + seq * (heads * max_length + heads * HEAD_DIM); /* [heads, max_length] */
        float *qf = probs + heads * max_length;                                 /* [heads, HEAD_DIM] */
        for (int64_t i = 0; i < heads * HEAD_DIM; ++i)
            qf[i] = bf16 ? bf16_to_float(((const uint16_t *)q)[seq * heads * HEAD_DIM + i])
                         : ((const float *)q)[seq * heads * HEAD_DIM + i];
        for (int64_t t = 0; t < length; ++t) {
            const int64_t slot = table[t / block_size] * block_size + t % block_size;
            const int8_t *krow = k_cache + slot * slot_stride;
            for (int64_t h = 0; h < heads; ++h) {
                const int8_t *k = krow + (h / GROUP) * HEAD_DIM;
                const float *qh = qf + h * HEAD_DIM;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t x = 0; x < HEAD_DIM; ++x)
                    dot += qh[x] * (float)k[x];
                probs[h * max_length + t] = dot * k_scale[slot * kv_heads + h / GROUP] * scale;
            }
        }
        softmax_rows(probs, heads, length, max_length);
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
            float acc[GROUP][HEAD_DIM] __attribute__((aligned(64)));
            memset(acc, 0, sizeof acc);
            for (int64_t t = 0; t < length; ++t) {
                const int64_t slot = table[t / block_size] * block_size + t % block_size;
                const int8_t *v = v_cache + slot * slot_stride + kh * HEAD_DIM;
                const float vs = v_scale[slot * kv_heads + kh];
                for (int64_t g = 0; g < GROUP; ++g) {
                    const float w = probs[(kh * GROUP + g) * max_length + t] * vs;
#pragma omp simd
                    for (int64_t x = 0; x < HEAD_DIM; ++x)
                        acc[g][x] += w * (float)v[x];
                }
            }
            const int64_t at = (seq * heads + kh * GROUP) * HEAD_DIM;
            for (int64_t i = 0; i < GROUP * HEAD_DIM; ++i) {
                const float value = (&acc[0][0])[i];
                if (bf16)
                    ((uint16_t *)out)[at + i] = float_to_bf16(value);
                else
                    ((float *)out)[at + i] = value;
            }
        }
    }
    return 0;
}

/* Causal softmax of a prefill tile's scores, in place.
 *   scores [heads * rows, seen] bf16, contiguous: for each head, `rows` query rows at positions
 *   first_pos .. first_pos + rows - 1; the row at position p sees keys 0 .. p.
 * Each visible score is scaled in fp32 and rounded to bf16 (a bf16 multiply), then softmax in fp32
 * over the visible keys, probabilities rounded to bf16; keys past the position get 0.
 * Returns 0, or -1 when out of memory (nothing is guaranteed written then).
 */
int causal_softmax_bf16(uint16_t *scores, int64_t heads, int64_t rows, int64_t seen, int64_t first_pos, float scale)
{
    int failed = 0;
#pragma omp parallel
    {
        float *buf = malloc(sizeof(float) * (size_t)seen);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < heads * rows; ++r) {
            if (buf == NULL)
                continue;
            uint16_t *row = scores + r * seen;
            int64_t visible = first_pos + r % rows + 1;
            if (visible > seen)
                visible = seen;
            float top = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : top)
            for (int64_t t = 0; t < visible; ++t) {
                buf[t] = round_to_bf16(bf16_to_float(row[t]) * scale);
                top = buf[t] > top ? buf[t] : top;
            }
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < visible; ++t) {
                buf[t] = expf(buf[t] - top);
                sum += buf[t];
            }
#pragma omp simd
            for (int64_t t = 0; t < visible; ++t)
                row[t] = float_to_bf16(buf[t] / sum);
            for (int64_t t = visible; t < seen; ++t)
                row[t] = 0;
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* RMSNorm of rows as transformers' Llama-family norms compute it (`normed_row`): each row in fp32, and with
 * bf16 rows (`bf16`) x * rsqrt(mean(x^2) + eps) rounded to bf16, times the bf16 weight, rounded to bf16.
 *   x [rows, width] bf16 or fp32, contiguous; weight [width] and out [rows, width] (may be x) of x's dtype.
 */
void rms_norm(const void *x, int bf16, const void *weight, int64_t rows, int64_t width, float eps, void *out)
{
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows * width >= 32768)
    for (int64_t r = 0; r < rows; ++r) {
        float h[width];
        normed_row((const char *)x + r * width * size, bf16, weight, eps, width, h);
        if (bf16) {
            uint16_t *dst = (uint16_t *)out + r * width;
#pragma omp simd
            for (int64_t i = 0; i < width; ++i)
                dst[i] = float_to_bf16(h[i]); /* exact: h is rounded already */
        } else {
            memcpy((float *)out + r * width, h, sizeof(float) * (size_t)width);
        }
    }
}

/* HEAD_DIM values from element `at` of bf16 (`bf16`) or fp32 `src`, as floats. */
static inline void widen_row(const void *src, int bf16, int64_t at, float *dst)
{
    for (int64_t d = 0; d < HEAD_DIM; ++d)
        dst[d] = bf16 ? bf16_to_float(((const uint16_t *)src)[at + d]) : ((const float *)src)[at + d];
}

/* RoPE in place on the first `heads` heads of each row of a QKV projection, as transformers'
 * apply_rotary_pos_emb: x * cos and rotate_half(x) * sin, their sum; in bf16 (`bf16`) each product and the
 * sum rounded to bf16. Contraction into an FMA is off here, so fp32 keeps torch's bits too. One pass
 * instead of five ops and two intermediate tensors.
 *   qkv [rows, row_stride]; cos, sin [rows, HEAD_DIM], contiguous; all bf16 or all fp32.
 */
__attribute__((optimize("fp-contract=off"))) void rope(void *qkv, int bf16, int64_t rows, int64_t row_stride,
                                                       int64_t heads, const void *cos, const void *sin)
{
    const int64_t half = HEAD_DIM / 2;
#pragma omp parallel for schedule(static) if (rows * heads >= 512)
    for (int64_t r = 0; r < rows; ++r) {
        float c[HEAD_DIM], s[HEAD_DIM];
        widen_row(cos, bf16, r * HEAD_DIM, c);
        widen_row(sin, bf16, r * HEAD_DIM, s);
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t at = r * row_stride + h * HEAD_DIM;
            float in[HEAD_DIM], y[HEAD_DIM];
            widen_row(qkv, bf16, at, in);
#pragma omp simd
            for (int64_t d = 0; d < HEAD_DIM; ++d) {
                const float rotated = d < half ? -in[d + half] : in[d - half];
                const float a = in[d] * c[d], b = rotated * s[d];
                y[d] = bf16 ? round_to_bf16(a) + round_to_bf16(b) : a + b;
            }
            for (int64_t d = 0; d < HEAD_DIM; ++d) {
                if (bf16)
                    ((uint16_t *)qkv)[at + d] = float_to_bf16(y[d]);
                else
                    ((float *)qkv)[at + d] = y[d];
            }
        }
    }
}

/* A step's new keys and values into their cache slots: row t of `k_new` / `v_new` (rows `k_stride` /
 * `v_stride` bytes apart, each `row_bytes` contiguous: a token's KV heads) to slot slots[t] of `k_slots` /
 * `v_slots`. Two torch index_copy_ calls per layer otherwise; the caller guarantees the slots index the
 * cache. */
void write_kv(const char *k_new, const char *v_new, int64_t rows, int64_t k_stride, int64_t v_stride,
              int64_t row_bytes, const int64_t *slots, char *k_slots, char *v_slots)
{
#pragma omp parallel for schedule(static) if (rows >= 256)
    for (int64_t t = 0; t < rows; ++t) {
        memcpy(k_slots + slots[t] * row_bytes, k_new + t * k_stride, (size_t)row_bytes);
        memcpy(v_slots + slots[t] * row_bytes, v_new + t * v_stride, (size_t)row_bytes);
    }
}

/* A SiLU-gated MLP's hidden rows from its gate_up projection: out[r] = silu(gate[r]) * up[r], as
 * F.silu(gate).mul_(up) gives them (bf16: the SiLU rounded to bf16, then the product). One pass instead
 * of two torch ops and their intermediate.
 *   gate_up [rows, 2 * inter] (`[gate | up]`), bf16 (`bf16`) or fp32; out [rows, inter], the same dtype.
 */
void silu_mul(const void *gate_up, int bf16, int64_t rows, int64_t inter, void *out)
{
#pragma omp parallel for schedule(static) if (rows * inter >= 16384)
    for (int64_t r = 0; r < rows; ++r) {
        if (bf16) {
            const uint16_t *g = (const uint16_t *)gate_up + r * 2 * inter, *u = g + inter;
            uint16_t *o = (uint16_t *)out + r * inter;
#pragma omp simd
            for (int64_t j = 0; j < inter; ++j)
                o[j] = float_to_bf16(round_to_bf16(silu(bf16_to_float(g[j]))) * bf16_to_float(u[j]));
        } else {
            const float *g = (const float *)gate_up + r * 2 * inter, *u = g + inter;
            float *o = (float *)out + r * inter;
#pragma omp simd
            for (int64_t j = 0; j < inter; ++j)
                o[j] = silu(g[j]) * u[j];
        }
    }
}

/* ------------------------------------------------------------------------------------------------
 * paged_prefill_f32: causal attention of one prefill chunk over its sequence's paged keys, in fp32.
 *
 * Why: torch's fused CPU attention runs these shapes (64-wide heads, a few hundred keys) at a fraction
 * of the FMA rate. Here each KV head's keys are packed once per call, transposed ([HEAD_DIM][keys]),
 * so that a tile of PREFILL_ROWS query rows times KEY_TILE keys is a register-blocked product; each
 * row's softmax is exact (max, exp, sum over its visible keys, like eager attention), and the
 * weighted values are a second register-blocked product over the packed values. The G query heads
 * sharing a KV head are rows of one tile, so GQA reads each key once per tile.
 *   q       [t, kv_heads * GROUP, HEAD_DIM] fp32, contiguous: positions start .. start + t - 1
 *   k_src   key row j (position j) at k_src + slot(j) * kv_heads * HEAD_DIM, with
 *           slot(j) = table[j / block_size] * block_size + j % block_size, or slot(j) = j without a table
 *   v_src   the same for values
 *   out     [t, kv_heads * GROUP, HEAD_DIM] fp32
 * Returns 0; -1 when group or head_dim differ from the build's (or HEAD_DIM is not a multiple of 16),
 * -2 when out of memory (nothing is guaranteed written then).
 * --------------------------------------------------------------------------------------------- */
#if HEAD_DIM % 16 == 0
typedef float vec16 __attribute__((vector_size(64)));                    /* 16 floats, 64-byte aligned */
typedef float vec16_unaligned __attribute__((vector_size(64), aligned(4)));
#define PREFILL_ROWS 6                                 /* query rows per tile: 6 x 2 score accumulators */
#define KEY_TILE 32                                    /* keys per score tile: two vectors */
#define HEAD_VECS (HEAD_DIM / 16)
/* rows per weighted-value pass: ~24 accumulators, at most a tile */
#define VALUE_ROWS (24 / HEAD_VECS < 1 ? 1 : 24 / HEAD_VECS > PREFILL_ROWS ? PREFILL_ROWS : 24 / HEAD_VECS)

static inline int64_t key_slot(const int64_t *table, int64_t j, int64_t block_size)
{
    return table == NULL ? j : table[j / block_size] * block_size + j % block_size;
}

/* Scores of PREFILL_ROWS pre-scaled query rows `qb` against keys [0, keys) of one head's
 * transposed keys `kt` [HEAD_DIM][stride] into `s` [PREFILL_ROWS][stride]; keys is a multiple of KEY_TILE,
 * padding keys are zero. */
static inline void tile_scores(float *s, const float qb[PREFILL_ROWS][HEAD_DIM], const float *kt, int64_t stride,
                               int64_t keys)
{
    for (int64_t j = 0; j < keys; j += KEY_TILE) {
        vec16 acc[PREFILL_ROWS][2];
        for (int r = 0; r < PREFILL_ROWS; ++r)
            acc[r][0] = acc[r][1] = (vec16){0};
        for (int64_t d = 0; d < HEAD_DIM; ++d) {
            const vec16 k0 = *(const vec16 *)(kt + d * stride + j);
            const vec16 k1 = *(const vec16 *)(kt + d * stride + j + 16);
            for (int r = 0; r < PREFILL_ROWS; ++r) {
                acc[r][0] += qb[r][d] * k0;
                acc[r][1] += qb[r][d] * k1;
            }
        }
        for (int r = 0; r < PREFILL_ROWS; ++r) {
            *(vec16 *)(s + r * stride + j) = acc[r][0];
            *(vec16 *)(s + r * stride + j + 16) = acc[r][1];
        }
    }
}

/* The body of paged_prefill_f32 and paged_prefill_i8: keys and values come from fp32 rows (k_src, v_src),
 * or from int8 rows with one fp32 scale per slot and KV head (k_i8, v_i8, k_scale, v_scale), dequantised as
 * they are packed. */
static int prefill_f32(const float *q, const float *k_src, const float *v_src, const int8_t *k_i8,
                       const int8_t *v_i8, const float *k_scale, const float *v_scale, const int64_t *table,
                       int64_t block_size, int64_t start, int64_t t, int64_t kv_heads, int64_t group_arg,
                       int64_t head_dim_arg, float scale, float *out)
{
    if (head_dim_arg != HEAD_DIM || group_arg != GROUP)
        return -1;
    const int64_t heads = kv_heads * GROUP, slot_stride = kv_heads * HEAD_DIM;
    const int64_t length = start + t;
    const int64_t stride = (length + KEY_TILE - 1) / KEY_TILE * KEY_TILE; /* padded keys per head */
    const int64_t rows = t * GROUP;                                      /* query rows per KV head */
    const int64_t tiles = (rows + PREFILL_ROWS - 1) / PREFILL_ROWS;
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)(kv_heads * HEAD_DIM * stride)); /* [h][d][key] */
    float *vp = aligned_alloc(64, sizeof(float) * (size_t)(kv_heads * stride * HEAD_DIM)); /* [h][key][d] */
    int failed = kt == NULL || vp == NULL;
    if (failed) {
        free(kt);
        free(vp);
        return -2;
    }

#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t hj = 0; hj < kv_heads * stride; ++hj) {
            const int64_t h = hj / stride, j = hj % stride;
            float *vrow = vp + (h * stride + j) * HEAD_DIM;
            if (j >= length) {
                for (int64_t d = 0; d < HEAD_DIM; ++d)
                    kt[(h * HEAD_DIM + d) * stride + j] = 0.f;
                memset(vrow, 0, sizeof(float) * HEAD_DIM);
                continue;
            }
            const int64_t slot = key_slot(table, j, block_size), offset = slot * slot_stride + h * HEAD_DIM;
            if (k_i8 != NULL) {
                const float ks = k_scale[slot * kv_heads + h], vs = v_scale[slot * kv_heads + h];
                for (int64_t d = 0; d < HEAD_DIM; ++d)
                    kt[(h * HEAD_DIM + d) * stride + j] = (float)k_i8[offset + d] * ks;
                for (int64_t d = 0; d < HEAD_DIM; ++d)
                    vrow[d] = (float)v_i8[offset + d] * vs;
                continue;
            }
            for (int64_t d = 0; d < HEAD_DIM; ++d)
                kt[(h * HEAD_DIM + d) * stride + j] = k_src[offset + d];
            memcpy(vrow, v_src + offset, sizeof(float) * HEAD_DIM);
        }

        float *scores = aligned_alloc(64, sizeof(float) * (size_t)(PREFILL_ROWS * stride));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* Later tiles see more keys: small dynamic chunks keep both threads busy to the end. */
#pragma omp for schedule(dynamic, 2)
        for (int64_t item = 0; item < kv_heads * tiles; ++item) {
            if (scores == NULL)
                continue;
            const int64_t h = item / tiles, r0 = (item % tiles) * PREFILL_ROWS;
            const int64_t real = rows - r0 < PREFILL_ROWS ? rows - r0 : PREFILL_ROWS;
            float qb[PREFILL_ROWS][HEAD_DIM] __attribute__((aligned(64)));
            int64_t visible[PREFILL_ROWS];
            for (int r = 0; r < PREFILL_ROWS; ++r) {
                const int64_t row = r0 + (r < real ? r : real - 1); /* padding rows repeat the last one */
                const int64_t pos = row / GROUP, g = row % GROUP;
                const float *src = q + (pos * heads + h * GROUP + g) * HEAD_DIM;
                for (int64_t d = 0; d < HEAD_DIM; ++d)
                    qb[r][d] = src[d] * scale;
                visible[r] = start + pos + 1;
            }
            const int64_t keys = visible[PREFILL_ROWS - 1];
            const int64_t padded = (keys + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
            tile_scores(scores, qb, kt + h * HEAD_DIM * stride, stride, padded);

            float inv_sum[PREFILL_ROWS];
            for (int r = 0; r < PREFILL_ROWS; ++r) {
                float *s = scores + r * stride;
                const int64_t seen = visible[r];
                const float sum = exp_minus_max(s, seen);
                for (int64_t j = seen; j < keys; ++j)
                    s[j] = 0.f;
                inv_sum[r] = 1.f / sum;
            }

            const float *vh = vp + h * stride * HEAD_DIM;
            for (int rb = 0; rb < real; rb += VALUE_ROWS) {
                const int count = real - rb < VALUE_ROWS ? real - rb : VALUE_ROWS;
                vec16 acc[VALUE_ROWS][HEAD_VECS];
                for (int r = 0; r < VALUE_ROWS; ++r)
                    for (int x = 0; x < HEAD_VECS; ++x)
                        acc[r][x] = (vec16){0};
                for (int64_t j = 0; j < keys; ++j) {
                    const vec16 *v = (const vec16 *)(vh + j * HEAD_DIM);
                    for (int r = 0; r < VALUE_ROWS; ++r) {
                        const float p = scores[(rb + (r < count ? r : 0)) * stride + j];
                        for (int x = 0; x < HEAD_VECS; ++x)
                            acc[r][x] += p * v[x];
                    }
                }
                for (int r = 0; r < count; ++r) {
                    const int64_t row = r0 + rb + r, pos = row / GROUP, g = row % GROUP;
                    vec16_unaligned *dst = (vec16_unaligned *)(out + (pos * heads + h * GROUP + g) * HEAD_DIM);
                    for (int x = 0; x < HEAD_VECS; ++x)
                        dst[x] = acc[r][x] * inv_sum[rb + r];
                }
            }
        }
        free(scores);
    }
    free(kt);
    free(vp);
    return failed ? -2 : 0;
}
int paged_prefill_f32(const float *q, const float *k_src, const float *v_src, const int64_t *table,
                      int64_t block_size, int64_t start, int64_t t, int64_t kv_heads, int64_t group_arg,
                      int64_t head_dim_arg, float scale, float *out)
{
    return prefill_f32(q, k_src, v_src, NULL, NULL, NULL, NULL, table, block_size, start, t, kv_heads, group_arg,
                       head_dim_arg, scale, out);
}

/* paged_prefill_f32 over an int8 cache (kv_cache_dtype="int8"): fp32 queries and output. */
int paged_prefill_i8(const float *q, const int8_t *k_i8, const int8_t *v_i8, const float *k_scale,
                     const float *v_scale, const int64_t *table, int64_t block_size, int64_t start, int64_t t,
                     int64_t kv_heads, int64_t group_arg, int64_t head_dim_arg, float scale, float *out)
{
    return prefill_f32(q, NULL, NULL, k_i8, v_i8, k_scale, v_scale, table, block_size, start, t, kv_heads,
                       group_arg, head_dim_arg, scale, out);
}
#else
int paged_prefill_f32(const float *q, const float *k_src, const float *v_src, const int64_t *table,
                      int64_t block_size, int64_t start, int64_t t, int64_t kv_heads, int64_t group_arg,
                      int64_t head_dim_arg, float scale, float *out)
{
    return -1;
}

int paged_prefill_i8(const float *q, const int8_t *k_i8, const int8_t *v_i8, const float *k_scale,
                     const float *v_scale, const int64_t *table, int64_t block_size, int64_t start, int64_t t,
                     int64_t kv_heads, int64_t group_arg, int64_t head_dim_arg, float scale, float *out)
{
    return -1;
}
#endif

/* ------------------------------------------------------------------------------------------------
 * paged_prefill_bf16: paged_prefill_f32's tiling for bf16 caches, with AVX512-BF16 dot products
 * (two bf16 products summed into each fp32 lane: twice the FMA rate). Keys are packed as pairs of
 * head dimensions per key lane ([HEAD_DIM / 2][keys] pairs), values as pairs of keys per dimension
 * lane ([keys / 2][HEAD_DIM] pairs). Arithmetic as causal_softmax_bf16 and eager bf16 attention:
 * scores summed in fp32 and rounded to bf16, scaled with rounding, softmax in fp32, probabilities
 * rounded to bf16, values summed in fp32, the output rounded to bf16.
 *   q, out  [t, kv_heads * GROUP, HEAD_DIM] bf16; k_src, v_src, table as paged_prefill_f32.
 * prefill_bf16_available() says whether this build has it (else the call returns -1).
 * --------------------------------------------------------------------------------------------- */
#if defined(__AVX512BF16__) && HEAD_DIM % 16 == 0
int prefill_bf16_available(void) { return 1; }

int paged_prefill_bf16(const uint16_t *q, const uint16_t *k_src, const uint16_t *v_src, const int64_t *table,
                       int64_t block_size, int64_t start, int64_t t, int64_t kv_heads, int64_t group_arg,
                       int64_t head_dim_arg, float scale, uint16_t *out)
{
    if (head_dim_arg != HEAD_DIM || group_arg != GROUP)
        return -1;
    const int64_t heads = kv_heads * GROUP, slot_stride = kv_heads * HEAD_DIM, pairs = HEAD_DIM / 2;
    const int64_t length = start + t;
    const int64_t stride = (length + KEY_TILE - 1) / KEY_TILE * KEY_TILE; /* padded keys per head (even) */
    const int64_t rows = t * GROUP;
    const int64_t tiles = (rows + PREFILL_ROWS - 1) / PREFILL_ROWS;
    uint32_t *kp = aligned_alloc(64, sizeof(uint32_t) * (size_t)(kv_heads * pairs * stride));     /* [h][d/2][key] */
    uint32_t *vp = aligned_alloc(64, sizeof(uint32_t) * (size_t)(kv_heads * stride / 2 * HEAD_DIM)); /* [h][key/2][d] */
    int failed = kp == NULL || vp == NULL;
    if (failed) {
        free(kp);
        free(vp);
        return -2;
    }

#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t hj = 0; hj < kv_heads * stride / 2; ++hj) {
            const int64_t h = hj / (stride / 2), j = 2 * (hj % (stride / 2)); /* keys j and j + 1 */
            const uint16_t *k0 = NULL, *k1 = NULL, *v0 = NULL, *v1 = NULL;
            if (j < length) {
                k0 = k_src + key_slot(table, j, block_size) * slot_stride + h * HEAD_DIM;
                v0 = v_src + key_slot(table, j, block_size) * slot_stride + h * HEAD_DIM;
            }
            if (j + 1 < length) {
                k1 = k_src + key_slot(table, j + 1, block_size) * slot_stride + h * HEAD_DIM;
                v1 = v_src + key_slot(table, j + 1, block_size) * slot_stride + h * HEAD_DIM;
            }
            for (int64_t p = 0; p < pairs; ++p) {
                kp[(h * pairs + p) * stride + j] = k0 ? (uint32_t)k0[2 * p] | (uint32_t)k0[2 * p + 1] << 16 : 0;
                kp[(h * pairs + p) * stride + j + 1] = k1 ? (uint32_t)k1[2 * p] | (uint32_t)k1[2 * p + 1] << 16 : 0;
            }
            uint32_t *vrow = vp + (h * stride / 2 + j / 2) * HEAD_DIM;
            for (int64_t d = 0; d < HEAD_DIM; ++d)
                vrow[d] = (v0 ? v0[d] : 0u) | (uint32_t)(v1 ? v1[d] : 0u) << 16;
        }

        float *scores = aligned_alloc(64, sizeof(float) * (size_t)(PREFILL_ROWS * stride));
        uint16_t *probs = aligned_alloc(64, sizeof(uint16_t) * (size_t)(PREFILL_ROWS * stride));
        if (scores == NULL || probs == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 2)
        for (int64_t item = 0; item < kv_heads * tiles; ++item) {
            if (scores == NULL || probs == NULL)
                continue;
            const int64_t h = item / tiles, r0 = (item % tiles) * PREFILL_ROWS;
            const int64_t real = rows - r0 < PREFILL_ROWS ? rows - r0 : PREFILL_ROWS;
            uint32_t qb[PREFILL_ROWS][HEAD_DIM / 2];
            int64_t visible[PREFILL_ROWS];
            for (int r = 0; r < PREFILL_ROWS; ++r) {
                const int64_t row = r0 + (r < real ? r : real - 1); /* padding rows repeat the last one */
                const int64_t pos = row / GROUP, g = row % GROUP;
                memcpy(qb[r], q + (pos * heads + h * GROUP + g) * HEAD_DIM, sizeof qb[r]);
                visible[r] = start + pos + 1;
            }
            const int64_t keys = visible[PREFILL_ROWS - 1];
            const int64_t padded = (keys + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
            const uint32_t *kh = kp + h * pairs * stride;
            for (int64_t j = 0; j < padded; j += KEY_TILE) {
                __m512 acc[PREFILL_ROWS][2];
                for (int r = 0; r < PREFILL_ROWS; ++r)
                    acc[r][0] = acc[r][1] = _mm512_setzero_ps();
                for (int64_t p = 0; p < pairs; ++p) {
                    const __m512bh k0 = (__m512bh)_mm512_load_si512(kh + p * stride + j);
                    const __m512bh k1 = (__m512bh)_mm512_load_si512(kh + p * stride + j + 16);
                    for (int r = 0; r < PREFILL_ROWS; ++r) {
                        const __m512bh w = (__m512bh)_mm512_set1_epi32((int)qb[r][p]);
                        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w, k0);
                        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w, k1);
                    }
                }
                for (int r = 0; r < PREFILL_ROWS; ++r) {
                    _mm512_store_ps(scores + r * stride + j, acc[r][0]);
                    _mm512_store_ps(scores + r * stride + j + 16, acc[r][1]);
                }
            }
            const int64_t even = (keys + 1) / 2 * 2;
            for (int r = 0; r < PREFILL_ROWS; ++r) {
                float *s = scores + r * stride;
                uint16_t *p = probs + r * stride;
                const int64_t seen = visible[r];
#pragma omp simd
                for (int64_t j = 0; j < seen; ++j)
                    s[j] = round_to_bf16(round_to_bf16(s[j]) * scale);
                const float inv = 1.f / exp_minus_max(s, seen);
#pragma omp simd
                for (int64_t j = 0; j < seen; ++j)
                    p[j] = float_to_bf16(s[j] * inv);
                for (int64_t j = seen; j < even; ++j)
                    p[j] = 0;
            }

            const uint32_t *vh = vp + h * stride / 2 * HEAD_DIM;
            for (int rb = 0; rb < real; rb += VALUE_ROWS) {
                const int count = real - rb < VALUE_ROWS ? real - rb : VALUE_ROWS;
                __m512 acc[VALUE_ROWS][HEAD_VECS];
                for (int r = 0; r < VALUE_ROWS; ++r)
                    for (int x = 0; x < HEAD_VECS; ++x)
                        acc[r][x] = _mm512_setzero_ps();
                for (int64_t jp = 0; jp < even / 2; ++jp) {
                    __m512bh v[HEAD_VECS];
                    for (int x = 0; x < HEAD_VECS; ++x)
                        v[x] = (__m512bh)_mm512_load_si512(vh + jp * HEAD_DIM + 16 * x);
                    for (int r = 0; r < VALUE_ROWS; ++r) {
                        uint32_t pair;
                        memcpy(&pair, probs + (rb + (r < count ? r : 0)) * stride + 2 * jp, sizeof pair);
                        const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pair);
                        for (int x = 0; x < HEAD_VECS; ++x)
                            acc[r][x] = _mm512_dpbf16_ps(acc[r][x], w, v[x]);
                    }
                }
                for (int r = 0; r < count; ++r) {
                    const int64_t row = r0 + rb + r, pos = row / GROUP, g = row % GROUP;
                    uint16_t *dst = out + (pos * heads + h * GROUP + g) * HEAD_DIM;
                    for (int x = 0; x < HEAD_VECS; ++x)
                        _mm256_storeu_si256((__m256i *)(dst + 16 * x), (__m256i)_mm512_cvtneps_pbh(acc[r][x]));
                }
            }
        }
        free(scores);
        free(probs);
    }
    free(kp);
    free(vp);
    return failed ? -2 : 0;
}
#else
int prefill_bf16_available(void) { return 0; }

int paged_prefill_bf16(const uint16_t *q, const uint16_t *k_src, const uint16_t *v_src, const int64_t *table,
                       int64_t block_size, int64_t start, int64_t t, int64_t kv_heads, int64_t group_arg,
                       int64_t head_dim_arg, float scale, uint16_t *out)
{
    return -1;
}
#endif

/* ------------------------------------------------------------------------------------------------
 * decode_layers: every decoder layer of a decode step (one new token per sequence) in one call.
 *
 * Why: a decode step's arithmetic is short (~20 ms for 16 sequences of SmolLM2-135M in bf16), and the
 * same layers driven from Python spend ~4 ms of it between kernels (ten calls per layer, their
 * arguments, output tensors), while the second OpenMP thread waits. This loop makes the calls the
 * fused Python loop makes (tokenflow/runtime/fused_layers.py), in the same order with the same
 * arguments, so its output is the same bit for bit:
 *   norm, QKV projection (few-rows kernel), RoPE on Q and K, K/V into the cache, paged attention,
 *   h + output projection, norm, gate_up projection, SiLU product, h + down projection.
 * The few-rows linear lives in its own library (few_rows_linear.c): the caller passes its address.
 *   h        [m, hidden] the step's hidden rows (model dtype); the result is written back into it
 *   cos, sin [m, HEAD_DIM] RoPE of each row's position; slots [m] each row's cache slot
 *   tables [m, max_blocks], lengths [m]: as paged_decode_*, each row one sequence
 *   work     bytes for 2 [m, hidden] + [m, qkv_n] + [m, heads * HEAD_DIM] + [m, 2 * inter] + [m, inter]
 *            rows of the model dtype; scratch as paged_decode_* asks
 * Returns 0, or the first failing kernel's status (a geometry error; nothing is guaranteed written then).
 * --------------------------------------------------------------------------------------------- */
typedef int (*few_rows_linear_fn)(const void *x, int bf16, int64_t m, int64_t k, const void *w, const float *bias,
                                  int64_t n, int64_t n_pad, const void *residual, void *out);

typedef struct {
    const void *weight;  /* few-rows packed */
    const float *bias;   /* fp32, or NULL */
    int64_t n, n_pad;
} PackedWeight;

typedef struct {
    const void *input_norm, *post_norm; /* [hidden] RMSNorm weights, the model's dtype */
    PackedWeight qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [slots, kv_heads, HEAD_DIM] */
    float scale;
} DecodeLayer;

int decode_layers(const DecodeLayer *layers, int64_t num_layers, few_rows_linear_fn linear, int bf16, void *h,
                  int64_t m, int64_t hidden, int64_t inter, int64_t kv_heads, float eps, const void *cos,
                  const void *sin, const int64_t *slots, const int64_t *tables, int64_t max_blocks,
                  const int64_t *lengths, int64_t max_length, int64_t block_size, char *work, float *scratch)
{
    const int64_t size = bf16 ? 2 : 4, heads = kv_heads * GROUP;
    const int64_t q_width = heads * HEAD_DIM, kv_width = kv_heads * HEAD_DIM;
    const int64_t qkv_n = layers[0].qkv.n;
    char *other = work;                          /* [m, hidden]: the residual stream's other buffer */
    char *normed = other + m * hidden * size;    /* [m, hidden] */
    char *qkv = normed + m * hidden * size;      /* [m, qkv_n] */
    char *attn = qkv + m * qkv_n * size;         /* [m, heads * HEAD_DIM] */
    char *gate_up = attn + m * q_width * size;   /* [m, 2 * inter] */
    char *act = gate_up + m * 2 * inter * size;  /* [m, inter] */
    int status;
    for (int64_t i = 0; i < num_layers; ++i) {
        const DecodeLayer *L = layers + i;
        rms_norm(h, bf16, L->input_norm, m, hidden, eps, normed);
        if ((status = linear(normed, bf16, m, hidden, L->qkv.weight, L->qkv.bias, L->qkv.n, L->qkv.n_pad, NULL, qkv)))
            return status;
        rope(qkv, bf16, m, qkv_n, heads + kv_heads, cos, sin);
        write_kv(qkv + q_width * size, qkv + (q_width + kv_width) * size, m, qkv_n * size, qkv_n * size,
                 kv_width * size, slots, L->k_cache, L->v_cache);
        status = bf16 ? paged_decode_bf16((const uint16_t *)qkv, qkv_n, L->k_cache, L->v_cache, tables, max_blocks,
                                          lengths, m, kv_heads, GROUP, HEAD_DIM, block_size, max_length, L->scale,
                                          scratch, (uint16_t *)attn)
                      : paged_decode_f32((const float *)qkv, qkv_n, L->k_cache, L->v_cache, tables, max_blocks,
                                         lengths, m, kv_heads, GROUP, HEAD_DIM, block_size, max_length, L->scale,
                                         scratch, (float *)attn);
        if (status)
            return status;
        if ((status = linear(attn, bf16, m, q_width, L->o.weight, L->o.bias, L->o.n, L->o.n_pad, h, other)))
            return status;
        rms_norm(other, bf16, L->post_norm, m, hidden, eps, normed);
        if ((status = linear(normed, bf16, m, hidden, L->gate_up.weight, L->gate_up.bias, L->gate_up.n,
                             L->gate_up.n_pad, NULL, gate_up)))
            return status;
        silu_mul(gate_up, bf16, m, inter, act);
        if ((status = linear(act, bf16, m, inter, L->down.weight, L->down.bias, L->down.n, L->down.n_pad, other, h)))
            return status;
    }
    return 0;
}
