/* What the AMX tile kernels (linear.c, attention.c) share: the tile configuration they load. */
#pragma once
#include <stdint.h>

typedef struct { /* palette 1's layout, as ldtilecfg reads it */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* eight tiles of 16 rows x 64 bytes (16 fp32 or 16 bf16 pairs a row): all either kernel uses */
static inline tile_config amx_tiles_16x64(void) {
    tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    return cfg;
}

int linear_amx(void); /* 1 where prompt rows run on AMX tiles (linear.c) */
