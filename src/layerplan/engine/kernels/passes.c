/* Decoder sub-layers (the llama family: RMSNorm, RoPE, grouped-query attention, gated MLP) and
 * passes over runs of plan steps: the runner's loop with no Python between its parts. The same
 * kernels in the same order whichever entry point runs them, so the same numbers. */
#include <omp.h>

#include "common.h"

/* BODY for r = 0 .. rows-1: shared among the threads when `split`, in this thread otherwise. A
 * region's fork and join cost about as much as a norm over a few thousand elements, so the per-row
 * work is shared only where there is enough of it (LP_SPLIT_ELEMENTS): a step, and the few rows of a
 * batch's decode, keep one thread. Which thread runs a row changes no number. */
#define EACH_ROW(split, threads, rows, ...)                                                         \
    do {                                                                                            \
        if (split) {                                                                                \
            _Pragma("omp parallel for num_threads(threads) schedule(static)")                       \
            for (long r = 0; r < (rows); r++) __VA_ARGS__                                           \
        } else {                                                                                    \
            for (long r = 0; r < (rows); r++) __VA_ARGS__                                           \
        }                                                                                           \
    } while (0)

#define LP_SPLIT_ELEMENTS 16384
static inline int split_rows(long rows, long width, int threads) {
    return threads > 1 && rows > 1 && rows * width >= LP_SPLIT_ELEMENTS;
}

static int valid_norm(const lp_norm *nm) { return !nm->weight || lp_dtype_bytes(nm->dtype); }

static int attention_segments(const lp_attention *a, const void *hidden, void *out, long rows, const lp_segment *segs,
                              const lp_kv *kvs, long nsegs, const void *cos, const void *sin, long keep_sink,
                              long keep_recent, const unsigned char *tree, float residual_scale, int dtype,
                              int threads);

/* One attention sub-layer on `rows` tokens at positions pos0.. (hidden and out: (rows, hidden)):
 * out = hidden + residual_scale * o_proj(attention(rope(q), rope(k), v)), with k and v written into
 * the slot at pos0.. first.
 * keep_sink/keep_recent > 0 (single-token reads only): attend to the first keep_sink and the last
 * keep_recent positions (a windowed draft); 0 = every position.
 * tree (rows x rows, NULL = a chain): the pass's tokens are the nodes of a draft tree, row r
 * attending to row c of the pass only where tree[r * rows + c] (its ancestors and itself; the
 * caller's cos / sin give each node its position by depth). A node's result is then the one a
 * chain of its path would give, bit for bit: the same keys, summed in the same order. */
LP_API int lp_attention_block(const lp_attention *a, const void *hidden, void *out, long rows, long pos0,
                              const void *cos, const void *sin, const lp_kv *kv, long keep_sink, long keep_recent,
                              const unsigned char *tree, float residual_scale, int dtype, int threads) {
    lp_segment whole = {rows, pos0, rows};
    return attention_segments(a, hidden, out, rows, &whole, kv, 1, cos, sin, keep_sink, keep_recent, tree,
                              residual_scale, dtype, threads);
}

/* lp_attention_block over the rows of several sequences (segments, in row order; kvs[s] the slot
 * of segment s): the products run on every row at once, each segment's rows write their keys and
 * values into their own slot at their own positions and attend to it alone. A row's numbers are
 * those of its sequence's pass alone (the products are batch-invariant, the rest per row or per
 * segment). keep_sink / keep_recent / tree: one segment only. */
