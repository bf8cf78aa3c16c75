/* The integer products over the block formats for AVX-512 VNNI (with BW, VL and VBMI): the
 * 32-byte tiles of int_tiles_avx2.h on vpdpbusd for one panel, and 64-byte tiles for two panels at
 * once (formats.h: lp_int_tiles_<format>). Its integers are AVX2's (every product and sum exact). */
#include "quant_avx2.h"
/* The pair tiles' prefetching (AMD EPYC with AVX-512, products read from memory, builds timed in
 * turns in one process): passes of few rows take pairs only of long panels (gemm.c
 * single_panel_most), whose streams the hardware's prefetchers follow by themselves (fetching them
 * too was ~10% slower at k = 8960 with one row). Passes of more rows do more work a byte and
 * fetch the next pair's both panels (without, 8 rows were 10-16% slower). */

#if !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512VNNI__) || !defined(__AVX512VBMI__)
#error "products_int_avx512vnni.c is built with -mavx512bw -mavx512vl -mavx512vnni -mavx512vbmi"
#endif

const char lp_products_isa[] = "avx512vnni"; /* (the build's one file of its own) */

ALWAYS __m256i dot4(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(acc, w, x); }
#define LP_INT16_SUMS 0
/* chains of integer sums a row and half: vpdpbusd adds into its accumulator with a latency of
 * several cycles, so with few rows the words of a sub-block alternate between two chains (integer
 * sums: the order does not change them); AVX2's route adds with a one-cycle vpaddd */
#define CHAINS(R) ((R) <= 2 ? 2 : 1)

#include "int_tiles_avx2.h"

/* int_tiles_avx2.h's combine8 (formats.h's rule for one sub-block) on sixteen lanes */
ALWAYS __m512 combine16(__m512 sum, __m512i dot, __m512 scale, __m512 offset, __m512 d, __m512 s) {
    return _mm512_fmadd_ps(offset, s, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, d), sum));
}
/* fifths as the 32-byte tiles take them, for 16 bytes of bits (panel A's and B's quads) */
ALWAYS void fifths2(__m128i bits, int flip, __m512i *fl, __m512i *fh) {
    const __m512i spread = _mm512_set1_epi32(0x00204081), ones = _mm512_set1_epi32(0x01010101);
    __m512i h = _mm512_cvtepu8_epi32(bits);
    __m512i lo = _mm512_and_si512(_mm512_mullo_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0xF)), spread), ones);
    __m512i hi = _mm512_and_si512(_mm512_mullo_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 4), _mm512_set1_epi32(0xF)),
                                                     spread), ones);
    if (flip) {
        lo = _mm512_xor_si512(lo, ones);
        hi = _mm512_xor_si512(hi, ones);
    }
    *fl = _mm512_slli_epi32(lo, 4);
    *fh = _mm512_slli_epi32(hi, 4);
}
/* Q8_0's input-major bytes of four inputs of panels A and B (64 bytes each) to lanes 0-7 (A's
 * rows 0-7) and 8-15 (B's): one byte permutation each for rows 0-7 and 8-15, then + 128 */
ALWAYS void q8_0_transpose2(__m512i first, __m512i second, __m512i *wl, __m512i *wh) {
    _Alignas(64) static const uint8_t lo[64] = {
        0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54,
        7, 23, 39, 55, 64, 80, 96, 112, 65, 81, 97, 113, 66, 82, 98, 114, 67, 83, 99, 115, 68, 84, 100, 116,
        69, 85, 101, 117, 70, 86, 102, 118, 71, 87, 103, 119};
    const __m512i index_lo = _mm512_load_si512((const void *)lo), eight = _mm512_set1_epi8(8);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    *wl = _mm512_xor_si512(_mm512_permutex2var_epi8(first, index_lo, second), flip);
    *wh = _mm512_xor_si512(_mm512_permutex2var_epi8(first, _mm512_add_epi8(index_lo, eight), second), flip);
}
/* ----- two panels at once (the avx512vnni build) -----
 * Lanes 0-7 hold panel A's word c, lanes 8-15 panel B's word c: the same four inputs, so one
 * broadcast of the activations' four bytes serves both panels, and each half's integer sums are
 * its panel's (the same integers as the 32-byte tiles). Scales, offsets and float sums likewise:
 * lanes 0-7 panel A's, 8-15 panel B's. */
