/* What the AVX2 tiles over the block formats share (quant.h): the SIMD shims, and per format
 * the exact tiles' setup / load / widen (products_quant_avx2.c) and the layout constants both
 * the exact and the integer tiles (products_int_avx2.c) read, and the prefetching of panels. Two
 * files, so that the build compiles them at once. */
#ifndef LP_QUANT_AVX2_H
#define LP_QUANT_AVX2_H

#include <immintrin.h>

#include "quant.h"
#include "tiles_avx2.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "quant_avx2.h's users are built with -mavx2 -mfma -mf16c"
#endif

#define ALWAYS static inline __attribute__((always_inline))

/* A sub-block's widening state on one panel: per field place t, the multipliers scale 2^-s of
 * rows 0-7 (ml) and 8-15 (mh), the offsets added (ol, oh), and where the sub-block's quants and
 * high bits start. */
typedef struct {
    __m256 ml[8], mh[8], ol, oh;
    const uint8_t *q, *h;
} qstate;

/* one word of quants (and its high bits) */
typedef struct {
    __m256i v, h;
    const uint8_t *p;
} qraw;

ALWAYS __m256 half8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
ALWAYS __m256i bytes8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
ALWAYS __m256i sbytes8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
ALWAYS __m256i words8(const uint8_t *p) { return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)); }
ALWAYS __m256i and_(__m256i a, unsigned mask) { return _mm256_and_si256(a, _mm256_set1_epi32((int)mask)); }
ALWAYS __m256 cvt(__m256i a) { return _mm256_cvtepi32_ps(a); }
ALWAYS __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
ALWAYS __m256 neg(__m256 a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
ALWAYS __m256 fma_(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }

/* nibble places: input t of a quad at bits 8t (rows 0-7: q 2^8t) and 8t+4 (rows 8-15: q 2^(8t+4);
 * t = 3 shifted down to q) */
ALWAYS void nibble_scales(qstate *s, __m256 lo, __m256 hi) {
    s->ml[0] = lo;
    s->ml[1] = mul(lo, _mm256_set1_ps(0x1p-8f));
    s->ml[2] = mul(lo, _mm256_set1_ps(0x1p-16f));
    s->ml[3] = mul(lo, _mm256_set1_ps(0x1p-24f));
    s->mh[0] = mul(hi, _mm256_set1_ps(0x1p-4f));
    s->mh[1] = mul(hi, _mm256_set1_ps(0x1p-12f));
    s->mh[2] = mul(hi, _mm256_set1_ps(0x1p-20f));
    s->mh[3] = hi;
}

/* pair places: input t of an oct at bits 4t (rows 0-7) and 4t+2 (rows 8-15; t = 7 shifted down) */
ALWAYS void pair_scales(qstate *s, __m256 lo, __m256 hi) {
    float f = 1.0f;
    for (int t = 0; t < 8; t++, f *= 0x1p-4f) {
        s->ml[t] = mul(lo, _mm256_set1_ps(f));
        s->mh[t] = t < 7 ? mul(hi, _mm256_set1_ps(f * 0x1p-2f)) : hi;
    }
}

/* the nibble of input t as q 2^s (rows 0-7, rows 8-15) */
ALWAYS __m256i nib_lo(__m256i v, const int t) { return and_(v, 0xFu << 8 * t); }
ALWAYS __m256i nib_hi(__m256i v, const int t) { return t < 3 ? and_(v, 0xF0u << 8 * t) : _mm256_srli_epi32(v, 28); }

/* ----- per format (with its BLOCK, PB and SUB from formats.h's table): CHUNK inputs share a word;
 * setup(state, panel block, sub-block), load(state, chunk, raw), widen(state, raw, t) ----- */

/* f16: 32 bytes an input, rows in order */
#define F16_CHUNK 1
ALWAYS void f16_setup(qstate *s, const uint8_t *pb, int sub) { (void)sub; s->q = pb; }
ALWAYS void f16_load(const qstate *s, int c, qraw *r) { r->p = s->q + 32 * c; }
ALWAYS v16 f16_widen(const qstate *s, const qraw *r, const int t) {
    (void)s; (void)t;
    return (v16){half8(r->p), half8(r->p + 16)};
}

/* Q8_0: w = q d */
#define Q8_0_CHUNK 4
ALWAYS void q8_0_setup(qstate *s, const uint8_t *pb, int sub) {
    (void)sub;
    s->ml[0] = half8(pb);
    s->mh[0] = half8(pb + 16);
    s->q = pb + 32;
}
ALWAYS void q8_0_load(const qstate *s, int c, qraw *r) { r->p = s->q + 64 * c; }
ALWAYS v16 q8_0_widen(const qstate *s, const qraw *r, const int t) {
    return (v16){mul(cvt(sbytes8(r->p + 16 * t)), s->ml[0]), mul(cvt(sbytes8(r->p + 16 * t + 8)), s->mh[0])};
}

/* Q4_0: w = d (q - 8) = d q + (-8 d), exact (no rounding) */
#define Q4_0_CHUNK 4
ALWAYS void q4_0_setup(qstate *s, const uint8_t *pb, int sub) {
    (void)sub;
    __m256 lo = half8(pb), hi = half8(pb + 16);
    nibble_scales(s, lo, hi);
    s->ol = mul(lo, _mm256_set1_ps(-8.0f));
    s->oh = mul(hi, _mm256_set1_ps(-8.0f));
    s->q = pb + 32;
}
ALWAYS void quad_load(const qstate *s, int c, qraw *r) { r->v = _mm256_loadu_si256((const __m256i *)(s->q + 32 * c)); }
#define q4_0_load quad_load
ALWAYS v16 q4_0_widen(const qstate *s, const qraw *r, const int t) {
    return (v16){fma_(cvt(nib_lo(r->v, t)), s->ml[t], s->ol), fma_(cvt(nib_hi(r->v, t)), s->mh[t], s->oh)};
}

/* Q4_1: w = (d q) + m */
#define Q4_1_CHUNK 4
ALWAYS void q4_1_setup(qstate *s, const uint8_t *pb, int sub) {
    (void)sub;
    nibble_scales(s, half8(pb), half8(pb + 16));
    s->ol = half8(pb + 32);
    s->oh = half8(pb + 48);
    s->q = pb + 64;
}
#define q4_1_load quad_load
ALWAYS v16 q4_1_widen(const qstate *s, const qraw *r, const int t) {
    return (v16){fma_(cvt(nib_lo(r->v, t)), s->ml[t], s->ol), fma_(cvt(nib_hi(r->v, t)), s->mh[t], s->oh)};
}

/* fifth bits: byte j of a quad's 8 bytes, bit t = row j's, bit 4 + t = row j+8's; shifted to bit
 * 8t + 4 (rows 0-7) and 8t + 8 (rows 8-15), the weight 16 of each place */
ALWAYS void quad_fifth_load(const qstate *s, int c, qraw *r) {
    r->v = _mm256_loadu_si256((const __m256i *)(s->q + 32 * c));
    r->h = bytes8(s->h + 8 * c);
}
ALWAYS __m256i fifth_lo(__m256i h, const int t) { return and_(_mm256_slli_epi32(h, 7 * t + 4), 0x10u << 8 * t); }
ALWAYS __m256i fifth_hi(__m256i h, const int t) {
    return t < 3 ? and_(_mm256_slli_epi32(h, 7 * t + 4), 0x100u << 8 * t) : and_(_mm256_srli_epi32(h, 3), 0x10u);
}

/* Q5_0: w = d (q - 16), the fifth bits stored inverted: q - 16 = nibble - 16 (NOT bit) */
#define Q5_0_CHUNK 4
ALWAYS void q5_0_setup(qstate *s, const uint8_t *pb, int sub) {
    (void)sub;
    nibble_scales(s, half8(pb), half8(pb + 16));
    s->h = pb + 32;
    s->q = pb + 96;
}
#define q5_0_load quad_fifth_load
ALWAYS v16 q5_0_widen(const qstate *s, const qraw *r, const int t) {
    __m256i lo = _mm256_sub_epi32(nib_lo(r->v, t), fifth_lo(r->h, t));
    __m256i hi = _mm256_sub_epi32(nib_hi(r->v, t), fifth_hi(r->h, t));
    return (v16){mul(cvt(lo), s->ml[t]), mul(cvt(hi), s->mh[t])};
}

/* Q5_1: w = (d q) + m */
#define Q5_1_CHUNK 4
ALWAYS void q5_1_setup(qstate *s, const uint8_t *pb, int sub) {
    (void)sub;
    nibble_scales(s, half8(pb), half8(pb + 16));
    s->ol = half8(pb + 32);
    s->oh = half8(pb + 48);
    s->h = pb + 64;
    s->q = pb + 128;
}
#define q5_1_load quad_fifth_load
ALWAYS v16 q5_1_widen(const qstate *s, const qraw *r, const int t) {
    __m256i lo = _mm256_or_si256(nib_lo(r->v, t), fifth_lo(r->h, t));
    __m256i hi = _mm256_or_si256(nib_hi(r->v, t), fifth_hi(r->h, t));
    return (v16){fma_(cvt(lo), s->ml[t], s->ol), fma_(cvt(hi), s->mh[t], s->oh)};
}

/* A K-quant sub-block's fp32 scales of rows 0-7 (dl) and 8-15 (dh) and the offsets added (ol, oh),
 * as gguf computes them: what the exact tiles' setup and the legacy integer tiles start from */
typedef struct {
    __m256 dl, dh, ol, oh;
} kscales;

/* A K-quant sub-block's integer scales (sl: rows 0-7, sh: rows 8-15) and mins (ml, mh) as int32
 * lanes, w = D sc q - DMIN mn: what kscales and the K-quants' integer tiles (formats.h) start from */
typedef struct {
    __m256i sl, sh, ml, mh;
} kints;

/* Q4_K / Q5_K: the 6-bit scales and mins of the 16 rows from the sub-block's 24 bytes s24 (16
 * bytes of low nibbles, 8 of high bits) */
ALWAYS kints k4_ints(const uint8_t *s24) {
    __m256i a = bytes8(s24), b = bytes8(s24 + 8), c = bytes8(s24 + 16);
    return (kints){_mm256_or_si256(and_(a, 0xF), _mm256_slli_epi32(and_(c, 0x3), 4)),
                   _mm256_or_si256(and_(b, 0xF), and_(c, 0x30)),
                   _mm256_or_si256(_mm256_srli_epi32(a, 4), _mm256_slli_epi32(and_(c, 0xC), 2)),
                   _mm256_or_si256(_mm256_srli_epi32(b, 4), and_(_mm256_srli_epi32(c, 2), 0x30))};
}
/* Q3_K sub-block s's scales sc - 32 (4 low bits, 2 high bits; signed) and, for its quants centred
 * on 4 (the integer tiles'), mins 4 (sc - 32) */
ALWAYS kints q3_k_ints(const uint8_t *pb, int sub) {
    const uint8_t *s12 = pb + 32 + 12 * sub;
    uint32_t high;
    memcpy(&high, s12 + 8, 4);
    __m256i n = bytes8(s12);
    __m256i hh = _mm256_srlv_epi32(_mm256_set1_epi32((int)high), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256i off = _mm256_set1_epi32(32);
    __m256i lo = _mm256_sub_epi32(_mm256_or_si256(and_(n, 0xF), _mm256_slli_epi32(and_(hh, 0x3), 4)), off);
    __m256i hi = _mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(n, 4), _mm256_slli_epi32(and_(hh, 0xC), 2)), off);
    return (kints){lo, hi, _mm256_slli_epi32(lo, 2), _mm256_slli_epi32(hi, 2)};
}
/* Q2_K sub-block s's scales and mins (a byte's nibbles) */
ALWAYS kints q2_k_ints(const uint8_t *pb, int sub) {
    const uint8_t *sm = pb + 64 + 16 * sub;
    __m256i a = bytes8(sm), b = bytes8(sm + 8);
    return (kints){and_(a, 0xF), and_(b, 0xF), _mm256_srli_epi32(a, 4), _mm256_srli_epi32(b, 4)};
}
/* Q6_K sub-block s's int8 scales and, for its quants centred on 32, mins 32 sc */
ALWAYS kints q6_k_ints(const uint8_t *pb, int sub) {
    const uint8_t *sc = pb + Q6_K_SUB_AT(sub);
    __m256i lo = sbytes8(sc), hi = sbytes8(sc + 8);
    return (kints){lo, hi, _mm256_slli_epi32(lo, 5), _mm256_slli_epi32(hi, 5)};
}

