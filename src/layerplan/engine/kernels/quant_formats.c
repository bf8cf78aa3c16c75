/* The GGUF block formats' portable side (see quant.h for the layouts): the stored blocks read
 * into their fields, those fields dequantized as gguf does and packed into panels, the packed
 * panels read back (for the generic tiles), and fp32 quantized into stored blocks.
 *
 * Every fp32 operation of a dequantization is written as gguf-py's quants.py orders it, one
 * operation per rounding; the library is built with -std=c11, which keeps GCC from contracting a
 * multiply and an add into a fused multiply-add, so (d * q) + m rounds twice, as numpy does.
 */
#include <math.h>

#include "quant.h"

/* ----- a stored block's fields ----- */

/* The fields of one stored block: its f16 scales' bits, its sub-blocks' scales and mins (as
 * stored, unsigned), and its quants in input order (unsigned: Q5 0..31, Q6_K 0..63, Q3_K low
 * 2 bits | third bit << 2, so 0..7). */
typedef struct {
    uint16_t d, m; /* d, and m (Q4_1, Q5_1) or dmin (Q2_K, Q4_K, Q5_K) */
    uint8_t sc[16], mn[16];
    uint8_t q[LPQ_QK];
} lpq_fields;

static inline uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

static void fields_q8_0(const uint8_t *b, lpq_fields *f) {
    f->d = le16(b);
    for (int e = 0; e < 32; e++) f->q[e] = b[2 + e]; /* int8 bits */
}

/* element e < 16: the low nibble of qs[e]; e >= 16: the high nibble of qs[e - 16] */
static void nibbles32(const uint8_t *qs, uint8_t *q) {
    for (int e = 0; e < 16; e++) { q[e] = qs[e] & 0xF; q[e + 16] = qs[e] >> 4; }
}

static void fields_q4_0(const uint8_t *b, lpq_fields *f) { f->d = le16(b); nibbles32(b + 2, f->q); }
static void fields_q4_1(const uint8_t *b, lpq_fields *f) { f->d = le16(b); f->m = le16(b + 2); nibbles32(b + 4, f->q); }

static void fields_q5_0(const uint8_t *b, lpq_fields *f) {
    f->d = le16(b);
    uint32_t qh = le32(b + 2);
    nibbles32(b + 6, f->q);
    for (int e = 0; e < 32; e++) f->q[e] |= (uint8_t)((qh >> e & 1u) << 4);
}

static void fields_q5_1(const uint8_t *b, lpq_fields *f) {
    f->d = le16(b);
    f->m = le16(b + 2);
    uint32_t qh = le32(b + 4);
    nibbles32(b + 8, f->q);
    for (int e = 0; e < 32; e++) f->q[e] |= (uint8_t)((qh >> e & 1u) << 4);
}

/* Q2_K: scales[16] | qs[64] | d | dmin; element e = 128 h + 32 s + b: (qs[32 h + b] >> 2 s) & 3 */
static void fields_q2_k(const uint8_t *b, lpq_fields *f) {
    for (int s = 0; s < 16; s++) { f->sc[s] = b[s] & 0xF; f->mn[s] = b[s] >> 4; }
    /* (loops over runs of 32 consecutive elements: the compiler vectorises them; a first start
     * packs a whole model through these) */
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int t = 0; t < 32; t++) f->q[128 * h + 32 * s + t] = b[16 + 32 * h + t] >> (2 * s) & 3;
    f->d = le16(b + 80);
    f->m = le16(b + 82);
}

/* Q3_K: hmask[32] | qs[64] | scales[12] | d; low bits as Q2_K's, third bit e: hmask[e % 32] >> (e / 32) */
static void fields_q3_k(const uint8_t *b, lpq_fields *f) {
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int t = 0; t < 32; t++) {
                int e = 128 * h + 32 * s + t;
                f->q[e] = (uint8_t)((b[32 + 32 * h + t] >> (2 * s) & 3) | (b[t] >> (4 * h + s) & 1) << 2);
            }
    const uint8_t *s12 = b + 96;
    for (int s = 0; s < 16; s++)
        f->sc[s] = (uint8_t)((s12[s % 8] >> (4 * (s / 8)) & 0xF) | (s12[8 + s % 4] >> (2 * (s / 4)) & 3) << 4);
    f->d = le16(b + 108);
}

/* Q4_K / Q5_K's 12 bytes of 6-bit scales and mins (ggml's get_scale_min_k4) */
static void scales_k4(const uint8_t *s12, lpq_fields *f) {
    for (int s = 0; s < 4; s++) {
        f->sc[s] = s12[s] & 63;
        f->mn[s] = s12[s + 4] & 63;
        f->sc[s + 4] = (uint8_t)((s12[s + 8] & 0xF) | (s12[s] >> 6) << 4);
        f->mn[s + 4] = (uint8_t)((s12[s + 8] >> 4) | (s12[s + 4] >> 6) << 4);
    }
}

/* Q4_K: d | dmin | scales[12] | qs[128]; element e = 64 j + 32 h + b: (qs[32 j + b] >> 4 h) & 15 */
static void fields_q4_k(const uint8_t *b, lpq_fields *f) {
    f->d = le16(b);
    f->m = le16(b + 2);
    scales_k4(b + 4, f);
    for (int j = 0; j < 4; j++)
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 32; t++) f->q[64 * j + 32 * h + t] = b[16 + 32 * j + t] >> (4 * h) & 0xF;
}

