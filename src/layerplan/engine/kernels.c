/* layerplan's native CPU kernels (AVX2 + FMA), built on first use by engine/native.py.
 *
 * Why: on CPUs without bf16 instructions a bf16 matrix product in PyTorch costs linearly in its
 * rows, and an fp32 one is far from flat too, so verifying 8 drafted tokens cost 4x a decoding
 * step. Decoding is memory-bound: every weight is read once per pass, whatever the number of
 * rows. These kernels read each weight tile once and apply it to every row of the pass from
 * registers, so a k-token pass costs about one weight read.
 *
 * Batch invariance: every output element is reduced in the same order (8-wide lanes over k,
 * then a fixed horizontal sum, then the tail) whatever the number of rows, so a row computed
 * inside a k-token pass is bit-identical to the same row computed alone.
 */
#define _DEFAULT_SOURCE /* madvise */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#include <sys/mman.h>

/* Scratch for `count` floats, starting on a 64-byte line. A product's rows of sums are stored and
 * read back in 32-byte halves of 64-byte panels, and where malloc's 16-byte alignment put them
 * across two lines, 8-row products on weights in cache ran 1.3x slower (AVX2 EPYC, one thread,
 * lp_product_rate with malloc'd rows). The engine's passes were no faster for it (engine_ab.py):
 * their buffers had fallen on whole lines; now they cannot fall otherwise. */