/* Q4_K / Q5_K sub-block s's d sc and -(dmin m) in fp32, as gguf: d and dmin from the panel block
 * pb, the sub-block's 6-bit scales and mins from its 24 bytes s24 */
ALWAYS kscales k4_fields(const uint8_t *pb, const uint8_t *s24) {
    kints k = k4_ints(s24);
    return (kscales){mul(half8(pb), cvt(k.sl)), mul(half8(pb + 16), cvt(k.sh)), neg(mul(half8(pb + 32), cvt(k.ml))),
                     neg(mul(half8(pb + 48), cvt(k.mh)))};
}
ALWAYS void k4_scales(qstate *s, const uint8_t *pb, const uint8_t *s24) {
    kscales k = k4_fields(pb, s24);
    nibble_scales(s, k.dl, k.dh);
    s->ol = k.ol;
    s->oh = k.oh;
}

/* Q4_K: w = (d sc) q - (dmin m), sub-blocks of 32 */
#define Q4_K_CHUNK 4
ALWAYS void q4_k_setup(qstate *s, const uint8_t *pb, int sub) {
    k4_scales(s, pb, pb + Q4_K_SUB_AT(sub));
    s->q = pb + Q4_K_SUB_AT(sub) + 24;
}
#define q4_k_load quad_load
ALWAYS v16 q4_k_widen(const qstate *s, const qraw *r, const int t) {
    return (v16){fma_(cvt(nib_lo(r->v, t)), s->ml[t], s->ol), fma_(cvt(nib_hi(r->v, t)), s->mh[t], s->oh)};
}

