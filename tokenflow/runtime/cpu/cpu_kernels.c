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

#include "amx.h"
#include "bf16.h"
#include "rows.h"

#if !defined(HEAD_DIM) || !defined(GROUP)
#error "build with -DHEAD_DIM=<head_dim> -DGROUP=<query heads per KV head>"
#endif

/* The kernels by job, in one translation unit (HEAD_DIM and GROUP are this build's constants). */
#include "simd.h"
#include "decode_attention.c"
#include "pointwise.c"
#include "prefill_attention.c"
#include "decoder_loop.c"
