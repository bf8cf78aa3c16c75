/* The product tiles for AVX2 + FMA + F16C over the block formats of quant.h (lp_tiles in
 * formats.h).
 *
 * A tile widens each input's 16 panel rows to fp32 in two registers (rows 0-7, rows 8-15), once
 * per input and panel, and applies them to every row of the tile with one FMA per row and half:
 * R rows x 16 P outputs of sums in registers, as the fp32 tiles keep them, each output summed by
 * the block rule of LP_BLOCK (a chain of FMAs over each block's inputs in order, the blocks' sums
 * added in order). A widened weight is exactly gguf's fp32 value (quant.h), so every output is the
 * fp32 format's product of the dequantized matrix, bit for bit, whatever the tile or thread.
 *
 * Widening: a sub-block's scales are read once per panel (f16 by F16C; sub-block scales and mins
 * as gguf computes them, d * sc in fp32); quants come 4 or 8 inputs to a 32-byte word, each
 * input's field taken out by one AND at its place, as q 2^s (converted exactly), and multiplied by
 * scale 2^-s. Offsets (Q4_1's m, the K-quants' -dmin m, Q4_0's -8 d, Q6_K's -32 d sc) are added in
 * the same fused multiply-add: scale * q is exact in fp32 (quant.h), so the one rounding of the
 * FMA is the rounding of gguf's separate multiply and add. High bits (Q5, Q6_K, Q3_K) are shifted
 * to their fields once per input and merged with an OR, or with a subtraction where they are
 * stored inverted (q - 16 = nibble - 16 NOT bit).
 *
 * Shapes: register tiles where the sums and the widening state fit the 16 registers without
 * spilling (1-4 rows on a panel, 1-2 rows on two panels); 5-6 rows on a panel, and any number of
 * rows beyond LP_GROUP_ROWS (many_rows), widen each block of LP_BLOCK inputs of a panel once into
 * 4 KB of fp32 in L1 and run fp32 register tiles over it for every group of rows, so a 16-row
 * pass widens each weight once, not once per group.
 */
#include "quant_avx2.h"

/* ----- tiles ----- */