/* Q5_K: as Q4_K with fifth bits */
#define Q5_K_CHUNK 4
ALWAYS void q5_k_setup(qstate *s, const uint8_t *pb, int sub) {
    k4_scales(s, pb, pb + Q5_K_SUB_AT(sub));
    s->h = pb + Q5_K_SUB_AT(sub) + 24;
    s->q = pb + Q5_K_SUB_AT(sub) + 88;
}
#define q5_k_load quad_fifth_load
ALWAYS v16 q5_k_widen(const qstate *s, const qraw *r, const int t) {
    __m256i lo = _mm256_or_si256(nib_lo(r->v, t), fifth_lo(r->h, t));
    __m256i hi = _mm256_or_si256(nib_hi(r->v, t), fifth_hi(r->h, t));
    return (v16){fma_(cvt(lo), s->ml[t], s->ol), fma_(cvt(hi), s->mh[t], s->oh)};
}

/* Q6_K: w = (d sc) (q - 32) = (d sc) q + (-32 d sc), exact; sub-blocks of 16; high bits in 16-bit
 * lanes, row j's of input t at P[t] = {0, 2, 8, 10}, row j+8's at P[t] + 4, shifted by 8t + 4 - P[t]
 * to their places */
#define Q6_K_CHUNK 4
ALWAYS void q6_k_setup(qstate *s, const uint8_t *pb, int sub) {
    const uint8_t *sc = pb + Q6_K_SUB_AT(sub);
    __m256 lo = mul(half8(pb), cvt(sbytes8(sc))), hi = mul(half8(pb + 16), cvt(sbytes8(sc + 8)));
    nibble_scales(s, lo, hi);
    s->ol = mul(lo, _mm256_set1_ps(-32.0f));
    s->oh = mul(hi, _mm256_set1_ps(-32.0f));
    s->h = sc + 16;
    s->q = sc + 80;
}
ALWAYS void q6_k_load(const qstate *s, int c, qraw *r) {
    r->v = _mm256_loadu_si256((const __m256i *)(s->q + 32 * c));
    r->h = words8(s->h + 16 * c);
}
ALWAYS v16 q6_k_widen(const qstate *s, const qraw *r, const int t) {
    const int shift = t == 0 ? 4 : t == 1 ? 10 : t == 2 ? 12 : 18;
    __m256i hs = _mm256_slli_epi32(r->h, shift);
    __m256i lo = _mm256_or_si256(nib_lo(r->v, t), and_(hs, 0x30u << 8 * t));
    __m256i hi = t < 3 ? _mm256_or_si256(nib_hi(r->v, t), and_(hs, 0x300u << 8 * t))
                       : _mm256_or_si256(nib_hi(r->v, t), and_(_mm256_srli_epi32(r->h, 10), 0x30u));
    return (v16){fma_(cvt(lo), s->ml[t], s->ol), fma_(cvt(hi), s->mh[t], s->oh)};
}

