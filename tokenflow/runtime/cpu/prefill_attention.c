/* Causal attention of a prefill chunk over the paged cache: fp32 (and int8 caches) and bf16.
 * Part of cpu_kernels.c (one translation unit: included there, after simd.h). */

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
#define KEY_TILE 32 /* keys per score tile: two vectors (paged_prefill_bf16 takes two tiles at once where it can) */
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
 * On CPUs with AMX both products run on tiles of 16 query rows (prefill_tile_rows), the packing unchanged (it
 * is the tiles' pair layout): the same arithmetic up to the order of fp32 sums, for every chunk, so a prompt's
 * rows do not depend on how it was chunked or cached. Keys are padded to whole 64-key blocks.
 *   q, out  [t, kv_heads * GROUP, HEAD_DIM] bf16; k_src, v_src, table as paged_prefill_f32.
 * prefill_bf16_available() says whether this build has it (else the call returns -1).
 * --------------------------------------------------------------------------------------------- */
#if defined(__AVX512BF16__) && HEAD_DIM % 16 == 0
int prefill_bf16_available(void) { return 1; }

/* 16 fp32 lanes rounded to bf16 and widened back: eager's rounding of a bf16 result. */
static inline __m512 round16_to_bf16(__m512 x)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

/* 16 bf16 values at p widened to fp32. */
static inline __m512 load16_bf16(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __mmask16 lanes_below(int64_t j, int64_t limit)
{
    return limit - j >= 16 ? 0xFFFF : limit <= j ? 0 : (__mmask16)((1u << (limit - j)) - 1);
}

/* A row's scaled scores x[0, seen) (bf16 values held in fp32; `top` their max) into probabilities
 * p[0, padded): exp(x - top) / sum rounded to bf16, as eager bf16 attention rounds them, zeros past `seen`.
 * x is overwritten; both rows have room up to `padded` rounded up to 16 (x's lanes past `seen` are read as
 * they are and masked). */
static inline void bf16_probabilities(float *x, uint16_t *p, int64_t seen, int64_t padded, float top)
{
    const __m512 inv = _mm512_set1_ps(1.f / exp_minus(x, seen, top));
    for (int64_t j = 0; j < padded; j += 16) {
        const __m512 prob = _mm512_maskz_mul_ps(lanes_below(j, seen), _mm512_loadu_ps(x + j), inv);
        _mm256_storeu_si256((__m256i *)(p + j), (__m256i)_mm512_cvtneps_pbh(prob));
    }
}

/* Keys j .. j + 15 of KV head h (zeros past `length`) packed for paged_prefill_bf16: their pairs of
 * dimensions transposed into kp[pair][16 keys] (row stride kstride) by 16 x 16 transposes of 32-bit pairs,
 * and their values interleaved by pairs of keys into vp[8][HEAD_DIM] pairs. In registers, 16 keys at a time:
 * a copy one 32-bit pair at a time took ~8% of the kernel at 2k keys. */
static inline void pack_keys16(const uint16_t *k_src, const uint16_t *v_src, const int64_t *table, int64_t block_size,
                               int64_t slot_stride, int64_t h, int64_t j, int64_t length, uint32_t *kp, int64_t kstride,
                               uint32_t *vp)
{
    static const uint16_t zeros[HEAD_DIM] __attribute__((aligned(64)));
    const uint16_t *krow[16], *vrow[16];
    for (int i = 0; i < 16; ++i) {
        const int live = j + i < length;
        const int64_t at = live ? key_slot(table, j + i, block_size) * slot_stride + h * HEAD_DIM : 0;
        krow[i] = live ? k_src + at : zeros;
        vrow[i] = live ? v_src + at : zeros;
    }
    const int wide = HEAD_DIM / 32 * 32; /* dimensions in whole 32-wide vectors; HEAD_DIM % 32 == 16 leaves 16 */
    for (int d = 0; d < wide; d += 32) { /* pairs d / 2 .. d / 2 + 15 */
        __m512i r[16], t[16];
        for (int i = 0; i < 16; ++i)
            r[i] = _mm512_loadu_si512(krow[i] + d);
        for (int i = 0; i < 16; i += 2) {
            t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
            t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
        }
        for (int i = 0; i < 16; i += 4) {
            r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
            r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
            r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
            r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
        }
        /* r[4m + c] holds, in its 128-bit lane L, pair 4L + c of keys 4m .. 4m + 3 */
        for (int c = 0; c < 4; ++c) {
            const __m512i lo01 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
            const __m512i lo23 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
            const __m512i hi01 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
            const __m512i hi23 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
            uint32_t *dst = kp + (d / 2 + c) * kstride;
            _mm512_store_si512(dst, _mm512_shuffle_i32x4(lo01, lo23, 0x88));
            _mm512_store_si512(dst + 4 * kstride, _mm512_shuffle_i32x4(lo01, lo23, 0xDD));
            _mm512_store_si512(dst + 8 * kstride, _mm512_shuffle_i32x4(hi01, hi23, 0x88));
            _mm512_store_si512(dst + 12 * kstride, _mm512_shuffle_i32x4(hi01, hi23, 0xDD));
        }
    }
    for (int p = wide / 2; p < HEAD_DIM / 2; ++p)
        for (int i = 0; i < 16; ++i)
            kp[p * kstride + i] = (uint32_t)krow[i][2 * p] | (uint32_t)krow[i][2 * p + 1] << 16;
    /* element 2n of a pair vector from the first key's row, 2n + 1 from the second's */
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                         39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int i = 0; i < 16; i += 2) {
        uint32_t *dst = vp + i / 2 * HEAD_DIM;
        for (int d = 0; d < wide; d += 32) {
            const __m512i v0 = _mm512_loadu_si512(vrow[i] + d), v1 = _mm512_loadu_si512(vrow[i + 1] + d);
            _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(v0, low, v1));
            _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(v0, high, v1));
        }
        for (int d = wide; d < HEAD_DIM; ++d)
            dst[d] = (uint32_t)vrow[i][d] | (uint32_t)vrow[i + 1][d] << 16;
    }
}

