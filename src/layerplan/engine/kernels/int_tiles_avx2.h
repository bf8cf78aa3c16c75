/* The integer tiles (LP_ARITH_INT8, formats.h) on 32-byte words, which both integer builds
 * compile: products_int_avx2.c (vpmaddubsw + vpmaddwd) and products_int_avx512vnni.c (vpdpbusd,
 * and 64-byte tiles for pairs of panels of its own). The including file defines first:
 *   dot4(acc, w, x)   acc + each dword lane's four unsigned bytes of w times x's signed ones
 *   LP_INT16_SUMS     1: the words' pair sums add up in int16 before one vpmaddwd (below)
 *   CHAINS(R)         how many chains of integer sums R rows keep a sub-block's words in
 */
#ifndef LP_INT_TILES_AVX2_H
#define LP_INT_TILES_AVX2_H

#include "quant_avx2.h"

/* ===== integer products (LP_ARITH_INT8; formats.h) =====
 *
 * The packed layouts already hold, in dword lane j of a 32-byte word of nibbles, row j's quants of
 * four consecutive inputs (low nibbles) and row j+8's (high nibbles): one AND (or a shift and an
 * AND) gives the 16 rows' quants as unsigned bytes, four inputs a lane, which vpdpbusd (VNNI) or
 * vpmaddubsw + vpmaddwd (AVX2) multiply by the four activation bytes broadcast to every lane and
 * add into one int32 a row. Every product is exact (|q x| <= 63 x 127, and a pair's sum fits
 * vpmaddubsw's int16), so both routes give the same integers. Formats: every block format (Q2_K
 * and Q3_K by oct words, below). */

/* formats.h's rule for one sub-block on eight rows: sum + float(dot) times scale d, then + offset s
 * (d: the activations' block scale, s: d times the sum of their q; both in every lane),
 * two FMAs (the one place the 32-byte tiles write it; products_int_avx512vnni.c's combine16 is it
 * on sixteen lanes) */
ALWAYS __m256 combine8(__m256 sum, __m256i dot, __m256 scale, __m256 offset, __m256 d, __m256 s) {
    return fma_(offset, s, fma_(cvt(dot), mul(scale, d), sum));
}

/* a sub-block's scales (dl: rows 0-7, dh: rows 8-15) and offsets (Q8_0 activations), or its
 * integer scales (il, ih: int_scale's form; the K-quants, Q8_K activations), and where its words
 * start */
typedef struct {
    __m256 dl, dh, ol, oh;
    __m256i il, ih;
    const uint8_t *q, *h;
} istate;

/* ----- the K-quants on Q8_K activations (formats.h) -----
 * A sub-block's integer dot products are multiplied by its integer scales sc and summed over the
 * super-block (S1, exact in int32: at most 16 x 16 x 63 x 127 x 128 in magnitude); its mins meet
 * the activations' sums at the super-block's end (S2 = sum of mn bsum: one vpmaddwd for two
 * sub-blocks); then one float epilogue a super-block (kcombine8). */

/* sc in the form the build multiplies by: with LP_INT16_SUMS (AVX2) in both int16 halves of each
 * dword lane, so vpmaddwd of a lane's two int16 pair sums by it gives sc times their sum (in place
 * of vpmaddwd by ones: no instruction more); else the int32 (vpmulld on the sub-block's sum) */
ALWAYS __m256i int_scale(__m256i sc) {
    return LP_INT16_SUMS ? _mm256_or_si256(and_(sc, 0xFFFF), _mm256_slli_epi32(sc, 16)) : sc;
}
/* the int16 pair (a, b) in each dword lane: a in the low half (a and b fit int16) */
ALWAYS __m256i int16_pair(__m256i a, __m256i b) { return _mm256_or_si256(and_(a, 0xFFFF), _mm256_slli_epi32(b, 16)); }

#define LP_KSUBS 16 /* the most sub-blocks of a super-block (Q2_K, Q3_K, Q6_K: 16 of 16 inputs) */
/* a K-quant super-block of a panel: D and DMIN of rows 0-7 / 8-15 (f32), and its sub-blocks' mins
 * as int16 pairs, sub-blocks 2p (low) and 2p + 1 (high), filled as the sub-blocks are met (el, eh:
 * an even sub-block's, waiting for the next). Each sub-block's scales and mins are decoded when its
 * words are read, so the panel's bytes are read in order: decoding a super-block's at its start
 * read ahead of the hardware's prefetchers, and a one-row product took 1.5x the time. */
