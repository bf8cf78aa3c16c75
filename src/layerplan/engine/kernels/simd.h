/* The SIMD shims: eight float lanes (lp_f8) and the few composite operations the per-row work and
 * the attention are written in, once for AVX2 + FMA and once in portable C.
 *
 * Every operation here is exact IEEE single-precision arithmetic lane by lane (fused multiply-adds
 * where named: f8_fmadd is fma(a, b, c), rounded once), so the portable version gives the same
 * numbers as the AVX2 one, bit for bit; the lane orders of the reductions (f8_hsum8, lp_sum_squares)
 * are spelled out and both versions keep them. Code outside the product files uses only these,
 * never intrinsics: a new ISA (AVX-512, NEON) is a new branch of this file plus its product file.
 *
 * The scalar bf16 and f16 conversions are the reference the lanes are checked against
 * (tests/test_kernels.py: every seventh fp32 bit pattern).
 */
#ifndef LP_SIMD_H
#define LP_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(LP_PORTABLE)
#define LP_SIMD_AVX2 1
#include <immintrin.h>
#endif

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

/* v rounded to bf16 and back (the value a bf16 tensor would hold) */
static inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

/* IEEE half precision, as F16C's vcvtph2ps / vcvtps2ph (round to nearest even) and torch convert:
 * the kernels' one f16 pair (the activations' and the block formats' f16 scales). A NaN stays a NaN
 * of its sign, made quiet, with its payload (narrowed: its high bits), as F16C makes it (numpy's
 * astype keeps a signalling NaN signalling); subnormals exact, or rounded to even, as F16C's. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, x;
    if (e == 0x1f) { /* inf; a NaN quiet, its payload kept */
        x = sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u);
    } else if (e) {
        x = sign | ((e + 112) << 23) | (m << 13);
    } else if (m) { /* a subnormal half is a normal float */
        e = 113;
        while (!(m & 0x400u)) {
            m <<= 1;
            e--;
        }
        x = sign | (e << 23) | ((m & 0x3ffu) << 13);
    } else {
        x = sign;
    }
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf; a NaN quiet, its payload's high bits kept */
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* 65520 and up round to inf */
    uint32_t h, rem, half;
    if (ax < 0x38800000u) { /* below 2^-14: a subnormal half, or zero */
        if (ax < 0x33000000u) return (uint16_t)sign; /* below 2^-25 */
        uint32_t shift = 126 - (ax >> 23), m = (ax & 0x7fffffu) | 0x800000u;
        h = m >> shift;
        rem = m & ((1u << shift) - 1);
        half = 1u << (shift - 1);
    } else {
        h = (ax - 0x38000000u) >> 13;
        rem = ax & 0x1fffu;
        half = 0x1000u;
    }
    h += rem > half || (rem == half && (h & 1u)); /* a carry moves into the exponent, as it should */
    return (uint16_t)(sign | h);
}

#ifdef LP_SIMD_AVX2

typedef __m256 lp_f8;