static float *floats(long count) {
    return (float *)aligned_alloc(64, (size_t)((count * (long)sizeof(float) + 63) / 64 * 64));
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline __m256 load8_bf16(const uint16_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* exp on eight lanes (Cephes' expf: range reduction by ln 2, degree-5 polynomial; within 2 ulp
 * of expf), for the SiLU of an MLP: the scalar expf was a tenth of an 8-token pass. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

/* ----- matrix products: y[m, n] = x[m, :] . w[n, :] + bias[n] -----
 * Weights are used in a packed copy made once per model (lp_pack): panels of 16 output rows,
 * stored input-major (for each input i, the 16 weights of the panel), zero-padded to whole panels.
 * A kernel keeps an R-rows x 16P-outputs block of sums in registers and, for each input i,
 * broadcasts x[r][i] against the panel's 16 weights: no horizontal sums, every weight loaded once
 * per row group, and enough independent sums to keep both FMA units busy.
 * bf16 panels are stored with outputs 0-7 in the low and 8-15 in the high halves of the eight
 * 32-bit words ([0, 8, 1, 9, ...]): a shift by 16 widens the low ones to fp32 and a mask keeps the
 * high ones (one shift and one AND, which any vector pipe runs, where two unpacks both needed the
 * shuffle pipes: bf16 products 1-15% faster on the AVX2 EPYC, measured alternating builds).
 *
 * Batch invariance: every output is reduced in one order whatever the tile shape, the number of
 * rows or the thread that computes it: a chain of FMAs over each block of LP_BLOCK inputs in
 * order, the blocks' sums added in order. (Blocks keep the rounding error near that of PyTorch's
 * blocked sums; one chain over all 1536 inputs of an MLP down-projection drifted 1e-4 from
 * transformers' fp32 logits.) */
static inline void widen_bf16(const uint16_t *p, __m256 *lo, __m256 *hi) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline void widen_f32(const float *p, __m256 *lo, __m256 *hi) {
    *lo = _mm256_loadu_ps(p);
    *hi = _mm256_loadu_ps(p + 8);
}

/* R rows (x: rows of k floats) times P panels (w: the first panel, `panel` elements apart) into
 * y (row stride ys). R and P are literal constants in every instance; the sums are named
 * variables, not an array, because GCC keeps some arrays of sums in memory and stores them on
 * every step (measured: half the speed). */
#define DEFINE_KERNEL(NAME, R, P, WT, WIDEN, AHEAD)                                                 \
    static void NAME(const float *x, long k, long from, long to, const WT *w, long panel, float *y, long ys, int fetch) { \
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
                    if (P > 0) _mm_prefetch((const char *)(w + (P + 0) * panel + i * 16 + AHEAD), LP_HINT); \
                    if (P > 1) _mm_prefetch((const char *)(w + (P + 1) * panel + i * 16 + AHEAD), LP_HINT); \
                    if (P > 2) _mm_prefetch((const char *)(w + (P + 2) * panel + i * 16 + AHEAD), LP_HINT); \
                    if (P > 3) _mm_prefetch((const char *)(w + (P + 3) * panel + i * 16 + AHEAD), LP_HINT); \
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

#define DEFINE_KERNELS(SUFFIX, WT, WIDEN, AHEAD)                                                    \
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
#ifndef LP_BLOCK
#define LP_BLOCK 64
#endif
#ifndef LP_HINT
#define LP_HINT _MM_HINT_T0
#endif
#ifndef LP_AHEAD_BF16
#define LP_AHEAD_BF16 4096
#endif
#ifndef LP_AHEAD_F32
#define LP_AHEAD_F32 1024
#endif
DEFINE_KERNELS(bf16, uint16_t, widen_bf16, LP_AHEAD_BF16)
DEFINE_KERNELS(f32, float, widen_f32, LP_AHEAD_F32)

/* A packed weight matrix (see lp_pack) and its bias in fp32 (NULL = none). */
typedef struct {
    const void *w;
    const float *bias;
    long n, k;
    int bf16;
} lp_matrix;

/* Panels [p0, p1) of the product for the m rows of x into y (row stride ys, panel p at column
 * 16p): a decoding step or a short verify takes several panels per call, longer passes one panel
 * at a time with the rows in even groups of at most six. With several groups, every group works
 * through a block of LP_BLOCK inputs before the next block, so the block's weights come from
 * memory once and from L1 for the other groups, and only the first group prefetches (measured on
 * the AVX2 EPYC, LM head: 7 rows 15% and 8 rows 2% faster than each group walking the whole panel).
 * Rows go in groups of six (twelve sums: both FMA units busy while the weights stream in) and the
 * rest. fp32 takes one panel at a time (8 rows = 6 + 2, faster than 4 + 4). In bf16 a rest of 1-3
 * rows takes two panels at once (k2x2: eight sums, where one panel gives it four, too few to hide
 * the FMA latency), after the six-row groups went through both; a larger rest, or a last unpaired
 * panel, goes one panel at a time in even groups (bf16 6 + 2 on single panels was slower than
 * 4 + 4). Measured on the AVX2 EPYC, alternating builds in both orders: bf16 8 rows over panel
 * pairs 1-10% faster than 4 + 4; the same pairing in fp32 no faster than 6 + 2 on single panels. */
#define RUN_PANELS(SUFFIX, WT)                                                                      \
    {                                                                                               \
        const WT *w = (const WT *)mat->w;                                                           \
        long p = p0, step = groups > 1 ? LP_BLOCK : k;                                              \
        if (m <= 3) {                                                                               \
            long group = m == 1 ? 4 : 2;                                                            \
            for (; p + group <= p1; p += group) {                                                   \
                if (m == 1) k1x4_##SUFFIX(x, k, 0, k, w + p * panel, panel, y + p * 16, ys, 1);     \
                else if (m == 2) k2x2_##SUFFIX(x, k, 0, k, w + p * panel, panel, y + p * 16, ys, 1); \
                else k3x2_##SUFFIX(x, k, 0, k, w + p * panel, panel, y + p * 16, ys, 1);            \
            }                                                                                       \
        }                                                                                           \
        long rest = m - 6 * (groups - 1); /* the rows left after groups of six */                   \
        if (bf16 && groups > 1 && rest <= 3)                                                        \
            for (; p + 2 <= p1; p += 2)                                                             \
                for (long i0 = 0; i0 < k; i0 += step) {                                             \
                    long i1 = i0 + step;                                                            \
                    for (long g = 0; g < groups - 1; g++)                                           \
                        for (long q = p; q < p + 2; q++)                                            \
                            k6x1_##SUFFIX(x + 6 * g * k, k, i0, i1, w + q * panel, panel, y + 6 * g * ys + q * 16, ys, g == 0); \
                    const float *xr = x + 6 * (groups - 1) * k;                                     \
                    float *yr = y + 6 * (groups - 1) * ys + p * 16;                                 \
                    if (rest == 1) k1x2_##SUFFIX(xr, k, i0, i1, w + p * panel, panel, yr, ys, 0);   \
                    else if (rest == 2) k2x2_##SUFFIX(xr, k, i0, i1, w + p * panel, panel, yr, ys, 0); \
                    else k3x2_##SUFFIX(xr, k, i0, i1, w + p * panel, panel, yr, ys, 0);             \
                }                                                                                   \
        for (; p < p1; p++)                                                                         \
            for (long i0 = 0; i0 < k; i0 += step)                                                   \
                for (long r0 = 0, g = 0, i1 = i0 + step; r0 < m; g++) {                             \
                    long nr = bf16 ? m / groups + (g < m % groups) : g < groups - 1 ? 6 : m - 6 * g; \
                    const float *xr = x + r0 * k;                                                   \
                    float *yr = y + r0 * ys + p * 16;                                               \
                    const WT *wp = w + p * panel;                                                   \
                    switch (nr) {                                                                   \
                    case 1: k1x1_##SUFFIX(xr, k, i0, i1, wp, panel, yr, ys, g == 0); break;         \
                    case 2: k2x1_##SUFFIX(xr, k, i0, i1, wp, panel, yr, ys, g == 0); break;         \
                    case 3: k3x1_##SUFFIX(xr, k, i0, i1, wp, panel, yr, ys, g == 0); break;         \
                    case 4: k4x1_##SUFFIX(xr, k, i0, i1, wp, panel, yr, ys, g == 0); break;         \
                    case 5: k5x1_##SUFFIX(xr, k, i0, i1, wp, panel, yr, ys, g == 0); break;         \
                    default: k6x1_##SUFFIX(xr, k, i0, i1, wp, panel, yr, ys, g == 0); break;        \
                    }                                                                               \
                    r0 += nr;                                                                       \
                }                                                                                   \
    }

static void gemm_panels(const lp_matrix *mat, const float *x, long m, float *y, long ys, long p0, long p1) {
    long k = mat->k, panel = 16 * k, groups = (m + 5) / 6;
    int bf16 = mat->bf16;
    if (bf16) RUN_PANELS(bf16, uint16_t)
    else RUN_PANELS(f32, float)
}

/* y (m, n) = x (m, k) . w^T + bias, parallel over panels. Each thread owns an even, contiguous run
 * of panels and walks it from its start, claiming a few panels at a time; a thread done with its
 * own run takes half of what is left of the fullest other run, from that run's end. So a thread
 * slowed down (by the host, or by the other's memory traffic) does not leave the other waiting at
 * the end of every product, and each thread still reads long runs of consecutive panels, which
 * the prefetchers need. (Measured on the AVX2 EPYC: summed over an 8-token fp32 pass, a thread
 * waited 5.0 ms for the other at the ends of products with a fixed even split, 1.8 ms with this;
 * alternating aligned builds in both orders, 8-row products up to 5% and one-row products 6%
 * faster. Handing out small chunks in turn from one counter, which interleaves the threads'
 * panels, made passes 13-16% slower.) Which thread computes a panel does not change its numbers
 * (see the kernels). */
typedef struct {
    _Alignas(64) unsigned long long span; /* first panel << 32 | end panel, of one thread's run */
} lp_run;

/* Claims panels [*from, *to) of run r, from its start (its owner: `take` panels, one at a time once
 * fewer than 2 x take are left) or from its end (another thread: half of what is left, at least
 * one panel); 0 when the run is empty. Small claims at the end keep the two threads' last panels,
 * and so their ends, close together. */
static int claim(lp_run *r, long take, int from_end, long *from, long *to) {
    unsigned long long span = __atomic_load_n(&r->span, __ATOMIC_ACQUIRE);
    for (;;) {
        long first = (long)(span >> 32), end = (long)(span & 0xffffffffu), left = end - first;
        if (first >= end) return 0;
        long n = from_end ? (left / 2 > 1 ? left / 2 : 1) : (left >= 2 * take ? take : 1);
        unsigned long long rest = from_end ? (unsigned long long)first << 32 | (unsigned long long)(end - n)
                                           : (unsigned long long)(first + n) << 32 | (unsigned long long)end;
        if (__atomic_compare_exchange_n(&r->span, &span, rest, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *from = from_end ? end - n : first;
            *to = from_end ? end : first + n;
            return 1;
        }
    }
}

static void gemm(const lp_matrix *mat, const float *x, long m, float *y, int threads) {
    long n = mat->n, whole = n / 16, panels = (n + 15) / 16;
    if (m <= 0) return; /* the kernels for few rows would read rows that are not there */
    if (threads < 1) threads = 1;
    if (panels < 2L * threads) threads = 1; /* too little work to share */
    /* the panels the kernels for few rows take at once (k1x4; k2x2 and k3x2, and bf16's pairs) */
    long grain = m == 1 ? 4 : 2;
    lp_run *runs = (lp_run *)aligned_alloc(64, sizeof(lp_run) * threads);
    for (int t = 0; t < threads; t++) {
        long first = whole * t / threads / grain * grain, end = t == threads - 1 ? whole : whole * (t + 1) / threads / grain * grain;
        runs[t].span = (unsigned long long)first << 32 | (unsigned long long)end;
    }
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long from, to;
        if (nt != threads) { /* fewer threads than asked: an even static split */
            gemm_panels(mat, x, m, y, n, whole * t / nt, whole * (t + 1) / nt);
        } else {
            while (claim(&runs[t], grain, 0, &from, &to)) gemm_panels(mat, x, m, y, n, from, to);
            for (;;) {
                int fullest = -1;
                long most = 0;
                for (int r = 0; r < nt; r++) {
                    unsigned long long span = __atomic_load_n(&runs[r].span, __ATOMIC_ACQUIRE);
                    long left = (long)(span & 0xffffffffu) - (long)(span >> 32);
                    if (left > most) { most = left; fullest = r; }
                }
                if (fullest < 0) break;
                if (claim(&runs[fullest], grain, 1, &from, &to)) gemm_panels(mat, x, m, y, n, from, to);
            }
        }
        if (whole < panels && t == nt - 1) {
            float *tail = floats(m * 16);
            gemm_panels(mat, x, m, tail - whole * 16, 16, whole, panels);
            for (long r = 0; r < m; r++) memcpy(y + r * n + whole * 16, tail + r * 16, sizeof(float) * (n - whole * 16));
            free(tail);
        }
    }
    free(runs);
    if (mat->bias)
        for (long r = 0; r < m; r++)
            for (long j = 0; j < n; j++) y[r * n + j] += mat->bias[j];
}

/* Asks the kernel to back [p, p + bytes) with 2 MB pages (p 2 MB-aligned, not yet touched): the
 * packed weights stream through the products once per pass, and on 4 KB pages every 64 cache
 * lines cost a TLB miss and the end of the hardware prefetchers' streams. Where the system gives
 * none, the memory stays on 4 KB pages and nothing else changes. */
void lp_advise_huge_pages(void *p, long bytes) {
#ifdef MADV_HUGEPAGE
    madvise(p, (size_t)bytes, MADV_HUGEPAGE);
#else
    (void)p; (void)bytes;
#endif
}

/* Packs w (n, k), fp32 or bf16, for gemm: out holds 16 * ceil(n / 16) * k elements of w's type. */
void lp_pack(const void *w, int bf16, long n, long k, void *out) {
    static const int lane[16] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15}; /* see widen_bf16 */
    long panels = (n + 15) / 16;
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++)
        for (long i = 0; i < k; i++)
            for (int j = 0; j < 16; j++) {
                long row = p * 16 + (bf16 ? lane[j] : j), at = (p * k + i) * 16 + j;
                if (bf16) ((uint16_t *)out)[at] = row < n ? ((const uint16_t *)w)[row * k + i] : 0;
                else ((float *)out)[at] = row < n ? ((const float *)w)[row * k + i] : 0.0f;
            }
}

/* ----- the machine's ceilings, measured for `layerplan probe` -----
 * A pass's products cannot run faster than these kernels do on weights already in cache, nor read
 * the weights faster than memory gives them; the probe measures both between its timings (on a
 * shared host both move from one second to the next) and prints the cost of a k-token pass they
 * allow. The arithmetic is timed with the products' own kernels rather than a loop of FMAs alone,
 * which promises more than products get: on the AVX2 EPYC, two threads of bare FMAs ran at a
 * median 195-197 GFLOP/s and two threads of 8-row bf16 products on weights in cache at 128-132
 * (benchmarks/ceilings.c, three runs). */

static void *prepare_product(int bf16, long n, long k) {
    size_t es = bf16 ? 2 : 4;
    void *raw = malloc(es * n * k), *packed = aligned_alloc(64, es * n * k);
    for (long i = 0; i < n * k; i++) { /* small values of both signs: no overflow, no denormals */
        float v = (float)((i * 7919) % 2001 - 1000) * 1e-4f;
        if (bf16) ((uint16_t *)raw)[i] = f32_to_bf16(v); else ((float *)raw)[i] = v;
    }
    lp_pack(raw, bf16, n, k, packed);
    free(raw);
    return packed;
}

/* GFLOP/s of `rounds` 8-row products (the verify pass's shape) on `threads` threads, in the
 * model's weight type, on a matrix small enough to stay in the threads' L2 caches. */
double lp_product_rate(int bf16, int threads, long rounds) {
    long k = 576, n = bf16 ? 512 : 256, m = 8; /* 576 KB of bf16 or fp32 weights */
    void *packed = prepare_product(bf16, n, k);
    lp_matrix mat = {packed, NULL, n, k, bf16};
    float *x = (float *)aligned_alloc(64, sizeof(float) * m * k), *y = (float *)aligned_alloc(64, sizeof(float) * m * n);
    for (long i = 0; i < m * k; i++) x[i] = (float)(i % 17) * 0.01f;
    gemm(&mat, x, m, y, threads); /* brings the weights into the caches */
    double start = omp_get_wtime();
    for (long r = 0; r < rounds; r++) gemm(&mat, x, m, y, threads);
    double seconds = omp_get_wtime() - start;
    free(x); free(y); free(packed);
    return seconds > 0 ? 2.0 * m * n * k * rounds / seconds / 1e9 : 0.0;
}

/* GB/s of reading [p, p + bytes) once on `threads` threads (bytes far larger than the last-level
 * cache). Each thread reads its slice as four streams at once, as a step's products read four
 * panels: one stream a thread read 15-20 GB/s where four read 19-27 in alternated runs. */
double lp_read_rate(const void *p, long bytes, int threads) {
    const char *base = (const char *)p;
    double start = omp_get_wtime();
    float sink = 0.0f;
    long read = 0;
    #pragma omp parallel num_threads(threads) reduction(+ : sink, read)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long from = bytes / nt * t, quarter = bytes / nt / 4 / 64 * 64;
        const char *a = base + from, *b = a + quarter, *c = b + quarter, *d = c + quarter;
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (long i = 0; i < quarter; i += 64) {
            s0 = _mm256_add_ps(s0, _mm256_add_ps(_mm256_loadu_ps((const float *)(a + i)), _mm256_loadu_ps((const float *)(a + i + 32))));
            s1 = _mm256_add_ps(s1, _mm256_add_ps(_mm256_loadu_ps((const float *)(b + i)), _mm256_loadu_ps((const float *)(b + i + 32))));
            s2 = _mm256_add_ps(s2, _mm256_add_ps(_mm256_loadu_ps((const float *)(c + i)), _mm256_loadu_ps((const float *)(c + i + 32))));
            s3 = _mm256_add_ps(s3, _mm256_add_ps(_mm256_loadu_ps((const float *)(d + i)), _mm256_loadu_ps((const float *)(d + i + 32))));
        }
        sink += _mm256_cvtss_f32(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
        read += 4 * quarter;
    }
    double seconds = omp_get_wtime() - start;
    volatile float keep = sink; /* the sums are used, or the compiler would drop the loop */
    (void)keep;
    return seconds > 0 ? read / seconds / 1e9 : 0.0;
}

/* Per-row work on eight lanes at a time (norms, RoPE, rounding, residuals, bf16 loads and stores):
 * each lane computes what the scalar code computes, bit for bit (the same operations in the same
 * order, no fused multiply-adds: -std=c11 keeps GCC from contracting the scalar ones), and the
 * scalar code finishes what is left of a row. (An 8-token bf16 pass spent 2.9 ms of 31 in this
 * work, scalar, against 1.2 ms in fp32, on the AVX2 EPYC.) */

/* rnd() on eight lanes: bf16_to_f32(f32_to_bf16(v)), NaNs included. */
static inline __m256 rnd8_exact(__m256 v) {
    __m256i u = _mm256_castps_si256(v), high = _mm256_set1_epi32((int)0xffff0000u);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), high);
    __m256i quiet = _mm256_or_si256(_mm256_and_si256(u, high), _mm256_set1_epi32(0x00400000)); /* f32_to_bf16's NaN */
    return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

