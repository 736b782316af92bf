/* bf16 attention pieces for tokenflow on CPU, called through ctypes.
 *
 * Built at first use by tokenflow/model/native_attention.py (cc -O3 -march=native -ffast-math
 * -fopenmp -DHEAD_DIM=... -DGROUP=..., linked without -ffast-math) for one model's head size
 * and query heads per KV head: constants let the compiler unroll every row loop.
 *
 * - paged_decode_bf16: single-token attention straight over the paged KV cache. Compared with
 *   torch ops it skips the gather of every sequence's blocks into a padded copy and the padding
 *   itself: each sequence reads its keys and values once, block by block, where they lie.
 * - causal_softmax_bf16: the middle of a prefill tile's attention (scale, causal mask, softmax,
 *   rounding) in one pass over the scores instead of four torch ops.
 *
 * Arithmetic follows transformers' eager bf16 attention: scores accumulated in fp32 and rounded
 * to bf16, scaled, softmax in fp32, probabilities rounded to bf16, the weighted sum of values
 * accumulated in fp32 and rounded to bf16. Only the order of fp32 sums and the exp differ.
 *
 * OpenMP: loaded into a process where torch already mapped its libgomp.so.1, this library's
 * libgomp.so.1 dependency resolves to that same runtime, so the parallel loops use the calling
 * thread's existing team.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <stdlib.h>

#if !defined(HEAD_DIM) || !defined(GROUP)
#error "build with -DHEAD_DIM=<head_dim> -DGROUP=<query heads per KV head>"
#endif

static inline float bf16_to_float(uint16_t x)
{
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) /* round to nearest even; inputs are finite */
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* Prefetch one block of one cache (all KV heads: block_size * slot_stride contiguous values). */
static inline void prefetch_block(const uint16_t *block, int64_t values)
{
    for (int64_t at = 0; at < values; at += 32) /* 64-byte lines */
        __builtin_prefetch(block + at, 0, 3);
}

/* One query token per sequence.
 *   q        [n, kv_heads, group, head_dim]      bf16, contiguous
 *   k_cache  [num_slots, kv_heads, head_dim]     bf16 (slot = block * block_size + offset)
 *   v_cache  [num_slots, kv_heads, head_dim]     bf16
 *   tables   [n, max_blocks]                     int64: each sequence's blocks, in order
 *   lengths  [n]                                 int64: keys each sequence attends to (>= 1)
 *   scratch  [n, heads * (2 * head_dim + max_length)]  fp32 work space (max_length >= every length)
 *   out      [n, kv_heads, group, head_dim]      bf16
 * One sequence per work item, all its heads together: a block's keys (then values) of every KV
 * head are contiguous, so each block is read as one stream, and the next block is prefetched.
 * Returns 0, or -1 when group or head_dim differ from the build's GROUP and HEAD_DIM (nothing is written then).
 */
int paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *tables,
                      int64_t max_blocks, const int64_t *lengths, int64_t n, int64_t kv_heads, int64_t group_arg,
                      int64_t head_dim_arg, int64_t block_size, int64_t max_length, float scale, float *scratch,
                      uint16_t *out)
{
    if (head_dim_arg != HEAD_DIM || group_arg != GROUP)
        return -1;
    const int64_t group = GROUP;
    const int64_t head_dim = HEAD_DIM;
    const int64_t heads = kv_heads * group, slot_stride = kv_heads * head_dim, block_values = block_size * slot_stride;

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t seq = 0; seq < n; ++seq) {
        const int64_t length = lengths[seq], blocks = (length + block_size - 1) / block_size;
        const int64_t *table = tables + seq * max_blocks;
        float *query = scratch + seq * heads * (2 * head_dim + max_length); /* [heads, head_dim] */
        float *acc = query + heads * head_dim;                               /* [heads, head_dim] */
        float *probs = acc + heads * head_dim;                               /* [heads, max_length] */

        const uint16_t *q_seq = q + seq * heads * head_dim;
        for (int64_t x = 0; x < heads * head_dim; ++x) {
            query[x] = bf16_to_float(q_seq[x]);
            acc[x] = 0.f;
        }

        /* scores, block by block */
        prefetch_block(k_cache + table[0] * block_values, block_values);
        for (int64_t b = 0; b < blocks; ++b) {
            if (b + 1 < blocks)
                prefetch_block(k_cache + table[b + 1] * block_values, block_values);
            const int64_t start = b * block_size;
            const int64_t count = length - start < block_size ? length - start : block_size;
            const uint16_t *keys = k_cache + table[b] * block_values;
            for (int64_t kh = 0; kh < kv_heads; ++kh) {
                float qv[GROUP][HEAD_DIM] __attribute__((aligned(64)));
                memcpy(qv, query + kh * GROUP * HEAD_DIM, sizeof qv);
                for (int64_t t = 0; t < count; ++t) {
                    const uint16_t *key = keys + t * slot_stride + kh * head_dim;
                    float row[HEAD_DIM] __attribute__((aligned(64)));
#pragma omp simd
                    for (int64_t x = 0; x < HEAD_DIM; ++x)
                        row[x] = bf16_to_float(key[x]);
                    for (int64_t g = 0; g < GROUP; ++g) {
                        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t x = 0; x < HEAD_DIM; ++x)
                            dot += qv[g][x] * row[x];
                        probs[(kh * GROUP + g) * max_length + start + t] = round_to_bf16(dot) * scale;
                    }
                }
            }
        }
        prefetch_block(v_cache + table[0] * block_values, block_values);

        /* softmax per query head, in fp32; probabilities rounded to bf16 */
        for (int64_t h = 0; h < heads; ++h) {
            float *p = probs + h * max_length, top = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : top)
            for (int64_t t = 0; t < length; ++t)
                top = p[t] > top ? p[t] : top;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < length; ++t) {
                p[t] = expf(p[t] - top);
                sum += p[t];
            }
            const float inv = 1.f / sum;
#pragma omp simd
            for (int64_t t = 0; t < length; ++t)
                p[t] = round_to_bf16(p[t] * inv);
        }

        /* weighted sum of values, block by block */
        for (int64_t b = 0; b < blocks; ++b) {
            if (b + 1 < blocks)
                prefetch_block(v_cache + table[b + 1] * block_values, block_values);
            const int64_t start = b * block_size;
            const int64_t count = length - start < block_size ? length - start : block_size;
            const uint16_t *values = v_cache + table[b] * block_values;
            for (int64_t kh = 0; kh < kv_heads; ++kh) {
                float a[GROUP][HEAD_DIM] __attribute__((aligned(64)));
                memcpy(a, acc + kh * GROUP * HEAD_DIM, sizeof a);
                for (int64_t t = 0; t < count; ++t) {
                    const uint16_t *value = values + t * slot_stride + kh * head_dim;
                    float row[HEAD_DIM] __attribute__((aligned(64)));
#pragma omp simd
                    for (int64_t x = 0; x < HEAD_DIM; ++x)
                        row[x] = bf16_to_float(value[x]);
                    for (int64_t g = 0; g < GROUP; ++g) {
                        const float weight = probs[(kh * GROUP + g) * max_length + start + t];
#pragma omp simd
                        for (int64_t x = 0; x < HEAD_DIM; ++x)
                            a[g][x] += weight * row[x];
                    }
                }
                memcpy(acc + kh * GROUP * HEAD_DIM, a, sizeof a);
            }
        }

        uint16_t *out_seq = out + seq * heads * head_dim;
        for (int64_t x = 0; x < heads * head_dim; ++x)
            out_seq[x] = float_to_bf16(acc[x]);
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