/* pairs of low bits: input t of an oct at bits 4t (rows 0-7) and 4t+2 (rows 8-15) */
ALWAYS __m256i pair_lo(__m256i v, const int t) { return and_(v, 0x3u << 4 * t); }
ALWAYS __m256i pair_hi(__m256i v, const int t) { return t < 7 ? and_(v, 0xCu << 4 * t) : _mm256_srli_epi32(v, 30); }

/* Q3_K: w = (d (sc - 32)) q, q = low - 4 (NOT third bit); sub-blocks of 16; third bits in 16-bit
 * lanes, row j's of input t at P[t] = {0,1,4,5,8,9,12,13}, row j+8's at P[t] + 2, shifted by
 * 4t + 2 - P[t] to the weight 4 of their places */
#define Q3_K_CHUNK 8
/* Q3_K sub-block s's scales of the 16 rows, d (sc - 32); no offset */
ALWAYS kscales q3_k_fields(const uint8_t *pb, int sub) {
    kints k = q3_k_ints(pb, sub);
    return (kscales){mul(half8(pb), cvt(k.sl)), mul(half8(pb + 16), cvt(k.sh)), _mm256_setzero_ps(), _mm256_setzero_ps()};
}
ALWAYS void q3_k_setup(qstate *s, const uint8_t *pb, int sub) {
    kscales k = q3_k_fields(pb, sub);
    pair_scales(s, k.dl, k.dh);
    s->q = pb + 224 + 64 * sub;
    s->h = pb + 1248 + 32 * sub;
}
ALWAYS void q3_k_load(const qstate *s, int c, qraw *r) {
    r->v = _mm256_loadu_si256((const __m256i *)(s->q + 32 * c));
    r->h = words8(s->h + 16 * c);
}
ALWAYS v16 q3_k_widen(const qstate *s, const qraw *r, const int t) {
    const int shift = t == 0 ? 2 : t == 1 ? 5 : t == 2 ? 6 : t == 3 ? 9 : t == 4 ? 10 : t == 5 ? 13 : t == 6 ? 14 : 17;
    __m256i hs = _mm256_slli_epi32(r->h, shift);
    __m256i lo = _mm256_sub_epi32(pair_lo(r->v, t), and_(hs, 0x4u << 4 * t));
    __m256i third_hi = t < 7 ? and_(hs, 0x10u << 4 * t) : and_(_mm256_srli_epi32(r->h, 13), 0x4u);
    __m256i hi = _mm256_sub_epi32(pair_hi(r->v, t), third_hi);
    return (v16){mul(cvt(lo), s->ml[t]), mul(cvt(hi), s->mh[t])};
}