/* Q5_K: as Q4_K with qh[32] before qs: fifth bit e = qh[e % 32] >> (e / 32) */
static void fields_q5_k(const uint8_t *b, lpq_fields *f) {
    f->d = le16(b);
    f->m = le16(b + 2);
    scales_k4(b + 4, f);
    for (int j = 0; j < 4; j++)
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 32; t++) {
                int e = 64 * j + 32 * h + t;
                f->q[e] = (uint8_t)((b[48 + 32 * j + t] >> (4 * h) & 0xF) | (b[16 + t] >> (2 * j + h) & 1) << 4);
            }
}

/* Q6_K: ql[128] | qh[64] | scales[16] (int8) | d; element e = 128 h + r: low nibble
 * (ql[64 h + r % 64] >> 4 (r / 64)) & 15, high bits (qh[32 h + r % 32] >> 2 (r / 32)) & 3 */
static void fields_q6_k(const uint8_t *b, lpq_fields *f) {
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int t = 0; t < 32; t++) {
                unsigned low = b[64 * h + 32 * (s % 2) + t] >> (4 * (s / 2)) & 0xF, high = b[128 + 32 * h + t] >> (2 * s) & 3;
                f->q[128 * h + 32 * s + t] = (uint8_t)(low | high << 4);
            }
    for (int s = 0; s < 16; s++) f->sc[s] = b[192 + s];
    f->d = le16(b + 208);
}

/* ----- dequantization: gguf's values ----- */

static void values(int format, const lpq_fields *f, float *out) {
    float d = f16_to_f32(f->d), m = f16_to_f32(f->m);
    switch (format) {
    case LP_FORMAT_Q8_0:
        for (int e = 0; e < 32; e++) out[e] = (float)(int8_t)f->q[e] * d;
        break;
    case LP_FORMAT_Q4_0:
        for (int e = 0; e < 32; e++) out[e] = d * (float)(f->q[e] - 8);
        break;
    case LP_FORMAT_Q5_0:
        for (int e = 0; e < 32; e++) out[e] = d * (float)(f->q[e] - 16);
        break;
    case LP_FORMAT_Q4_1:
    case LP_FORMAT_Q5_1:
        for (int e = 0; e < 32; e++) out[e] = d * (float)f->q[e] + m;
        break;
    case LP_FORMAT_Q2_K:
        for (int s = 0; s < 16; s++) {
            float dl = d * (float)f->sc[s], ml = m * (float)f->mn[s];
            for (int e = 16 * s; e < 16 * s + 16; e++) out[e] = dl * (float)f->q[e] - ml;
        }
        break;
    case LP_FORMAT_Q3_K:
        for (int s = 0; s < 16; s++) {
            float dl = d * (float)(f->sc[s] - 32);
            for (int e = 16 * s; e < 16 * s + 16; e++) out[e] = dl * (float)(f->q[e] - 4);
        }
        break;
    case LP_FORMAT_Q4_K:
    case LP_FORMAT_Q5_K:
        for (int s = 0; s < 8; s++) {
            float dl = d * (float)f->sc[s], ml = m * (float)f->mn[s];
            for (int e = 32 * s; e < 32 * s + 32; e++) out[e] = dl * (float)f->q[e] - ml;
        }
        break;
    case LP_FORMAT_Q6_K:
        for (int s = 0; s < 16; s++) {
            float dl = d * (float)(int8_t)f->sc[s];
            for (int e = 16 * s; e < 16 * s + 16; e++) out[e] = dl * (float)(f->q[e] - 32);
        }
        break;
    }
}

typedef struct {
    long block, block_bytes, panel_block; /* inputs and bytes of a stored block; bytes of a panel block */
    void (*fields)(const uint8_t *, lpq_fields *);
    /* one of these two: a row's block into the (zeroed) panel block, a field at a time; or the 16
     * rows' blocks at once, a word at a time (packing is then ~4x faster) */
    void (*put)(const lpq_fields *, int row, uint8_t *panel_block);
    void (*put_panel)(const lpq_fields *rows, uint8_t *panel_block);
} lpq_format;

static const lpq_format *lpq(int format);

LP_API int lp_dequantize_rows(int format, const void *rows, long count, long k, float *out) {
    if (format == LP_FORMAT_F32 || format == LP_FORMAT_BF16 || format == LP_FORMAT_F16) {
        if (count < 0 || k < 0) return LP_E_SHAPE;
        const uint16_t *h = (const uint16_t *)rows;
        if (format == LP_FORMAT_F32) memcpy(out, rows, sizeof(float) * (size_t)(count * k));
        else if (format == LP_FORMAT_BF16) for (long i = 0; i < count * k; i++) out[i] = bf16_to_f32(h[i]);
        else for (long i = 0; i < count * k; i++) out[i] = f16_to_f32(h[i]);
        return LP_OK;
    }
    const lpq_format *q = lpq(format);
    if (!q) return LP_E_TYPE;
    if (count < 0 || k < 0 || k % q->block) return LP_E_SHAPE;
    long blocks = count * (k / q->block);
    #pragma omp parallel for schedule(static) if (blocks >= 4096)
    for (long b = 0; b < blocks; b++) {
        lpq_fields f;
        q->fields((const uint8_t *)rows + b * q->block_bytes, &f);
        values(format, &f, out + b * q->block);
    }
    return LP_OK;
}