typedef struct {
    __m256 dl, dh, ml, mh;
    __m256i el, eh, pl[LP_KSUBS / 2], ph[LP_KSUBS / 2];
} ksuper;
/* the super-block of panel block pb: its f16 D (at pb) and DMIN (at dmin) */
ALWAYS void ksuper_start(ksuper *ks, const uint8_t *pb, const uint8_t *dmin) {
    ks->dl = half8(pb);
    ks->dh = half8(pb + 16);
    ks->ml = half8(dmin);
    ks->mh = half8(dmin + 16);
}
ALWAYS void q4_k_ksuper(ksuper *ks, const uint8_t *pb) { ksuper_start(ks, pb, pb + 32); }
ALWAYS void q5_k_ksuper(ksuper *ks, const uint8_t *pb) { ksuper_start(ks, pb, pb + 32); }
ALWAYS void q2_k_ksuper(ksuper *ks, const uint8_t *pb) { ksuper_start(ks, pb, pb + 32); }
ALWAYS void q3_k_ksuper(ksuper *ks, const uint8_t *pb) { ksuper_start(ks, pb, pb); }
ALWAYS void q6_k_ksuper(ksuper *ks, const uint8_t *pb) { ksuper_start(ks, pb, pb); }
/* (the formats on Q8_0 activations have none) */
ALWAYS void no_ksuper(ksuper *ks, const uint8_t *pb) {
    (void)ks;
    (void)pb;
}
#define q4_0_ksuper no_ksuper
#define q4_1_ksuper no_ksuper
#define q5_0_ksuper no_ksuper
#define q5_1_ksuper no_ksuper
#define q8_0_ksuper no_ksuper

/* sum + float(s1) D d - float(s2) DMIN d on eight lanes (formats.h's K-quant rule; d: the
 * activations' super-block scale in every lane) */
ALWAYS __m256 kcombine8(__m256 sum, __m256i s1, __m256i s2, __m256 D, __m256 DMIN, __m256 d) {
    return fma_(cvt(s2), neg(mul(DMIN, d)), fma_(cvt(s1), mul(D, d), sum));
}
/* S2 of rows 0-7 (*s2l) and 8-15 (*s2h) for one activation row: its sums bs of the super-block's
 * sub-blocks (int16, in order: two of them one dword) against the mins' pairs */
ALWAYS void kmins8(const ksuper *ks, const int16_t *bs, int pairs, __m256i *s2l, __m256i *s2h) {
    __m256i l = _mm256_setzero_si256(), h = _mm256_setzero_si256();
    for (int p = 0; p < pairs; p++) {
        int32_t two;
        memcpy(&two, bs + 2 * p, 4);
        const __m256i b = _mm256_set1_epi32(two);
        l = _mm256_add_epi32(l, _mm256_madd_epi16(ks->pl[p], b));
        h = _mm256_add_epi32(h, _mm256_madd_epi16(ks->ph[p], b));
    }
    *s2l = l;
    *s2h = h;
}
/* (tiles) row's activation scale and sums of the super-block holding input s0, format F */
#define KDX(F, row) x->d[(row) * (k / 256) + s0 / 256]
#define KBSUMS(F, row) (x->bsum + (row) * (k / F##_SUB) + s0 / 256 * (256 / F##_SUB))
/* (tiles) a sub-block's integer sums v times its scales s, where the words' route has not (the
 * int16 route multiplies in vpmaddwd: WORD_SUMS) */
#define KSCALED(F, v, s) (F##_KQ && !LP_INT16_SUMS ? _mm256_mullo_epi32((v), (s)) : (v))
/* (tiles) whether sub-block s0 is its super-block's last */
#define KLAST(F) (s0 % 256 == 256 - F##_SUB)

ALWAYS __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
ALWAYS __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
ALWAYS void nibble_words(const istate *s, int c, __m256i *wl, __m256i *wh) {
    __m256i v = _mm256_loadu_si256((const __m256i *)(s->q + 32 * c));
    *wl = low_nibbles(v);
    *wh = high_nibbles(v);
}

/* the scales of a sub-block whose quants are centred on `zero` (w = d (q - zero)): the offset is
 * -zero d */
ALWAYS void centred_scales(istate *s, __m256 dl, __m256 dh, float zero) {
    s->dl = dl;
    s->dh = dh;
    s->ol = mul(dl, _mm256_set1_ps(-zero));
    s->oh = mul(dh, _mm256_set1_ps(-zero));
}

ALWAYS void q4_0_iset(istate *s, const uint8_t *pb, int sub, ksuper *ks) {
    (void)sub;
    (void)ks;
    centred_scales(s, half8(pb), half8(pb + 16), 8.0f);
    s->q = pb + 32;
}
#define q4_0_iload nibble_words

ALWAYS void q4_1_iset(istate *s, const uint8_t *pb, int sub, ksuper *ks) {
    (void)sub;
    (void)ks;
    s->dl = half8(pb);
    s->dh = half8(pb + 16);
    s->ol = half8(pb + 32);
    s->oh = half8(pb + 48);
    s->q = pb + 64;
}
#define q4_1_iload nibble_words

/* a K-quant sub-block's integer scales into the tile's state, and its mins into its super-block's */
ALWAYS void take_kints(istate *s, ksuper *ks, int sub, kints k) {
    s->il = int_scale(k.sl);
    s->ih = int_scale(k.sh);
    if (sub & 1) {
        ks->pl[sub / 2] = int16_pair(ks->el, k.ml);
        ks->ph[sub / 2] = int16_pair(ks->eh, k.mh);
    } else {
        ks->el = k.ml;
        ks->eh = k.mh;
    }
}