/* RR rows x PP panels of format F (literal constants): a register tile of tiles_avx2.h */
#define QTILE(NAME, F, f, RR, PP)                                                                  \
    static void NAME(const float *x, long k, long from, long to, const void *wv, long panel_bytes, float *y, long ys, \
                     int fetch) {                                                                  \
        enum { R = RR, P = PP };                                                                   \
        const uint8_t *w = (const uint8_t *)wv;                                                    \
        ROW_INPUTS(x, k)                                                                           \
        for (long i0 = from; i0 < to; i0 += LP_BLOCK) {                                            \
            long i1 = i0 + LP_BLOCK < k ? i0 + LP_BLOCK : k;                                       \
            ZERO_ROWS                                                                              \
            for (long s0 = i0; s0 < i1; s0 += F##_SUB) {                                           \
                const uint8_t *pb = w + s0 / F##_BLOCK * F##_PB;                                   \
                const int sub = (int)(s0 % F##_BLOCK / F##_SUB);                                   \
                qstate st0, st1, st2, st3;                                                         \
                if (P > 0) f##_setup(&st0, pb, sub);                                              \
                if (P > 1) f##_setup(&st1, pb + panel_bytes, sub);                                \
                if (P > 2) f##_setup(&st2, pb + 2 * panel_bytes, sub);                            \
                if (P > 3) f##_setup(&st3, pb + 3 * panel_bytes, sub);                            \
                if (fetch)                                                                         \
                    for (int q = 0; q < P; q++)                                                    \
                        PREFETCH_SUB(F, F##_SUB, w, (LP_AHEAD_PANELS + q) * panel_bytes, s0); \
                for (int c = 0; c < F##_SUB / F##_CHUNK; c++) {                                    \
                    qraw r0, r1, r2, r3;                                                           \
                    if (P > 0) f##_load(&st0, c, &r0);                                            \
                    if (P > 1) f##_load(&st1, c, &r1);                                            \
                    if (P > 2) f##_load(&st2, c, &r2);                                            \
                    if (P > 3) f##_load(&st3, c, &r3);                                            \
                    const long ic = s0 + (long)c * F##_CHUNK;                                      \
                    _Pragma("GCC unroll 8") for (int t = 0; t < F##_CHUNK; t++) {                  \
                        v16 w0, w1, w2, w3;                                                        \
                        if (P > 0) w0 = f##_widen(&st0, &r0, t);                                  \
                        if (P > 1) w1 = f##_widen(&st1, &r1, t);                                  \
                        if (P > 2) w2 = f##_widen(&st2, &r2, t);                                  \
                        if (P > 3) w3 = f##_widen(&st3, &r3, t);                                  \
                        (void)w0; (void)w1; (void)w2; (void)w3;                                    \
                        FMA_ROWS(ic + t)                                                           \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            STORE_ROWS                                                                             \
        }                                                                                          \
    }

/* ----- many rows: each block of a panel widened once into L1, every row group over it ----- */

/* widens inputs [i0, i1) of a panel (LP_BLOCK at most, whole sub-blocks) into buf[(i - i0) 16 + j],
 * prefetching the same inputs of the panel `ahead` bytes on */
#define WIDEN_BLOCK(NAME, F, f)                                                                    \
    static void NAME(const uint8_t *w, long i0, long i1, float *buf, long ahead) {                \
        for (long s0 = i0; s0 < i1; s0 += F##_SUB) {                                               \
            qstate st;                                                                             \
            f##_setup(&st, w + s0 / F##_BLOCK * F##_PB, (int)(s0 % F##_BLOCK / F##_SUB));          \
            PREFETCH_SUB(F, F##_SUB, w, ahead, s0); \
            for (int c = 0; c < F##_SUB / F##_CHUNK; c++) {                                        \
                qraw r;                                                                            \
                f##_load(&st, c, &r);                                                              \
                _Pragma("GCC unroll 8") for (int t = 0; t < F##_CHUNK; t++) {                      \
                    v16 v = f##_widen(&st, &r, t);                                                 \
                    float *o = buf + (s0 - i0 + (long)c * F##_CHUNK + t) * LP_PANEL;               \
                    _mm256_store_ps(o, v.lo);                                                      \
                    _mm256_store_ps(o + 8, v.hi);                                                  \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

/* R rows (1-6) on the widened block buf of inputs [i0, i1): the fp32 tile's sums */
#define BUF_TILE(NAME, RR)                                                                         \
    static void NAME(const float *x, long k, long i0, long i1, const float *buf, float *y, long ys) { \
        enum { R = RR, P = 1 };                                                                    \
        ROW_INPUTS(x, k)                                                                           \
        ZERO_ROWS                                                                                  \
        for (long i = i0; i < i1; i++) {                                                           \
            const float *o = buf + (i - i0) * LP_PANEL;                                            \
            v16 w0 = {_mm256_load_ps(o), _mm256_load_ps(o + 8)}, w1 = w0, w2 = w0, w3 = w0;        \
            (void)w1; (void)w2; (void)w3;                                                          \
            FMA_ROWS(i)                                                                            \
        }                                                                                          \
        STORE_ROWS                                                                                 \
    }
BUF_TILE(buf1, 1)
BUF_TILE(buf2, 2)
BUF_TILE(buf3, 3)
BUF_TILE(buf4, 4)
BUF_TILE(buf5, 5)
BUF_TILE(buf6, 6)

typedef void (*buf_tile)(const float *, long, long, long, const float *, float *, long);
static const buf_tile buf_tiles[LP_GROUP_ROWS + 1] = {NULL, buf1, buf2, buf3, buf4, buf5, buf6};

/* m rows (any number) on `panels` panels, inputs [from, to) (LP_BLOCK granularity): each block of
 * a panel widened once into buf, then the rows in even groups of at most LP_GROUP_ROWS over it */
static void rows_on_buffer(void (*widen)(const uint8_t *, long, long, float *, long), const float *x,
                           long m, long k,
                           long from, long to, const void *w, long panel_bytes, long panels, float *y, long ys) {
    _Alignas(64) float buf[LP_BLOCK * LP_PANEL];
    long groups = (m + LP_GROUP_ROWS - 1) / LP_GROUP_ROWS;
    for (long p = 0; p < panels; p++)
        for (long i0 = from; i0 < to; i0 += LP_BLOCK) {
            long i1 = i0 + LP_BLOCK < k ? i0 + LP_BLOCK : k;
            widen((const uint8_t *)w + p * panel_bytes, i0, i1, buf, LP_AHEAD_PANELS * panel_bytes);
            for (long g = 0, r0 = 0; g < groups; g++) { /* 16 rows = 6 + 5 + 5 */
                long nr = m / groups + (g < m % groups);
                buf_tiles[nr](x + r0 * k, k, i0, i1, buf, y + r0 * ys + p * LP_PANEL, ys);
                r0 += nr;
            }
        }
}

/* ----- each format's tiles ----- */

/* Register tiles where their sums and widening state fit the 16 registers (1-4 rows on a panel,
 * 1-2 rows on two); one row on four panels is two runs on two, three rows on two panels one run
 * per panel; 5-6 rows on a panel, and more than LP_GROUP_ROWS on any, go through the buffer. */
#define QTILES(F, f)                                                                               \
    QTILE(f##_1x1, F, f, 1, 1)                                                                     \
    QTILE(f##_2x1, F, f, 2, 1)                                                                     \
    QTILE(f##_3x1, F, f, 3, 1)                                                                     \
    QTILE(f##_4x1, F, f, 4, 1)                                                                     \
    QTILE(f##_1x2, F, f, 1, 2)                                                                     \
    QTILE(f##_2x2, F, f, 2, 2)                                                                     \
    static void f##_1x4(const float *x, long k, long from, long to, const void *w, long panel_bytes, float *y, \
                        long ys, int fetch) {                                                      \
        f##_1x2(x, k, from, to, w, panel_bytes, y, ys, fetch);                                    \
        f##_1x2(x, k, from, to, (const uint8_t *)w + 2 * panel_bytes, panel_bytes, y + 2 * LP_PANEL, ys, fetch); \
    }                                                                                              \
    static void f##_3x2(const float *x, long k, long from, long to, const void *w, long panel_bytes, float *y, \
                        long ys, int fetch) {                                                      \
        f##_3x1(x, k, from, to, w, panel_bytes, y, ys, fetch);                                    \
        f##_3x1(x, k, from, to, (const uint8_t *)w + panel_bytes, panel_bytes, y + LP_PANEL, ys, fetch); \
    }                                                                                              \
    WIDEN_BLOCK(f##_widen_block, F, f)                                                             \
    static void f##_5x1(const float *x, long k, long from, long to, const void *w, long panel_bytes, float *y, \
                        long ys, int fetch) {                                                      \
        (void)fetch;                                                                               \
        rows_on_buffer(f##_widen_block, x, 5, k, from, to, w, panel_bytes, 1, y, ys);              \
    }                                                                                              \
    static void f##_6x1(const float *x, long k, long from, long to, const void *w, long panel_bytes, float *y, \
                        long ys, int fetch) {                                                      \
        (void)fetch;                                                                               \
        rows_on_buffer(f##_widen_block, x, 6, k, from, to, w, panel_bytes, 1, y, ys);              \
    }                                                                                              \
    static void f##_many(const float *x, long m, long k, const void *w, long panel_bytes, long panels, float *y, \
                         long ys) {                                                                \
        rows_on_buffer(f##_widen_block, x, m, k, 0, k, w, panel_bytes, panels, y, ys);             \
    }                                                                                              \
    const lp_tiles lp_tiles_##f = {                                                                \
        .one_panel = {NULL, f##_1x1, f##_2x1, f##_3x1, f##_4x1, f##_5x1, f##_6x1},                 \
        .two_panels = {NULL, f##_1x2, f##_2x2, f##_3x2},                                           \
        .four_panels = f##_1x4,                                                                    \
        .pair_rest = 0,                                                                            \
        .even_groups = 1,                                                                          \
        .many_rows = f##_many,                                                                     \
    };

#define QTILES_OF(ID, name, ...) QTILES(ID, name)
LP_QUANT_FORMATS(QTILES_OF)

/* ----- the activations of the integer products (LP_ARITH_INT8), for both integer builds ----- */

/* the largest of eight lanes */
static float hmax8(__m256 v) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
}

/* formats.h's quantization, eight lanes at a time: the same max, product and rounding as the
 * scalar rule (_mm256_cvtps_epi32 rounds to nearest even, as nearbyintf does by default) */
void lp_q8_quantize(const float *x, long m, long k, int8_t *q, float *d, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (long r = 0; r < m; r++)
        for (long b = 0; b < k / 32; b++) {
            const float *xb = x + r * k + 32 * b;
            __m256 v[4], amax = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
            }
            float most = hmax8(amax);
            float inv = most > 0.0f ? 127.0f / most : 0.0f;
            d[r * (k / 32) + b] = most / 127.0f;
            __m256i qi[4];
            for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(mul(v[i], _mm256_set1_ps(inv)));
            /* int32 -> int8 in input order (packs interleave 128-bit lanes; the permute restores it) */
            __m256i q16a = _mm256_packs_epi32(qi[0], qi[1]), q16b = _mm256_packs_epi32(qi[2], qi[3]);
            __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(q + r * k + 32 * b), q8);
            for (int h = 0; h < 2; h++) {
                int sum = 0;
                for (int i = 0; i < 16; i++) sum += q[r * k + 32 * b + 16 * h + i];
                s[r * (k / 16) + 2 * b + h] = d[r * (k / 32) + b] * (float)sum;
            }
        }
}

/* formats.h's Q8_K rule (the K-quants' activations) on 256 inputs a super-block: x_m is the
 * largest input where its magnitude is at least the smallest's, else the smallest (llama.cpp takes
 * the first input of largest magnitude: the same magnitude, and x_m's sign changes no result, as
 * every q, d and sum then changes sign); the product and the rounding as the scalar rule's */
void lp_q8k_quantize(const float *x, long m, long k, long sub, int8_t *q, float *d, int16_t *bsum) {
    for (long r = 0; r < m; r++)
        for (long b = 0; b < k / 256; b++) {
            const float *xb = x + r * k + 256 * b;
            int8_t *qb = q + r * k + 256 * b;
            __m256 hi = _mm256_loadu_ps(xb), lo = hi;
            for (int i = 8; i < 256; i += 8) {
                __m256 v = _mm256_loadu_ps(xb + i);
                hi = _mm256_max_ps(hi, v);
                lo = _mm256_min_ps(lo, v);
            }
            float most = hmax8(hi), least = -hmax8(neg(lo));
            float x_m = most >= -least ? most : least;
            if (x_m == 0.0f) {
                d[r * (k / 256) + b] = 0.0f;
                memset(qb, 0, 256);
            } else {
                const float iscale = -127.0f / x_m;
                const __m256 scale = _mm256_set1_ps(iscale);
                const __m256i top = _mm256_set1_epi32(127);
                for (int i = 0; i < 256; i += 32) {
                    __m256i qi[4];
                    for (int j = 0; j < 4; j++)
                        qi[j] = _mm256_min_epi32(_mm256_cvtps_epi32(mul(_mm256_loadu_ps(xb + i + 8 * j), scale)), top);
                    __m256i q16a = _mm256_packs_epi32(qi[0], qi[1]), q16b = _mm256_packs_epi32(qi[2], qi[3]);
                    _mm256_storeu_si256((__m256i *)(qb + i),
                                        _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b),
                                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
                }
                d[r * (k / 256) + b] = 1.0f / iscale;
            }
            lp_q8k_sums(qb, sub, bsum + r * (k / sub) + b * (256 / sub));
        }
}
