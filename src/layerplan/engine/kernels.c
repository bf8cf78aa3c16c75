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
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

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

/* ----- matrix products: y[m, n] = x[m, :] . w[n, :] + bias[n] -----
 * k is taken in blocks of 16. A bf16 block of w is widened with two unpacks, which puts its
 * elements in the order [0-3, 8-11] and [4-7, 12-15]; x is stored in that same order once per
 * call (xp below), so a dot product needs no shuffles. Each (row, output) pair has one 8-lane
 * accumulator that takes the low then the high half of every block, is summed across lanes by
 * hsum4, then gets the tail (k % 16) added in order: the same operations whatever the tile
 * shape, so results do not depend on how many rows the call has. */
static inline void widen_bf16(const uint16_t *p, __m256 *lo, __m256 *hi) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p), z = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}

static inline void widen_f32(const float *p, __m256 *lo, __m256 *hi) {
    *lo = _mm256_loadu_ps(p);
    *hi = _mm256_loadu_ps(p + 8);
}

/* R rows (xp: block order, x: natural order) times C weight rows: out[r][c]. R and C are
 * literal constants in every instance, so the accumulators live in registers. */
#define DEFINE_TILE(NAME, R, C, WT, WIDEN, WVAL)                                                    \
    static void NAME(const float *const *xp, const float *const *x, const WT *const *w, long k,   \
                     float out[4][4]) {                                                           \
        __m256 acc[R][C];                                                                         \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                       \
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();  \
        long kb = k & ~15L;                                                                       \
        for (long i = 0; i < kb; i += 16) {                                                       \
            if (R > 2 && (i & 31) == 0) { /* compute-bound: fetch weights 4 tiles ahead */       \
                _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)                               \
                    _mm_prefetch((const char *)(w[c] + 4 * C * k + i), _MM_HINT_T0);              \
            }                                                                                     \
            if (R <= 2) { /* rows in registers, weight rows streamed through */                  \
                __m256 xl[R], xh[R];                                                              \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                             \
                    xl[r] = _mm256_load_ps(xp[r] + i);                                            \
                    xh[r] = _mm256_load_ps(xp[r] + i + 8);                                        \
                }                                                                                 \
                _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) {                             \
                    __m256 wl, wh;                                                                \
                    WIDEN(w[c] + i, &wl, &wh);                                                    \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                         \
                        acc[r][c] = _mm256_fmadd_ps(xl[r], wl, acc[r][c]);                        \
                        acc[r][c] = _mm256_fmadd_ps(xh[r], wh, acc[r][c]);                        \
                    }                                                                             \
                }                                                                                 \
            } else { /* weight rows in registers, rows streamed through */                       \
                __m256 wl[C], wh[C];                                                              \
                _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) WIDEN(w[c] + i, &wl[c], &wh[c]); \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                             \
                    __m256 xl = _mm256_load_ps(xp[r] + i), xh = _mm256_load_ps(xp[r] + i + 8);   \
                    _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) {                         \
                        acc[r][c] = _mm256_fmadd_ps(xl, wl[c], acc[r][c]);                        \
                        acc[r][c] = _mm256_fmadd_ps(xh, wh[c], acc[r][c]);                        \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                     \
            __m256 z = _mm256_setzero_ps();                                                       \
            float s[4];                                                                           \
            _mm_storeu_ps(s, hsum4(acc[r][0], C > 1 ? acc[r][C > 1 ? 1 : 0] : z,                  \
                                   C > 2 ? acc[r][C > 2 ? 2 : 0] : z, C > 3 ? acc[r][C > 3 ? 3 : 0] : z)); \
            for (int c = 0; c < C; c++) {                                                         \
                float v = s[c];                                                                   \
                for (long i = kb; i < k; i++) v += x[r][i] * WVAL(w[c][i]);                       \
                out[r][c] = v;                                                                    \
            }                                                                                     \
        }                                                                                         \
    }