ALWAYS void q4_k_iset(istate *s, const uint8_t *pb, int sub, ksuper *ks) {
    take_kints(s, ks, sub, k4_ints(pb + Q4_K_SUB_AT(sub)));
    s->q = pb + Q4_K_SUB_AT(sub) + 24;
}
#define q4_k_iload nibble_words
/* the products of quants below 64 fit vpmaddubsw's pairs (dot4) */
#define q4_0_dot dot4
#define q4_1_dot dot4
#define q4_k_dot dot4
#define q5_0_dot dot4
#define q5_1_dot dot4
#define q5_k_dot dot4
#define q6_k_dot dot4
#define q2_k_dot dot4
#define q3_k_dot dot4

/* AVX2 without VNNI: vpmaddubsw's int16 pair sums of several words add up in int16 (vpaddw) before
 * one vpmaddwd widens them, where they cannot overflow: a pair is at most 2 x 63 x 128 for quants
 * below 64, so 8 words of quants below 16 (the Q4 formats: a whole sub-block), 4 below 32 (Q5),
 * 2 below 64 (Q6_K), 4 for Q2_K and Q3_K (pairs of at most 2 x 7 x 128: a whole sub-block of 4
 * words). The same integers as a vpmaddwd a word, with fewer instructions a row; 0: f##_dot a word
 * (Q8_0, whose quants take two pairs). Each format's count is its LP_INT_FORMATS row's steps16. */
/* plus128 (LP_INT_FORMATS): the formats whose words hold q + 128 (Q8_0): with LP_INT16_SUMS their
 * words hold q, and 128 times the sub-block's activation sum is added to its integer sums */

/* Q8_0: w = d q, q signed; the tiles take q + 128 (unsigned: q XOR 0x80) and subtract 128 d times
 * the activations' sum, as the offset. On AVX2 a product of q + 128 (to 255) with x (to 127) does
 * not fit a vpmaddubsw pair, so q + 128 goes as (q + 128) & 0x7F plus (q + 128) & 0x80: the same
 * integer as vpdpbusd's. The input-major panel (16 rows' bytes of each input) is transposed to four
 * inputs a lane. */
ALWAYS void q8_0_iset(istate *s, const uint8_t *pb, int sub, ksuper *ks) {
    (void)sub;
    (void)ks;
    centred_scales(s, half8(pb), half8(pb + 16), 128.0f);
    s->q = pb + 32;
}
ALWAYS void q8_0_iload(const istate *s, int c, __m256i *wl, __m256i *wh) {
    const uint8_t *p = s->q + 64 * c; /* inputs 4c..4c+3, 16 rows each */
    __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadu_si128((const __m128i *)(p + 16)),
            c2 = _mm_loadu_si128((const __m128i *)(p + 32)), d = _mm_loadu_si128((const __m128i *)(p + 48));
    __m128i ab_lo = _mm_unpacklo_epi8(a, b), ab_hi = _mm_unpackhi_epi8(a, b);
    __m128i cd_lo = _mm_unpacklo_epi8(c2, d), cd_hi = _mm_unpackhi_epi8(c2, d);
    /* q + 128 for vpdpbusd; AVX2's q8_0_dot takes q itself (Q8_0_PLUS128) */
    const __m256i flip = _mm256_set1_epi8(LP_INT16_SUMS ? 0 : (char)0x80);
    *wl = _mm256_xor_si256(_mm256_set_m128i(_mm_unpackhi_epi16(ab_lo, cd_lo), _mm_unpacklo_epi16(ab_lo, cd_lo)), flip);
    *wh = _mm256_xor_si256(_mm256_set_m128i(_mm_unpackhi_epi16(ab_hi, cd_hi), _mm_unpacklo_epi16(ab_hi, cd_hi)), flip);
}
ALWAYS __m256i q8_0_dot(__m256i acc, __m256i w, __m256i x) {
    if (!LP_INT16_SUMS) return dot4(acc, w, x);
    /* q x as |q| (unsigned: 128 for -128) times x with q's sign (x is never -128): one pair sum
     * of at most 2 x 128 x 127 a pair, one vpmaddubsw a word; the tile adds 128 times the
     * activations' sum after the sub-block, so the integers are those of (q + 128) x */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)),
                                                   _mm256_set1_epi16(1)));
}

/* the sum of 32 activation bytes (signed), from vpsadbw on them + 128 */
ALWAYS int sum32_i8(const int8_t *p) {
    __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p), _mm256_set1_epi8((char)0x80));
    __m256i sad = _mm256_sad_epu8(u, _mm256_setzero_si256());
    __m128i t = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
    t = _mm_add_epi64(t, _mm_unpackhi_epi64(t, t));
    return _mm_cvtsi128_si32(t) - 32 * 128;
}

/* fifth bits: byte j of a quad's 8 bytes holds row j's bit of input 4c + t at bit t and row j+8's
 * at bit 4 + t; (bits) * 0x00204081 moves bit t to bit 8t (the shifted copies never meet), so
 * masked and shifted by 4 they are the 16s of the quants' bytes. `flip` inverts them (Q5_0 stores
 * them inverted). */