LP_API int lp_quantize_rows(int format, const float *x, long count, long k, void *out) {
    const lp_format_traits *f = lp_format(format);
    if (!f) return LP_E_TYPE;
    if (count < 0 || k < 0 || k % f->block) return LP_E_SHAPE;
    long blocks = count * (k / f->block), per = f->block < 256 ? 256 / f->block : 1; /* blocks to a task */
    #pragma omp parallel for schedule(static) if (blocks >= 4096)
    for (long b = 0; b < blocks; b += per) {
        long take = blocks - b < per ? blocks - b : per;
        f->from_f32(x + b * f->block, (char *)out + b * f->block_bytes, take * f->block);
    }
    return LP_OK;
}

/* ----- packing ----- */

/* row j's nibble v of input i (0..31 within its run of quads) into the quads at p */
static inline void put_nibble(uint8_t *p, int j, long i, unsigned v) {
    uint8_t *byte = p + 32 * (i / 4) + 4 * (j % 8) + i % 4;
    *byte |= (uint8_t)((v & 0xF) << (j < 8 ? 0 : 4));
}

/* row j's fifth bit of input i into 8-byte quads of bits at p */
static inline void put_fifth(uint8_t *p, int j, long i, unsigned bit) {
    p[8 * (i / 4) + j % 8] |= (uint8_t)((bit & 1) << (i % 4 + (j < 8 ? 0 : 4)));
}

/* row j's 2-bit field of input i into 32-byte octs at p: lane j % 8, bits 4 (i % 8) (+2 for j >= 8) */
static inline void put_pair(uint8_t *p, int j, long i, unsigned v) {
    int bit = 4 * (int)(i % 8) + (j < 8 ? 0 : 2);
    p[32 * (i / 8) + 4 * (j % 8) + bit / 8] |= (uint8_t)((v & 3) << (bit % 8));
}

/* into 16-bit lanes of `bytes`-byte groups of `per` inputs at p: lane j % 8, bit at[i % per] (+ hi
 * for j >= 8) */
static inline void put_lane16(uint8_t *p, int j, long i, unsigned v, int per, const int *at, int hi) {
    int bit = at[i % per] + (j < 8 ? 0 : hi);
    p[16 * (i / per) + 2 * (j % 8) + bit / 8] |= (uint8_t)(v << (bit % 8));
}

static const int Q6_AT[4] = {0, 2, 8, 10};             /* Q6_K's high bits: row j's; row j+8's 4 up */
static const int Q3_AT[8] = {0, 1, 4, 5, 8, 9, 12, 13}; /* Q3_K's third bits: row j's; row j+8's 2 up */

static void put_q8_0(const lpq_fields *f, int j, uint8_t *pb) {
    put16(pb + 2 * j, f->d);
    for (int i = 0; i < 32; i++) pb[32 + 16 * i + j] = f->q[i];
}

static void put_q5_0(const lpq_fields *f, int j, uint8_t *pb) {
    put16(pb + 2 * j, f->d);
    for (int i = 0; i < 32; i++) {
        put_fifth(pb + 32, j, i, ~f->q[i] >> 4 & 1); /* inverted: q - 16 = nibble - 16 (NOT bit) */
        put_nibble(pb + 96, j, i, f->q[i]);
    }
}

static void put_q5_1(const lpq_fields *f, int j, uint8_t *pb) {
    put16(pb + 2 * j, f->d);
    put16(pb + 32 + 2 * j, f->m);
    for (int i = 0; i < 32; i++) {
        put_fifth(pb + 64, j, i, f->q[i] >> 4);
        put_nibble(pb + 128, j, i, f->q[i]);
    }
}

static void put_q2_k(const lpq_fields *f, int j, uint8_t *pb) {
    put16(pb + 2 * j, f->d);
    put16(pb + 32 + 2 * j, f->m);
    for (int s = 0; s < 16; s++) pb[64 + 16 * s + j] = (uint8_t)(f->sc[s] | f->mn[s] << 4);
    for (int i = 0; i < LPQ_QK; i++) put_pair(pb + 320, j, i, f->q[i]);
}

static void put_q3_k(const lpq_fields *f, int j, uint8_t *pb) {
    put16(pb + 2 * j, f->d);
    for (int s = 0; s < 16; s++) {
        uint8_t *s12 = pb + 32 + 12 * s;
        s12[j % 8] |= (uint8_t)((f->sc[s] & 0xF) << (j < 8 ? 0 : 4));
        int bit = 4 * (j % 8) + (j < 8 ? 0 : 2);
        s12[8 + bit / 8] |= (uint8_t)((f->sc[s] >> 4) << (bit % 8));
    }
    for (int i = 0; i < LPQ_QK; i++) {
        put_pair(pb + 224, j, i, f->q[i] & 3);
        put_lane16(pb + 1248, j, i, ~f->q[i] >> 2 & 1, 8, Q3_AT, 2); /* inverted: q - 4 = low - 4 (NOT bit) */
    }
}

/* row j's scales and mins into each sub-block's 24 B, sub-block s's at pb + 64 + stride s */
static void put_scales_k4(const lpq_fields *f, int j, uint8_t *pb, int stride) {
    for (int s = 0; s < 8; s++) {
        uint8_t *s24 = pb + 64 + stride * s;
        s24[j] = (uint8_t)((f->sc[s] & 0xF) | (f->mn[s] & 0xF) << 4);
        s24[16 + j % 8] |= (uint8_t)(((f->sc[s] >> 4) | (f->mn[s] >> 4) << 2) << (j < 8 ? 0 : 4));
    }
}