/* Scores of the PREFILL_ROWS query rows `qb` (pairs of dimensions) against keys j .. j + 16 * nv of the packed
 * keys kh: x = bf16(bf16(s) * scale), kept in fp32 in `scores` rows; each row's max over its visible keys.
 * nv (2 or 4 vectors of keys) is a constant where it is inlined: with 4, each broadcast query pair feeds four
 * products and 24 accumulators keep the dot-product ports busy (~6% faster than 2). */
static inline __attribute__((always_inline)) void score_tile(const uint32_t qb[PREFILL_ROWS][HEAD_DIM / 2],
                                                             const uint32_t *kh, int64_t kstride, int64_t j,
                                                             const int nv, float *scores, int64_t sstride,
                                                             __m512 scaling, __m512 top[PREFILL_ROWS],
                                                             const int64_t visible[PREFILL_ROWS])
{
    __m512 acc[PREFILL_ROWS][4];
    for (int r = 0; r < PREFILL_ROWS; ++r)
        for (int x = 0; x < nv; ++x)
            acc[r][x] = _mm512_setzero_ps();
    for (int64_t p = 0; p < HEAD_DIM / 2; ++p) {
        __m512bh k[4];
        for (int x = 0; x < nv; ++x)
            k[x] = (__m512bh)_mm512_load_si512(kh + p * kstride + j + 16 * x);
        for (int r = 0; r < PREFILL_ROWS; ++r) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)qb[r][p]);
            for (int x = 0; x < nv; ++x)
                acc[r][x] = _mm512_dpbf16_ps(acc[r][x], w, k[x]);
        }
    }
    for (int r = 0; r < PREFILL_ROWS; ++r)
        for (int x = 0; x < nv; ++x) {
            const __m512 scaled = round16_to_bf16(_mm512_mul_ps(round16_to_bf16(acc[r][x]), scaling));
            _mm512_store_ps(scores + r * sstride + j + 16 * x, scaled);
            top[r] = _mm512_mask_max_ps(top[r], lanes_below(j + 16 * x, visible[r]), top[r], scaled);
        }
}

#if HAVE_TILES && HEAD_DIM % 32 == 0
#define TILE_KEYS 64 /* keys per score block: four accumulator tiles, so the products do not wait on each other */

/* Query rows r0 .. r0 + 16 of KV head h (rows past `rows` repeat the last, unwritten) on AMX tiles (configured
 * 16 x 64 bytes each), in three passes over the row's keys that keep each pass's data in L1/L2:
 *   1. scores Q K^T, TILE_KEYS keys at a time (tmm0-3; tmm4 the rows' next 32 head dimensions, tmm5-7 16
 *      dimension pairs x 16 keys), rounded and scaled as eager bf16 attention rounds them; those are bf16
 *      values, kept as such in `xs` [16][xstride]; each row's max over its visible keys;
 *   2. each row's sum of exp(x - max);
 *   3. the probabilities exp(x - max) / sum rounded to bf16, written over `xs` 32 keys at a time just before
 *      P V takes them (tmm0-3 64 dimensions; tmm4 the probabilities, tmm5-7 16 key pairs x 16 dimensions). */