ALWAYS void fifths(__m256i h, int flip, __m256i *fl, __m256i *fh) {
    const __m256i spread = _mm256_set1_epi32(0x00204081), ones = _mm256_set1_epi32(0x01010101);
    __m256i lo = _mm256_and_si256(_mm256_mullo_epi32(and_(h, 0xF), spread), ones);
    __m256i hi = _mm256_and_si256(_mm256_mullo_epi32(and_(_mm256_srli_epi32(h, 4), 0xF), spread), ones);
    if (flip) {
        lo = _mm256_xor_si256(lo, ones);
        hi = _mm256_xor_si256(hi, ones);
    }
    *fl = _mm256_slli_epi32(lo, 4);
    *fh = _mm256_slli_epi32(hi, 4);
}
ALWAYS void fifth_words(const istate *s, int c, int flip, __m256i *wl, __m256i *wh) {
    __m256i fl, fh;
    nibble_words(s, c, wl, wh);
    fifths(bytes8(s->h + 8 * c), flip, &fl, &fh);
    *wl = _mm256_or_si256(*wl, fl);
    *wh = _mm256_or_si256(*wh, fh);
}

/* Q5_0: w = d (q - 16), q = nibble + 16 fifth (stored inverted) */
ALWAYS void q5_0_iset(istate *s, const uint8_t *pb, int sub, ksuper *ks) {
    (void)sub;
    (void)ks;
    centred_scales(s, half8(pb), half8(pb + 16), 16.0f);
    s->h = pb + 32;
    s->q = pb + 96;
}
ALWAYS void q5_0_iload(const istate *s, int c, __m256i *wl, __m256i *wh) { fifth_words(s, c, 1, wl, wh); }

/* Q5_1: w = d q + m */
ALWAYS void q5_1_iset(istate *s, const uint8_t *pb, int sub, ksuper *ks) {
    q4_1_iset(s, pb, sub, ks);
    s->h = pb + 64;
    s->q = pb + 128;
}
ALWAYS void q5_1_iload(const istate *s, int c, __m256i *wl, __m256i *wh) { fifth_words(s, c, 0, wl, wh); }

/* Q5_K: as Q4_K with fifth bits */
ALWAYS void q5_k_iset(istate *s, const uint8_t *pb, int sub, ksuper *ks) {
    take_kints(s, ks, sub, k4_ints(pb + Q5_K_SUB_AT(sub)));
    s->h = pb + Q5_K_SUB_AT(sub) + 24;
    s->q = pb + Q5_K_SUB_AT(sub) + 88;
}
ALWAYS void q5_k_iload(const istate *s, int c, __m256i *wl, __m256i *wh) { fifth_words(s, c, 0, wl, wh); }

/* Q6_K: sub-blocks of 16; the high 2 bits of row j's input t at bits P[t] = {0, 2, 8, 10} of 16-bit
 * lane j (row j+8's at P[t] + 4), moved to bits 4-5 of byte t of dword lane j */
ALWAYS void q6_k_iset(istate *s, const uint8_t *pb, int sub, ksuper *ks) {
    const uint8_t *sc = pb + Q6_K_SUB_AT(sub);
    take_kints(s, ks, sub, q6_k_ints(pb, sub));
    s->h = sc + 16;
    s->q = sc + 80;
}
ALWAYS void q6_k_iload(const istate *s, int c, __m256i *wl, __m256i *wh) {
    __m256i v = _mm256_loadu_si256((const __m256i *)(s->q + 32 * c));
    /* each dword lane's bytes b0 b0 b1 b1 of its 16 bits: inputs 0, 1 of rows j / j+8 in b0, 2, 3 in b1 */
    __m256i t = _mm256_shuffle_epi8(words8(s->h + 16 * c),
                                    _mm256_setr_epi8(0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13,
                                                     0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13));
    __m256i lo = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(t, _mm256_set1_epi16(0x0003)), 4),
                                 _mm256_slli_epi16(_mm256_and_si256(t, _mm256_set1_epi16(0x0C00)), 2));
    __m256i hi = _mm256_or_si256(_mm256_and_si256(t, _mm256_set1_epi16(0x0030)),
                                 _mm256_srli_epi16(_mm256_and_si256(t, _mm256_set1_epi16((short)0xC000)), 2));
    *wl = _mm256_or_si256(low_nibbles(v), lo);
    *wh = _mm256_or_si256(high_nibbles(v), hi);
}

