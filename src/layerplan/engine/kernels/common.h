/* What the kernel files share among themselves (not part of the ABI: kernels.h is that).
 *
 * Invariants every file keeps:
 * - Batch invariance: every output element is reduced in one order whatever the number of rows,
 *   the tile shape or the thread that computes it, so a row computed inside a k-token pass is
 *   bit-identical to the same row computed alone.
 * - Per-row work (norms, RoPE, rounding, residuals) on eight lanes computes what the scalar code
 *   computes, bit for bit (the same operations in the same order; no contraction into fused
 *   multiply-adds: the library is built with -std=c11, which keeps GCC from contracting), and the
 *   scalar code finishes what is left of a row.
 * - Rounding to the activation dtype happens where the PyTorch modules round, so a bf16 pass gives
 *   the numbers of the bf16 modules.
 * - Every allocation is checked; a function that allocates returns LP_E_MEMORY when one fails.
 */
#ifndef LP_COMMON_H
#define LP_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

/* Inputs per reduction block: every product kernel, of every ISA and weight format, sums each
 * output over blocks of LP_BLOCK inputs in order (a chain of fused multiply-adds within a block),
 * adding the blocks' sums in order. Blocks keep the rounding error near PyTorch's blocked sums. */
#ifndef LP_BLOCK
#define LP_BLOCK 64
#endif


/* bytes of one element of an activation / norm-weight dtype; 0 for an unknown one */
static inline long lp_dtype_bytes(int dtype) { return dtype == LP_DTYPE_F32 ? 4 : dtype == LP_DTYPE_BF16 ? 2 : 0; }

/* bytes of one element of a KV cache's dtype (F16 too); 0 for an unknown one */
static inline long lp_kv_bytes(int dtype) { return dtype == LP_DTYPE_F16 ? 2 : lp_dtype_bytes(dtype); }

/* v rounded as a tensor of `dtype` would store it */
static inline float lp_rnd(float v, int dtype) { return dtype == LP_DTYPE_BF16 ? round_bf16(v) : v; }
static inline lp_f8 lp_rnd8(lp_f8 v, int dtype) { return dtype == LP_DTYPE_BF16 ? f8_round_bf16(v) : v; }

/* element i of a float, bf16 or f16 array, as a float */
static inline float lp_param(const void *p, int dtype, long i) {
    return dtype == LP_DTYPE_BF16 ? bf16_to_f32(((const uint16_t *)p)[i])
         : dtype == LP_DTYPE_F16  ? f16_to_f32(((const uint16_t *)p)[i])
                                  : ((const float *)p)[i];
}

/* ----- rows.c: per-row work ----- */
/* scratch for `count` floats on a 64-byte line (rows of sums are stored in halves of 64-byte
 * panels); NULL when the allocation fails */
float *lp_floats(long count);
/* one lp_floats block for `count` scratch buffers (a call's, in one allocation where it needs
 * several): piece[i] the start of sizes[i] bytes on a 64-byte line, NULL for none; returns the
 * block, to free, or NULL (every piece NULL) when the allocation fails */
void *lp_pieces(const size_t *sizes, int count, void **piece);
void lp_load_f32(const void *src, int dtype, float *dst, long count);
void lp_store(const float *src, void *dst, int dtype, long count);
/* in place, to what a PyTorch op in `dtype` would have stored */
void lp_round_all(float *v, long count, int dtype);
/* rows x dim in place; rounded as `dtype` (the activations'), the weight read in nm->dtype */
void lp_norm_rows(float *x, long rows, long dim, const lp_norm *nm, int dtype);
/* q (rows, heads * head_dim) in place: q * cos + rotate_half(q) * sin over the first rotary_dim
 * dims of each head (rotary_dim <= 512); cs, sn (rows, rotary_dim) */
void lp_rope_rows(float *q, long rows, long heads, long head_dim, long rotary_dim, const float *cs, const float *sn,
                  int dtype);
/* out = hidden + scale * update, rounded as the modules round (scratch: count floats) */
void lp_residual_add(const void *hidden, const float *update, float *scratch, void *out, long count, float scale,
                     int dtype);
/* out[i] = act(gate[i]) * up[i] over n values */
void lp_gated_activation(const float *gate, const float *up, float *out, long n, int activation, int dtype);

/* ----- gemm.c: products over packed matrices ----- */
/* y (m, n) = x (m, k) . w^T + bias, shared among `threads`; LP_OK, LP_E_TYPE or LP_E_MEMORY */
int lp_gemm(const lp_matrix *mat, const float *x, long m, float *y, int threads);

/* ----- attention.c ----- */
#define LP_QUERIES 32 /* queries attended together at most */
/* softmax(q . k * scaling) . v for every (head, row) of a pass: q (rows, heads, head_dim) fp32,
 * out likewise (rounded to `dtype`), keys and values from the slot. LP_OK or LP_E_MEMORY. */
int lp_attend(const lp_attention *a, const float *q, float *o, long rows, long pos0, const lp_kv *kv, long keep_sink,
              long keep_recent, const unsigned char *tree, int dtype, int threads);
/* lp_attend for several sequences' rows (segments in row order, kvs[s] the slot of segment s; no
 * window masks nor trees), in as few parallel regions as their queries allow: the same numbers. */
int lp_attend_segments(const lp_attention *a, const float *q, float *o, const lp_segment *segs, long nsegs,
                       const lp_kv *kvs, int dtype, int threads);

#endif