/* f32_to_bf16 on eight lanes */
static inline __m128i to_bf16_8(__m256 v) {
    __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(rnd8_exact(v)), 16); /* 0 .. 0xffff */
    return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}

static inline __m256 load8(const void *p, int bf16, long i) {
    return bf16 ? load8_bf16((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

static void load_f32(const void *src, int bf16, float *dst, long count) {
    if (!bf16) { memcpy(dst, src, sizeof(float) * count); return; }
    long i = 0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(dst + i, load8_bf16((const uint16_t *)src + i));
    for (; i < count; i++) dst[i] = bf16_to_f32(((const uint16_t *)src)[i]);
}

static void store(const float *src, void *dst, int bf16, long count) {
    if (!bf16) { memcpy(dst, src, sizeof(float) * count); return; }
    long i = 0;
    for (; i + 8 <= count; i += 8) _mm_storeu_si128((__m128i *)((uint16_t *)dst + i), to_bf16_8(_mm256_loadu_ps(src + i)));
    for (; i < count; i++) ((uint16_t *)dst)[i] = f32_to_bf16(src[i]);
}

/* Round in place to the model's precision: what a PyTorch op in that dtype would have stored. */
static inline float rnd(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }
static inline __m256 rnd8(__m256 v, int bf16) { return bf16 ? rnd8_exact(v) : v; }
static void round_all(float *v, long count, int bf16) {
    if (!bf16) return;
    long i = 0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(v + i, rnd8_exact(_mm256_loadu_ps(v + i)));
    for (; i < count; i++) v[i] = rnd(v[i], 1);
}

static inline float param(const void *p, int bf16, long i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* out[0 : 8 lanes] = sum over kept positions, in order, of scores[q] * v[first + q] (8-lane groups
 * of the row from v, rows `stride` apart); with `more`, the sums go on from those in out (a run of
 * positions after the ones already summed there: the same chain of FMAs, stopped and resumed). The
 * sums are named variables, not an array: GCC kept an array of them on the stack, storing and
 * loading them at every position (seen in the profile of an 8-token pass, whose attention was a
 * tenth of its time). */
#define DEFINE_WEIGH(NAME, WT, LOAD8)                                                              \
    static void NAME(const float *scores, const unsigned char *keep, const WT *v, long stride, long first, long n, \
                     long lanes, float *out, int more) {                                           \
        __m256 z = _mm256_setzero_ps(), a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z; \
        if (more) {                                                                                \
            if (lanes > 0) a0 = _mm256_loadu_ps(out);                                              \
            if (lanes > 1) a1 = _mm256_loadu_ps(out + 8);                                          \
            if (lanes > 2) a2 = _mm256_loadu_ps(out + 16);                                         \
            if (lanes > 3) a3 = _mm256_loadu_ps(out + 24);                                         \
            if (lanes > 4) a4 = _mm256_loadu_ps(out + 32);                                         \
            if (lanes > 5) a5 = _mm256_loadu_ps(out + 40);                                         \
            if (lanes > 6) a6 = _mm256_loadu_ps(out + 48);                                         \
            if (lanes > 7) a7 = _mm256_loadu_ps(out + 56);                                         \
        }                                                                                          \
        for (long q = 0; q < n; q++) {                                                             \
            if (keep && !keep[q]) continue;                                                        \
            __m256 e = _mm256_set1_ps(scores[q]);                                                  \
            const WT *row = v + (first + q) * stride;                                              \
            if (lanes == 8) {                                                                      \
                a0 = _mm256_fmadd_ps(e, LOAD8(row), a0); a1 = _mm256_fmadd_ps(e, LOAD8(row + 8), a1); \
                a2 = _mm256_fmadd_ps(e, LOAD8(row + 16), a2); a3 = _mm256_fmadd_ps(e, LOAD8(row + 24), a3); \
                a4 = _mm256_fmadd_ps(e, LOAD8(row + 32), a4); a5 = _mm256_fmadd_ps(e, LOAD8(row + 40), a5); \
                a6 = _mm256_fmadd_ps(e, LOAD8(row + 48), a6); a7 = _mm256_fmadd_ps(e, LOAD8(row + 56), a7); \
            } else {                                                                               \
                if (lanes > 0) a0 = _mm256_fmadd_ps(e, LOAD8(row), a0);                            \
                if (lanes > 1) a1 = _mm256_fmadd_ps(e, LOAD8(row + 8), a1);                        \
                if (lanes > 2) a2 = _mm256_fmadd_ps(e, LOAD8(row + 16), a2);                       \
                if (lanes > 3) a3 = _mm256_fmadd_ps(e, LOAD8(row + 24), a3);                       \
                if (lanes > 4) a4 = _mm256_fmadd_ps(e, LOAD8(row + 32), a4);                       \
                if (lanes > 5) a5 = _mm256_fmadd_ps(e, LOAD8(row + 40), a5);                       \
                if (lanes > 6) a6 = _mm256_fmadd_ps(e, LOAD8(row + 48), a6);                       \
            }                                                                                      \
        }                                                                                          \
        if (lanes > 0) _mm256_storeu_ps(out, a0);                                                  \
        if (lanes > 1) _mm256_storeu_ps(out + 8, a1);                                              \
        if (lanes > 2) _mm256_storeu_ps(out + 16, a2);                                             \
        if (lanes > 3) _mm256_storeu_ps(out + 24, a3);                                             \
        if (lanes > 4) _mm256_storeu_ps(out + 32, a4);                                             \
        if (lanes > 5) _mm256_storeu_ps(out + 40, a5);                                             \
        if (lanes > 6) _mm256_storeu_ps(out + 48, a6);                                             \
        if (lanes > 7) _mm256_storeu_ps(out + 56, a7);                                             \
    }
DEFINE_WEIGH(weigh_values_bf16, uint16_t, load8_bf16)
DEFINE_WEIGH(weigh_values_f32, float, _mm256_loadu_ps)

/* q . key for the eight cache rows r0, r0 + stride, ... (the first `valid` of them; row 0 stands in
 * for the others, whose results are not used: the cache may end before them), each summed over d in
 * one 8-lane chain, then across lanes (hsum4), then the tail in order: a key's score does not
 * depend on the rows beside it. Eight chains, not four: with four the FMA latency (4 cycles, 8
 * steps for d = 64) bounded the scores. The rows are named pointers and the dots come back in a
 * register: a table of eight row pointers, and dots stored as two halves then loaded whole (a
 * store the load cannot forward from), made an 8-token pass's attention 1.1-1.35x slower (AVX2
 * EPYC, builds alternated). */
#define DEFINE_DOT8(NAME, WT, LOAD8, PARAM)                                                         \
    static inline __m256 NAME(const float *q, const WT *r0, long stride, int valid, long d) {      \
        const WT *k0 = r0, *k1 = r0 + (valid > 1) * stride, *k2 = r0 + (valid > 2) * 2 * stride,   \
                 *k3 = r0 + (valid > 3) * 3 * stride, *k4 = r0 + (valid > 4) * 4 * stride,             \
                 *k5 = r0 + (valid > 5) * 5 * stride, *k6 = r0 + (valid > 6) * 6 * stride,             \
                 *k7 = r0 + (valid > 7) * 7 * stride;                                              \
        __m256 z = _mm256_setzero_ps(), a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z; \
        long i = 0;                                                                                \
        for (; i + 8 <= d; i += 8) {                                                               \
            __m256 qv = _mm256_loadu_ps(q + i);                                                    \
            a0 = _mm256_fmadd_ps(qv, LOAD8(k0 + i), a0); a1 = _mm256_fmadd_ps(qv, LOAD8(k1 + i), a1);   \
            a2 = _mm256_fmadd_ps(qv, LOAD8(k2 + i), a2); a3 = _mm256_fmadd_ps(qv, LOAD8(k3 + i), a3);   \
            a4 = _mm256_fmadd_ps(qv, LOAD8(k4 + i), a4); a5 = _mm256_fmadd_ps(qv, LOAD8(k5 + i), a5);   \
            a6 = _mm256_fmadd_ps(qv, LOAD8(k6 + i), a6); a7 = _mm256_fmadd_ps(qv, LOAD8(k7 + i), a7);   \
        }                                                                                          \
        __m256 dots = _mm256_insertf128_ps(_mm256_castps128_ps256(hsum4(a0, a1, a2, a3)), hsum4(a4, a5, a6, a7), 1); \
        if (i < d) { /* the dims past the last whole eight, in order */                            \
            float out[8];                                                                          \
            _mm256_storeu_ps(out, dots);                                                           \
            for (long t = i; t < d; t++) {                                                         \
                out[0] += q[t] * PARAM(k0[t]); out[1] += q[t] * PARAM(k1[t]); out[2] += q[t] * PARAM(k2[t]); \
                out[3] += q[t] * PARAM(k3[t]); out[4] += q[t] * PARAM(k4[t]); out[5] += q[t] * PARAM(k5[t]); \
                out[6] += q[t] * PARAM(k6[t]); out[7] += q[t] * PARAM(k7[t]);                      \
            }                                                                                      \
            dots = _mm256_loadu_ps(out);                                                           \
        }                                                                                          \
        return dots;                                                                               \
    }
#define AS_F32(v) (v)
DEFINE_DOT8(dot8_bf16, uint16_t, load8_bf16, bf16_to_f32)
DEFINE_DOT8(dot8_f32, float, _mm256_loadu_ps, AS_F32)

/* scores[p - first] = q . key[p] * scaling for the cache positions p in [from, to], a run of the
 * query's [first, ...] (-inf where keep[p - first] is 0; keep NULL: every one kept). Eight keys at
 * a time; a key's score does not depend on the keys beside it (dot8), so neither on where a run
 * starts or ends. A key left out is scored all the same, and its score dropped (no branch per key). */
static void score_keys(const float *q, const void *kbase, long stride, long first, long from, long to,
                       const unsigned char *keep, float scaling, int bf16, long d, float *scores) {
    for (long p = from; p <= to; p += 8) {
        int valid = to - p + 1 < 8 ? (int)(to - p + 1) : 8;
        __m256 dots = bf16 ? dot8_bf16(q, (const uint16_t *)kbase + p * stride, stride, valid, d)
                           : dot8_f32(q, (const float *)kbase + p * stride, stride, valid, d);
        if (!keep && valid == 8) { /* eight kept keys: the same products on eight lanes */
            _mm256_storeu_ps(scores + p - first, _mm256_mul_ps(dots, _mm256_set1_ps(scaling)));
            continue;
        }
        float dot[8];
        _mm256_storeu_ps(dot, dots);
        for (int j = 0; j < valid; j++) scores[p + j - first] = !keep || keep[p + j - first] ? dot[j] * scaling : -INFINITY;
    }
}

/* scores[0 : n] -> exp(score - the largest score), left unnormalised; returns their sum, added in
 * order. A NaN score is passed over by the maximum (max_ps keeps its second operand, as `>` does),
 * and which of two equal zeros is the largest does not matter (x - 0 and x + 0 are x, and
 * exp(-0) = exp(0)). */
static float exp_scores(float *scores, long n) {
    __m256 best8 = _mm256_set1_ps(-INFINITY);
    long p = 0;
    for (; p + 8 <= n; p += 8) best8 = _mm256_max_ps(_mm256_loadu_ps(scores + p), best8);
    float lanes8[8], best = -INFINITY;
    _mm256_storeu_ps(lanes8, best8);
    for (int j = 0; j < 8; j++)
        if (lanes8[j] > best) best = lanes8[j];
    for (; p < n; p++)
        if (scores[p] > best) best = scores[p];
    float total = 0.0f;
    p = 0;
    for (; p + 8 <= n; p += 8) { /* exp in lanes (every position the same way), added in order */
        __m256 sc = _mm256_loadu_ps(scores + p);
        __m256 ev = exp8(_mm256_sub_ps(sc, _mm256_set1_ps(best)));
        ev = _mm256_blendv_ps(ev, _mm256_setzero_ps(), _mm256_cmp_ps(sc, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
        float e[8];
        _mm256_storeu_ps(e, ev);
        _mm256_storeu_ps(scores + p, ev);
        for (int j = 0; j < 8; j++) total += e[j];
    }
    for (; p < n; p += 8) { /* the last, partial eight */
        float in[8], ev[8];
        for (int j = 0; j < 8; j++) in[j] = p + j < n ? scores[p + j] - best : 0.0f;
        _mm256_storeu_ps(ev, exp8(_mm256_loadu_ps(in)));
        for (int j = 0; j < 8 && p + j < n; j++) {
            float e = scores[p + j] == -INFINITY ? 0.0f : ev[j];
            scores[p + j] = e;
            total += e;
        }
    }
    return total;
}

/* One query of attend_group: its vector, its cache positions [first, last] (in the slot), which
 * of them it keeps (NULL: every one), and room for its scores (last - first + 1) and output (d). */
typedef struct {
    const float *q;
    long first, last;
    const unsigned char *keep;
    float *scores, *out;
} lp_query;

/* Queries that attend over one kv head, each softmax(q . k * scaling) . v into its out. They go
 * through the positions in runs of about 4096 cache elements: every query scores a run's keys, and
 * later weighs a run's values, while the run is in L1 (an 8-token pass of SmolLM2 has 24 queries
 * per kv head over 100+ positions: 52 KB of fp32 keys and values, more than L1 holds). Each query's
 * numbers are those of attending alone: every score is its own dot product, and every output is one
 * chain of FMAs over the positions in order, carried from run to run in out. (With dot8's named rows,
 * the attention of an 8-token pass on the AVX2 EPYC, per-phase timers, builds alternated: bf16
 * 1.83-2.18 -> 1.39-1.91 ms, fp32 1.95-2.33 -> 1.68-1.92 ms; a host that drifted, so ranges.) */
#define LP_RUN_ELEMENTS 4096
#define LP_QUERIES 32 /* queries attended together at most (their scores: 32 rows of the context) */
static void attend_group(const lp_query *qs, long count, const void *kbase, const void *vbase, long stride,
                         float scaling, int bf16, long d) {
    long lo = qs[0].first, hi = qs[0].last;
    for (long s = 1; s < count; s++) {
        if (qs[s].first < lo) lo = qs[s].first;
        if (qs[s].last > hi) hi = qs[s].last;
    }
    long run = LP_RUN_ELEMENTS / d / 8 * 8;
    if (run < 8) run = 8;
    for (long r0 = lo; r0 <= hi; r0 += run)
        for (long s = 0; s < count; s++) {
            long from = r0 > qs[s].first ? r0 : qs[s].first, to = r0 + run - 1 < qs[s].last ? r0 + run - 1 : qs[s].last;
            if (from <= to) score_keys(qs[s].q, kbase, stride, qs[s].first, from, to, qs[s].keep, scaling, bf16, d, qs[s].scores);
        }
    float totals[count];
    for (long s = 0; s < count; s++) totals[s] = exp_scores(qs[s].scores, qs[s].last - qs[s].first + 1);
    for (long r0 = lo; r0 <= hi; r0 += run)
        for (long s = 0; s < count; s++) {
            long from = r0 > qs[s].first ? r0 : qs[s].first, to = r0 + run - 1 < qs[s].last ? r0 + run - 1 : qs[s].last;
            if (from > to) continue;
            const float *sc = qs[s].scores + (from - qs[s].first);
            const unsigned char *kp = qs[s].keep ? qs[s].keep + (from - qs[s].first) : NULL;
            for (long c = 0; c < d; c += 64) { /* 64 output dims in eight registers */
                long width = d - c < 64 ? d - c : 64, lanes = width / 8;
                if (bf16) weigh_values_bf16(sc, kp, (const uint16_t *)vbase + c, stride, from, to - from + 1, lanes, qs[s].out + c, from > qs[s].first);
                else weigh_values_f32(sc, kp, (const float *)vbase + c, stride, from, to - from + 1, lanes, qs[s].out + c, from > qs[s].first);
            }
        }
    for (long s = 0; s < count; s++) {
        const lp_query *qy = qs + s;
        long n = qy->last - qy->first + 1;
        for (long c = 0; c < d; c += 64) { /* dims past the last whole eight: one scalar chain each */
            long width = d - c < 64 ? d - c : 64;
            for (long t = width / 8 * 8; t < width; t++) {
                float tail = 0.0f;
                for (long q2 = 0; q2 < n; q2++)
                    if (!qy->keep || qy->keep[q2]) tail += qy->scores[q2] * param(vbase, bf16, (qy->first + q2) * stride + c + t);
                qy->out[c + t] = tail;
            }
        }
        long i = 0;
        for (; i + 8 <= d; i += 8) _mm256_storeu_ps(qy->out + i, _mm256_div_ps(_mm256_loadu_ps(qy->out + i), _mm256_set1_ps(totals[s])));
        for (; i < d; i++) qy->out[i] /= totals[s];
    }
}

/* ----- decoder sub-layers (the llama family: RMSNorm, RoPE, grouped-query attention, gated MLP) ----- */

/* How a norm rounds, as the transformers module does it:
 *   0: weight * (normalised rounded to the dtype)       (Llama, Qwen, Mistral, Phi-3 RMSNorm)
 *   1: (offset + weight) * normalised in fp32, rounded  (Gemma RMSNorm) */
typedef struct {
    const void *weight; /* (dim,) in the model dtype; NULL = no norm */
    float eps;
    float offset;
    int mode;
} lp_norm;

typedef struct {
    long hidden, heads, kv_heads, head_dim;
    lp_norm norm, q_norm, k_norm, post_norm;
    lp_matrix qkv, o;              /* packed: q, k and v projections stacked; output projection */
    float scaling;                 /* scores = q.k * scaling */
    long window;                   /* sliding window (keys > position - window); 0 = none */
    long rotary_dim;               /* dims rotated (head_dim for full RoPE); 0 = no RoPE */
} lp_attention;

typedef struct {
    long hidden, inner;
    lp_norm norm, post_norm;
    lp_matrix gate_up, down;  /* packed: gate and up stacked (2 inner, hidden); down (hidden, inner) */
    int activation;           /* 0: SiLU, 1: GELU (tanh approximation) */
} lp_mlp;

/* The sum of v[i]^2 in double: eight double lanes in two registers, then across them, then the tail
 * (a float's square is exact in double, so a fused multiply-add rounds only the sum). One chain of
 * 576 dependent additions took 0.7 us a row, a norm of a pass's row a tenth of its per-row work. */
static double sum_squares(const float *v, long dim) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    long i = 0;
    for (; i + 8 <= dim; i += 8) {
        __m256 x = _mm256_loadu_ps(v + i);
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
        a0 = _mm256_fmadd_pd(lo, lo, a0);
        a1 = _mm256_fmadd_pd(hi, hi, a1);
    }
    double lanes[4], ss = 0.0;
    _mm256_storeu_pd(lanes, _mm256_add_pd(a0, a1));
    ss = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; i < dim; i++) ss += (double)v[i] * v[i];
    return ss;
}

/* rows x dim in place */
static void norm_rows(float *x, long rows, long dim, const lp_norm *nm, int bf16) {
    if (!nm->weight) return;
    for (long r = 0; r < rows; r++) {
        float *v = x + r * dim;
        double ss = sum_squares(v, dim);
        float inv = 1.0f / sqrtf((float)(ss / dim) + nm->eps);
        __m256 inv8 = _mm256_set1_ps(inv), offset8 = _mm256_set1_ps(nm->offset);
        long i = 0;
        for (; i + 8 <= dim; i += 8) {
            __m256 w = _mm256_add_ps(load8(nm->weight, bf16, i), offset8);
            __m256 t = _mm256_mul_ps(_mm256_loadu_ps(v + i), inv8);
            if (nm->mode == 0) t = rnd8(t, bf16);
            _mm256_storeu_ps(v + i, rnd8(_mm256_mul_ps(w, t), bf16));
        }
        for (; i < dim; i++) {
            float w = param(nm->weight, bf16, i) + nm->offset;
            if (nm->mode == 0) v[i] = rnd(w * rnd(v[i] * inv, bf16), bf16);
            else v[i] = rnd(w * (v[i] * inv), bf16);
        }
    }
}

/* q (rows, heads*head_dim), cos/sin (rows, rotary_dim) fp32: q*cos + rotate_half(q)*sin */
static void rope_rows(float *q, long rows, long heads, long head_dim, long rotary_dim, const float *cs,
                      const float *sn, int bf16) {
    long half = rotary_dim / 2;
    for (long r = 0; r < rows; r++) {
        const float *c = cs + r * rotary_dim, *s = sn + r * rotary_dim;
        for (long h = 0; h < heads; h++) {
            float *v = q + (r * heads + h) * head_dim;
            float tmp[512];
            long i = 0;
            if (half % 8 == 0)
                for (; i < rotary_dim; i += 8) {
                    __m256 rot = i < half ? _mm256_xor_ps(_mm256_loadu_ps(v + i + half), _mm256_set1_ps(-0.0f))
                                          : _mm256_loadu_ps(v + i - half);
                    __m256 a = rnd8(_mm256_mul_ps(_mm256_loadu_ps(v + i), _mm256_loadu_ps(c + i)), bf16);
                    __m256 b = rnd8(_mm256_mul_ps(rot, _mm256_loadu_ps(s + i)), bf16);
                    _mm256_storeu_ps(tmp + i, rnd8(_mm256_add_ps(a, b), bf16));
                }
            for (; i < rotary_dim; i++) {
                float rot = i < half ? -v[i + half] : v[i - half];
                tmp[i] = rnd(rnd(v[i] * c[i], bf16) + rnd(rot * s[i], bf16), bf16);
            }
            memcpy(v, tmp, sizeof(float) * rotary_dim);
        }
    }
}

/* out = hidden + scale * update, rounded as the PyTorch modules round (scratch: count floats). */
static void residual_add(const void *hidden, const float *update, float *scratch, void *out, long count,
                         float scale, int bf16) {
    load_f32(hidden, bf16, scratch, count);
    __m256 scale8 = _mm256_set1_ps(scale);
    long i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256 up = _mm256_loadu_ps(update + i);
        if (scale != 1.0f) up = rnd8(_mm256_mul_ps(scale8, up), bf16);
        _mm256_storeu_ps(scratch + i, rnd8(_mm256_add_ps(_mm256_loadu_ps(scratch + i), up), bf16));
    }
    for (; i < count; i++)
        scratch[i] = rnd(scratch[i] + (scale == 1.0f ? update[i] : rnd(scale * update[i], bf16)), bf16);
    store(scratch, out, bf16, count);
}

static inline float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* out[i] = act(gate[i]) * up[i] over n values, rounded as the PyTorch modules round. */
static void gated_activation(const float *gate, const float *up, float *out, long n, int activation, int bf16) {
    long i = 0;
    if (activation == 0)
        for (; i + 8 <= n; i += 8) {
            __m256 g = _mm256_loadu_ps(gate + i), u = _mm256_loadu_ps(up + i);
            g = rnd8(g, bf16);
            u = rnd8(u, bf16);
            __m256 act = rnd8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))), bf16);
            _mm256_storeu_ps(out + i, rnd8(_mm256_mul_ps(act, u), bf16));
        }
    for (; i < n; i++) {
        float gv = rnd(gate[i], bf16), uv = rnd(up[i], bf16);
        float act = activation == 0 ? gv / (1.0f + expf(-gv)) : gelu_tanh(gv);
        out[i] = rnd(rnd(act, bf16) * uv, bf16);
    }
}