static void put_q5_k(const lpq_fields *f, int j, uint8_t *pb) {
    put16(pb + 2 * j, f->d);
    put16(pb + 32 + 2 * j, f->m);
    put_scales_k4(f, j, pb, Q5_K_SUB_AT(1) - Q5_K_SUB_AT(0));
    for (int i = 0; i < LPQ_QK; i++) {
        put_fifth(pb + Q5_K_SUB_AT(i / 32) + 24, j, i % 32, f->q[i] >> 4);
        put_nibble(pb + Q5_K_SUB_AT(i / 32) + 88, j, i % 32, f->q[i]);
    }
}

/* ----- whole panel blocks at a time (put_panel) ----- */

/* the 16 rows' nibbles of `inputs` inputs into quads at p: 32-bit lane L of quad c holds row L's
 * nibbles of inputs 4c..4c+3 in its bytes' low halves and row L+8's in their high halves */
static void nibbles_panel(uint8_t *p, const lpq_fields *f, int from, int inputs) {
    for (int c = 0; c < inputs / 4; c++)
        for (int lane = 0; lane < 8; lane++) {
            uint32_t lo, hi, word;
            memcpy(&lo, f[lane].q + from + 4 * c, 4);
            memcpy(&hi, f[lane + 8].q + from + 4 * c, 4);
            word = (lo & 0x0F0F0F0Fu) | (hi & 0x0F0F0F0Fu) << 4;
            memcpy(p + 32 * c + 4 * lane, &word, 4);
        }
}

static void put_panel_q4_0(const lpq_fields *f, uint8_t *pb) {
    for (int j = 0; j < LP_PANEL; j++) put16(pb + 2 * j, f[j].d);
    nibbles_panel(pb + 32, f, 0, 32);
}

static void put_panel_q4_1(const lpq_fields *f, uint8_t *pb) {
    for (int j = 0; j < LP_PANEL; j++) {
        put16(pb + 2 * j, f[j].d);
        put16(pb + 32 + 2 * j, f[j].m);
    }
    nibbles_panel(pb + 64, f, 0, 32);
}

static void put_panel_q4_k(const lpq_fields *f, uint8_t *pb) {
    for (int j = 0; j < LP_PANEL; j++) {
        put16(pb + 2 * j, f[j].d);
        put16(pb + 32 + 2 * j, f[j].m);
        put_scales_k4(&f[j], j, pb, Q4_K_SUB_AT(1) - Q4_K_SUB_AT(0));
    }
    for (int s = 0; s < 8; s++) nibbles_panel(pb + Q4_K_SUB_AT(s) + 24, f, 32 * s, 32);
}

/* Q6_K's high 2 bits (q >> 4) of inputs 4c..4c+3: 16-bit lane L of the 16-byte group c, row L's at
 * bits Q6_AT = {0, 2, 8, 10}, row L+8's 4 bits up */
static uint32_t q6_highs(const uint8_t *q) {
    uint32_t a;
    memcpy(&a, q, 4);
    a = a >> 4 & 0x03030303u; /* input t's two bits at 8t */
    a |= a >> 6;              /* input 1's to bits 2-3, input 3's to 18-19 */
    return (a & 0xFu) | (a >> 16 & 0xFu) << 8;
}

static void put_panel_q6_k(const lpq_fields *f, uint8_t *pb) {
    for (int j = 0; j < LP_PANEL; j++) put16(pb + 2 * j, f[j].d);
    for (int s = 0; s < 16; s++) { /* a sub-block's bytes together: Q6_K_SUB_AT */
        uint8_t *sub = pb + Q6_K_SUB_AT(s);
        for (int j = 0; j < LP_PANEL; j++) sub[j] = f[j].sc[s];
        for (int c = 4 * s; c < 4 * s + 4; c++)
            for (int lane = 0; lane < 8; lane++) {
                uint16_t v = (uint16_t)(q6_highs(f[lane].q + 4 * c) | q6_highs(f[lane + 8].q + 4 * c) << 4);
                put16(sub + 16 + 16 * (c - 4 * s) + 2 * lane, v);
            }
        nibbles_panel(sub + 80, f, 16 * s, 16);
    }
}

static const lpq_format formats_q[] = {
    [LP_FORMAT_Q8_0] = {Q8_0_BLOCK, Q8_0_BYTES, Q8_0_PB, fields_q8_0, put_q8_0},
    [LP_FORMAT_Q4_0] = {Q4_0_BLOCK, Q4_0_BYTES, Q4_0_PB, fields_q4_0, NULL, put_panel_q4_0},
    [LP_FORMAT_Q4_1] = {Q4_1_BLOCK, Q4_1_BYTES, Q4_1_PB, fields_q4_1, NULL, put_panel_q4_1},
    [LP_FORMAT_Q5_0] = {Q5_0_BLOCK, Q5_0_BYTES, Q5_0_PB, fields_q5_0, put_q5_0},
    [LP_FORMAT_Q5_1] = {Q5_1_BLOCK, Q5_1_BYTES, Q5_1_PB, fields_q5_1, put_q5_1},
    [LP_FORMAT_Q2_K] = {Q2_K_BLOCK, Q2_K_BYTES, Q2_K_PB, fields_q2_k, put_q2_k},
    [LP_FORMAT_Q3_K] = {Q3_K_BLOCK, Q3_K_BYTES, Q3_K_PB, fields_q3_k, put_q3_k},
    [LP_FORMAT_Q4_K] = {Q4_K_BLOCK, Q4_K_BYTES, Q4_K_PB, fields_q4_k, NULL, put_panel_q4_k},
    [LP_FORMAT_Q5_K] = {Q5_K_BLOCK, Q5_K_BYTES, Q5_K_PB, fields_q5_k, put_q5_k},
    [LP_FORMAT_Q6_K] = {Q6_K_BLOCK, Q6_K_BYTES, Q6_K_PB, fields_q6_k, NULL, put_panel_q6_k},
};