ALWAYS __m256i four_bytes(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The 2-bit fields of Q2_K and Q3_K lie as their exact tiles read them: a dword lane j of a word
 * holds an oct (8 inputs) of row j at bits 4t and of row j+8 at bits 4t + 2. Their integer words
 * take every other input of an oct (word 2o: inputs 8o + {0, 2, 4, 6}, word 2o + 1: 8o + {1, 3, 5,
 * 7}: one shift and one AND a word), and the activations' bytes are gathered in the same order
 * (oct_four); the sums are of integers, so the order does not change them. */
ALWAYS __m256i oct_four(const int8_t *p, int c) {
    int64_t v;
    memcpy(&v, p + 8 * (c >> 1), 8);
    const __m256i even = _mm256_setr_epi8(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6,
                                          0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
    const __m256i odd = _mm256_setr_epi8(1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7,
                                         1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7);
    return _mm256_shuffle_epi8(_mm256_set1_epi64x(v), (c & 1) ? odd : even);
}
/* the four activation bytes that meet word c of sub-block p (p: the sub-block's first input; F##_OCTS:
 * its LP_INT_FORMATS row's octs) */
#define XFOUR(F, p, c) (F##_OCTS ? oct_four((p), (c)) : four_bytes((p) + 4 * (c)))

/* word c of an oct layout: row j's (wl) and row j+8's (wh) 2-bit fields of every other input */
ALWAYS void oct_words(const istate *s, int c, __m256i *wl, __m256i *wh) {
    __m256i v = _mm256_loadu_si256((const __m256i *)(s->q + 32 * (c >> 1)));
    const int at = 4 * (c & 1);
    *wl = _mm256_and_si256(_mm256_srli_epi32(v, at), _mm256_set1_epi8(0x03));
    *wh = _mm256_and_si256(_mm256_srli_epi32(v, at + 2), _mm256_set1_epi8(0x03));
}

/* Q2_K: w = (d sc) q - (dmin m), q 0..3, sub-blocks of 16 */
ALWAYS void q2_k_iset(istate *s, const uint8_t *pb, int sub, ksuper *ks) {
    take_kints(s, ks, sub, q2_k_ints(pb, sub));
    s->q = pb + 320 + 64 * sub;
}
#define q2_k_iload oct_words

/* Q3_K: w = (d (sc - 32)) (u - 4), u = low + 4 (third bit) in 0..7; sub-blocks of 16. The packed
 * third bits are stored inverted (q3_k_widen subtracts 4 where one is set) in 16-bit lanes: nibble
 * n of lane j holds, from bit 0, inputs 2n and 2n + 1 of the oct for row j, then for row j+8. The
 * lane's two bytes are copied to (b0, b0, b1, b1), so byte n holds nibble n at bit 0 (n even) or 4
 * (n odd): a compare with the field's bit in every byte's place, and 4 where it is clear. */
ALWAYS void q3_k_iset(istate *s, const uint8_t *pb, int sub, ksuper *ks) {
    take_kints(s, ks, sub, q3_k_ints(pb, sub));
    s->q = pb + 224 + 64 * sub;
    s->h = pb + 1248 + 32 * sub;
}
ALWAYS __m256i third_fours(__m256i lanes, unsigned bit) {
    const __m256i place = _mm256_set1_epi32((int)(bit | bit << 12 | bit << 16 | bit << 28));
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(lanes, place), place);
    return _mm256_andnot_si256(set, _mm256_set1_epi8(4));
}
ALWAYS void q3_k_iload(const istate *s, int c, __m256i *wl, __m256i *wh) {
    oct_words(s, c, wl, wh);
    __m256i lanes = _mm256_shuffle_epi8(words8(s->h + 16 * (c >> 1)),
                                        _mm256_setr_epi8(0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13,
                                                         0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13));
    const unsigned odd = (unsigned)(c & 1);
    *wl = _mm256_or_si256(*wl, third_fours(lanes, 1u << odd));
    *wh = _mm256_or_si256(*wh, third_fours(lanes, 4u << odd));
}

/* the rows' int32 sums AL / AH (expressions in r and c: row r's for word c) over a sub-block's
 * WORDS words of R rows (XR: row r's int8 inputs), WORD(f, c, wl, wh) giving word c (unpacked from
 * the panel, or read from a buffer of them): int16 pair sums of F##_STEPS16 words first where
 * LP_INT16_SUMS takes the format (a K-quant's times its integer scales st.il / st.ih in the same
 * vpmaddwd), else f##_dot a word; then, for a format whose words hold q rather than q + 128 on
 * AVX2, 128 times the activations' sum. The sums are integers, exact in any order: whichever tile
 * runs them, the same. */
#define WORD_SUMS(F, f, R, WORDS, WORD, XR, AL, AH)                                                \
    if (LP_INT16_SUMS && F##_STEPS16 > 0) {                                                        \
        const __m256i ones16 = _mm256_set1_epi16(1);                                               \
        _Pragma("GCC unroll 8") for (int c0 = 0; c0 < (WORDS); c0 += (F##_STEPS16 > 0 ? F##_STEPS16 : 1)) { \
            __m256i pl[R], ph[R];                                                                  \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) pl[r] = ph[r] = _mm256_setzero_si256(); \
            _Pragma("GCC unroll 8") for (int c = c0; c < c0 + F##_STEPS16 && c < (WORDS); c++) {   \
                __m256i wl, wh;                                                                    \
                WORD(f, c, wl, wh);                                                                \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                              \
                    __m256i xb = XFOUR(F, (XR) + s0, c);                                           \
                    pl[r] = _mm256_add_epi16(pl[r], _mm256_maddubs_epi16(wl, xb));                 \
                    ph[r] = _mm256_add_epi16(ph[r], _mm256_maddubs_epi16(wh, xb));                 \
                }                                                                                  \
            }                                                                                      \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                  \
                const int c = c0; /* (AL and AH may name a word's chain) */                        \
                (void)c;                                                                           \
                AL = _mm256_add_epi32(AL, _mm256_madd_epi16(pl[r], F##_KQ ? st.il : ones16));      \
                AH = _mm256_add_epi32(AH, _mm256_madd_epi16(ph[r], F##_KQ ? st.ih : ones16));      \
            }                                                                                      \
        }                                                                                          \
    } else {                                                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < (WORDS); c++) {                                \
            __m256i wl, wh;                                                                        \
            WORD(f, c, wl, wh);                                                                    \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                  \
                __m256i xb = XFOUR(F, (XR) + s0, c);                                               \
                AL = f##_dot(AL, wl, xb);                                                          \
                AH = f##_dot(AH, wh, xb);                                                          \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    if (LP_INT16_SUMS && F##_PLUS128)                                                              \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                      \
            const int c = 0;                                                                       \
            (void)c;                                                                               \
            const __m256i more = _mm256_set1_epi32(128 * sum32_i8((XR) + s0));                     \
            AL = _mm256_add_epi32(AL, more);                                                       \
            AH = _mm256_add_epi32(AH, more);                                                       \
        }

/* WORD_SUMS's words: unpacked from the panel by the sub-block's state st, or read from the
 * buffers wls / whs they were unpacked into */
#define UNPACKED_WORD(f, c, wl, wh) f##_iload(&st, (c), &(wl), &(wh))
#define BUFFERED_WORD(f, c, wl, wh) ((wl) = wls[c], (wh) = whs[c])

/* a sub-block's words into the rows' int32 sums AL / AH (WORD_SUMS) */
#define SUB_BLOCK_WORDS(F, f, R, AL, AH) WORD_SUMS(F, f, R, F##_SUB / 4, UNPACKED_WORD, xr[r], AL, AH)

/* RR rows on one panel of format F over all k inputs (formats.h: the sum rule) */
#define ITILE(NAME, F, f, RR)                                                                      \
    static void NAME(const lp_q8 *x, long r0, const void *wv, float *y, long ys) {                \
        enum { R = RR, S = CHAINS(RR) };                                                           \
        const uint8_t *w = (const uint8_t *)wv;                                                    \
        const long k = x->k;                                                                       \
        const int8_t *xr[R];                                                                       \
        __m256 sl[R], sh[R];                                                                       \
        __m256i kl[R], kh[R]; /* a K-quant super-block's S1 so far */                            \
        ksuper ks;                                                                                 \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                      \
            xr[r] = x->q + (r0 + r) * k;                                                           \
            sl[r] = sh[r] = _mm256_setzero_ps();                                                   \
            kl[r] = kh[r] = _mm256_setzero_si256();                                                \
        }                                                                                          \
        for (long s0 = 0; s0 < k; s0 += F##_SUB) {                                                \
            istate st;                                                                             \
            const uint8_t *pb = w + s0 / F##_BLOCK * F##_PB;                                       \
            if (F##_KQ && s0 % 256 == 0) f##_ksuper(&ks, pb);                                      \
            f##_iset(&st, pb, (int)(s0 % F##_BLOCK / F##_SUB), &ks);                               \
            if (r0 == 0)                                                                           \
                PREFETCH_SUB(F, F##_SUB, w, LP_AHEAD_PANELS * (k / F##_BLOCK * F##_PB), s0);       \
            __m256i al[R][S], ah[R][S];                                                            \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                    \
                _Pragma("GCC unroll 2") for (int c = 0; c < S; c++) al[r][c] = ah[r][c] = _mm256_setzero_si256(); \
            SUB_BLOCK_WORDS(F, f, R, al[r][c % S], ah[r][c % S])                                   \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                  \
                __m256i il = al[r][0], ih = ah[r][0];                                              \
                if (S > 1) {                                                                       \
                    il = _mm256_add_epi32(il, al[r][S - 1]);                                       \
                    ih = _mm256_add_epi32(ih, ah[r][S - 1]);                                       \
                }                                                                                  \
                if (F##_KQ) {                                                                      \
                    kl[r] = _mm256_add_epi32(kl[r], KSCALED(F, il, st.il));                        \
                    kh[r] = _mm256_add_epi32(kh[r], KSCALED(F, ih, st.ih));                        \
                    if (KLAST(F)) {                                                                \
                        __m256i ml, mh;                                                            \
                        kmins8(&ks, KBSUMS(F, r0 + r), 128 / F##_SUB, &ml, &mh);                   \
                        __m256 dx = _mm256_set1_ps(KDX(F, r0 + r));                                \
                        sl[r] = kcombine8(sl[r], kl[r], ml, ks.dl, ks.ml, dx);                     \
                        sh[r] = kcombine8(sh[r], kh[r], mh, ks.dh, ks.mh, dx);                     \
                        kl[r] = kh[r] = _mm256_setzero_si256();                                    \
                    }                                                                              \
                } else {                                                                           \
                    const float *ss = x->s + (r0 + r) * (k / 16) + s0 / 16;                        \
                    __m256 d = _mm256_set1_ps(x->d[(r0 + r) * (k / 32) + s0 / 32]);                \
                    __m256 s = _mm256_set1_ps(F##_SUB == 32 ? ss[0] + ss[1] : ss[0]);             \
                    sl[r] = combine8(sl[r], il, st.dl, st.ol, d, s);                               \
                    sh[r] = combine8(sh[r], ih, st.dh, st.oh, d, s);                               \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                      \
            _mm256_storeu_ps(y + r * ys, sl[r]);                                                   \
            _mm256_storeu_ps(y + r * ys + 8, sh[r]);                                               \
        }                                                                                          \
    }

/* RR rows on one panel as ITILE, with the rows' float sums in y (in L1) rather than in registers:
 * for more rows than the registers hold sums for, so a pass of up to LP_INT_ROWS rows unpacks each
 * word once. The same operations in the same order as ITILE: the same bits. */
#define ITILE_Y(NAME, F, f, RR)                                                                    \
    static void NAME(const lp_q8 *x, long r0, const void *wv, float *y, long ys) {                \
        enum { R = RR };                                                                           \
        const uint8_t *w = (const uint8_t *)wv;                                                    \
        const long k = x->k;                                                                       \
        const int8_t *xr[R];                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) xr[r] = x->q + (r0 + r) * k;           \
        ZERO_Y_ROWS(R)                                                                             \
        for (long s0 = 0; s0 < k; s0 += F##_SUB) {                                                \
            ISUB_STATE(F, f)                                                                       \
            __m256i al[R], ah[R];                                                                  \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) al[r] = ah[r] = _mm256_setzero_si256(); \
            SUB_BLOCK_WORDS(F, f, R, al[r], ah[r])                                                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) ADD_INTO_Y(F, r, al[r], ah[r])     \
        }                                                                                          \
    }

/* (ITILE_Y, ITILE_W) the float sums of R rows in y, zeroed, and their K-quant super-block's
 * integer sums S1 (ky, in L1) */
#define ZERO_Y_ROWS(R)                                                                             \
    __m256i ky[R][2];                                                                              \
    ksuper ks;                                                                                     \
    _Pragma("GCC unroll 8") for (int r = 0; r < (R); r++) {                                        \
        _mm256_storeu_ps(y + r * ys, _mm256_setzero_ps());                                         \
        _mm256_storeu_ps(y + r * ys + 8, _mm256_setzero_ps());                                     \
        ky[r][0] = ky[r][1] = _mm256_setzero_si256();                                              \
    }

/* (ITILE_Y, ITILE_W) sub-block s0's scales and offsets in st (a K-quant's super-block in ks at
 * its first); the first row group prefetches */
#define ISUB_STATE(F, f)                                                                           \
    istate st;                                                                                     \
    const uint8_t *pb = w + s0 / F##_BLOCK * F##_PB;                                               \
    if (F##_KQ && s0 % 256 == 0) f##_ksuper(&ks, pb);                                              \
    f##_iset(&st, pb, (int)(s0 % F##_BLOCK / F##_SUB), &ks);                                       \
    if (r0 == 0)                                                                                   \
        PREFETCH_SUB(F, F##_SUB, w, LP_AHEAD_PANELS * (k / F##_BLOCK * F##_PB), s0);

/* (ITILE_Y, ITILE_W) row r's integer sums AL / AH of sub-block s0 into its float sums in y, as
 * ITILE adds them into its registers */
#define ADD_INTO_Y(F, r, AL, AH)                                                                   \
    if (F##_KQ) {                                                                                  \
        ky[r][0] = _mm256_add_epi32(ky[r][0], KSCALED(F, AL, st.il));                              \
        ky[r][1] = _mm256_add_epi32(ky[r][1], KSCALED(F, AH, st.ih));                              \
        if (KLAST(F)) {                                                                            \
            __m256i ml, mh;                                                                        \
            kmins8(&ks, KBSUMS(F, r0 + (r)), 128 / F##_SUB, &ml, &mh);                             \
            __m256 dx = _mm256_set1_ps(KDX(F, r0 + (r)));                                          \
            float *o = y + (r) * ys;                                                               \
            _mm256_storeu_ps(o, kcombine8(_mm256_loadu_ps(o), ky[r][0], ml, ks.dl, ks.ml, dx));    \
            _mm256_storeu_ps(o + 8, kcombine8(_mm256_loadu_ps(o + 8), ky[r][1], mh, ks.dh, ks.mh, dx)); \
            ky[r][0] = ky[r][1] = _mm256_setzero_si256();                                          \
        }                                                                                          \
    } else {                                                                                       \
        const float *ss = x->s + (r0 + (r)) * (k / 16) + s0 / 16;                                  \
        __m256 d = _mm256_set1_ps(x->d[(r0 + (r)) * (k / 32) + s0 / 32]);                          \
        __m256 s = _mm256_set1_ps(F##_SUB == 32 ? ss[0] + ss[1] : ss[0]);                         \
        float *o = y + (r) * ys;                                                                   \
        _mm256_storeu_ps(o, combine8(_mm256_loadu_ps(o), AL, st.dl, st.ol, d, s));                 \
        _mm256_storeu_ps(o + 8, combine8(_mm256_loadu_ps(o + 8), AH, st.dh, st.oh, d, s));         \
    }

/* RR rows on one panel as ITILE_Y, for 7-8 rows on AVX2, whose 16 registers do not hold their
 * int16 and int32 sums (ITILE_Y's row-inner loop spills them at every word; two 4-row tiles unpack
 * every word twice): each sub-block's words are unpacked once into wls / whs (in L1), then the rows
 * run over them one after another, each with its sums in four registers. (Two rows at a time, one
 * load of a word serving both, measured no faster; for 3-6 rows ITILE and ITILE_Y measured faster
 * than this.) The same integers (exact sums) and the same
 * float operations in the same order as ITILE: the same bits. */
#define ITILE_W(NAME, F, f, RR)                                                                    \
    static void NAME(const lp_q8 *x, long r0, const void *wv, float *y, long ys) {                \
        enum { R = RR, WORDS = F##_SUB / 4 };                                                     \
        const uint8_t *w = (const uint8_t *)wv;                                                    \
        const long k = x->k;                                                                       \
        _Alignas(32) __m256i wls[WORDS], whs[WORDS];                                               \
        ZERO_Y_ROWS(R)                                                                             \
        for (long s0 = 0; s0 < k; s0 += F##_SUB) {                                                \
            ISUB_STATE(F, f)                                                                       \
            _Pragma("GCC unroll 8") for (int c = 0; c < WORDS; c++) f##_iload(&st, c, &wls[c], &whs[c]); \
            for (int row = 0; row < R; row++) {                                                    \
                const int8_t *xr = x->q + (r0 + row) * k;                                          \
                __m256i al = _mm256_setzero_si256(), ah = _mm256_setzero_si256();                  \
                WORD_SUMS(F, f, 1, WORDS, BUFFERED_WORD, xr, al, ah)                               \
                ADD_INTO_Y(F, row, al, ah)                                                         \
            }                                                                                      \
        }                                                                                          \
    }

/* the one-panel tiles by rows: sums in registers for up to 4 rows, in y for 5 and 6 */
#define PANEL_TILES(F, f)                                                                          \
    ITILE(f##_i1, F, f, 1)                                                                         \
    ITILE(f##_i2, F, f, 2)                                                                         \
    ITILE(f##_i3, F, f, 3)                                                                         \
    ITILE(f##_i4, F, f, 4)                                                                         \
    ITILE_Y(f##_i5, F, f, 5)                                                                       \
    ITILE_Y(f##_i6, F, f, 6)

/* the format's row of integer tiles (formats.h), from its tiles f##_i1 .. f##_i8 and PAIRS: NULL,
 * or the two-panel tiles f##_p1 .. f##_p8 */
#define INT_TILES_ROW(F, f, PAIRS)                                                                 \
    const lp_int_tiles lp_int_tiles_##f = {{NULL, f##_i1, f##_i2, f##_i3, f##_i4, f##_i5, f##_i6, f##_i7, f##_i8}, \
                                           {PAIRS}, 8, F##_KQ ? F##_SUB : 0};
#define INT_PAIRS(f) NULL, f##_p1, f##_p2, f##_p3, f##_p4, f##_p5, f##_p6, f##_p7, f##_p8

/* The formats with integer tiles, one row each: X(F, f, octs, steps16, plus128, kq)
 *   F, f     the format's ID and name (formats.h's LP_FORMAT_LIST): its f##_iset, f##_iload, f##_dot
 *            above, and the tiles' names
 *   octs     1: its words take every other input of an oct (Q2_K, Q3_K: oct_four, oct_words)
 *   steps16  words whose pair sums add up in int16 (LP_INT16_SUMS; 0: none)
 *   plus128  1: its words hold q + 128 (Q8_0), so AVX2's int16 route adds 128 times the activations'
 *            sum
 *   kq       1: a K-quant, on Q8_K activations (f##_ksuper; formats.h), else on Q8_0's
 * Each build expands its tiles over it (LP_INT_FORMATS(ITILES_OF)). */
#define LP_INT_FORMATS(X)                                                                          \
    X(Q4_0, q4_0, 0, 8, 0, 0)                                                                      \
    X(Q4_1, q4_1, 0, 8, 0, 0)                                                                      \
    X(Q4_K, q4_k, 0, 8, 0, 1)                                                                      \
    X(Q6_K, q6_k, 0, 2, 0, 1)                                                                      \
    X(Q5_0, q5_0, 0, 4, 0, 0)                                                                      \
    X(Q5_1, q5_1, 0, 4, 0, 0)                                                                      \
    X(Q5_K, q5_k, 0, 4, 0, 1)                                                                      \
    X(Q8_0, q8_0, 0, 0, 1, 0)                                                                      \
    X(Q2_K, q2_k, 1, 4, 0, 1)                                                                      \
    X(Q3_K, q3_k, 1, 4, 0, 1)
#define INT_FACTS(F, f, octs, steps16, plus128, kq)                                                \
    enum { F##_OCTS = octs, F##_STEPS16 = steps16, F##_PLUS128 = plus128, F##_KQ = kq };
LP_INT_FORMATS(INT_FACTS)

#endif
