/* Single-token (decode) attention over the paged KV cache: bf16 (widening, or AVX512-BF16 dot
 * products), fp32, and int8 caches.
 * Part of cpu_kernels.c (one translation unit: included there, after simd.h). */

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
 * front-to-back reads and fetches ahead keep the memory streaming while the arithmetic runs (docs/benchmarks.md,
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