/* y[m, n] = w[n, :] . norm(x[m, :]) + bias[n] for a packed matrix (nm NULL: no norm, else rounded
 * as x's dtype); x and y in fp32 or bf16 (their flags). */
static void norm_linear(const lp_norm *nm, const void *x, int x_bf16, const lp_matrix *w, void *y, int y_bf16,
                        long m, int threads) {
    long n = w->n, k = w->k;
    float *xf = floats(m * k);
    load_f32(x, x_bf16, xf, m * k);
    if (nm) norm_rows(xf, m, k, nm, x_bf16);
    float *yf = y_bf16 ? floats(m * n) : (float *)y;
    gemm(w, xf, m, yf, threads);
    if (y_bf16) { store(yf, y, 1, m * n); free(yf); }
    free(xf);
}

/* y[m, n] = x[m, :] . w[n, :] + bias[n] for a packed matrix; x and y in fp32 or bf16 (their flags). */
void lp_linear(const void *x, int x_bf16, const lp_matrix *w, void *y, int y_bf16, long m, int threads) {
    norm_linear(NULL, x, x_bf16, w, y, y_bf16, m, threads);
}

/* The LM head on the final norm of m rows of x (the model's dtype): y = w . norm(x), in x's dtype.
 * The norm in the kernels, as every layer's, rather than as a PyTorch module between two native
 * calls (an RMSNorm of one row took 0.3 ms there, its code and data cold after a pass). */
