/* The product tiles over the block formats of quant.h in portable C, for the generic build: each
 * input's 16 weights widened to gguf's fp32 values (lp_quant_panel_values), then one chain of fmaf
 * over each block of LP_BLOCK inputs in order, the blocks' sums added in order: the reduction of
 * the SIMD tiles, so these give their numbers bit for bit. */
#include <math.h>
#include <string.h>

#include "quant.h"

static void widen(int format, const void *panel, long i, float out[LP_PANEL]) {
    if (format == LP_FORMAT_F16) {
        for (int j = 0; j < LP_PANEL; j++) out[j] = f16_to_f32(((const uint16_t *)panel)[i * LP_PANEL + j]);
        return;
    }
    const lp_format_traits *f = lp_format(format);
    const uint8_t *pb = (const uint8_t *)panel + i / f->block * LP_PANEL * f->block_bytes;
    lp_quant_panel_values(format, pb, i % f->block, out);
}

static void tile(int format, int rows, int panels, const float *x, long k, long from, long to, const void *w,
                 long panel_bytes, float *y, long ys) {
    for (long i0 = from; i0 < to; i0 += LP_BLOCK) {
        long i1 = i0 + LP_BLOCK < k ? i0 + LP_BLOCK : k;
        float sums[LP_GROUP_ROWS][4][LP_PANEL] = {{{0.0f}}};
        for (long i = i0; i < i1; i++)
            for (int p = 0; p < panels; p++) {
                float wv[LP_PANEL];
                widen(format, (const char *)w + p * panel_bytes, i, wv);
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

#define DEFINE_TILE(NAME, FORMAT, R, P)                                                             \
    static void NAME(const float *x, long k, long from, long to, const void *w, long panel_bytes, float *y, long ys, \
                     int fetch) {                                                                  \
        (void)fetch;                                                                               \
        tile(FORMAT, R, P, x, k, from, to, w, panel_bytes, y, ys);                                 \
    }
#define DEFINE_TILES(f, FORMAT)                                                                     \
    DEFINE_TILE(f##_1x4, FORMAT, 1, 4)                                                              \
    DEFINE_TILE(f##_1x2, FORMAT, 1, 2)                                                              \
    DEFINE_TILE(f##_2x2, FORMAT, 2, 2)                                                              \
    DEFINE_TILE(f##_3x2, FORMAT, 3, 2)                                                              \
    DEFINE_TILE(f##_1x1, FORMAT, 1, 1)                                                              \
    DEFINE_TILE(f##_2x1, FORMAT, 2, 1)                                                              \
    DEFINE_TILE(f##_3x1, FORMAT, 3, 1)                                                              \
    DEFINE_TILE(f##_4x1, FORMAT, 4, 1)                                                              \
    DEFINE_TILE(f##_5x1, FORMAT, 5, 1)                                                              \
    DEFINE_TILE(f##_6x1, FORMAT, 6, 1)                                                              \
    const lp_tiles lp_tiles_##f = {                                                                \
        .one_panel = {NULL, f##_1x1, f##_2x1, f##_3x1, f##_4x1, f##_5x1, f##_6x1},                 \
        .two_panels = {NULL, f##_1x2, f##_2x2, f##_3x2},                                           \
        .four_panels = f##_1x4,                                                                    \
    };

#define TILES_OF(ID, name, ...) DEFINE_TILES(name, LP_FORMAT_##ID)
LP_QUANT_FORMATS(TILES_OF)

/* Integer products: none in the portable build (no lp_int_tiles_<format>: the trait rows' int_tiles
 * are NULL); LP_ARITH_INT8 matrices run the exact products. */

/* formats.h's quantization in scalar C: its rule written plainly (lp_gemm links to it; without
 * integer tiles this build never calls it) */
void lp_q8_quantize(const float *x, long m, long k, int8_t *q, float *d, float *s) {
    for (long r = 0; r < m; r++)
        for (long b = 0; b < k / 32; b++) {
            const float *xb = x + r * k + 32 * b;
            float most = 0.0f;
            for (int i = 0; i < 32; i++) most = fabsf(xb[i]) > most ? fabsf(xb[i]) : most;
            float inv = most > 0.0f ? 127.0f / most : 0.0f;
            d[r * (k / 32) + b] = most / 127.0f;
            for (int h = 0; h < 2; h++) {
                int sum = 0;
                for (int i = 16 * h; i < 16 * h + 16; i++) {
                    q[r * k + 32 * b + i] = (int8_t)nearbyintf(xb[i] * inv);
                    sum += q[r * k + 32 * b + i];
                }
                s[r * (k / 16) + 2 * b + h] = d[r * (k / 32) + b] * (float)sum;
            }
        }
}

/* formats.h's Q8_K rule in scalar C (x_m chosen as products_quant_avx2.c chooses it) */
void lp_q8k_quantize(const float *x, long m, long k, long sub, int8_t *q, float *d, int16_t *bsum) {
    for (long r = 0; r < m; r++)
        for (long b = 0; b < k / 256; b++) {
            const float *xb = x + r * k + 256 * b;
            int8_t *qb = q + r * k + 256 * b;
            float most = xb[0], least = xb[0];
            for (int i = 1; i < 256; i++) {
                most = xb[i] > most ? xb[i] : most;
                least = xb[i] < least ? xb[i] : least;
            }
            float x_m = most >= -least ? most : least;
            if (x_m == 0.0f) {
                d[r * (k / 256) + b] = 0.0f;
                memset(qb, 0, 256);
            } else {
                const float iscale = -127.0f / x_m;
                for (int i = 0; i < 256; i++) {
                    int v = (int)nearbyintf(iscale * xb[i]);
                    qb[i] = (int8_t)(v > 127 ? 127 : v);
                }
                d[r * (k / 256) + b] = 1.0f / iscale;
            }
            lp_q8k_sums(qb, sub, bsum + r * (k / sub) + b * (256 / sub));
        }
}
