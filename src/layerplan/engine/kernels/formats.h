/* The weight-format trait table: one row per weight format (lp_matrix.format), with what the rest
 * of the engine needs to know of it. Adding a format is a row of LP_FORMAT_LIST (below; its number
 * in kernels.h) plus its functions and tiles; nothing else in the engine names a format.
 *
 * Packed layout, common to every format: panels of LP_PANEL output rows (zero-padded to whole
 * panels), each panel input-major: for each block of `block` inputs, the LP_PANEL rows' blocks
 * (`block_bytes` each), in the order the format's pack function gives them. So a panel is
 * LP_PANEL * (k / block) * block_bytes bytes, and panel p starts p panels in.
 */
#ifndef LP_FORMATS_H
#define LP_FORMATS_H

#include "common.h"

/* One tile of a product: for `rows` rows of x (rows of k floats, consecutive) and `panels` panels
 * from w (the first panel; the others panel_bytes apart), y[r][16 p + j] += the sums over inputs
 * [from, to) (from a multiple of LP_BLOCK; y is overwritten rather than added to when from is 0).
 * y's rows are ys apart. fetch: this tile may prefetch the next panels (one tile of a group does).
 * Every tile sums each output as the block rule of LP_BLOCK says, so which tile computes an output
 * does not change it. */
typedef void (*lp_tile)(const float *x, long k, long from, long to, const void *w, long panel_bytes, float *y, long ys,
                        int fetch);

#define LP_GROUP_ROWS 6 /* the most rows a tile takes */

/* The tiles of one format on one ISA, by row-count class, and how the scheduler groups rows. */
typedef struct {
    lp_tile one_panel[LP_GROUP_ROWS + 1]; /* [r]: r rows (1 .. LP_GROUP_ROWS) on one panel */
    lp_tile two_panels[4];                /* [r]: r rows (1 .. 3) on two panels */
    lp_tile four_panels;                  /* one row on four panels */
    /* rows past the groups of LP_GROUP_ROWS, when 1-3, go on panel pairs after the groups went
     * through both panels (two_panels), rather than one panel at a time */
    int pair_rest;
    /* rows in even groups of at most LP_GROUP_ROWS (8 = 4 + 4) rather than full groups and the rest
     * (8 = 6 + 2) */
    int even_groups;
    /* NULL, or m > LP_GROUP_ROWS rows (any number) on `panels` panels over all k inputs, each weight
     * widened once for all the rows (the block formats: widening costs more than an FMA) */
    void (*many_rows)(const float *x, long m, long k, const void *w, long panel_bytes, long panels, float *y,
                      long ys);
} lp_tiles;

/* ----- integer products (LP_ARITH_INT8) -----
 * The activations of a product are quantized row by row as llama.cpp quantizes them for the
 * weight type (lp_q8_quantize, lp_q8k_quantize), and each weight sub-block (the inputs that share
 * one scale and offset) meets them as one exact integer dot product a row:
 * - Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: Q8_0 activations, per block of 32 inputs: d = max|x| / 127,
 *   q = x * (127 / max|x|) rounded to the nearest (ties to even), so |q| <= 127. With w = scale q +
 *   offset (q an unsigned integer, the scale of 16 rows an f32 vector computed as the exact tiles
 *   compute it), each output sums, sub-block by sub-block in input order,
 *       sum = fma(float(dot), scale * d, sum);  sum = fma(offset, s, sum)
 *   where s is d times the sum of the sub-block's q.
 * - the K-quants (Q2_K .. Q6_K): Q8_K activations, per super-block of 256 inputs: iscale = -127 /
 *   x_m (x_m the input of largest magnitude, its sign kept), q = min(127, iscale x rounded to the
 *   nearest, ties to even), d = 1 / iscale (0 and all q 0 where every input is 0), and the sum of
 *   q over each weight sub-block (bsum). With w = D sc q - DMIN mn (D, DMIN the super-block's f16
 *   scales, sc and mn each sub-block's integers; Q3_K's and Q6_K's centred quants as mn = the
 *   centre times sc and DMIN = D), each output sums, super-block by super-block in input order,
 *       S1 = sum over sub-blocks of sc dot,  S2 = sum over sub-blocks of mn bsum  (int32, exact)
 *       sum = fma(float(S1), D * d, sum);  sum = fma(float(S2), -(DMIN * d), sum)
 *   which is llama.cpp's ggml_vec_dot_q<N>_K_q8_K with the float adds in input order, and one
 *   float epilogue a super-block rather than a sub-block.
 * So a row's result depends on its own inputs only (not on the other rows, the tile or the
 * thread), as the exact products' do. */
typedef struct {
    const int8_t *q;      /* (rows, k) */
    const float *d;       /* (rows, k / 32) each block's scale; Q8_K: (rows, k / 256) */
    const float *s;       /* Q8_0: (rows, k / 16): d times the sum of each 16 inputs' q */
    const int16_t *bsum;  /* Q8_K: (rows, k / sub): the sum of each weight sub-block's q */
    long k;
} lp_q8;

#define LP_INT_ROWS 8 /* the most rows an integer tile may take */