static const lpq_format *lpq(int format) {
    if (format < 0 || format >= (int)(sizeof formats_q / sizeof formats_q[0]) || !formats_q[format].fields) return NULL;
    return &formats_q[format];
}

/* Panels of 16 rows, each its panel blocks in input order; a row past n packs as a zero block. */
static void pack_blocks(int format, const void *w, long n, long k, void *out) {
    const lpq_format *q = lpq(format);
    long panels = (n + LP_PANEL - 1) / LP_PANEL, blocks = k / q->block;
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++)
        for (long b = 0; b < blocks; b++) {
            uint8_t *pb = (uint8_t *)out + (p * blocks + b) * q->panel_block;
            lpq_fields f[LP_PANEL];
            memset(pb, 0, (size_t)q->panel_block);
            for (int j = 0; j < LP_PANEL; j++) {
                long row = p * LP_PANEL + j;
                if (row < n) q->fields((const uint8_t *)w + (row * blocks + b) * q->block_bytes, &f[j]);
                else memset(&f[j], 0, sizeof f[j]);
            }
            if (q->put_panel) q->put_panel(f, pb);
            else for (int j = 0; j < LP_PANEL; j++) q->put(&f[j], j, pb);
        }
}

void lp_pack_q8_0(const void *w, long n, long k, void *out) { pack_blocks(LP_FORMAT_Q8_0, w, n, k, out); }
void lp_pack_q4_0(const void *w, long n, long k, void *out) { pack_blocks(LP_FORMAT_Q4_0, w, n, k, out); }
void lp_pack_q4_1(const void *w, long n, long k, void *out) { pack_blocks(LP_FORMAT_Q4_1, w, n, k, out); }
void lp_pack_q5_0(const void *w, long n, long k, void *out) { pack_blocks(LP_FORMAT_Q5_0, w, n, k, out); }
void lp_pack_q5_1(const void *w, long n, long k, void *out) { pack_blocks(LP_FORMAT_Q5_1, w, n, k, out); }
void lp_pack_q2_k(const void *w, long n, long k, void *out) { pack_blocks(LP_FORMAT_Q2_K, w, n, k, out); }
void lp_pack_q3_k(const void *w, long n, long k, void *out) { pack_blocks(LP_FORMAT_Q3_K, w, n, k, out); }
void lp_pack_q4_k(const void *w, long n, long k, void *out) { pack_blocks(LP_FORMAT_Q4_K, w, n, k, out); }
void lp_pack_q5_k(const void *w, long n, long k, void *out) { pack_blocks(LP_FORMAT_Q5_K, w, n, k, out); }
void lp_pack_q6_k(const void *w, long n, long k, void *out) { pack_blocks(LP_FORMAT_Q6_K, w, n, k, out); }

/* f16: a panel stores, for each input, its 16 rows' halves in row order. */
void lp_pack_f16(const void *w, long n, long k, void *out) {
    long panels = (n + LP_PANEL - 1) / LP_PANEL;
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++)
        for (long i = 0; i < k; i++)
            for (int j = 0; j < LP_PANEL; j++) {
                long row = p * LP_PANEL + j;
                ((uint16_t *)out)[(p * k + i) * LP_PANEL + j] = row < n ? ((const uint16_t *)w)[row * k + i] : 0;
            }
}

/* ----- reading packed panels back (the generic tiles) ----- */

static inline unsigned nibble_at(const uint8_t *p, int j, long i) {
    return p[32 * (i / 4) + 4 * (j % 8) + i % 4] >> (j < 8 ? 0 : 4) & 0xF;
}
static inline unsigned fifth_at(const uint8_t *p, int j, long i) {
    return p[8 * (i / 4) + j % 8] >> (i % 4 + (j < 8 ? 0 : 4)) & 1;
}
static inline unsigned pair_at(const uint8_t *p, int j, long i) {
    int bit = 4 * (int)(i % 8) + (j < 8 ? 0 : 2);
    return p[32 * (i / 8) + 4 * (j % 8) + bit / 8] >> (bit % 8) & 3;
}
static inline unsigned lane16_at(const uint8_t *p, int j, long i, int per, const int *at, int hi, unsigned mask) {
    int bit = at[i % per] + (j < 8 ? 0 : hi);
    return p[16 * (i / per) + 2 * (j % 8) + bit / 8] >> (bit % 8) & mask;
}
static inline float half_at(const uint8_t *p, int j) { return f16_to_f32(le16(p + 2 * j)); }

/* row j's scale (sc) and min (mn) of K-quant sub-block s, from their packed bytes */
/* row j's scale (sc) and min (mn) of a K-quant sub-block, from its 24 packed bytes */
static void scale_k4_at(const uint8_t *s24, int j, unsigned *sc, unsigned *mn) {
    unsigned high = s24[16 + j % 8] >> (j < 8 ? 0 : 4);
    *sc = (s24[j] & 0xFu) | (high & 3u) << 4;
    *mn = (unsigned)(s24[j] >> 4) | (high >> 2 & 3u) << 4;
}

