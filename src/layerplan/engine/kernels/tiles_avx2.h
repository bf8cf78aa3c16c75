/* The register tiles of the AVX2 products: R rows x 16 P outputs of fp32 sums, kept in registers
 * as named variables a<r><p>l / a<r><p>h (row r, panel p, outputs 0-7 / 8-15), not an array: GCC
 * keeps some arrays of sums in memory and stores them on every step. products_avx2.c (fp32 and
 * bf16 panels) and products_quant_avx2.c (the block formats) build their tiles from these.
 *
 * A tile's body defines R and P (enum constants, R <= 6, P <= 4), x0..x5 (its rows' inputs),
 * w0..w3 (v16: one input's 16 weights of each panel, widened to fp32), y and ys (its outputs), and
 * i0 (the first input of its block of LP_BLOCK: a block's sums are stored, or added to the sums of
 * the blocks before it, in order: the block rule of common.h). */
#ifndef LP_TILES_AVX2_H
#define LP_TILES_AVX2_H

#include <immintrin.h>

/* the 16 rows' fp32 weights of one input */
typedef struct {
    __m256 lo, hi;
} v16;

#define ZERO_ROW(r) __m256 a##r##0l = z, a##r##0h = z, a##r##1l = z, a##r##1h = z, a##r##2l = z, a##r##2h = z, a##r##3l = z, a##r##3h = z;
#define ZERO_ROWS                                                                                  \
    __m256 z = _mm256_setzero_ps();                                                                \
    ZERO_ROW(0) ZERO_ROW(1) ZERO_ROW(2) ZERO_ROW(3) ZERO_ROW(4) ZERO_ROW(5)

/* row r's sums += its input I times each panel's weights */
#define FMA_ROW(r, XR, I)                                                                          \
    if (R > r) {                                                                                   \
        __m256 b = _mm256_broadcast_ss((XR) + (I));                                                \
        if (P > 0) { a##r##0l = _mm256_fmadd_ps(b, w0.lo, a##r##0l); a##r##0h = _mm256_fmadd_ps(b, w0.hi, a##r##0h); } \
        if (P > 1) { a##r##1l = _mm256_fmadd_ps(b, w1.lo, a##r##1l); a##r##1h = _mm256_fmadd_ps(b, w1.hi, a##r##1h); } \
        if (P > 2) { a##r##2l = _mm256_fmadd_ps(b, w2.lo, a##r##2l); a##r##2h = _mm256_fmadd_ps(b, w2.hi, a##r##2h); } \
        if (P > 3) { a##r##3l = _mm256_fmadd_ps(b, w3.lo, a##r##3l); a##r##3h = _mm256_fmadd_ps(b, w3.hi, a##r##3h); } \
    }
#define FMA_ROWS(I)                                                                                \
    FMA_ROW(0, x0, I) FMA_ROW(1, x1, I) FMA_ROW(2, x2, I) FMA_ROW(3, x3, I) FMA_ROW(4, x4, I) FMA_ROW(5, x5, I)

#define STORE_ONE(r, p)                                                                            \
    if (R > r && P > p) {                                                                          \
        float *o = y + r * ys + 16 * p;                                                            \
        _mm256_storeu_ps(o, i0 ? _mm256_add_ps(_mm256_loadu_ps(o), a##r##p##l) : a##r##p##l);     \
        _mm256_storeu_ps(o + 8, i0 ? _mm256_add_ps(_mm256_loadu_ps(o + 8), a##r##p##h) : a##r##p##h); \
    }
#define STORE_ROW(r) STORE_ONE(r, 0) STORE_ONE(r, 1) STORE_ONE(r, 2) STORE_ONE(r, 3)
#define STORE_ROWS STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5)

/* the rows' inputs, x0 .. x5 (rows beyond R alias row 0 and are never read) */
#define ROW_INPUTS(x, k)                                                                           \
    const float *x0 = (x), *x1 = (x) + (R > 1 ? 1 : 0) * (k), *x2 = (x) + (R > 2 ? 2 : 0) * (k),   \
                *x3 = (x) + (R > 3 ? 3 : 0) * (k), *x4 = (x) + (R > 4 ? 4 : 0) * (k),                  \
                *x5 = (x) + (R > 5 ? 5 : 0) * (k);                                                   \
    (void)x1; (void)x2; (void)x3; (void)x4; (void)x5;

#endif