static void prefill_tile_rows(const uint16_t *q, const uint32_t *kh, int64_t kstride, const uint32_t *vh,
                              int64_t rows, int64_t r0, int64_t heads, int64_t h, int64_t start, float scale,
                              uint16_t *xs, int64_t xstride, float *es, int64_t estride, uint16_t *out)
{
    const int64_t real = rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS;
    uint16_t qb[TILE_ROWS][HEAD_DIM] __attribute__((aligned(64)));
    int64_t visible[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; ++r) {
        const int64_t row = r0 + (r < real ? r : real - 1);
        const int64_t pos = row / GROUP, g = row % GROUP;
        memcpy(qb[r], q + (pos * heads + h * GROUP + g) * HEAD_DIM, sizeof qb[r]);
        visible[r] = start + pos + 1;
    }
    const int64_t keys = visible[TILE_ROWS - 1];
    const __m512 scaling = _mm512_set1_ps(scale);
    float block[TILE_ROWS][TILE_KEYS] __attribute__((aligned(64)));
    __m512 top[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; ++r)
        top[r] = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < keys; j += TILE_KEYS) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t d = 0; d < HEAD_DIM; d += 32) {
            const uint32_t *k = kh + (d / 2) * kstride + j;
            _tile_loadd(4, qb[0] + d, HEAD_DIM * 2);
            _tile_loadd(5, k, kstride * 4);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, k + 16, kstride * 4);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, k + 32, kstride * 4);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, k + 48, kstride * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, block[0], TILE_KEYS * 4);
        _tile_stored(1, block[0] + 16, TILE_KEYS * 4);
        _tile_stored(2, block[0] + 32, TILE_KEYS * 4);
        _tile_stored(3, block[0] + 48, TILE_KEYS * 4);
        /* x = bf16(bf16(s) * scale), kept as bf16; the max of the unrounded products is the max's rounding
         * (rounding is monotonic), so the max skips the second widening */
        for (int r = 0; r < TILE_ROWS; ++r)
            for (int x = 0; x < TILE_KEYS / 16; ++x) {
                const __m512 scaled = _mm512_mul_ps(round16_to_bf16(_mm512_load_ps(block[r] + 16 * x)), scaling);
                _mm256_storeu_si256((__m256i *)(xs + r * xstride + j + 16 * x), (__m256i)_mm512_cvtneps_pbh(scaled));
                top[r] = _mm512_mask_max_ps(top[r], lanes_below(j + 16 * x, visible[r]), top[r], scaled);
            }
    }
    float inv[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; ++r) { /* e = exp(x - max) in fp32, and their sum */
        const __m512 m = round16_to_bf16(_mm512_set1_ps(_mm512_reduce_max_ps(top[r])));
        __m512 sum = _mm512_setzero_ps();
        float *e_row = es + r * estride;
        for (int64_t j = 0; j < visible[r]; j += 16) {
            const __m512 e = _mm512_maskz_mov_ps(lanes_below(j, visible[r]),
                                                 exp16(_mm512_sub_ps(load16_bf16(xs + r * xstride + j), m)));
            _mm512_store_ps(e_row + j, e);
            sum = _mm512_add_ps(sum, e);
        }
        inv[r] = 1.f / _mm512_reduce_add_ps(sum);
    }
    const int64_t padded = (keys + 31) / 32 * 32;
    float acc[TILE_ROWS][HEAD_DIM] __attribute__((aligned(64)));
    for (int x0 = 0; x0 < HEAD_VECS; x0 += 4) {
        const int n = HEAD_VECS - x0 < 4 ? HEAD_VECS - x0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t jp = 0; jp < padded / 2; jp += 16) {
            if (x0 == 0) /* this block's probabilities bf16(e / sum), over its scaled scores */
                for (int r = 0; r < TILE_ROWS; ++r) {
                    const __m512 scale_r = _mm512_set1_ps(inv[r]);
                    for (int x = 0; x < 2; ++x) {
                        const int64_t j = 2 * jp + 16 * x;
                        const __m512 prob = _mm512_maskz_mul_ps(lanes_below(j, visible[r]), _mm512_load_ps(es + r * estride + j),
                                                                scale_r);
                        _mm256_storeu_si256((__m256i *)(xs + r * xstride + j), (__m256i)_mm512_cvtneps_pbh(prob));
                    }
                }
            const uint32_t *v = vh + jp * HEAD_DIM + 16 * x0;
            _tile_loadd(4, xs + 2 * jp, xstride * 2);
            _tile_loadd(5, v, HEAD_DIM * 4);
            _tile_dpbf16ps(0, 4, 5);
            if (n > 1) {
                _tile_loadd(6, v + 16, HEAD_DIM * 4);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (n > 2) {
                _tile_loadd(7, v + 32, HEAD_DIM * 4);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (n > 3) {
                _tile_loadd(5, v + 48, HEAD_DIM * 4);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, acc[0] + 16 * x0, HEAD_DIM * 4);
        if (n > 1)
            _tile_stored(1, acc[0] + 16 * (x0 + 1), HEAD_DIM * 4);
        if (n > 2)
            _tile_stored(2, acc[0] + 16 * (x0 + 2), HEAD_DIM * 4);
        if (n > 3)
            _tile_stored(3, acc[0] + 16 * (x0 + 3), HEAD_DIM * 4);
    }
    for (int r = 0; r < real; ++r) {
        const int64_t row = r0 + r, pos = row / GROUP, g = row % GROUP;
        uint16_t *dst = out + (pos * heads + h * GROUP + g) * HEAD_DIM;
        for (int x = 0; x < HEAD_VECS; ++x)
            _mm256_storeu_si256((__m256i *)(dst + 16 * x), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc[r] + 16 * x)));
    }
}
#define PREFILL_TILES 1
#else
#define PREFILL_TILES 0
#endif