ALWAYS __m512i pair256(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
ALWAYS __m512 pair_ps(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}
/* int_tiles_avx2.h's kcombine8 (a K-quant super-block's) on sixteen lanes */
ALWAYS __m512 kcombine16(__m512 sum, __m512i s1, __m512i s2, __m512 D, __m512 DMIN, __m512 d) {
    __m512 dmin = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(DMIN, d)),
                                                       _mm512_set1_epi32((int)0x80000000u))); /* (neg's) */
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2), dmin, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(D, d), sum));
}
ALWAYS __m512i pair_si(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
ALWAYS void nibble_pair(const istate *a, const istate *b, int c, __m512i *wl, __m512i *wh) {
    __m512i v = pair256(a->q + 32 * c, b->q + 32 * c);
    *wl = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
    *wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
}
#define q4_0_ipair nibble_pair
#define q4_1_ipair nibble_pair
#define q4_k_ipair nibble_pair
ALWAYS void fifth_pair(const istate *a, const istate *b, int c, int flip, __m512i *wl, __m512i *wh) {
    __m512i fl, fh;
    nibble_pair(a, b, c, wl, wh);
    fifths2(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(a->h + 8 * c)),
                               _mm_loadl_epi64((const __m128i *)(b->h + 8 * c))), flip, &fl, &fh);
    *wl = _mm512_or_si512(*wl, fl);
    *wh = _mm512_or_si512(*wh, fh);
}
ALWAYS void q5_0_ipair(const istate *a, const istate *b, int c, __m512i *wl, __m512i *wh) { fifth_pair(a, b, c, 1, wl, wh); }
ALWAYS void q8_0_ipair(const istate *a, const istate *b, int c, __m512i *wl, __m512i *wh) {
    q8_0_transpose2(_mm512_loadu_si512((const void *)(a->q + 64 * c)), _mm512_loadu_si512((const void *)(b->q + 64 * c)),
                    wl, wh);
}
ALWAYS void q5_1_ipair(const istate *a, const istate *b, int c, __m512i *wl, __m512i *wh) { fifth_pair(a, b, c, 0, wl, wh); }
ALWAYS void q5_k_ipair(const istate *a, const istate *b, int c, __m512i *wl, __m512i *wh) { fifth_pair(a, b, c, 0, wl, wh); }
ALWAYS void q6_k_ipair(const istate *a, const istate *b, int c, __m512i *wl, __m512i *wh) {
    __m512i v = pair256(a->q + 32 * c, b->q + 32 * c);
    __m256i hh = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a->h + 16 * c))),
                                         _mm_loadu_si128((const __m128i *)(b->h + 16 * c)), 1);
    __m512i t = _mm512_shuffle_epi8(_mm512_cvtepu16_epi32(hh),
                                    _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13)));
    __m512i lo = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(t, _mm512_set1_epi16(0x0003)), 4),
                                 _mm512_slli_epi16(_mm512_and_si512(t, _mm512_set1_epi16(0x0C00)), 2));
    __m512i hi = _mm512_or_si512(_mm512_and_si512(t, _mm512_set1_epi16(0x0030)),
                                 _mm512_srli_epi16(_mm512_and_si512(t, _mm512_set1_epi16((short)0xC000)), 2));
    *wl = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi8(0x0F)), lo);
    *wh = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)), hi);
}

/* RR rows on panels A and B (panel_bytes apart): y[r][0..15] panel A's, y[r][16..31] panel B's;
 * the float sums in registers (YSUMS 0) or in y; a K-quant super-block's integer sums S1 (kl, kh)
 * in registers */