void lp_norm_linear(const lp_norm *nm, const void *x, const lp_matrix *w, void *y, long m, int bf16, int threads) {
    norm_linear(nm, x, bf16, w, y, bf16, m, threads);
}

/* BODY for r = 0 .. rows-1: shared among the threads when `split` (a pass), in this thread
 * otherwise (a step: even an OpenMP region of one thread costs a team's set-up, 30 layers over). */
#define EACH_ROW(split, threads, rows, ...)                                                         \
    do {                                                                                            \
        if (split) {                                                                                \
            _Pragma("omp parallel for num_threads(threads) schedule(static)")                       \
            for (long r = 0; r < (rows); r++) __VA_ARGS__                                           \
        } else {                                                                                    \
            for (long r = 0; r < (rows); r++) __VA_ARGS__                                           \
        }                                                                                           \
    } while (0)

/* One attention sub-layer on `rows` tokens at positions pos0.. (hidden and out: (rows, hidden)):
 * out = hidden + residual_scale * o_proj(attention(rope(q), rope(k), v)), with k and v written into the
 * step's cache slot (kv_heads, capacity, head_dim) at pos0.. first. The slot holds positions from
 * kv_start on (0 for a KV cache; pos0 for a pass that attends to its own tokens only).
 * keep_sink/keep_recent > 0 (single-token reads only): attend to the first keep_sink and the last
 * keep_recent positions (a windowed draft); 0 = every position.
 * tree (rows x rows, NULL = a chain): the pass's tokens are the nodes of a draft tree, row r
 * attending to row c of the pass only where tree[r * rows + c] (its ancestors and itself; the
 * caller's cos / sin give each node its position by depth). A node's result is then the one a
 * chain of its path would give, bit for bit: the same keys, summed in the same order.
 * Returns 0, or -1 when head_dim is beyond what the kernel handles or a tree meets a sliding window. */