/* rows [r0, r0 + r) of x on one panel (all k inputs): y[r][j] = the sums (overwritten) */
typedef void (*lp_int_tile)(const lp_q8 *x, long r0, const void *w, float *y, long ys);
/* the same on two panels, the second panel_bytes after the first: y[r][16 + j] its sums */
typedef void (*lp_int_pair_tile)(const lp_q8 *x, long r0, const void *w, long panel_bytes, float *y, long ys);
typedef struct {
    lp_int_tile rows[LP_INT_ROWS + 1];           /* [r]: r rows */
    lp_int_pair_tile pair_rows[LP_INT_ROWS + 1]; /* [r]: r rows on two panels (NULL: one at a time) */
    long most;                         /* the most rows a pass gives one tile (<= LP_INT_ROWS) */
    long kquant_sub;                   /* Q8_K activations, summed per this many inputs; 0: Q8_0's */
} lp_int_tiles;

typedef struct {
    const char *name;
    long block;       /* inputs per block (1 for the plain formats) */
    long block_bytes; /* bytes of one row's block */
    /* w (n, k) as the format's rows are stored unpacked -> out, the packed panels */
    void (*pack)(const void *w, long n, long k, void *out);
    /* count fp32 values (a whole number of blocks) -> the format's unpacked row */
    void (*from_f32)(const float *src, void *dst, long count);
    const lp_tiles *tiles; /* this library's ISA's tiles for the format */
    /* this library's ISA's integer tiles for the format (LP_ARITH_INT8); NULL where the format or
     * the build has none (the products then run exact) */
    const lp_int_tiles *int_tiles;
} lp_format_traits;

/* x (m, k fp32; k a multiple of 32) -> q, d, s of an lp_q8 (Q8_0 activations) */
void lp_q8_quantize(const float *x, long m, long k, int8_t *q, float *d, float *s);
/* x (m, k fp32; k a multiple of 256) -> q, d, bsum of an lp_q8 (Q8_K activations, their sums per
 * `sub` inputs) */
void lp_q8k_quantize(const float *x, long m, long k, long sub, int8_t *q, float *d, int16_t *bsum);
/* (both builds' lp_q8k_quantize) the sums of a super-block's 256 q per `sub` inputs, into out */
void lp_q8k_sums(const int8_t *q, long sub, int16_t *out);

/* the row of `format`, NULL for an unknown one */
const lp_format_traits *lp_format(int format);

/* bytes of one packed panel of a k-input matrix; -1 where the blocks do not divide k */
static inline long lp_panel_bytes(const lp_format_traits *f, long k) {
    return k % f->block ? -1 : LP_PANEL * (k / f->block) * f->block_bytes;
}

/* ----- the formats, one row each: X(ID, name, block, bytes, sub) -----
 *   ID     LP_FORMAT_<ID> in kernels.h (the number native.py reads) and the prefix of the row's
 *          constants: <ID>_BLOCK, <ID>_BYTES, <ID>_PB (a panel block's bytes) and <ID>_SUB
 *   name   the trait row's name, and its functions': lp_pack_<name>, lp_<name>_from_f32 (quant.h's
 *          layouts: quant_formats.c; f32 and bf16: formats.c), its tiles lp_tiles_<name> and, where
 *          a build has them, its integer tiles lp_int_tiles_<name>
 *   block  inputs of a stored block (1: one value a block), bytes: a row's block's bytes
 *   sub    inputs that share one scale (a sub-block; 1 for the formats without scales)
 * The plain formats' tiles are products_<isa>.c's, the others' products_quant_<isa>.c's (those
 * files expand their tiles from these lists). */
#define LP_PLAIN_FORMATS(X)                                                                        \
    X(F32, f32, 1, 4, 1)                                                                           \
    X(BF16, bf16, 1, 2, 1)
#define LP_QUANT_FORMATS(X)                                                                        \
    X(F16, f16, 1, 2, 1)                                                                           \
    X(Q8_0, q8_0, 32, 34, 32)                                                                      \
    X(Q4_0, q4_0, 32, 18, 32)                                                                      \
    X(Q4_1, q4_1, 32, 20, 32)                                                                      \
    X(Q5_0, q5_0, 32, 22, 32)                                                                      \
    X(Q5_1, q5_1, 32, 24, 32)                                                                      \
    X(Q2_K, q2_k, 256, 84, 16)                                                                     \
    X(Q3_K, q3_k, 256, 110, 16)                                                                    \
    X(Q4_K, q4_k, 256, 144, 32)                                                                    \
    X(Q5_K, q5_k, 256, 176, 32)                                                                    \
    X(Q6_K, q6_k, 256, 210, 16)
#define LP_FORMAT_LIST(X) LP_PLAIN_FORMATS(X) LP_QUANT_FORMATS(X)

/* each row's constants and declarations. The integer tiles are declared weak: where no file of a
 * build defines a format's (the formats without: f32, bf16, f16; the generic build: none), the
 * linker makes its address NULL, so the format's row says the build has none. */
#define LP_MAYBE __attribute__((weak, visibility("hidden")))
#define LP_FORMAT_DECLARE(ID, name, block, bytes, sub)                                             \
    enum { ID##_BLOCK = block, ID##_BYTES = bytes, ID##_PB = LP_PANEL * bytes, ID##_SUB = sub };    \
    void lp_pack_##name(const void *w, long n, long k, void *out);                                 \
    void lp_##name##_from_f32(const float *src, void *dst, long count);                            \
    extern const lp_tiles lp_tiles_##name;                                                         \
    extern const lp_int_tiles lp_int_tiles_##name LP_MAYBE;
LP_FORMAT_LIST(LP_FORMAT_DECLARE)

extern const char lp_products_isa[];

#endif