#define AS_F32(v) (v)
#define DEFINE_TILES(SUFFIX, WT, WIDEN, WVAL)                                                     \
    DEFINE_TILE(tile4x2_##SUFFIX, 4, 2, WT, WIDEN, WVAL)                                          \
    DEFINE_TILE(tile2x4_##SUFFIX, 2, 4, WT, WIDEN, WVAL)                                          \
    DEFINE_TILE(tile1x4_##SUFFIX, 1, 4, WT, WIDEN, WVAL)                                          \
    DEFINE_TILE(tile3x2_##SUFFIX, 3, 2, WT, WIDEN, WVAL)                                          \
    DEFINE_TILE(tile2x2_##SUFFIX, 2, 2, WT, WIDEN, WVAL)                                          \
    DEFINE_TILE(tile1x2_##SUFFIX, 1, 2, WT, WIDEN, WVAL)                                          \
    DEFINE_TILE(tile1x1_##SUFFIX, 1, 1, WT, WIDEN, WVAL)
DEFINE_TILES(bf16, uint16_t, widen_bf16, bf16_to_f32)
DEFINE_TILES(f32, float, widen_f32, AS_F32)

/* The tile for nr rows and nc weight rows; leftovers of other shapes one output at a time. */
#define RUN_TILES(SUFFIX, WT)                                                                          \
    {                                                                                                  \
        WT *const *ws = (WT *const *)wr;                                                               \
        if (nr == 4 && nc == 2) tile4x2_##SUFFIX(rows_p, rows_x, ws, k, out);                          \
        else if (nr == 2 && nc == 4) tile2x4_##SUFFIX(rows_p, rows_x, ws, k, out);                     \
        else if (nr == 1 && nc == 4) tile1x4_##SUFFIX(rows_p, rows_x, ws, k, out);                     \
        else if (nr == 3 && nc == 2) tile3x2_##SUFFIX(rows_p, rows_x, ws, k, out);                     \
        else if (nr == 2 && nc == 2) tile2x2_##SUFFIX(rows_p, rows_x, ws, k, out);                     \
        else if (nr == 1 && nc == 2) tile1x2_##SUFFIX(rows_p, rows_x, ws, k, out);                     \
        else                                                                                           \
            for (int r = 0; r < nr; r++)                                                               \
                for (int c = 0; c < nc; c++)                                                           \
                    tile1x1_##SUFFIX(rows_p + r, rows_x + r, ws + c, k, (float (*)[4]) & out[r][c]);   \
    }

/* Four rows at a time against pairs of weight rows; two rows against four weight rows when the
 * call has at most three rows (a decoding step, a short verify). Parallel over weight rows:
 * each weight is read from memory once per call. */
static void gemm(const float *x, const void *w, int w_bf16, const void *bias, float *y, long m, long n, long k,
                 int threads) {
    long kb = k & ~15L, stride = (k + 15) & ~15L;
    /* x copied 64-byte aligned, rows padded to whole blocks, in the block order of widened bf16
     * weights (natural order for fp32 weights) */
    float *xp = (float *)aligned_alloc(64, sizeof(float) * m * stride);
    for (long r = 0; r < m; r++) {
        const float *src = x + r * k;
        float *dst = xp + r * stride;
        for (long i = 0; i < kb; i += 16) {
            if (w_bf16) {
                memcpy(dst + i, src + i, 16);
                memcpy(dst + i + 4, src + i + 8, 16);
                memcpy(dst + i + 8, src + i + 4, 16);
                memcpy(dst + i + 12, src + i + 12, 16);
            } else {
                memcpy(dst + i, src + i, 64);
            }
        }
        memcpy(dst + kb, src + kb, sizeof(float) * (k - kb));
    }
    int wide = m >= 4;
    long cols = wide ? 2 : 4, rstep = wide ? 4 : 2;
    long tiles = (n + cols - 1) / cols;
    if (threads < 1) threads = 1;
    if (tiles < 16L * threads) threads = 1; /* too little work to share */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long tile = 0; tile < tiles; tile++) {
        long n0 = tile * cols, nc = n - n0 < cols ? n - n0 : cols;
        const void *wr[4];
        for (int c = 0; c < nc; c++)
            wr[c] = w_bf16 ? (const void *)((const uint16_t *)w + (n0 + c) * k) : (const void *)((const float *)w + (n0 + c) * k);
        for (long r0 = 0; r0 < m; r0 += rstep) {
            int nr = (int)(m - r0 < rstep ? m - r0 : rstep);
            const float *rows_p[4], *rows_x[4];
            for (int r = 0; r < nr; r++) { rows_p[r] = xp + (r0 + r) * stride; rows_x[r] = x + (r0 + r) * k; }
            float out[4][4];
            if (w_bf16) RUN_TILES(bf16, const uint16_t)
            else RUN_TILES(f32, const float)
            for (int r = 0; r < nr; r++)
                for (int c = 0; c < nc; c++) {
                    float b = !bias ? 0.0f : w_bf16 ? bf16_to_f32(((const uint16_t *)bias)[n0 + c]) : ((const float *)bias)[n0 + c];
                    y[(r0 + r) * n + n0 + c] = out[r][c] + b;
                }
        }
    }
    free(xp);
}

static void load_f32(const void *src, int bf16, float *dst, long count) {
    if (!bf16) { memcpy(dst, src, sizeof(float) * count); return; }
    for (long i = 0; i < count; i++) dst[i] = bf16_to_f32(((const uint16_t *)src)[i]);
}

static void store(const float *src, void *dst, int bf16, long count) {
    if (!bf16) { memcpy(dst, src, sizeof(float) * count); return; }
    for (long i = 0; i < count; i++) ((uint16_t *)dst)[i] = f32_to_bf16(src[i]);
}

/* Round in place to the model's precision: what a PyTorch op in that dtype would have stored. */
static inline float rnd(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }
static void round_all(float *v, long count, int bf16) {
    if (bf16) for (long i = 0; i < count; i++) v[i] = rnd(v[i], 1);
}

static inline float param(const void *p, int bf16, long i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* dot(q, cache row) and acc += e * cache row over d dims, 8 lanes at a time (fixed order). */
static inline float dot_row(const float *q, const void *row, int bf16, long d) {
    __m256 acc = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= d; i += 8) {
        __m256 c = bf16 ? load8_bf16((const uint16_t *)row + i) : _mm256_loadu_ps((const float *)row + i);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), c, acc);
    }
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    float s = _mm_cvtss_f32(lo);
    for (; i < d; i++) s += q[i] * param(row, bf16, i);
    return s;
}

static inline void axpy_row(float *acc, float e, const void *row, int bf16, long d) {
    __m256 ev = _mm256_set1_ps(e);
    long i = 0;
    for (; i + 8 <= d; i += 8) {
        __m256 c = bf16 ? load8_bf16((const uint16_t *)row + i) : _mm256_loadu_ps((const float *)row + i);
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(ev, c, _mm256_loadu_ps(acc + i)));
    }
    for (; i < d; i++) acc[i] += e * param(row, bf16, i);
}

/* y[m, n] = x[m, :] . w[n, :] + bias[n]; x, w, bias and y in fp32 or bf16 (their flags). */
void lp_linear(const void *x, int x_bf16, const void *w, int w_bf16, const void *bias, void *y, int y_bf16,
               long m, long n, long k, int threads) {
    float *xf = (float *)malloc(sizeof(float) * m * k);
    load_f32(x, x_bf16, xf, m * k);
    float *yf = y_bf16 ? (float *)malloc(sizeof(float) * m * n) : (float *)y;
    gemm(xf, w, w_bf16, bias, yf, m, n, k, threads);
    if (y_bf16) { store(yf, y, 1, m * n); free(yf); }
    free(xf);
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
    const void *wq, *wk, *wv, *wo; /* (out, in) in the model dtype */
    const void *bq, *bk, *bv, *bo; /* NULL = no bias */
    float scaling;                 /* scores = q.k * scaling */
    long window;                   /* sliding window (keys > position - window); 0 = none */
    long rotary_dim;               /* dims rotated (head_dim for full RoPE); 0 = no RoPE */
} lp_attention;

typedef struct {
    long hidden, inner;
    lp_norm norm, post_norm;
    const void *wg, *wu, *wd; /* gate (inner, hidden), up (inner, hidden), down (hidden, inner) */
    int activation;           /* 0: SiLU, 1: GELU (tanh approximation) */
} lp_mlp;

/* rows x dim in place */
static void norm_rows(float *x, long rows, long dim, const lp_norm *nm, int bf16) {
    if (!nm->weight) return;
    for (long r = 0; r < rows; r++) {
        float *v = x + r * dim;
        double ss = 0.0;
        for (long i = 0; i < dim; i++) ss += (double)v[i] * v[i];
        float inv = 1.0f / sqrtf((float)(ss / dim) + nm->eps);
        for (long i = 0; i < dim; i++) {
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
            for (long i = 0; i < rotary_dim; i++) {
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
    for (long i = 0; i < count; i++)
        scratch[i] = rnd(scratch[i] + (scale == 1.0f ? update[i] : rnd(scale * update[i], bf16)), bf16);
    store(scratch, out, bf16, count);
}

static inline float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* One attention sub-layer on `rows` tokens at positions pos0.. (hidden and out: (rows, hidden)):
 * out = hidden + residual_scale * o_proj(attention(rope(q), rope(k), v)), with k and v written into the
 * step's cache slot (kv_heads, capacity, head_dim) at pos0.. first. The slot holds positions from
 * kv_start on (0 for a KV cache; pos0 for a pass that attends to its own tokens only).
 * keep_sink/keep_recent > 0 (single-token reads only): attend to the first keep_sink and the last
 * keep_recent positions (a windowed draft); 0 = every position. Returns 0, or -1 when head_dim is
 * beyond what the kernel handles. */
int lp_attention_block(const lp_attention *a, const void *hidden, void *out, long rows, long pos0, const void *cos, const void *sin,
                       void *kcache, void *vcache, long capacity, long kv_start, long keep_sink, long keep_recent,
                       float residual_scale, int bf16, int threads) {
    long H = a->hidden, D = a->head_dim, NQ = a->heads * D, NK = a->kv_heads * D;
    if (D > 512 || a->rotary_dim > D) return -1;
    float *x = (float *)malloc(sizeof(float) * rows * H);
    float *q = (float *)malloc(sizeof(float) * rows * NQ);
    float *k = (float *)malloc(sizeof(float) * rows * NK);
    float *v = (float *)malloc(sizeof(float) * rows * NK);
    float *o = (float *)malloc(sizeof(float) * rows * NQ);
    float *u = (float *)malloc(sizeof(float) * rows * H);
    load_f32(hidden, bf16, x, rows * H);
    norm_rows(x, rows, H, &a->norm, bf16);
    gemm(x, a->wq, bf16, a->bq, q, rows, NQ, H, threads);
    gemm(x, a->wk, bf16, a->bk, k, rows, NK, H, threads);
    gemm(x, a->wv, bf16, a->bv, v, rows, NK, H, threads);
    round_all(q, rows * NQ, bf16);
    round_all(k, rows * NK, bf16);
    round_all(v, rows * NK, bf16);
    norm_rows(q, rows * a->heads, D, &a->q_norm, bf16);
    norm_rows(k, rows * a->kv_heads, D, &a->k_norm, bf16);
    if (a->rotary_dim) {
        long R = a->rotary_dim;
        float *cs = (float *)malloc(sizeof(float) * rows * R), *sn = (float *)malloc(sizeof(float) * rows * R);
        load_f32(cos, bf16, cs, rows * R);
        load_f32(sin, bf16, sn, rows * R);
        rope_rows(q, rows, a->heads, D, R, cs, sn, bf16);
        rope_rows(k, rows, a->kv_heads, D, R, cs, sn, bf16);
        free(cs);
        free(sn);
    }
    for (long r = 0; r < rows; r++)
        for (long h = 0; h < a->kv_heads; h++) {
            long at = (h * capacity + pos0 - kv_start + r) * D;
            if (bf16) {
                store(k + (r * a->kv_heads + h) * D, (uint16_t *)kcache + at, 1, D);
                store(v + (r * a->kv_heads + h) * D, (uint16_t *)vcache + at, 1, D);
            } else {
                memcpy((float *)kcache + at, k + (r * a->kv_heads + h) * D, sizeof(float) * D);
                memcpy((float *)vcache + at, v + (r * a->kv_heads + h) * D, sizeof(float) * D);
            }
        }
    long group = a->heads / a->kv_heads;
    long end = pos0 + rows;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long h = 0; h < a->heads; h++) {
        long kh = h / group;
        float *scores = (float *)malloc(sizeof(float) * end);
        float acc[512];
        for (long r = 0; r < rows; r++) {
            long pos = pos0 + r, first = 0;
            if (a->window > 0 && pos - a->window + 1 > 0) first = pos - a->window + 1;
            if (first < kv_start) first = kv_start;
            const float *qv = q + (r * a->heads + h) * D;
            float best = -INFINITY;
            for (long p = first; p <= pos; p++) {
                if (rows == 1 && keep_recent > 0 && p >= keep_sink && p < end - keep_recent) { scores[p] = -INFINITY; continue; }
                long at = (kh * capacity + p - kv_start) * D;
                const void *row = bf16 ? (const void *)((const uint16_t *)kcache + at) : (const void *)((const float *)kcache + at);
                float s = dot_row(qv, row, bf16, D) * a->scaling;
                scores[p] = s;
                if (s > best) best = s;
            }
            float total = 0.0f;
            for (long i = 0; i < D; i++) acc[i] = 0.0f;
            for (long p = first; p <= pos; p++) {
                if (scores[p] == -INFINITY) continue;
                float e = expf(scores[p] - best);
                total += e;
                long at = (kh * capacity + p - kv_start) * D;
                axpy_row(acc, e, bf16 ? (const void *)((const uint16_t *)vcache + at) : (const void *)((const float *)vcache + at), bf16, D);
            }
            float *ov = o + (r * a->heads + h) * D;
            for (long i = 0; i < D; i++) ov[i] = rnd(acc[i] / total, bf16);
        }
        free(scores);
    }
    gemm(o, a->wo, bf16, a->bo, u, rows, H, NQ, threads);
    round_all(u, rows * H, bf16);
    norm_rows(u, rows, H, &a->post_norm, bf16);
    residual_add(hidden, u, x, out, rows * H, residual_scale, bf16);
    free(x); free(q); free(k); free(v); free(o); free(u);
    return 0;
}

/* One MLP sub-layer: out = hidden + residual_scale * down(act(gate(n)) * up(n)), n = norm(hidden). */
void lp_mlp_block(const lp_mlp *m, const void *hidden, void *out, long rows, float residual_scale, int bf16, int threads) {
    long H = m->hidden, I = m->inner;
    float *x = (float *)malloc(sizeof(float) * rows * H);
    float *g = (float *)malloc(sizeof(float) * rows * I);
    float *u = (float *)malloc(sizeof(float) * rows * I);
    float *d = (float *)malloc(sizeof(float) * rows * H);
    load_f32(hidden, bf16, x, rows * H);
    norm_rows(x, rows, H, &m->norm, bf16);
    gemm(x, m->wg, bf16, NULL, g, rows, I, H, threads);
    gemm(x, m->wu, bf16, NULL, u, rows, I, H, threads);
    for (long i = 0; i < rows * I; i++) {
        float gv = rnd(g[i], bf16), uv = rnd(u[i], bf16);
        float act = m->activation == 0 ? gv / (1.0f + expf(-gv)) : gelu_tanh(gv);
        g[i] = rnd(rnd(act, bf16) * uv, bf16);
    }
    gemm(g, m->wd, bf16, NULL, d, rows, H, I, threads);
    round_all(d, rows * H, bf16);
    norm_rows(d, rows, H, &m->post_norm, bf16);
    residual_add(hidden, d, x, out, rows * H, residual_scale, bf16);
    free(x); free(g); free(u); free(d);
}