int lp_attention_block(const lp_attention *a, const void *hidden, void *out, long rows, long pos0, const void *cos, const void *sin,
                       void *kcache, void *vcache, long capacity, long kv_start, long keep_sink, long keep_recent,
                       const unsigned char *tree, float residual_scale, int bf16, int threads) {
    long H = a->hidden, D = a->head_dim, NQ = a->heads * D, NK = a->kv_heads * D;
    if (D > 512 || a->rotary_dim > D || (tree && a->window > 0)) return -1;
    if (rows <= 0) return 0;
    float *x = floats(rows * H);
    float *qkv = floats(rows * (NQ + 2 * NK));
    float *q = floats(rows * NQ);
    float *k = floats(rows * NK);
    float *v = floats(rows * NK);
    float *o = floats(rows * NQ);
    float *u = floats(rows * H);
    long es = bf16 ? 2 : 4; /* bytes per element of hidden, out and the cache */
    int split = rows > 1 && threads > 1; /* a pass shares the per-row work too; a step keeps one thread */
    EACH_ROW(split, threads, rows, {
        load_f32((const char *)hidden + r * H * es, bf16, x + r * H, H);
        norm_rows(x + r * H, 1, H, &a->norm, bf16);
    });
    gemm(&a->qkv, x, rows, qkv, threads);
    long R = a->rotary_dim;
    EACH_ROW(split, threads, rows, {
        float *qr = q + r * NQ, *kr = k + r * NK, *vr = v + r * NK;
        const float *src = qkv + r * (NQ + 2 * NK);
        memcpy(qr, src, sizeof(float) * NQ);
        memcpy(kr, src + NQ, sizeof(float) * NK);
        memcpy(vr, src + NQ + NK, sizeof(float) * NK);
        round_all(qr, NQ, bf16);
        round_all(kr, NK, bf16);
        round_all(vr, NK, bf16);
        norm_rows(qr, a->heads, D, &a->q_norm, bf16);
        norm_rows(kr, a->kv_heads, D, &a->k_norm, bf16);
        if (R) {
            float cs[512], sn[512];
            load_f32((const char *)cos + r * R * es, bf16, cs, R);
            load_f32((const char *)sin + r * R * es, bf16, sn, R);
            rope_rows(qr, 1, a->heads, D, R, cs, sn, bf16);
            rope_rows(kr, 1, a->kv_heads, D, R, cs, sn, bf16);
        }
        for (long h = 0; h < a->kv_heads; h++) {
            long at = (h * capacity + pos0 - kv_start + r) * D;
            if (bf16) {
                store(kr + h * D, (uint16_t *)kcache + at, 1, D);
                store(vr + h * D, (uint16_t *)vcache + at, 1, D);
            } else {
                memcpy((float *)kcache + at, kr + h * D, sizeof(float) * D);
                memcpy((float *)vcache + at, vr + h * D, sizeof(float) * D);
            }
        }
    });
    long group = a->heads / a->kv_heads;
    long end = pos0 + rows;
    /* A pass's queries share each kv head's keys and values (SmolLM2, 8 rows: 24 queries per head):
     * a bf16 cache is widened to fp32 once for all of them rather than once per query (exact, so
     * the same numbers); a step (few queries per head) reads the cache as it is. */
    long span = end - kv_start;
    int widen = bf16 && group * rows >= 8;
    float *kw = widen ? floats(a->kv_heads * span * D) : NULL;
    float *vw = widen ? floats(a->kv_heads * span * D) : NULL;
    /* every (head, row) pair is one item: 9 heads over 2 threads left one thread idle a ninth of
     * the time (SmolLM2), and a pass has rows x heads items to share */
    #pragma omp parallel num_threads(threads)
    {
        if (widen) {
            #pragma omp for schedule(static)
            for (long hp = 0; hp < a->kv_heads * span; hp++) {
                long h = hp / span, at = (h * capacity + hp % span) * D;
                load_f32((const uint16_t *)kcache + at, 1, kw + hp * D, D);
                load_f32((const uint16_t *)vcache + at, 1, vw + hp * D, D);
            }
        }
        /* each thread takes an even, contiguous share of the (head, row) items, and attends to them in
         * groups that share a kv head (attend_group) */
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long items = a->heads * rows, i0 = items * t / nt, i1 = items * (t + 1) / nt;
        float *scores = floats(LP_QUERIES * (end + 8));
        unsigned char *keep = (unsigned char *)malloc(LP_QUERIES * (end + 8));
        lp_query qs[LP_QUERIES];
        for (long b0 = i0, b1; b0 < i1; b0 = b1) {
            long kh = b0 / rows / group;
            for (b1 = b0; b1 < i1 && b1 - b0 < LP_QUERIES && b1 / rows / group == kh; b1++) {
                long h = b1 / rows, r = b1 % rows, s = b1 - b0;
                long pos = pos0 + r, first = 0;
                if (a->window > 0 && pos - a->window + 1 > 0) first = pos - a->window + 1;
                if (first < kv_start) first = kv_start;
                int masked = tree || (rows == 1 && keep_recent > 0); /* else every position is kept */
                unsigned char *kp = keep + s * (end + 8);
                if (masked)
                    for (long p = first; p <= pos; p++)
                        kp[p - first] = !((rows == 1 && keep_recent > 0 && p >= keep_sink && p < end - keep_recent)
                                          || (tree && p >= pos0 && !tree[r * rows + p - pos0]));
                /* the cache holds positions from kv_start on */
                qs[s] = (lp_query){q + (r * a->heads + h) * D, first - kv_start, pos - kv_start, masked ? kp : NULL,
                                   scores + s * (end + 8), o + (r * a->heads + h) * D};
            }
            const void *kbase = widen ? (const void *)(kw + kh * span * D) : (const void *)((const char *)kcache + kh * capacity * D * es);
            const void *vbase = widen ? (const void *)(vw + kh * span * D) : (const void *)((const char *)vcache + kh * capacity * D * es);
            attend_group(qs, b1 - b0, kbase, vbase, D, a->scaling, bf16 && !widen, D);
            for (long s = 0; s < b1 - b0; s++) round_all(qs[s].out, D, bf16);
        }
        free(scores);
        free(keep);
    }
    free(kw);
    free(vw);
    gemm(&a->o, o, rows, u, threads);
    EACH_ROW(split, threads, rows, {
        round_all(u + r * H, H, bf16);
        norm_rows(u + r * H, 1, H, &a->post_norm, bf16);
        residual_add((const char *)hidden + r * H * es, u + r * H, x + r * H, (char *)out + r * H * es, H,
                     residual_scale, bf16);
    });
    free(x); free(qkv); free(q); free(k); free(v); free(o); free(u);
    return 0;
}