#define ZPAIR(NAME, F, f, RR, YSUMS)                                                               \
    static void NAME(const lp_q8 *x, long r0, const void *wv, long panel_bytes, float *y, long ys) { \
        enum { R = RR, S = RR <= 1 ? 2 : 1 };                                                      \
        const uint8_t *wa = (const uint8_t *)wv, *wb = wa + panel_bytes;                           \
        const long k = x->k;                                                                       \
        const int8_t *xr[R];                                                                       \
        __m512 sl[YSUMS ? 1 : R], sh[YSUMS ? 1 : R];                                               \
        __m512i kl[R], kh[R];                                                                      \
        ksuper ksa, ksb;                                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                      \
            xr[r] = x->q + (r0 + r) * k;                                                           \
            kl[r] = kh[r] = _mm512_setzero_si512();                                                \
            if (YSUMS) {                                                                           \
                _mm512_storeu_ps(y + r * ys, _mm512_setzero_ps());                                 \
                _mm512_storeu_ps(y + r * ys + 16, _mm512_setzero_ps());                            \
            } else {                                                                               \
                sl[YSUMS ? 0 : r] = sh[YSUMS ? 0 : r] = _mm512_setzero_ps();                       \
            }                                                                                      \
        }                                                                                          \
        for (long s0 = 0; s0 < k; s0 += F##_SUB) {                                                \
            istate sa, sb;                                                                         \
            const long at = s0 / F##_BLOCK * F##_PB;                                               \
            const int sub = (int)(s0 % F##_BLOCK / F##_SUB);                                      \
            if (F##_KQ && s0 % 256 == 0) {                                                         \
                f##_ksuper(&ksa, wa + at);                                                         \
                f##_ksuper(&ksb, wb + at);                                                         \
            }                                                                                      \
            f##_iset(&sa, wa + at, sub, &ksa);                                                     \
            f##_iset(&sb, wb + at, sub, &ksb);                                                     \
            if (R > 1 && r0 == 0) { /* (the next pair's both panels) */                            \
                PREFETCH_SUB(F, F##_SUB, wa, LP_AHEAD_PANELS * panel_bytes, s0);                   \
                PREFETCH_SUB(F, F##_SUB, wa, (LP_AHEAD_PANELS + 1) * panel_bytes, s0);             \
            }                                                                                      \
            __m512 dl, dh, ol, oh;                                                                 \
            __m512i il, ih;                                                                        \
            if (F##_KQ) {                                                                          \
                il = pair_si(sa.il, sb.il);                                                        \
                ih = pair_si(sa.ih, sb.ih);                                                        \
            } else {                                                                               \
                dl = pair_ps(sa.dl, sb.dl), dh = pair_ps(sa.dh, sb.dh), ol = pair_ps(sa.ol, sb.ol); \
                oh = pair_ps(sa.oh, sb.oh);                                                        \
            }                                                                                      \
            __m512i al[R][S], ah[R][S];                                                            \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                    \
                _Pragma("GCC unroll 2") for (int c = 0; c < S; c++) al[r][c] = ah[r][c] = _mm512_setzero_si512(); \
            _Pragma("GCC unroll 8") for (int c = 0; c < F##_SUB / 4; c++) {                       \
                __m512i wl, wh;                                                                    \
                f##_ipair(&sa, &sb, c, &wl, &wh);                                                  \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                              \
                    int32_t four;                                                                  \
                    memcpy(&four, xr[r] + s0 + 4 * c, 4);                                          \
                    __m512i xb = _mm512_set1_epi32(four);                                          \
                    al[r][c % S] = _mm512_dpbusd_epi32(al[r][c % S], wl, xb);                      \
                    ah[r][c % S] = _mm512_dpbusd_epi32(ah[r][c % S], wh, xb);                      \
                }                                                                                  \
            }                                                                                      \
            __m512 kdl, kdh, kml, kmh; /* (a K-quant's last sub-block) both panels' D and DMIN */ \
            if (F##_KQ && KLAST(F)) {                                                              \
                kdl = pair_ps(ksa.dl, ksb.dl), kdh = pair_ps(ksa.dh, ksb.dh);                      \
                kml = pair_ps(ksa.ml, ksb.ml), kmh = pair_ps(ksa.mh, ksb.mh);                      \
            }                                                                                      \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                  \
                __m512i zl = al[r][0], zh = ah[r][0];                                              \
                if (S > 1) {                                                                       \
                    zl = _mm512_add_epi32(zl, al[r][S - 1]);                                       \
                    zh = _mm512_add_epi32(zh, ah[r][S - 1]);                                       \
                }                                                                                  \
                float *o = y + r * ys;                                                             \
                const int i = YSUMS ? 0 : r;                                                       \
                if (F##_KQ) {                                                                      \
                    kl[r] = _mm512_add_epi32(kl[r], _mm512_mullo_epi32(zl, il));                   \
                    kh[r] = _mm512_add_epi32(kh[r], _mm512_mullo_epi32(zh, ih));                   \
                    if (KLAST(F)) {                                                                \
                        __m256i mla, mha, mlb, mhb;                                                \
                        kmins8(&ksa, KBSUMS(F, r0 + r), 128 / F##_SUB, &mla, &mha);                \
                        kmins8(&ksb, KBSUMS(F, r0 + r), 128 / F##_SUB, &mlb, &mhb);                \
                        const __m512i ml = pair_si(mla, mlb), mh = pair_si(mha, mhb);              \
                        const __m512 dx = _mm512_set1_ps(KDX(F, r0 + r));                          \
                        if (YSUMS) {                                                               \
                            store_ab(o, 0, kcombine16(lanes_ab(o, 0), kl[r], ml, kdl, kml, dx));   \
                            store_ab(o, 8, kcombine16(lanes_ab(o, 8), kh[r], mh, kdh, kmh, dx));   \
                        } else {                                                                   \
                            sl[i] = kcombine16(sl[i], kl[r], ml, kdl, kml, dx);                    \
                            sh[i] = kcombine16(sh[i], kh[r], mh, kdh, kmh, dx);                    \
                        }                                                                          \
                        kl[r] = kh[r] = _mm512_setzero_si512();                                    \
                    }                                                                              \
                } else {                                                                           \
                    const float *ss = x->s + (r0 + r) * (k / 16) + s0 / 16;                        \
                    __m512 d = _mm512_set1_ps(x->d[(r0 + r) * (k / 32) + s0 / 32]);                \
                    __m512 s = _mm512_set1_ps(F##_SUB == 32 ? ss[0] + ss[1] : ss[0]);             \
                    if (YSUMS) {                                                                   \
                        store_ab(o, 0, combine16(lanes_ab(o, 0), zl, dl, ol, d, s));               \
                        store_ab(o, 8, combine16(lanes_ab(o, 8), zh, dh, oh, d, s));               \
                    } else {                                                                       \
                        sl[i] = combine16(sl[i], zl, dl, ol, d, s);                                \
                        sh[i] = combine16(sh[i], zh, dh, oh, d, s);                                \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        if (!YSUMS)                                                                                \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                  \
                store_ab(y + r * ys, 0, sl[YSUMS ? 0 : r]);                                        \
                store_ab(y + r * ys, 8, sh[YSUMS ? 0 : r]);                                        \
            }                                                                                      \
    }

/* a pair's sums of rows 0-7 (at 0) or 8-15 (at 8): panel A's at o + at, panel B's at o + 16 + at */
ALWAYS __m512 lanes_ab(const float *o, int at) { return pair_ps(_mm256_loadu_ps(o + at), _mm256_loadu_ps(o + 16 + at)); }
ALWAYS void store_ab(float *o, int at, __m512 v) {
    _mm256_storeu_ps(o + at, _mm512_castps512_ps256(v));
    _mm256_storeu_ps(o + 16 + at, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* pairs of panels on 64-byte words; a panel alone (a run's odd last one) on the 32-byte tiles,
 * whose integers are the same. The float sums of five rows or more go to y where a K-quant's integer sums of the super-block (kl,
 * kh: two registers a row) hold the registers; the other formats' float sums stay in registers
 * at every row count (with a row's float sums in y, its every sub-block loaded and stored them,
 * and 8-row passes of SmolLM2's Q4_1 and Q8_0 products took 1.07x the time) */
#define ITILES(F, f)                                                                               \
    PANEL_TILES(F, f)                                                                              \
    ITILE_Y(f##_i7, F, f, 7)                                                                       \
    ITILE_Y(f##_i8, F, f, 8)                                                                       \
    ZPAIR(f##_p1, F, f, 1, 0)                                                                      \
    ZPAIR(f##_p2, F, f, 2, 0)                                                                      \
    ZPAIR(f##_p3, F, f, 3, 0)                                                                      \
    ZPAIR(f##_p4, F, f, 4, 0)                                                                      \
    ZPAIR(f##_p5, F, f, 5, F##_KQ)                                                                 \
    ZPAIR(f##_p6, F, f, 6, F##_KQ)                                                                 \
    ZPAIR(f##_p7, F, f, 7, F##_KQ)                                                                 \
    ZPAIR(f##_p8, F, f, 8, F##_KQ)                                                                 \
    INT_TILES_ROW(F, f, INT_PAIRS(f))
/* the oct formats (Q2_K, Q3_K) one panel at a time, on the 32-byte tiles */
#define ITILES_ONE_PANEL(F, f)                                                                     \
    PANEL_TILES(F, f)                                                                              \
    ITILE_Y(f##_i7, F, f, 7)                                                                       \
    ITILE_Y(f##_i8, F, f, 8)                                                                       \
    INT_TILES_ROW(F, f, NULL)

/* the oct formats (octs 1) one panel at a time, the others on pairs of panels too */
#define ITILES_OF(F, f, octs, ...) ITILES_OCTS##octs(F, f)
#define ITILES_OCTS0 ITILES
#define ITILES_OCTS1 ITILES_ONE_PANEL
LP_INT_FORMATS(ITILES_OF)
