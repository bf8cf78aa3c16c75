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

#if !defined(__AVX2__) || !defined(__FMA__)
#error "products_avx2.c is built with -mavx2 -mfma"
#endif

static inline void widen_bf16(const uint16_t *p, __m256 *lo, __m256 *hi) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline void widen_f32(const float *p, __m256 *lo, __m256 *hi) {
    *lo = _mm256_loadu_ps(p);
    *hi = _mm256_loadu_ps(p + 8);
}

/* R rows times P panels (R and P literal constants in every instance). The sums are named
 * variables, not an array: GCC keeps some arrays of sums in memory and stores them on every step.
 * With R > 1 and fetch, each next panel's line AHEAD elements on is prefetched once per line. */
#define DEFINE_KERNEL(NAME, R, P, WT, WIDEN, AHEAD)                                                 \
    static void NAME(const float *x, long k, long from, long to, const void *wv, long panel_bytes, float *y, long ys, \
                     int fetch) {                                                                  \
        const WT *w = (const WT *)wv;                                                              \
        const long panel = panel_bytes / (long)sizeof(WT);                                         \
        const float *x0 = x + (R > 0 ? 0 : 0) * k, *x1 = x + (R > 1 ? 1 : 0) * k, *x2 = x + (R > 2 ? 2 : 0) * k, *x3 = x + (R > 3 ? 3 : 0) * k, *x4 = x + (R > 4 ? 4 : 0) * k, *x5 = x + (R > 5 ? 5 : 0) * k; \
        for (long i0 = from; i0 < to; i0 += LP_BLOCK) {                                            \
            long i1 = i0 + LP_BLOCK < k ? i0 + LP_BLOCK : k;                                       \
            __m256 z = _mm256_setzero_ps();                                                        \
            __m256 a00l = z, a00h = z, a01l = z, a01h = z, a02l = z, a02h = z, a03l = z, a03h = z; \
            __m256 a10l = z, a10h = z, a11l = z, a11h = z, a12l = z, a12h = z, a13l = z, a13h = z; \
            __m256 a20l = z, a20h = z, a21l = z, a21h = z, a22l = z, a22h = z, a23l = z, a23h = z; \
            __m256 a30l = z, a30h = z, a31l = z, a31h = z, a32l = z, a32h = z, a33l = z, a33h = z; \
            __m256 a40l = z, a40h = z, a41l = z, a41h = z, a42l = z, a42h = z, a43l = z, a43h = z; \
            __m256 a50l = z, a50h = z, a51l = z, a51h = z, a52l = z, a52h = z, a53l = z, a53h = z; \
            for (long i = i0; i < i1; i++) {                                                       \
                __m256 wl0, wh0, wl1, wh1, wl2, wh2, wl3, wh3, b;                                   \
                if (AHEAD && R > 1 && fetch && (i * 16 * sizeof(WT)) % 64 == 0) { /* a line of each next panel */ \
                    if (P > 0) lp_prefetch((uintptr_t)w + (uintptr_t)((P + 0) * panel + i * 16 + AHEAD) * sizeof(WT)); \
                    if (P > 1) lp_prefetch((uintptr_t)w + (uintptr_t)((P + 1) * panel + i * 16 + AHEAD) * sizeof(WT)); \
                    if (P > 2) lp_prefetch((uintptr_t)w + (uintptr_t)((P + 2) * panel + i * 16 + AHEAD) * sizeof(WT)); \
                    if (P > 3) lp_prefetch((uintptr_t)w + (uintptr_t)((P + 3) * panel + i * 16 + AHEAD) * sizeof(WT)); \
                }                                                                                  \
                if (P > 0) WIDEN(w + 0 * panel + i * 16, &wl0, &wh0);   \
                if (P > 1) WIDEN(w + 1 * panel + i * 16, &wl1, &wh1);   \
                if (P > 2) WIDEN(w + 2 * panel + i * 16, &wl2, &wh2);   \
                if (P > 3) WIDEN(w + 3 * panel + i * 16, &wl3, &wh3);   \
                if (R > 0) { b = _mm256_broadcast_ss(x0 + i); if (P > 0) { a00l = _mm256_fmadd_ps(b, wl0, a00l); a00h = _mm256_fmadd_ps(b, wh0, a00h); } if (P > 1) { a01l = _mm256_fmadd_ps(b, wl1, a01l); a01h = _mm256_fmadd_ps(b, wh1, a01h); } if (P > 2) { a02l = _mm256_fmadd_ps(b, wl2, a02l); a02h = _mm256_fmadd_ps(b, wh2, a02h); } if (P > 3) { a03l = _mm256_fmadd_ps(b, wl3, a03l); a03h = _mm256_fmadd_ps(b, wh3, a03h); } } \
                if (R > 1) { b = _mm256_broadcast_ss(x1 + i); if (P > 0) { a10l = _mm256_fmadd_ps(b, wl0, a10l); a10h = _mm256_fmadd_ps(b, wh0, a10h); } if (P > 1) { a11l = _mm256_fmadd_ps(b, wl1, a11l); a11h = _mm256_fmadd_ps(b, wh1, a11h); } if (P > 2) { a12l = _mm256_fmadd_ps(b, wl2, a12l); a12h = _mm256_fmadd_ps(b, wh2, a12h); } if (P > 3) { a13l = _mm256_fmadd_ps(b, wl3, a13l); a13h = _mm256_fmadd_ps(b, wh3, a13h); } } \
                if (R > 2) { b = _mm256_broadcast_ss(x2 + i); if (P > 0) { a20l = _mm256_fmadd_ps(b, wl0, a20l); a20h = _mm256_fmadd_ps(b, wh0, a20h); } if (P > 1) { a21l = _mm256_fmadd_ps(b, wl1, a21l); a21h = _mm256_fmadd_ps(b, wh1, a21h); } if (P > 2) { a22l = _mm256_fmadd_ps(b, wl2, a22l); a22h = _mm256_fmadd_ps(b, wh2, a22h); } if (P > 3) { a23l = _mm256_fmadd_ps(b, wl3, a23l); a23h = _mm256_fmadd_ps(b, wh3, a23h); } } \
                if (R > 3) { b = _mm256_broadcast_ss(x3 + i); if (P > 0) { a30l = _mm256_fmadd_ps(b, wl0, a30l); a30h = _mm256_fmadd_ps(b, wh0, a30h); } if (P > 1) { a31l = _mm256_fmadd_ps(b, wl1, a31l); a31h = _mm256_fmadd_ps(b, wh1, a31h); } if (P > 2) { a32l = _mm256_fmadd_ps(b, wl2, a32l); a32h = _mm256_fmadd_ps(b, wh2, a32h); } if (P > 3) { a33l = _mm256_fmadd_ps(b, wl3, a33l); a33h = _mm256_fmadd_ps(b, wh3, a33h); } } \
                if (R > 4) { b = _mm256_broadcast_ss(x4 + i); if (P > 0) { a40l = _mm256_fmadd_ps(b, wl0, a40l); a40h = _mm256_fmadd_ps(b, wh0, a40h); } if (P > 1) { a41l = _mm256_fmadd_ps(b, wl1, a41l); a41h = _mm256_fmadd_ps(b, wh1, a41h); } if (P > 2) { a42l = _mm256_fmadd_ps(b, wl2, a42l); a42h = _mm256_fmadd_ps(b, wh2, a42h); } if (P > 3) { a43l = _mm256_fmadd_ps(b, wl3, a43l); a43h = _mm256_fmadd_ps(b, wh3, a43h); } } \
                if (R > 5) { b = _mm256_broadcast_ss(x5 + i); if (P > 0) { a50l = _mm256_fmadd_ps(b, wl0, a50l); a50h = _mm256_fmadd_ps(b, wh0, a50h); } if (P > 1) { a51l = _mm256_fmadd_ps(b, wl1, a51l); a51h = _mm256_fmadd_ps(b, wh1, a51h); } if (P > 2) { a52l = _mm256_fmadd_ps(b, wl2, a52l); a52h = _mm256_fmadd_ps(b, wh2, a52h); } if (P > 3) { a53l = _mm256_fmadd_ps(b, wl3, a53l); a53h = _mm256_fmadd_ps(b, wh3, a53h); } } \
            }                                                                                      \
            if (R > 0 && P > 0) _mm256_storeu_ps(y + 0 * ys + 0, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 0 * ys + 0), a00l) : a00l); \
            if (R > 0 && P > 0) _mm256_storeu_ps(y + 0 * ys + 8, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 0 * ys + 8), a00h) : a00h); \
            if (R > 0 && P > 1) _mm256_storeu_ps(y + 0 * ys + 16, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 0 * ys + 16), a01l) : a01l); \
            if (R > 0 && P > 1) _mm256_storeu_ps(y + 0 * ys + 24, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 0 * ys + 24), a01h) : a01h); \
            if (R > 0 && P > 2) _mm256_storeu_ps(y + 0 * ys + 32, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 0 * ys + 32), a02l) : a02l); \
            if (R > 0 && P > 2) _mm256_storeu_ps(y + 0 * ys + 40, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 0 * ys + 40), a02h) : a02h); \
            if (R > 0 && P > 3) _mm256_storeu_ps(y + 0 * ys + 48, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 0 * ys + 48), a03l) : a03l); \
            if (R > 0 && P > 3) _mm256_storeu_ps(y + 0 * ys + 56, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 0 * ys + 56), a03h) : a03h); \
            if (R > 1 && P > 0) _mm256_storeu_ps(y + 1 * ys + 0, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 1 * ys + 0), a10l) : a10l); \
            if (R > 1 && P > 0) _mm256_storeu_ps(y + 1 * ys + 8, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 1 * ys + 8), a10h) : a10h); \
            if (R > 1 && P > 1) _mm256_storeu_ps(y + 1 * ys + 16, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 1 * ys + 16), a11l) : a11l); \
            if (R > 1 && P > 1) _mm256_storeu_ps(y + 1 * ys + 24, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 1 * ys + 24), a11h) : a11h); \
            if (R > 1 && P > 2) _mm256_storeu_ps(y + 1 * ys + 32, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 1 * ys + 32), a12l) : a12l); \
            if (R > 1 && P > 2) _mm256_storeu_ps(y + 1 * ys + 40, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 1 * ys + 40), a12h) : a12h); \
            if (R > 1 && P > 3) _mm256_storeu_ps(y + 1 * ys + 48, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 1 * ys + 48), a13l) : a13l); \
            if (R > 1 && P > 3) _mm256_storeu_ps(y + 1 * ys + 56, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 1 * ys + 56), a13h) : a13h); \
            if (R > 2 && P > 0) _mm256_storeu_ps(y + 2 * ys + 0, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 2 * ys + 0), a20l) : a20l); \
            if (R > 2 && P > 0) _mm256_storeu_ps(y + 2 * ys + 8, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 2 * ys + 8), a20h) : a20h); \
            if (R > 2 && P > 1) _mm256_storeu_ps(y + 2 * ys + 16, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 2 * ys + 16), a21l) : a21l); \
            if (R > 2 && P > 1) _mm256_storeu_ps(y + 2 * ys + 24, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 2 * ys + 24), a21h) : a21h); \
            if (R > 2 && P > 2) _mm256_storeu_ps(y + 2 * ys + 32, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 2 * ys + 32), a22l) : a22l); \
            if (R > 2 && P > 2) _mm256_storeu_ps(y + 2 * ys + 40, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 2 * ys + 40), a22h) : a22h); \
            if (R > 2 && P > 3) _mm256_storeu_ps(y + 2 * ys + 48, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 2 * ys + 48), a23l) : a23l); \
            if (R > 2 && P > 3) _mm256_storeu_ps(y + 2 * ys + 56, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 2 * ys + 56), a23h) : a23h); \
            if (R > 3 && P > 0) _mm256_storeu_ps(y + 3 * ys + 0, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 3 * ys + 0), a30l) : a30l); \
            if (R > 3 && P > 0) _mm256_storeu_ps(y + 3 * ys + 8, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 3 * ys + 8), a30h) : a30h); \
            if (R > 3 && P > 1) _mm256_storeu_ps(y + 3 * ys + 16, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 3 * ys + 16), a31l) : a31l); \
            if (R > 3 && P > 1) _mm256_storeu_ps(y + 3 * ys + 24, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 3 * ys + 24), a31h) : a31h); \
            if (R > 3 && P > 2) _mm256_storeu_ps(y + 3 * ys + 32, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 3 * ys + 32), a32l) : a32l); \
            if (R > 3 && P > 2) _mm256_storeu_ps(y + 3 * ys + 40, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 3 * ys + 40), a32h) : a32h); \
            if (R > 3 && P > 3) _mm256_storeu_ps(y + 3 * ys + 48, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 3 * ys + 48), a33l) : a33l); \
            if (R > 3 && P > 3) _mm256_storeu_ps(y + 3 * ys + 56, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 3 * ys + 56), a33h) : a33h); \
            if (R > 4 && P > 0) _mm256_storeu_ps(y + 4 * ys + 0, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 4 * ys + 0), a40l) : a40l); \
            if (R > 4 && P > 0) _mm256_storeu_ps(y + 4 * ys + 8, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 4 * ys + 8), a40h) : a40h); \
            if (R > 4 && P > 1) _mm256_storeu_ps(y + 4 * ys + 16, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 4 * ys + 16), a41l) : a41l); \
            if (R > 4 && P > 1) _mm256_storeu_ps(y + 4 * ys + 24, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 4 * ys + 24), a41h) : a41h); \
            if (R > 4 && P > 2) _mm256_storeu_ps(y + 4 * ys + 32, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 4 * ys + 32), a42l) : a42l); \
            if (R > 4 && P > 2) _mm256_storeu_ps(y + 4 * ys + 40, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 4 * ys + 40), a42h) : a42h); \
            if (R > 4 && P > 3) _mm256_storeu_ps(y + 4 * ys + 48, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 4 * ys + 48), a43l) : a43l); \
            if (R > 4 && P > 3) _mm256_storeu_ps(y + 4 * ys + 56, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 4 * ys + 56), a43h) : a43h); \
            if (R > 5 && P > 0) _mm256_storeu_ps(y + 5 * ys + 0, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 5 * ys + 0), a50l) : a50l); \
            if (R > 5 && P > 0) _mm256_storeu_ps(y + 5 * ys + 8, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 5 * ys + 8), a50h) : a50h); \
            if (R > 5 && P > 1) _mm256_storeu_ps(y + 5 * ys + 16, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 5 * ys + 16), a51l) : a51l); \
            if (R > 5 && P > 1) _mm256_storeu_ps(y + 5 * ys + 24, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 5 * ys + 24), a51h) : a51h); \
            if (R > 5 && P > 2) _mm256_storeu_ps(y + 5 * ys + 32, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 5 * ys + 32), a52l) : a52l); \
            if (R > 5 && P > 2) _mm256_storeu_ps(y + 5 * ys + 40, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 5 * ys + 40), a52h) : a52h); \
            if (R > 5 && P > 3) _mm256_storeu_ps(y + 5 * ys + 48, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 5 * ys + 48), a53l) : a53l); \
            if (R > 5 && P > 3) _mm256_storeu_ps(y + 5 * ys + 56, i0 ? _mm256_add_ps(_mm256_loadu_ps(y + 5 * ys + 56), a53h) : a53h); \
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