static inline lp_f8 f8_zero(void) { return _mm256_setzero_ps(); }
static inline lp_f8 f8_set1(float v) { return _mm256_set1_ps(v); }
static inline lp_f8 f8_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void f8_store(float *p, lp_f8 v) { _mm256_storeu_ps(p, v); }
static inline lp_f8 f8_add(lp_f8 a, lp_f8 b) { return _mm256_add_ps(a, b); }
static inline lp_f8 f8_sub(lp_f8 a, lp_f8 b) { return _mm256_sub_ps(a, b); }
static inline lp_f8 f8_mul(lp_f8 a, lp_f8 b) { return _mm256_mul_ps(a, b); }
static inline lp_f8 f8_div(lp_f8 a, lp_f8 b) { return _mm256_div_ps(a, b); }
static inline lp_f8 f8_fmadd(lp_f8 a, lp_f8 b, lp_f8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline lp_f8 f8_fnmadd(lp_f8 a, lp_f8 b, lp_f8 c) { return _mm256_fnmadd_ps(a, b, c); }
/* a > b ? a : b and a < b ? a : b, lane by lane (so a NaN in a gives b) */
static inline lp_f8 f8_max(lp_f8 a, lp_f8 b) { return _mm256_max_ps(a, b); }
static inline lp_f8 f8_min(lp_f8 a, lp_f8 b) { return _mm256_min_ps(a, b); }
static inline lp_f8 f8_neg(lp_f8 a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
/* 0 in the lanes where `where` is -inf, else v */
static inline lp_f8 f8_zero_where_neg_inf(lp_f8 v, lp_f8 where) {
    return _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps(where, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
}

static inline lp_f8 f8_load_bf16(const uint16_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* round_bf16 on eight lanes, NaNs included */
static inline lp_f8 f8_round_bf16(lp_f8 v) {
    __m256i u = _mm256_castps_si256(v), high = _mm256_set1_epi32((int)0xffff0000u);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), high);
    __m256i quiet = _mm256_or_si256(_mm256_and_si256(u, high), _mm256_set1_epi32(0x00400000)); /* f32_to_bf16's NaN */
    return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

/* f32_to_bf16 of eight lanes into p[0 : 8] */
static inline void f8_store_bf16(uint16_t *p, lp_f8 v) {
    __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(f8_round_bf16(v)), 16); /* 0 .. 0xffff */
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}

static inline lp_f8 f8_load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void f8_store_f16(uint16_t *p, lp_f8 v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* lane j = the sum of aj's lanes, as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) */
static inline lp_f8 f8_hsum8(lp_f8 a0, lp_f8 a1, lp_f8 a2, lp_f8 a3, lp_f8 a4, lp_f8 a5, lp_f8 a6, lp_f8 a7) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(hsum4(a0, a1, a2, a3)), hsum4(a4, a5, a6, a7), 1);
}

/* exp on eight lanes (Cephes' expf: range reduction by ln 2, degree-5 polynomial; within 2 ulp
 * of expf) */
static inline lp_f8 f8_exp(lp_f8 x) {
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

/* The sum of v[i]^2 in double: lanes 0-3 and 4-7 of each eight in two registers of four doubles
 * (fused: a float's square is exact in double, so only the sums round), those added lane by lane,
 * then (d0 + d1) + (d2 + d3), then the tail in order. */
static inline double lp_sum_squares(const float *v, long dim) {
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

/* a hint to bring the line at address `at` into the caches; `at` is an integer, so an address
 * past the end of an object is never formed as a pointer into it */
static inline void lp_prefetch(uintptr_t at) { _mm_prefetch((const char *)at, _MM_HINT_T0); }

#else /* portable C: the same operations lane by lane */

typedef struct {
    float v[8];
} lp_f8;

#define LP_F8_MAP(EXPR)                                                                            \
    lp_f8 r;                                                                                       \
    for (int j = 0; j < 8; j++) r.v[j] = (EXPR);                                                   \
    return r

static inline lp_f8 f8_zero(void) { LP_F8_MAP(0.0f); }
static inline lp_f8 f8_set1(float s) { LP_F8_MAP(s); }
static inline lp_f8 f8_load(const float *p) { LP_F8_MAP(p[j]); }
static inline void f8_store(float *p, lp_f8 v) { memcpy(p, v.v, sizeof v.v); }
static inline lp_f8 f8_add(lp_f8 a, lp_f8 b) { LP_F8_MAP(a.v[j] + b.v[j]); }
static inline lp_f8 f8_sub(lp_f8 a, lp_f8 b) { LP_F8_MAP(a.v[j] - b.v[j]); }
static inline lp_f8 f8_mul(lp_f8 a, lp_f8 b) { LP_F8_MAP(a.v[j] * b.v[j]); }
static inline lp_f8 f8_div(lp_f8 a, lp_f8 b) { LP_F8_MAP(a.v[j] / b.v[j]); }
static inline lp_f8 f8_fmadd(lp_f8 a, lp_f8 b, lp_f8 c) { LP_F8_MAP(fmaf(a.v[j], b.v[j], c.v[j])); }
static inline lp_f8 f8_fnmadd(lp_f8 a, lp_f8 b, lp_f8 c) { LP_F8_MAP(fmaf(-a.v[j], b.v[j], c.v[j])); }
static inline lp_f8 f8_max(lp_f8 a, lp_f8 b) { LP_F8_MAP(a.v[j] > b.v[j] ? a.v[j] : b.v[j]); }
static inline lp_f8 f8_min(lp_f8 a, lp_f8 b) { LP_F8_MAP(a.v[j] < b.v[j] ? a.v[j] : b.v[j]); }
static inline lp_f8 f8_neg(lp_f8 a) { LP_F8_MAP(-a.v[j]); }
static inline lp_f8 f8_zero_where_neg_inf(lp_f8 v, lp_f8 where) { LP_F8_MAP(where.v[j] == -INFINITY ? 0.0f : v.v[j]); }
static inline lp_f8 f8_load_bf16(const uint16_t *p) { LP_F8_MAP(bf16_to_f32(p[j])); }
static inline lp_f8 f8_round_bf16(lp_f8 v) { LP_F8_MAP(round_bf16(v.v[j])); }
static inline void f8_store_bf16(uint16_t *p, lp_f8 v) {
    for (int j = 0; j < 8; j++) p[j] = f32_to_bf16(v.v[j]);
}
static inline lp_f8 f8_load_f16(const uint16_t *p) { LP_F8_MAP(f16_to_f32(p[j])); }
static inline void f8_store_f16(uint16_t *p, lp_f8 v) {
    for (int j = 0; j < 8; j++) p[j] = f32_to_f16(v.v[j]);
}

static inline float lp_hsum(lp_f8 a) {
    return ((a.v[0] + a.v[1]) + (a.v[2] + a.v[3])) + ((a.v[4] + a.v[5]) + (a.v[6] + a.v[7]));
}

static inline lp_f8 f8_hsum8(lp_f8 a0, lp_f8 a1, lp_f8 a2, lp_f8 a3, lp_f8 a4, lp_f8 a5, lp_f8 a6, lp_f8 a7) {
    lp_f8 r = {{lp_hsum(a0), lp_hsum(a1), lp_hsum(a2), lp_hsum(a3), lp_hsum(a4), lp_hsum(a5), lp_hsum(a6), lp_hsum(a7)}};
    return r;
}

static inline float lp_exp1(float x) {
    x = x > -88.3762626647949f ? x : -88.3762626647949f;
    x = x < 88.3762626647949f ? x : 88.3762626647949f;
    float fx = floorf(fmaf(x, 1.44269504088896341f, 0.5f));
    x = fmaf(-fx, 0.693359375f, x);
    x = fmaf(-fx, -2.12194440e-4f, x);
    float y = 1.9875691500e-4f;
    y = fmaf(y, x, 1.3981999507e-3f);
    y = fmaf(y, x, 8.3334519073e-3f);
    y = fmaf(y, x, 4.1665795894e-2f);
    y = fmaf(y, x, 1.6666665459e-1f);
    y = fmaf(y, x, 5.0000001201e-1f);
    y = fmaf(y, x * x, x + 1.0f);
    uint32_t n = (uint32_t)((int32_t)fx + 127) << 23;
    float scale;
    memcpy(&scale, &n, 4);
    return y * scale;
}

static inline lp_f8 f8_exp(lp_f8 x) { LP_F8_MAP(lp_exp1(x.v[j])); }

static inline double lp_sum_squares(const float *v, long dim) {
    double a[4] = {0.0, 0.0, 0.0, 0.0}, b[4] = {0.0, 0.0, 0.0, 0.0};
    long i = 0;
    for (; i + 8 <= dim; i += 8)
        for (int j = 0; j < 4; j++) {
            a[j] = fma((double)v[i + j], (double)v[i + j], a[j]);
            b[j] = fma((double)v[i + 4 + j], (double)v[i + 4 + j], b[j]);
        }
    double ss = ((a[0] + b[0]) + (a[1] + b[1])) + ((a[2] + b[2]) + (a[3] + b[3]));
    for (; i < dim; i++) ss += (double)v[i] * v[i];
    return ss;
}

static inline void lp_prefetch(uintptr_t at) { (void)at; }

#endif

/* eight lanes of a float or bf16 array from element i */
static inline lp_f8 f8_load_as(const void *p, int bf16, long i) {
    return bf16 ? f8_load_bf16((const uint16_t *)p + i) : f8_load((const float *)p + i);
}

#endif