static int attention_segments(const lp_attention *a, const void *hidden, void *out, long rows, const lp_segment *segs,
                              const lp_kv *kvs, long nsegs, const void *cos, const void *sin, long keep_sink,
                              long keep_recent, const unsigned char *tree, float residual_scale, int dtype,
                              int threads) {
    long H = a->hidden, D = a->head_dim, NQ = a->heads * D, NK = a->kv_heads * D, R = a->rotary_dim;
    long es = lp_dtype_bytes(dtype);
    if (!es || !valid_norm(&a->norm) || !valid_norm(&a->q_norm) || !valid_norm(&a->k_norm) || !valid_norm(&a->post_norm))
        return LP_E_TYPE;
    if (D <= 0 || D > 512 || R < 0 || R > D || a->kv_heads <= 0 || a->heads % a->kv_heads || (tree && a->window > 0)
        || nsegs < 1 || (nsegs > 1 && (tree || keep_sink || keep_recent)))
        return LP_E_SHAPE;
    long apart = a->v.n > 0, QKV = apart ? NQ + NK : NQ + 2 * NK; /* qkv's rows, v's apart or not */
    if (a->qkv.n != QKV || (apart && a->v.n != NK)) return LP_E_SHAPE;
    long total = 0;
    for (long s = 0; s < nsegs; s++) {
        const lp_kv *kv = kvs + s;
        if (!lp_kv_bytes(kv->dtype)) return LP_E_TYPE;
        if (segs[s].rows < 0) return LP_E_SHAPE;
        if (segs[s].pos0 < kv->start || segs[s].pos0 - kv->start + segs[s].rows > kv->capacity) return LP_E_CAPACITY;
        total += segs[s].rows;
    }
    if (total != rows) return LP_E_SHAPE;
    if (rows <= 0) return LP_OK;
    if (threads < 1) threads = 1;
    /* the pass's scratch in one block: each row's segment and its place in it, the rows' floats */
    size_t fl = sizeof(float);
    size_t sizes[] = {sizeof(long) * (size_t)rows, sizeof(long) * (size_t)nsegs, fl * (size_t)(rows * H),
                      fl * (size_t)(rows * (NQ + 2 * NK)), fl * (size_t)(rows * NQ), fl * (size_t)(rows * NK),
                      fl * (size_t)(rows * NK), fl * (size_t)(rows * NQ), fl * (size_t)(rows * H),
                      apart ? fl * (size_t)(rows * NK) : 0};
    void *piece[10];
    void *block = lp_pieces(sizes, 10, piece);
    if (!block) return LP_E_MEMORY;
    long *seg_of = (long *)piece[0], *first_of = (long *)piece[1];
    for (long s = 0, r0 = 0; s < nsegs; r0 += segs[s].rows, s++) {
        first_of[s] = r0;
        for (long r = r0; r < r0 + segs[s].rows; r++) seg_of[r] = s;
    }
    float *x = (float *)piece[2], *qkv = (float *)piece[3], *q = (float *)piece[4], *k = (float *)piece[5],
          *v = (float *)piece[6], *o = (float *)piece[7], *u = (float *)piece[8];
    float *v_apart = (float *)piece[9];
    int split = split_rows(rows, H, threads);
    EACH_ROW(split, threads, rows, {
        lp_load_f32((const char *)hidden + r * H * es, dtype, x + r * H, H);
        lp_norm_rows(x + r * H, 1, H, &a->norm, dtype);
    });
    int status = lp_gemm(&a->qkv, x, rows, qkv, threads);
    if (status == LP_OK && apart) status = lp_gemm(&a->v, x, rows, v_apart, threads);
    if (status == LP_OK) {
        EACH_ROW(split, threads, rows, {
            float *qr = q + r * NQ, *kr = k + r * NK, *vr = v + r * NK;
            const float *src = qkv + r * QKV;
            memcpy(qr, src, sizeof(float) * (size_t)NQ);
            memcpy(kr, src + NQ, sizeof(float) * (size_t)NK);
            memcpy(vr, apart ? v_apart + r * NK : src + NQ + NK, sizeof(float) * (size_t)NK);
            lp_round_all(qr, NQ, dtype);
            lp_round_all(kr, NK, dtype);
            lp_round_all(vr, NK, dtype);
            lp_norm_rows(qr, a->heads, D, &a->q_norm, dtype);
            lp_norm_rows(kr, a->kv_heads, D, &a->k_norm, dtype);
            if (R) {
                float cs[512], sn[512];
                lp_load_f32((const char *)cos + r * R * es, dtype, cs, R);
                lp_load_f32((const char *)sin + r * R * es, dtype, sn, R);
                lp_rope_rows(qr, 1, a->heads, D, R, cs, sn, dtype);
                lp_rope_rows(kr, 1, a->kv_heads, D, R, cs, sn, dtype);
            }
            const long s = seg_of[r];
            const lp_kv *kv = kvs + s;
            const long ces = lp_kv_bytes(kv->dtype), at_row = segs[s].pos0 - kv->start + r - first_of[s];
            for (long h = 0; h < a->kv_heads; h++) {
                long at = (h * kv->capacity + at_row) * D;
                lp_store(kr + h * D, (char *)kv->k + at * ces, kv->dtype, D);
                lp_store(vr + h * D, (char *)kv->v + at * ces, kv->dtype, D);
            }
        });
        if (nsegs > 1) /* (no window masks nor trees in a pass over several: checked above) */
            status = lp_attend_segments(a, q, o, segs, nsegs, kvs, dtype, threads);
        else if (rows > 0)
            status = lp_attend(a, q, o, rows, segs[0].pos0, kvs, keep_sink, keep_recent, tree, dtype, threads);
    }
    if (status == LP_OK) status = lp_gemm(&a->o, o, rows, u, threads);
    if (status == LP_OK)
        EACH_ROW(split, threads, rows, {
            lp_round_all(u + r * H, H, dtype);
            lp_norm_rows(u + r * H, 1, H, &a->post_norm, dtype);
            lp_residual_add((const char *)hidden + r * H * es, u + r * H, x + r * H, (char *)out + r * H * es, H,
                            residual_scale, dtype);
        });
    free(block);
    return status;
}

