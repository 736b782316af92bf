/* Row helpers shared by tokenflow's CPU kernels (cpu_kernels.c, int8_kernels.c): the Llama-family RMSNorm
 * and SiLU as the fused layers compute them, so every kernel that forms them gives the same numbers. */
#ifndef TOKENFLOW_ROWS_H
#define TOKENFLOW_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* x * sigmoid(x), exp kept finite. */
static inline float silu(float x) { return x / (1.f + expf(fminf(-x, 88.f))); }

/* An RMSNorm'd row into `h` (floats): x * rsqrt(mean(x^2) + eps), times the norm's weight, with
 * transformers' bf16 roundings when `bf16` (normalised, then weighted, each rounded). x and the weight
 * are bf16 (`bf16`) or fp32. */
static inline void normed_row(const void *x, int bf16, const void *norm_weight, float eps, int64_t width, float *h)
{
    float squares = 0.f;
    if (bf16) {
#pragma omp simd reduction(+ : squares)
        for (int64_t j = 0; j < width; ++j) {
            h[j] = bf16_to_float(((const uint16_t *)x)[j]);
            squares += h[j] * h[j];
        }
    } else {
        memcpy(h, x, sizeof(float) * (size_t)width);
#pragma omp simd reduction(+ : squares)
        for (int64_t j = 0; j < width; ++j)
            squares += h[j] * h[j];
    }
    const float inv_rms = 1.f / sqrtf(squares / (float)width + eps);
    if (bf16) {
#pragma omp simd
        for (int64_t j = 0; j < width; ++j)
            h[j] = round_to_bf16(bf16_to_float(((const uint16_t *)norm_weight)[j]) * round_to_bf16(h[j] * inv_rms));
    } else {
#pragma omp simd
        for (int64_t j = 0; j < width; ++j)
            h[j] = ((const float *)norm_weight)[j] * (h[j] * inv_rms);
    }
}

#endif