void lp_quant_panel_values(int format, const uint8_t *pb, long i, float out[LP_PANEL]) {
    for (int j = 0; j < LP_PANEL; j++) {
        float d = half_at(pb, j), w = 0.0f;
        unsigned sc, mn;
        switch (format) {
        case LP_FORMAT_Q8_0: w = (float)(int8_t)pb[32 + 16 * i + j] * d; break;
        case LP_FORMAT_Q4_0: w = d * (float)((int)nibble_at(pb + 32, j, i) - 8); break;
        case LP_FORMAT_Q4_1: w = d * (float)nibble_at(pb + 64, j, i) + half_at(pb + 32, j); break;
        case LP_FORMAT_Q5_0:
            w = d * (float)((int)(nibble_at(pb + 96, j, i) | (1 - fifth_at(pb + 32, j, i)) << 4) - 16);
            break;
        case LP_FORMAT_Q5_1:
            w = d * (float)(nibble_at(pb + 128, j, i) | fifth_at(pb + 64, j, i) << 4) + half_at(pb + 32, j);
            break;
        case LP_FORMAT_Q2_K: {
            unsigned byte = pb[64 + 16 * (i / 16) + j];
            float dl = d * (float)(byte & 0xF), ml = half_at(pb + 32, j) * (float)(byte >> 4);
            w = dl * (float)pair_at(pb + 320, j, i) - ml;
            break;
        }
        case LP_FORMAT_Q3_K: {
            const uint8_t *s12 = pb + 32 + 12 * (i / 16);
            int bit = 4 * (j % 8) + (j < 8 ? 0 : 2);
            sc = (s12[j % 8] >> (j < 8 ? 0 : 4) & 0xFu) | (s12[8 + bit / 8] >> (bit % 8) & 3u) << 4;
            float dl = d * (float)((int)sc - 32);
            int q = (int)pair_at(pb + 224, j, i) - 4 * (int)lane16_at(pb + 1248, j, i, 8, Q3_AT, 2, 1);
            w = dl * (float)q;
            break;
        }
        case LP_FORMAT_Q4_K:
        case LP_FORMAT_Q5_K: {
            const uint8_t *sub = pb + (format == LP_FORMAT_Q4_K ? Q4_K_SUB_AT(i / 32) : Q5_K_SUB_AT(i / 32));
            scale_k4_at(sub, j, &sc, &mn);
            float dl = d * (float)sc, ml = half_at(pb + 32, j) * (float)mn;
            unsigned q = format == LP_FORMAT_Q4_K ? nibble_at(sub + 24, j, i % 32)
                                                  : nibble_at(sub + 88, j, i % 32) | fifth_at(sub + 24, j, i % 32) << 4;
            w = dl * (float)q - ml;
            break;
        }
        case LP_FORMAT_Q6_K: {
            const uint8_t *sub = pb + Q6_K_SUB_AT(i / 16);
            float dl = d * (float)(int8_t)sub[j];
            int q = (int)(nibble_at(sub + 80, j, i % 16) | lane16_at(sub + 16, j, i % 16, 4, Q6_AT, 4, 3) << 4) - 32;
            w = dl * (float)q;
            break;
        }
        }
        out[j] = w;
    }
}

/* ----- quantizing fp32 into stored blocks ----- */

void lp_f16_from_f32(const float *src, void *dst, long count) {
    for (long i = 0; i < count; i++) ((uint16_t *)dst)[i] = f32_to_f16(src[i]);
}

/* numpy's np_roundf in gguf-py: half away from zero, as floor(a) + floor(2 (a - floor(a))) */
static inline float round_away(float v) {
    float a = fabsf(v), fl = floorf(a), b = fl + floorf(2.0f * (a - fl));
    return v > 0.0f ? b : v < 0.0f ? -b : 0.0f * b;
}

void lp_q8_0_from_f32(const float *src, void *dst, long count) {
    for (long b = 0; b < count / 32; b++) {
        const float *x = src + 32 * b;
        uint8_t *out = (uint8_t *)dst + 34 * b;
        float amax = 0.0f;
        for (int e = 0; e < 32; e++) amax = fabsf(x[e]) > amax ? fabsf(x[e]) : amax;
        float d = amax / 127.0f, id = d == 0.0f ? 0.0f : 1.0f / d;
        put16(out, f32_to_f16(d));
        for (int e = 0; e < 32; e++) out[2 + e] = (uint8_t)(int8_t)round_away(x[e] * id);
    }
}

/* the value of largest magnitude (the first of them), as gguf's argmax of abs */
static inline float signed_max(const float *x, int count) {
    int at = 0;
    for (int e = 1; e < count; e++) if (fabsf(x[e]) > fabsf(x[at])) at = e;
    return x[at];
}

static inline int clip(float v, int top) { /* trunc, then into [0, top], as astype(uint8).clip */
    int q = (int)truncf(v);
    return q < 0 ? 0 : q > top ? top : q;
}