/* One MLP sub-layer: out = hidden + residual_scale * down(act(gate(n)) * up(n)), n = norm(hidden). */
LP_API int lp_mlp_block(const lp_mlp *m, const void *hidden, void *out, long rows, float residual_scale, int dtype,
                        int threads) {
    long H = m->hidden, I = m->inner, es = lp_dtype_bytes(dtype);
    if (!es || !valid_norm(&m->norm) || !valid_norm(&m->post_norm)) return LP_E_TYPE;
    if (m->activation != LP_ACT_SILU && m->activation != LP_ACT_GELU_TANH) return LP_E_SHAPE;
    if (rows <= 0) return LP_OK;
    if (threads < 1) threads = 1;
    /* the pass's scratch in one block */
    size_t sizes[] = {sizeof(float) * (size_t)(rows * H), sizeof(float) * (size_t)(rows * 2 * I),
                      sizeof(float) * (size_t)(rows * I), sizeof(float) * (size_t)(rows * H)};
    void *piece[4];
    void *block = lp_pieces(sizes, 4, piece);
    if (!block) return LP_E_MEMORY;
    float *x = (float *)piece[0], *gu = (float *)piece[1], *g = (float *)piece[2], *d = (float *)piece[3];
    int split = split_rows(rows, H, threads), split_inner = split_rows(rows, I, threads);
    EACH_ROW(split, threads, rows, {
        lp_load_f32((const char *)hidden + r * H * es, dtype, x + r * H, H);
        lp_norm_rows(x + r * H, 1, H, &m->norm, dtype);
    });
    int status = lp_gemm(&m->gate_up, x, rows, gu, threads);
    if (status == LP_OK) {
        EACH_ROW(split_inner, threads, rows, { lp_gated_activation(gu + r * 2 * I, gu + r * 2 * I + I, g + r * I, I, m->activation, dtype); });
        status = lp_gemm(&m->down, g, rows, d, threads);
    }
    if (status == LP_OK)
        EACH_ROW(split, threads, rows, {
            lp_round_all(d + r * H, H, dtype);
            lp_norm_rows(d + r * H, 1, H, &m->post_norm, dtype);
            lp_residual_add((const char *)hidden + r * H * es, d + r * H, x + r * H, (char *)out + r * H * es, H,
                            residual_scale, dtype);
        });
    free(block);
    return status;
}

/* hidden (rows, hidden) in place through `count` steps over the rows of `nsegs` sequences (one:
 * a pass; several: lp_forward_batch): step s's attention writes and reads segment g's KV slot
 * kvs[s * nsegs + g], or with kvs NULL the step's own slot (one segment). */
static int run_segments(const lp_step *steps, long count, void *hidden, long rows, const lp_segment *segs, long nsegs,
                        const lp_kv *kvs, const void *const *cos, const void *const *sin, long keep_sink,
                        long keep_recent, const unsigned char *tree, int dtype, int threads) {
    for (long s = 0; s < count; s++) {
        const lp_step *st = steps + s;
        int status = LP_OK;
        if (st->stream && !kvs) { /* one sequence's pass (a batch's steps keep no stream) */
            long H = st->attention ? st->attention->hidden : st->mlp ? st->mlp->hidden : 0, es = lp_dtype_bytes(dtype);
            if (segs[0].pos0 < 0 || segs[0].pos0 + rows > st->stream_capacity) return LP_E_CAPACITY;
            memcpy((char *)st->stream + segs[0].pos0 * H * es, hidden, (size_t)(rows * H * es));
        }
        if (st->attention)
            status = attention_segments(st->attention, hidden, hidden, rows, segs, kvs ? kvs + s * nsegs : &st->kv,
                                        nsegs, cos[st->rope], sin[st->rope], keep_sink, keep_recent, tree, st->scale,
                                        dtype, threads);
        if (status == LP_OK && st->mlp) status = lp_mlp_block(st->mlp, hidden, hidden, rows, st->scale, dtype, threads);
        if (status != LP_OK) return status;
    }
    return LP_OK;
}

