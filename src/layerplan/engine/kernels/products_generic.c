/* The product tiles in portable C, for machines without an ISA file of their own (see lp_tiles in
 * formats.h). Each output is one chain of fmaf over each block of LP_BLOCK inputs in order, the
 * blocks' sums added in order: the reduction of the SIMD tiles, lane by lane, so these give their
 * numbers bit for bit (tests/test_kernels.py builds both and compares). */
#include <math.h>

#include "formats.h"

const char lp_products_isa[] = "generic";

/* the 16 weights of input i of a panel, in output order */
static inline void widen_f32(const void *panel, long i, float out[LP_PANEL]) {
    memcpy(out, (const float *)panel + i * LP_PANEL, sizeof(float) * LP_PANEL);
}

static inline void widen_bf16(const void *panel, long i, float out[LP_PANEL]) {
    const uint16_t *p = (const uint16_t *)panel + i * LP_PANEL;
    for (int t = 0; t < LP_PANEL / 2; t++) { /* pack_bf16's order: rows 0, 8, 1, 9, ... */
        out[t] = bf16_to_f32(p[2 * t]);
        out[LP_PANEL / 2 + t] = bf16_to_f32(p[2 * t + 1]);
    }
}

static inline void tile(int rows, int panels, void (*widen)(const void *, long, float *), const float *x, long k,
                        long from, long to, const void *w, long panel_bytes, float *y, long ys) {
    for (long i0 = from; i0 < to; i0 += LP_BLOCK) {
        long i1 = i0 + LP_BLOCK < k ? i0 + LP_BLOCK : k;
        float sums[LP_GROUP_ROWS][4][LP_PANEL] = {{{0.0f}}};
        for (long i = i0; i < i1; i++)
            for (int p = 0; p < panels; p++) {
                float wv[LP_PANEL];
                widen((const char *)w + p * panel_bytes, i, wv);
                for (int r = 0; r < rows; r++)
                    for (int j = 0; j < LP_PANEL; j++) sums[r][p][j] = fmaf(x[r * k + i], wv[j], sums[r][p][j]);
            }
        for (int r = 0; r < rows; r++)
            for (int p = 0; p < panels; p++)
                for (int j = 0; j < LP_PANEL; j++) {
                    float *out = y + r * ys + p * LP_PANEL + j;
                    *out = i0 ? *out + sums[r][p][j] : sums[r][p][j];
                }
    }
}

#define DEFINE_TILE(NAME, R, P, WIDEN)                                                              \
    static void NAME(const float *x, long k, long from, long to, const void *w, long panel_bytes, float *y, long ys, \
                     int fetch) {                                                                  \
        (void)fetch;                                                                               \
        tile(R, P, WIDEN, x, k, from, to, w, panel_bytes, y, ys);                                  \
    }
#define DEFINE_TILES(SUFFIX, WIDEN)                                                                 \
    DEFINE_TILE(k1x4_##SUFFIX, 1, 4, WIDEN)                                                         \
    DEFINE_TILE(k1x2_##SUFFIX, 1, 2, WIDEN)                                                         \
    DEFINE_TILE(k2x2_##SUFFIX, 2, 2, WIDEN)                                                         \
    DEFINE_TILE(k3x2_##SUFFIX, 3, 2, WIDEN)                                                         \
    DEFINE_TILE(k1x1_##SUFFIX, 1, 1, WIDEN)                                                         \
    DEFINE_TILE(k2x1_##SUFFIX, 2, 1, WIDEN)                                                         \
    DEFINE_TILE(k3x1_##SUFFIX, 3, 1, WIDEN)                                                         \
    DEFINE_TILE(k4x1_##SUFFIX, 4, 1, WIDEN)                                                         \
    DEFINE_TILE(k5x1_##SUFFIX, 5, 1, WIDEN)                                                         \
    DEFINE_TILE(k6x1_##SUFFIX, 6, 1, WIDEN)
DEFINE_TILES(f32, widen_f32)
DEFINE_TILES(bf16, widen_bf16)

const lp_tiles lp_tiles_f32 = {
    .one_panel = {NULL, k1x1_f32, k2x1_f32, k3x1_f32, k4x1_f32, k5x1_f32, k6x1_f32},
    .two_panels = {NULL, k1x2_f32, k2x2_f32, k3x2_f32},
    .four_panels = k1x4_f32,
};

const lp_tiles lp_tiles_bf16 = {
    .one_panel = {NULL, k1x1_bf16, k2x1_bf16, k3x1_bf16, k4x1_bf16, k5x1_bf16, k6x1_bf16},
    .two_panels = {NULL, k1x2_bf16, k2x2_bf16, k3x2_bf16},
    .four_panels = k1x4_bf16,
};