/* Q4_0 (bits 4) and Q5_0 (bits 5): d = max / -2^(bits-1), q = trunc(x / d + 2^(bits-1) + 0.5) */
static void symmetric_from_f32(const float *src, void *dst, long count, int bits) {
    int half = 1 << (bits - 1), top = (1 << bits) - 1;
    long bytes = bits == 4 ? 18 : 22;
    for (long b = 0; b < count / 32; b++) {
        const float *x = src + 32 * b;
        uint8_t *out = (uint8_t *)dst + bytes * b, q[32];
        float d = signed_max(x, 32) / (float)-half, id = d == 0.0f ? 0.0f : 1.0f / d;
        for (int e = 0; e < 32; e++) q[e] = (uint8_t)clip(x[e] * id + ((float)half + 0.5f), top);
        put16(out, f32_to_f16(d));
        uint8_t *qs = out + (bits == 4 ? 2 : 6);
        for (int e = 0; e < 16; e++) qs[e] = (uint8_t)((q[e] & 0xF) | q[e + 16] << 4);
        if (bits == 5) {
            uint32_t qh = 0;
            for (int e = 0; e < 32; e++) qh |= (uint32_t)(q[e] >> 4) << e;
            for (int t = 0; t < 4; t++) out[2 + t] = (uint8_t)(qh >> 8 * t);
        }
    }
}

/* Q4_1 (bits 4) and Q5_1 (bits 5): d = (max - min) / (2^bits - 1), q = trunc((x - min) / d + 0.5) */
static void affine_from_f32(const float *src, void *dst, long count, int bits) {
    int top = (1 << bits) - 1;
    long bytes = bits == 4 ? 20 : 24;
    for (long b = 0; b < count / 32; b++) {
        const float *x = src + 32 * b;
        uint8_t *out = (uint8_t *)dst + bytes * b, q[32];
        float lo = x[0], hi = x[0];
        for (int e = 1; e < 32; e++) { lo = x[e] < lo ? x[e] : lo; hi = x[e] > hi ? x[e] : hi; }
        float d = (hi - lo) / (float)top, id = d == 0.0f ? 0.0f : 1.0f / d;
        for (int e = 0; e < 32; e++) q[e] = (uint8_t)clip((x[e] - lo) * id + 0.5f, top);
        put16(out, f32_to_f16(d));
        put16(out + 2, f32_to_f16(lo));
        uint8_t *qs = out + (bits == 4 ? 4 : 8);
        for (int e = 0; e < 16; e++) qs[e] = (uint8_t)((q[e] & 0xF) | q[e + 16] << 4);
        if (bits == 5) {
            uint32_t qh = 0;
            for (int e = 0; e < 32; e++) qh |= (uint32_t)(q[e] >> 4) << e;
            for (int t = 0; t < 4; t++) out[4 + t] = (uint8_t)(qh >> 8 * t);
        }
    }
}

void lp_q4_0_from_f32(const float *src, void *dst, long count) { symmetric_from_f32(src, dst, count, 4); }
void lp_q5_0_from_f32(const float *src, void *dst, long count) { symmetric_from_f32(src, dst, count, 5); }
void lp_q4_1_from_f32(const float *src, void *dst, long count) { affine_from_f32(src, dst, count, 4); }
void lp_q5_1_from_f32(const float *src, void *dst, long count) { affine_from_f32(src, dst, count, 5); }

static inline int nearest(float v, int lo, int hi) {
    int q = (int)lrintf(v);
    return q < lo ? lo : q > hi ? hi : q;
}

/* The K-quants with a min (Q2_K: 16 sub-blocks, 4-bit scales, 2-bit quants; Q4_K / Q5_K: 8, 6-bit,
 * 4 / 5-bit): each sub-block spans [min(x, 0), max(x)], its scale and min on a grid of the
 * super-block's d and dmin. */
static void k_affine(const float *x, int subs, int scale_top, int q_top, lpq_fields *f) {
    int per = LPQ_QK / subs;
    float scale[16], mins[16], smax = 0.0f, mmax = 0.0f;
    for (int s = 0; s < subs; s++) {
        float lo = 0.0f, hi = 0.0f;
        for (int e = per * s; e < per * s + per; e++) { lo = x[e] < lo ? x[e] : lo; hi = x[e] > hi ? x[e] : hi; }
        scale[s] = (hi - lo) / (float)q_top;
        mins[s] = -lo;
        smax = scale[s] > smax ? scale[s] : smax;
        mmax = mins[s] > mmax ? mins[s] : mmax;
    }
    f->d = f32_to_f16(smax / (float)scale_top);
    f->m = f32_to_f16(mmax / (float)scale_top);
    float d = f16_to_f32(f->d), dmin = f16_to_f32(f->m);
    for (int s = 0; s < subs; s++) {
        f->sc[s] = (uint8_t)(d > 0.0f ? nearest(scale[s] / d, 0, scale_top) : 0);
        f->mn[s] = (uint8_t)(dmin > 0.0f ? nearest(mins[s] / dmin, 0, scale_top) : 0);
        float dl = d * (float)f->sc[s], ml = dmin * (float)f->mn[s];
        for (int e = per * s; e < per * s + per; e++)
            f->q[e] = (uint8_t)(dl > 0.0f ? nearest((x[e] + ml) / dl, 0, q_top) : 0);
    }
}

/* The K-quants without a min (Q3_K: 3-bit quants, 6-bit signed scales; Q6_K: 6-bit quants, 8-bit
 * signed scales; 16 sub-blocks of 16): symmetric per sub-block. */
