/* bf16 <-> fp32 for tokenflow's CPU kernels (cpu_kernels.c, int8_kernels.c), the roundings torch's
 * bf16 ops make: round to nearest, ties to even. Inputs are finite. */
#ifndef TOKENFLOW_BF16_H
#define TOKENFLOW_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x)
{
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#endif