/* hidden (rows, hidden) in place through `count` steps, as the runner's loop would run them one
 * sub-layer at a time; the same kernels, so the same numbers. LP_OK, or the failing status. */
LP_API int lp_run_steps(const lp_step *steps, long count, void *hidden, long rows, long pos0, const void *const *cos,
                        const void *const *sin, long keep_sink, long keep_recent, const unsigned char *tree,
                        int dtype, int threads) {
    lp_segment whole = {rows, pos0, rows};
    return run_segments(steps, count, hidden, rows, &whole, 1, NULL, cos, sin, keep_sink, keep_recent, tree, dtype,
                        threads);
}

/* hidden's rows: the embedding's rows of the token ids; LP_E_TOKEN for an id outside [0, vocab) */
static int embed_rows(const void *embedding, long vocab, const long *ids, long rows, void *hidden, long dim, long es) {
    for (long r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= vocab) return LP_E_TOKEN;
    for (long r = 0; r < rows; r++)
        memcpy((char *)hidden + r * dim * es, (const char *)embedding + ids[r] * dim * es, (size_t)(dim * es));
    return LP_OK;
}

LP_API int lp_forward(const void *embedding, long vocab, const long *ids, long rows, void *hidden,
                      const lp_step *steps, long count, long pos0, const void *const *cos, const void *const *sin,
                      long keep_sink, long keep_recent, const unsigned char *tree, const lp_norm *final_norm,
                      const lp_matrix *head, long head_from, void *logits, int dtype, int threads) {
    long dim = head->k, es = lp_dtype_bytes(dtype);
    if (!es) return LP_E_TYPE;
    if (head_from < 0 || head_from > rows) return LP_E_SHAPE;
    int status = embed_rows(embedding, vocab, ids, rows, hidden, dim, es);
    if (status != LP_OK) return status;
    status = lp_run_steps(steps, count, hidden, rows, pos0, cos, sin, keep_sink, keep_recent, tree, dtype, threads);
    if (status != LP_OK) return status;
    return lp_norm_linear(final_norm, (const char *)hidden + head_from * dim * es, head, logits, rows - head_from, dtype,
                          threads);
}

/* Several sequences' passes as one (continuous batching): segments[s] rows of sequence s at its
 * positions, in row order over `rows` rows of ids; each step's attention writes and reads each
 * segment's own slot, kvs[step * nsegs + s] (the steps' own kv fields are not read); the products
 * (and the LM head) run on every row at once. cos / sin: each rope table's rows in row order (row
 * r at its segment's position). logits: (sum of segments[s].logits, vocab), each segment's last
 * `logits` rows in order (a prompt's chunk before its last needs none; a verify needs all). A
 * row's numbers are those of its sequence's pass alone (lp_forward). */
LP_API int lp_forward_batch(const void *embedding, long vocab, const long *ids, long rows, void *hidden,
                            const lp_step *steps, long count, const lp_kv *kvs, const lp_segment *segments, long nsegs,
                            const void *const *cos, const void *const *sin, const lp_norm *final_norm,
                            const lp_matrix *head, void *logits, int dtype, int threads) {
    long dim = head->k, es = lp_dtype_bytes(dtype), wanted = 0, total = 0;
    if (!es) return LP_E_TYPE;
    for (long s = 0; s < nsegs; s++) {
        if (segments[s].logits < 0 || segments[s].logits > segments[s].rows) return LP_E_SHAPE;
        wanted += segments[s].logits;
        total += segments[s].rows;
    }
    if (total != rows) return LP_E_SHAPE;
    int status = embed_rows(embedding, vocab, ids, rows, hidden, dim, es);
    if (status == LP_OK)
        status = run_segments(steps, count, hidden, rows, segments, nsegs, kvs, cos, sin, 0, 0, NULL, dtype, threads);
    if (status != LP_OK || wanted == 0) return status;
    if (wanted == rows) return lp_norm_linear(final_norm, hidden, head, logits, rows, dtype, threads);
    /* the wanted rows, gathered in order, through the head */
    char *picked = (char *)malloc((size_t)(wanted * dim * es));
    if (!picked) return LP_E_MEMORY;
    for (long s = 0, end = 0, at = 0; s < nsegs; s++) {
        end += segments[s].rows;
        long n = segments[s].logits;
        if (n > 0) memcpy(picked + at * dim * es, (const char *)hidden + (end - n) * dim * es, (size_t)(n * dim * es));
        at += n;
    }
    status = lp_norm_linear(final_norm, picked, head, logits, wanted, dtype, threads);
    free(picked);
    return status;
}