/* Q2_K: w = (d sc) q - (dmin m), sub-blocks of 16 */
#define Q2_K_CHUNK 8
/* Q2_K sub-block s's d sc and -(dmin m) of the 16 rows (sc, m: a byte's nibbles) */
ALWAYS kscales q2_k_fields(const uint8_t *pb, int sub) {
    kints k = q2_k_ints(pb, sub);
    return (kscales){mul(half8(pb), cvt(k.sl)), mul(half8(pb + 16), cvt(k.sh)), neg(mul(half8(pb + 32), cvt(k.ml))),
                     neg(mul(half8(pb + 48), cvt(k.mh)))};
}
ALWAYS void q2_k_setup(qstate *s, const uint8_t *pb, int sub) {
    kscales k = q2_k_fields(pb, sub);
    pair_scales(s, k.dl, k.dh);
    s->ol = k.ol;
    s->oh = k.oh;
    s->q = pb + 320 + 64 * sub;
}
#define q2_k_load quad_load
ALWAYS v16 q2_k_widen(const qstate *s, const qraw *r, const int t) {
    return (v16){fma_(cvt(pair_lo(r->v, t)), s->ml[t], s->ol), fma_(cvt(pair_hi(r->v, t)), s->mh[t], s->oh)};
}

/* Prefetching. The tiles read each panel's bytes in order, but a core's own loads and the
 * hardware's prefetchers leave it waiting on memory, one row or sixteen: while a sub-block of the
 * panels in hand is summed, the same sub-block's bytes of the panels LP_AHEAD_PANELS on are
 * fetched (the SUB inputs from s0 of format F: their share of their panel block; the bytes of a
 * block are fetched once over its sub-blocks, whatever their layout). Where rows go in groups, the first
 * group fetches. */
#ifndef LP_AHEAD_PANELS
#define LP_AHEAD_PANELS 2
#endif
#define PREFETCH_SUB(F, SUB, w, ahead, s0)                                                         \
    for (long o = 0; o < F##_PB * (SUB) / F##_BLOCK; o += 64) /* addresses as integers: past the end \
                                                                  of the weights, no pointer is made */ \
        lp_prefetch((uintptr_t)(w) + (uintptr_t)((ahead) + (s0) / F##_BLOCK * F##_PB                     \
                                                 + (s0) % F##_BLOCK / (SUB) * (F##_PB * (SUB) / F##_BLOCK) + o))

#endif
