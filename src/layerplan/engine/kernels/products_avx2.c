/* The product tiles for AVX2 + FMA (see lp_tiles in formats.h), for the fp32 and bf16 formats.
 *
 * A tile keeps an R-rows x 16P-outputs block of sums in registers and, for each input i,
 * broadcasts x[r][i] against the panel's 16 weights: no horizontal sums, every weight loaded once
 * per row group, and enough independent sums to keep both FMA units busy. Each output is summed
 * as the block rule of LP_BLOCK says (common.h): a chain of FMAs over each block of inputs in
 * order, the blocks' sums added in order, whatever R, P or the thread.
 *
 * bf16 panels hold outputs 0-7 in the low and 8-15 in the high halves of their eight 32-bit words
 * (pack_bf16 in formats.c): a shift by 16 widens the low ones to fp32 and a mask keeps the high
 * ones (one shift and one AND, which any vector pipe runs).
 */
#include <immintrin.h>

#include "formats.h"
#include "tiles_avx2.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "products_avx2.c is built with -mavx2 -mfma"
#endif

static inline v16 widen_bf16(const uint16_t *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return (v16){_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
                 _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)))};
}

static inline v16 widen_f32(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }

/* (DEFINE_KERNEL) the line of next panel q at input i, AHEAD elements on */
#define AHEAD_LINE(q, WT, AHEAD)                                                                   \
    if (P > q) lp_prefetch((uintptr_t)w + (uintptr_t)((P + q) * panel + i * 16 + AHEAD) * sizeof(WT));

/* RR rows times PP panels (literal constants in every instance), a register tile of tiles_avx2.h.
 * With R > 1 and fetch, each next panel's line AHEAD elements on is prefetched once per line. */
#define DEFINE_KERNEL(NAME, RR, PP, WT, WIDEN, AHEAD)                                               \
    static void NAME(const float *x, long k, long from, long to, const void *wv, long panel_bytes, float *y, long ys, \
                     int fetch) {                                                                  \
        enum { R = RR, P = PP };                                                                   \
        const WT *w = (const WT *)wv;                                                              \
        const long panel = panel_bytes / (long)sizeof(WT);                                         \
        ROW_INPUTS(x, k)                                                                           \
        for (long i0 = from; i0 < to; i0 += LP_BLOCK) {                                            \
            long i1 = i0 + LP_BLOCK < k ? i0 + LP_BLOCK : k;                                       \
            ZERO_ROWS                                                                              \
            for (long i = i0; i < i1; i++) {                                                       \
                if (AHEAD && R > 1 && fetch && (i * 16 * sizeof(WT)) % 64 == 0) { /* a line of each next panel */ \
                    AHEAD_LINE(0, WT, AHEAD) AHEAD_LINE(1, WT, AHEAD) AHEAD_LINE(2, WT, AHEAD) AHEAD_LINE(3, WT, AHEAD) \
                }                                                                                  \
                v16 w0, w1, w2, w3;                                                                \
                if (P > 0) w0 = WIDEN(w + 0 * panel + i * 16);                                     \
                if (P > 1) w1 = WIDEN(w + 1 * panel + i * 16);                                     \
                if (P > 2) w2 = WIDEN(w + 2 * panel + i * 16);                                     \
                if (P > 3) w3 = WIDEN(w + 3 * panel + i * 16);                                     \
                (void)w0; (void)w1; (void)w2; (void)w3;                                            \
                FMA_ROWS(i)                                                                        \
            }                                                                                      \
            STORE_ROWS                                                                             \
        }                                                                                          \
    }


#define DEFINE_TILES(SUFFIX, WT, WIDEN, AHEAD)                                                      \
    DEFINE_KERNEL(k1x4_##SUFFIX, 1, 4, WT, WIDEN, AHEAD)                                            \
    DEFINE_KERNEL(k2x2_##SUFFIX, 2, 2, WT, WIDEN, AHEAD)                                            \
    DEFINE_KERNEL(k3x2_##SUFFIX, 3, 2, WT, WIDEN, AHEAD)                                            \
    DEFINE_KERNEL(k1x2_##SUFFIX, 1, 2, WT, WIDEN, AHEAD)                                            \
    DEFINE_KERNEL(k1x1_##SUFFIX, 1, 1, WT, WIDEN, AHEAD)                                            \
    DEFINE_KERNEL(k2x1_##SUFFIX, 2, 1, WT, WIDEN, AHEAD)                                            \
    DEFINE_KERNEL(k3x1_##SUFFIX, 3, 1, WT, WIDEN, AHEAD)                                            \
    DEFINE_KERNEL(k4x1_##SUFFIX, 4, 1, WT, WIDEN, AHEAD)                                            \
    DEFINE_KERNEL(k5x1_##SUFFIX, 5, 1, WT, WIDEN, AHEAD)                                            \
    DEFINE_KERNEL(k6x1_##SUFFIX, 6, 1, WT, WIDEN, AHEAD)

/* prefetch distances, in elements */
#ifndef LP_AHEAD_BF16
#define LP_AHEAD_BF16 4096
#endif
#ifndef LP_AHEAD_F32
#define LP_AHEAD_F32 1024
#endif
DEFINE_TILES(bf16, uint16_t, widen_bf16, LP_AHEAD_BF16)
DEFINE_TILES(f32, float, widen_f32, LP_AHEAD_F32)

/* fp32 takes one panel at a time in groups of six and the rest (8 rows = 6 + 2). bf16 takes a rest
 * of 1-3 rows on panel pairs (eight sums, where one panel gives it four, too few to hide the FMA
 * latency), and otherwise even groups (4 + 4). */
const lp_tiles lp_tiles_f32 = {
    .one_panel = {NULL, k1x1_f32, k2x1_f32, k3x1_f32, k4x1_f32, k5x1_f32, k6x1_f32},
    .two_panels = {NULL, k1x2_f32, k2x2_f32, k3x2_f32},
    .four_panels = k1x4_f32,
    .pair_rest = 0,
    .even_groups = 0,
};

const lp_tiles lp_tiles_bf16 = {
    .one_panel = {NULL, k1x1_bf16, k2x1_bf16, k3x1_bf16, k4x1_bf16, k5x1_bf16, k6x1_bf16},
    .two_panels = {NULL, k1x2_bf16, k2x2_bf16, k3x2_bf16},
    .four_panels = k1x4_bf16,
    .pair_rest = 1,
    .even_groups = 1,
};
