/* decode_layers: every decoder layer of a decode step in one call.
 * Part of cpu_kernels.c (one translation unit: included there, after simd.h). */

/* ------------------------------------------------------------------------------------------------
 * decode_layers: every decoder layer of a decode step (one new token per sequence) in one call.
 *
 * Why: a decode step's arithmetic is short (~20 ms for 16 sequences of SmolLM2-135M in bf16), and the
 * same layers driven from Python spend ~4 ms of it between kernels (ten calls per layer, their
 * arguments, output tensors), while the second OpenMP thread waits. This loop makes the calls the
 * fused Python loop makes (tokenflow/runtime/fused_layers.py), in the same order with the same
 * arguments, so its output is the same bit for bit:
 *   norm, QKV projection (few-rows kernel), [Q and K head norms], RoPE on Q and K, K/V into the cache, paged attention,
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
    const void *q_norm, *k_norm;        /* [HEAD_DIM] per-head RMSNorm weights (Qwen3), or NULL */
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
        if (L->q_norm != NULL) {
            head_rms_norm(qkv, bf16, m, qkv_n, heads, L->q_norm, eps);
            head_rms_norm(qkv + q_width * size, bf16, m, qkv_n, kv_heads, L->k_norm, eps);
        }
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
