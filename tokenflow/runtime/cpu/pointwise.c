/* Pointwise kernels: a prefill tile's causal softmax (bf16), RMSNorm (of rows and of heads), RoPE, the K/V write,
 * SiLU product.
 * Part of cpu_kernels.c (one translation unit: included there, after simd.h). */

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

/* RMSNorm over each head of the first `heads` heads of each row, in place (Qwen3's Q and K norms, which
 * transformers applies to the projection viewed as [rows, heads, HEAD_DIM]): `normed_row` per head.
 *   x [rows, row_stride] bf16 or fp32 (the heads start at x); weight [HEAD_DIM] of x's dtype.
 */
void head_rms_norm(void *x, int bf16, int64_t rows, int64_t row_stride, int64_t heads, const void *weight, float eps)
{
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows * heads * HEAD_DIM >= 32768)
    for (int64_t r = 0; r < rows * heads; ++r) {
        char *head = (char *)x + ((r / heads) * row_stride + (r % heads) * HEAD_DIM) * size;
        float h[HEAD_DIM];
        normed_row(head, bf16, weight, eps, HEAD_DIM, h);
        for (int64_t d = 0; d < HEAD_DIM; ++d) {
            if (bf16)
                ((uint16_t *)head)[d] = float_to_bf16(h[d]); /* exact: h is rounded already */
            else
                ((float *)head)[d] = h[d];
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