/* One MLP sub-layer: out = hidden + residual_scale * down(act(gate(n)) * up(n)), n = norm(hidden). */
void lp_mlp_block(const lp_mlp *m, const void *hidden, void *out, long rows, float residual_scale, int bf16, int threads) {
    long H = m->hidden, I = m->inner;
    if (rows <= 0) return;
    float *x = floats(rows * H);
    float *gu = floats(rows * 2 * I);
    float *g = floats(rows * I);
    float *d = floats(rows * H);
    long es = bf16 ? 2 : 4;
    int split = rows > 1 && threads > 1; /* a pass shares the per-row work too; a step keeps one thread */
    EACH_ROW(split, threads, rows, {
        load_f32((const char *)hidden + r * H * es, bf16, x + r * H, H);
        norm_rows(x + r * H, 1, H, &m->norm, bf16);
    });
    gemm(&m->gate_up, x, rows, gu, threads);
    EACH_ROW(split, threads, rows, { gated_activation(gu + r * 2 * I, gu + r * 2 * I + I, g + r * I, I, m->activation, bf16); });
    gemm(&m->down, g, rows, d, threads);
    EACH_ROW(split, threads, rows, {
        round_all(d + r * H, H, bf16);
        norm_rows(d + r * H, 1, H, &m->post_norm, bf16);
        residual_add((const char *)hidden + r * H * es, d + r * H, x + r * H, (char *)out + r * H * es, H,
                     residual_scale, bf16);
    });
    free(x); free(gu); free(g); free(d);
}