static void k_symmetric(const float *x, int scale_half, int q_half, lpq_fields *f) {
    float scale[16], smax = 0.0f;
    for (int s = 0; s < 16; s++) {
        float amax = 0.0f;
        for (int e = 16 * s; e < 16 * s + 16; e++) amax = fabsf(x[e]) > amax ? fabsf(x[e]) : amax;
        scale[s] = amax / (float)q_half;
        smax = scale[s] > smax ? scale[s] : smax;
    }
    f->d = f32_to_f16(smax / (float)(scale_half - 1));
    float d = f16_to_f32(f->d);
    for (int s = 0; s < 16; s++) {
        int sc = d > 0.0f ? nearest(scale[s] / d, 0, scale_half - 1) : 0;
        f->sc[s] = (uint8_t)(sc + (scale_half == 32 ? 32 : 0)); /* Q3_K stores sc + 32; Q6_K the int8 */
        float dl = d * (float)sc;
        for (int e = 16 * s; e < 16 * s + 16; e++)
            f->q[e] = (uint8_t)((dl > 0.0f ? nearest(x[e] / dl, -q_half, q_half - 1) : 0) + q_half);
    }
}

static void store_q2_k(const lpq_fields *f, uint8_t *b) {
    memset(b, 0, 84);
    for (int s = 0; s < 16; s++) b[s] = (uint8_t)(f->sc[s] | f->mn[s] << 4);
    for (int e = 0; e < LPQ_QK; e++) b[16 + 32 * (e / 128) + e % 32] |= (uint8_t)(f->q[e] << (2 * (e % 128 / 32)));
    put16(b + 80, f->d);
    put16(b + 82, f->m);
}

static void store_q3_k(const lpq_fields *f, uint8_t *b) {
    memset(b, 0, 110);
    for (int e = 0; e < LPQ_QK; e++) {
        b[32 + 32 * (e / 128) + e % 32] |= (uint8_t)((f->q[e] & 3) << (2 * (e % 128 / 32)));
        b[e % 32] |= (uint8_t)((f->q[e] >> 2) << (e / 32));
    }
    for (int s = 0; s < 16; s++) {
        b[96 + s % 8] |= (uint8_t)((f->sc[s] & 0xF) << (4 * (s / 8)));
        b[104 + s % 4] |= (uint8_t)((f->sc[s] >> 4) << (2 * (s / 4)));
    }
    put16(b + 108, f->d);
}

static void store_scales_k4(const lpq_fields *f, uint8_t *s12) {
    for (int s = 0; s < 4; s++) {
        s12[s] = (uint8_t)((f->sc[s] & 63) | (f->sc[s + 4] >> 4) << 6);
        s12[s + 4] = (uint8_t)((f->mn[s] & 63) | (f->mn[s + 4] >> 4) << 6);
        s12[s + 8] = (uint8_t)((f->sc[s + 4] & 0xF) | (f->mn[s + 4] & 0xF) << 4);
    }
}

static void store_q4_k(const lpq_fields *f, uint8_t *b) {
    memset(b, 0, 144);
    put16(b, f->d);
    put16(b + 2, f->m);
    store_scales_k4(f, b + 4);
    for (int e = 0; e < LPQ_QK; e++) b[16 + 32 * (e / 64) + e % 32] |= (uint8_t)(f->q[e] << (4 * (e % 64 / 32)));
}

static void store_q5_k(const lpq_fields *f, uint8_t *b) {
    memset(b, 0, 176);
    put16(b, f->d);
    put16(b + 2, f->m);
    store_scales_k4(f, b + 4);
    for (int e = 0; e < LPQ_QK; e++) {
        b[48 + 32 * (e / 64) + e % 32] |= (uint8_t)((f->q[e] & 0xF) << (4 * (e % 64 / 32)));
        b[16 + e % 32] |= (uint8_t)((f->q[e] >> 4) << (e / 32));
    }
}

static void store_q6_k(const lpq_fields *f, uint8_t *b) {
    memset(b, 0, 210);
    for (int e = 0; e < LPQ_QK; e++) {
        int h = e / 128, r = e % 128;
        b[64 * h + r % 64] |= (uint8_t)((f->q[e] & 0xF) << (4 * (r / 64)));
        b[128 + 32 * h + r % 32] |= (uint8_t)((f->q[e] >> 4) << (2 * (r / 32)));
    }
    for (int s = 0; s < 16; s++) b[192 + s] = f->sc[s];
    put16(b + 208, f->d);
}

#define K_FROM_F32(NAME, BYTES, QUANTIZE, STORE)                                                    \
    void NAME(const float *src, void *dst, long count) {                                           \
        for (long b = 0; b < count / LPQ_QK; b++) {                                                \
            lpq_fields f;                                                                          \
            memset(&f, 0, sizeof f);                                                               \
            QUANTIZE;                                                                              \
            STORE(&f, (uint8_t *)dst + (BYTES) * b);                                               \
        }                                                                                          \
    }
K_FROM_F32(lp_q2_k_from_f32, 84, k_affine(src + LPQ_QK * b, 16, 15, 3, &f), store_q2_k)
K_FROM_F32(lp_q3_k_from_f32, 110, k_symmetric(src + LPQ_QK * b, 32, 4, &f), store_q3_k)
K_FROM_F32(lp_q4_k_from_f32, 144, k_affine(src + LPQ_QK * b, 8, 63, 15, &f), store_q4_k)
K_FROM_F32(lp_q5_k_from_f32, 176, k_affine(src + LPQ_QK * b, 8, 63, 31, &f), store_q5_k)
K_FROM_F32(lp_q6_k_from_f32, 210, k_symmetric(src + LPQ_QK * b, 128, 32, &f), store_q6_k)
