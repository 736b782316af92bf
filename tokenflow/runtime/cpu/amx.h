/* AMX tiles for tokenflow's CPU kernels (few_rows_linear.c, prefill_attention.c): whether this build and
 * process may use them, and the one tile shape the kernels use.
 *
 * Every tile the kernels load is 16 rows of 64 bytes: 16 x 32 bf16 of a left operand, 16 pairs x 16 columns
 * of a right operand (the pair layout the kernels pack anyway for AVX512-BF16), 16 x 16 fp32 accumulators.
 * Linux gives a process the tiles' register state only once it asks (ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); torch's oneDNN asks too, and the answer holds for every thread of the process. */
#ifndef TOKENFLOW_AMX_H
#define TOKENFLOW_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define HAVE_TILES 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TILE_ROWS 16

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int tiles_state = -1; /* -1: not asked yet */

static inline int tiles_permitted(void)
{
    if (tiles_state < 0)
        tiles_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return tiles_state;
}

/* This thread's 8 tiles as 16 rows of 64 bytes, the first `left_rows` (accumulators and left operand: tiles
 * 0-4) possibly fewer. */
static inline void configure_tiles(int left_rows)
{
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = t < 5 ? (uint8_t)left_rows : TILE_ROWS;
    }
    _tile_loadconfig(&config);
}
#else
#define HAVE_TILES 0
#endif

#endif
