/* The GGUF weight types F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K as
 * weight formats of the trait table (formats.h): their packed panel layouts, their packing from
 * the rows a GGUF file stores, their exact dequantization, and the tiles each ISA defines for them
 * (products_quant_<isa>.c).
 *
 * Arithmetic ("exact"): a product over a block format is the fp32 format's product of the
 * dequantized matrix, bit for bit, so a row's result depends on neither the other rows of its pass
 * nor the thread count. Every weight is widened to the fp32 value gguf's reference (gguf-py
 * quants.py) gives it. Each product gguf forms on the way (f16 scale x sub-block scale, that x
 * quant) is exact in fp32: an f16 has at most 11 significant bits, a sub-block scale at most 7
 * (Q6_K's int8), a quant at most 7 (Q8_0's int8; Q6_K's q - 32 has 5), and no format reaches 24.
 * So a weight rounds at most once, in gguf's final add or subtract (Q4_1's + m, the K-quants'
 * - dmin m), and a fused multiply-add computes the same value as gguf's separate multiply and add.
 * The AVX2 tiles take a quant out of its word as q 2^s and multiply it by scale 2^-s, exact too
 * (a nonzero scale is at least 2^-24 in magnitude and s <= 28, so scale 2^-s stays normal).
 *
 * Packed layout (formats.h): panels of LP_PANEL = 16 output rows, each panel one "panel block"
 * per block of the format (`block` inputs, 16 x block_bytes bytes: exactly the file's bytes),
 * in input order. A panel block holds the 16 rows' scales first, then their quants input by input.
 * Scales are the file's f16 bits. In what follows "rows j / j+8" means: dword lane j (j = 0..7) of
 * a 32-byte word carries row j in its low and row j + 8 in its high field of each pair.
 *
 *   F16   (1 input, 2 B):  input i: the 16 rows' halves in row order.
 *   Q8_0  (32 inputs, 34 B a row):  d[16] f16 | input i: 16 int8, byte j = row j's quant.
 *   Q4_0  (32, 18):  d[16] | 8 quads of 4 inputs, 32 B each: lane j, byte t = row j's nibble of
 *                    input 4c + t in its low half, row j+8's in its high half.   w = d (q - 8)
 *   Q4_1  (32, 20):  d[16] | m[16] | quads as Q4_0.                                w = d q + m
 *   Q5_0  (32, 22):  d[16] | 8 quads of fifth bits, 8 B: byte j bit t = NOT row j's fifth bit of
 *                    input 4c + t, bit 4 + t = NOT row j+8's | quads of nibbles.   w = d (q - 16)
 *   Q5_1  (32, 24):  d[16] | m[16] | fifth bits as Q5_0, not inverted | nibbles.  w = d q + m
 *   Q2_K  (256, 84): d[16] | dmin[16] | 16 sub-blocks of 16 inputs: a byte a row (scale low,
 *                    min high nibble) | 32 octs of 8 inputs, 32 B: lane j bits 4t..4t+1 = row j's
 *                    quant of input 8c + t, bits 4t+2..4t+3 = row j+8's.     w = (d sc) q - (dmin m)
 *   Q3_K  (256, 110): d[16] | 16 sub-blocks x 12 B of 6-bit scales (8 B: byte j = row j's low
 *                    nibble | row j+8's << 4; 4 B: bits 4j..4j+1 = row j's high bits, 4j+2..4j+3
 *                    = row j+8's) | octs of low 2 bits as Q2_K | 32 octs of third bits, 16 B:
 *                    16-bit lane j, bit P[t] = NOT row j's bit of input 8c + t, P[t] + 2 = NOT
 *                    row j+8's, P = {0,1,4,5,8,9,12,13}.                      w = (d (sc - 32)) q
 *   Q4_K  (256, 144): d[16] | dmin[16] | 8 sub-blocks of 32 inputs, each 280 B together
 *                    (Q4_K_SUB_AT): 24 B of 6-bit scale and min (16 B: byte j = row j's scale low
 *                    nibble | min low nibble << 4; 8 B: byte j = row j's scale high bits | min
 *                    high bits << 2 | row j+8's << 4, << 6) | 8 quads of nibbles as Q4_0.
 *                                                                          w = (d sc) q - (dmin m)
 *   Q5_K  (256, 176): as Q4_K, each sub-block's 344 B (Q5_K_SUB_AT) with 8 quads of fifth bits as
 *                    Q5_1 (not inverted) between its scales and its nibbles.
 *   Q6_K  (256, 210): d[16] | 16 sub-blocks of 16 inputs, each 208 B together (Q6_K_SUB_AT):
 *                    int8 scale a row | 4 quads of high 2 bits, 16 B: 16-bit lane j, bits
 *                    P[t]..P[t]+1 = row j's of input 4c + t, P[t]+4.. = row j+8's, P = {0,2,8,10}
 *                    | 4 quads of low nibbles as Q4_0. A sub-block's bytes in one run keep a
 *                    panel one stream of reads (apart, its scales, high bits and nibbles were
 *                    three, and a pair of panels six).                        w = (d sc) (q - 32)
 * The K-quants keep each sub-block's bytes in one run: a panel is then one stream of reads (a
 * pair of panels two), where scales, high bits and nibbles apart were three a panel, and a
 * one-row product reads ~10% faster from memory (Q6_K, AMD EPYC with AVX-512).
 * Rows past n pack as blocks of zero scales and zero quants (zero weights).
 */
#ifndef LP_QUANT_H
#define LP_QUANT_H

#include "formats.h"

#define LPQ_QK 256 /* inputs of a K-quant super-block */
/* where Q6_K's sub-block s begins in its panel block: its scales, then its high bits at + 16,
 * its nibbles at + 80 */
#define Q6_K_SUB_AT(s) (32 + 208 * (s))
/* where Q4_K's and Q5_K's sub-block s begins in its panel block: its 24 B of scales and mins,
 * then Q4_K's nibbles at + 24; Q5_K's fifth bits at + 24, its nibbles at + 88 */
#define Q4_K_SUB_AT(s) (64 + 280 * (s))
#define Q5_K_SUB_AT(s) (64 + 344 * (s))

/* f16 scales convert with simd.h's f16_to_f32 and f32_to_f16 */
/* ----- quant_formats.c -----
 * Each format's lp_pack_<name> (the file's rows: n rows of k / block stored blocks -> the packed
 * panels) and lp_<name>_from_f32 (count fp32 values, whole blocks -> stored blocks), declared by
 * formats.h's table. The legacy formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) quantize as gguf-py's
 * quantize does, bit for bit; the K-quants by plain per-sub-block min / max (valid blocks, not
 * llama.cpp's searched scales). */

/* The 16 rows' weights of input i (0 <= i < block) of a panel block, as fp32 (the portable
 * decoding of the layouts above, for the generic tiles). */
void lp_quant_panel_values(int format, const uint8_t *panel_block, long i, float out[LP_PANEL]);

#endif
