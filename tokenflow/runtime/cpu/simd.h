/* SIMD and row helpers shared by the attention kernels of cpu_kernels.c (one translation unit: included
 * once, after bf16.h and rows.h, with HEAD_DIM and GROUP defined). */

#ifndef TOKENFLOW_SIMD_H
#define TOKENFLOW_SIMD_H

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

/* In place on `n` scores whose max is `top`: exponentiate each minus it; returns their sum. */
static inline float exp_minus(float *s, int64_t n, float top)
{
    const __m512 m = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), m));
        _mm512_mask_storeu_ps(s + j, live, e);
        sum = _mm512_mask_add_ps(sum, live, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* Softmax's middle, in place on `n` scores: subtract their max, exponentiate; returns the sum. */
static inline float exp_minus_max(float *s, int64_t n)
{
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        top = _mm512_mask_max_ps(top, live, top, _mm512_maskz_loadu_ps(live, s + j));
    }
    return exp_minus(s, n, _mm512_reduce_max_ps(top));
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

#endif /* TOKENFLOW_SIMD_H */