/* ----- a pass over a run of plan steps (the runner's loop, for steps whose sub-layers all run here) ----- */

/* One plan step: its sub-layers (NULL = off), its KV slot and its residual scale. */
typedef struct {
    const lp_attention *attention;
    const lp_mlp *mlp;
    void *kcache, *vcache; /* the step's slot buffers (kv_heads, capacity, head_dim) */
    long capacity;
    long rope;             /* index into the pass's cos / sin tables (the layer's type) */
    float scale;
} lp_step;

/* hidden (rows, hidden) in place through `count` steps, as the runner's loop would run them one
 * sub-layer at a time; the same kernels, so the same numbers. Returns 0, or the failing status. */
int lp_run_steps(const lp_step *steps, long count, void *hidden, long rows, long pos0, const void *const *cos,
                 const void *const *sin, long keep_sink, long keep_recent, const unsigned char *tree, int bf16,
                 int threads) {
    for (long s = 0; s < count; s++) {
        const lp_step *st = steps + s;
        if (st->attention) {
            int status = lp_attention_block(st->attention, hidden, hidden, rows, pos0, cos[st->rope], sin[st->rope],
                                             st->kcache, st->vcache, st->capacity, 0, keep_sink, keep_recent,
                                             tree, st->scale, bf16, threads);
            if (status != 0) return status;
        }
        if (st->mlp) lp_mlp_block(st->mlp, hidden, hidden, rows, st->scale, bf16, threads);
    }
    return 0;
}

/* A whole pass in one call: the embedding rows of the token ids, the steps (lp_run_steps), then
 * the final norm and the LM head (lp_norm_linear) on rows [head_from, rows) into logits. hidden:
 * (rows, hidden) scratch in the model's dtype. The runner's forward, with no Python between its
 * parts (that Python cost a pass about 1 ms on the AVX2 EPYC, its memory cold after the weights
 * went through the caches). Returns 0, -2 for a token id outside [0, vocab), or lp_run_steps' status. */
int lp_forward(const void *embedding, long vocab, const long *ids, long rows, void *hidden, const lp_step *steps,
               long count, long pos0, const void *const *cos, const void *const *sin, long keep_sink,
               long keep_recent, const unsigned char *tree, const lp_norm *final_norm, const lp_matrix *head,
               long head_from, void *logits, int bf16, int threads) {
    long dim = head->k, es = bf16 ? 2 : 4;
    for (long r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= vocab) return -2;
    for (long r = 0; r < rows; r++)
        memcpy((char *)hidden + r * dim * es, (const char *)embedding + ids[r] * dim * es, dim * es);
    int status = lp_run_steps(steps, count, hidden, rows, pos0, cos, sin, keep_sink, keep_recent, tree, bf16, threads);
    if (status != 0) return status;
    lp_norm_linear(final_norm, (const char *)hidden + head_from * dim * es, head, logits, rows - head_from, bf16, threads);
    return 0;
}