int paged_prefill_bf16(const uint16_t *q, const uint16_t *k_src, const uint16_t *v_src, const int64_t *table,
                       int64_t block_size, int64_t start, int64_t t, int64_t kv_heads, int64_t group_arg,
                       int64_t head_dim_arg, float scale, uint16_t *out)
{
    if (head_dim_arg != HEAD_DIM || group_arg != GROUP)
        return -1;
    const int64_t heads = kv_heads * GROUP, slot_stride = kv_heads * HEAD_DIM, pairs = HEAD_DIM / 2;
    const int64_t length = start + t;
    const int64_t stride = (length + 63) / 64 * 64; /* padded keys per head: whole score blocks of either path */
    const int64_t kstride = stride + 16; /* packed keys' row stride: off multiples of 4 KiB (L1 sets) */
    const int64_t rows = t * GROUP;
    const int64_t row_blocks = (rows + PREFILL_ROWS - 1) / PREFILL_ROWS;
#if PREFILL_TILES
    const int tiles = tiles_permitted();
#else
    const int tiles = 0;
#endif
    uint32_t *kp = aligned_alloc(64, sizeof(uint32_t) * (size_t)(kv_heads * pairs * kstride));     /* [h][d/2][key] */
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
        for (int64_t hj = 0; hj < kv_heads * stride / 16; ++hj) {
            const int64_t h = hj / (stride / 16), j = 16 * (hj % (stride / 16));
            pack_keys16(k_src, v_src, table, block_size, slot_stride, h, j, length, kp + h * pairs * kstride + j,
                        kstride, vp + (h * stride / 2 + j / 2) * HEAD_DIM);
        }

        /* per thread: a tile's scaled scores (bf16, then its probabilities) and exponentials (fp32), rows off
         * multiples of 4 KiB; or the register tile's scores and probabilities */
        const int64_t buffer_rows = tiles ? 16 : PREFILL_ROWS, xstride = stride + 32, estride = stride + 16;
        float *scores = aligned_alloc(64, sizeof(float) * (size_t)(buffer_rows * estride));
        uint16_t *probs = aligned_alloc(64, sizeof(uint16_t) * (size_t)(buffer_rows * xstride));
        if (scores == NULL || probs == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#if PREFILL_TILES
        if (tiles) {
            configure_tiles(TILE_ROWS);
            const int64_t row_tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp for schedule(dynamic, 2)
            for (int64_t item = 0; item < kv_heads * row_tiles; ++item) {
                if (scores == NULL || probs == NULL)
                    continue;
                const int64_t h = item / row_tiles;
                prefill_tile_rows(q, kp + h * pairs * kstride, kstride, vp + h * stride / 2 * HEAD_DIM, rows,
                                  (item % row_tiles) * TILE_ROWS, heads, h, start, scale, probs, xstride, scores,
                                  estride, out);
            }
            _tile_release();
        }
#endif
#pragma omp for schedule(dynamic, 2)
        for (int64_t item = 0; item < (tiles ? 0 : kv_heads * row_blocks); ++item) {
            if (scores == NULL || probs == NULL)
                continue;
            const int64_t h = item / row_blocks, r0 = (item % row_blocks) * PREFILL_ROWS;
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
            const uint32_t *kh = kp + h * pairs * kstride;
            const __m512 scaling = _mm512_set1_ps(scale);
            __m512 top[PREFILL_ROWS];
            for (int r = 0; r < PREFILL_ROWS; ++r)
                top[r] = _mm512_set1_ps(-INFINITY);
            int64_t j = 0;
            for (; j + 2 * KEY_TILE <= padded; j += 2 * KEY_TILE)
                score_tile(qb, kh, kstride, j, 4, scores, stride, scaling, top, visible);
            if (j < padded)
                score_tile(qb, kh, kstride, j, 2, scores, stride, scaling, top, visible);
            const int64_t even = (keys + 1) / 2 * 2;
            for (int r = 0; r < PREFILL_ROWS; ++r)
                bf16_probabilities(scores + r * stride, probs + r * stride, visible[r], even,
                                   _mm512_reduce_max_ps(top[r]));

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
