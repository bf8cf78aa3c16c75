/* Attention over a KV slot: softmax(q . k * scaling) . v for every (head, row) of a pass.
 *
 * Each query's numbers are those of attending alone, whatever the other queries of the pass: every
 * score is its own dot product (dot8: a key's score does not depend on the keys beside it), the
 * softmax sums in position order, and every output is one chain of FMAs over the positions in
 * order. So a pass's token gets the logits of decoding it alone, bit for bit.
 */
#include <omp.h>

#include "common.h"

/* out[0 : 8 lanes] = sum over kept positions, in order, of scores[q] * v[first + q] (8-lane groups
 * of the row from v, rows `stride` apart); with `more`, the sums go on from those in out (a run of
 * positions after the ones already summed there: the same chain of FMAs, stopped and resumed). The
 * sums are named variables, not an array: GCC keeps an array of them on the stack, storing and
 * loading them at every position. */
#define DEFINE_WEIGH(NAME, WT, LOAD8)                                                              \
    static void NAME(const float *scores, const unsigned char *keep, const WT *v, long stride, long first, long n, \
                     long lanes, float *out, int more) {                                           \
        lp_f8 z = f8_zero(), a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z;       \
        if (more) {                                                                                \
            if (lanes > 0) a0 = f8_load(out);                                                      \
            if (lanes > 1) a1 = f8_load(out + 8);                                                  \
            if (lanes > 2) a2 = f8_load(out + 16);                                                 \
            if (lanes > 3) a3 = f8_load(out + 24);                                                 \
            if (lanes > 4) a4 = f8_load(out + 32);                                                 \
            if (lanes > 5) a5 = f8_load(out + 40);                                                 \
            if (lanes > 6) a6 = f8_load(out + 48);                                                 \
            if (lanes > 7) a7 = f8_load(out + 56);                                                 \
        }                                                                                          \
        for (long q = 0; q < n; q++) {                                                             \
            if (keep && !keep[q]) continue;                                                        \
            lp_f8 e = f8_set1(scores[q]);                                                          \
            const WT *row = v + (first + q) * stride;                                              \
            if (lanes == 8) {                                                                      \
                a0 = f8_fmadd(e, LOAD8(row), a0); a1 = f8_fmadd(e, LOAD8(row + 8), a1);            \
                a2 = f8_fmadd(e, LOAD8(row + 16), a2); a3 = f8_fmadd(e, LOAD8(row + 24), a3);      \
                a4 = f8_fmadd(e, LOAD8(row + 32), a4); a5 = f8_fmadd(e, LOAD8(row + 40), a5);      \
                a6 = f8_fmadd(e, LOAD8(row + 48), a6); a7 = f8_fmadd(e, LOAD8(row + 56), a7);      \
            } else {                                                                               \
                if (lanes > 0) a0 = f8_fmadd(e, LOAD8(row), a0);                                   \
                if (lanes > 1) a1 = f8_fmadd(e, LOAD8(row + 8), a1);                               \
                if (lanes > 2) a2 = f8_fmadd(e, LOAD8(row + 16), a2);                              \
                if (lanes > 3) a3 = f8_fmadd(e, LOAD8(row + 24), a3);                              \
                if (lanes > 4) a4 = f8_fmadd(e, LOAD8(row + 32), a4);                              \
                if (lanes > 5) a5 = f8_fmadd(e, LOAD8(row + 40), a5);                              \
                if (lanes > 6) a6 = f8_fmadd(e, LOAD8(row + 48), a6);                              \
            }                                                                                      \
        }                                                                                          \
        if (lanes > 0) f8_store(out, a0);                                                          \
        if (lanes > 1) f8_store(out + 8, a1);                                                      \
        if (lanes > 2) f8_store(out + 16, a2);                                                     \
        if (lanes > 3) f8_store(out + 24, a3);                                                     \
        if (lanes > 4) f8_store(out + 32, a4);                                                     \
        if (lanes > 5) f8_store(out + 40, a5);                                                     \
        if (lanes > 6) f8_store(out + 48, a6);                                                     \
        if (lanes > 7) f8_store(out + 56, a7);                                                     \
    }
DEFINE_WEIGH(weigh_values_bf16, uint16_t, f8_load_bf16)
DEFINE_WEIGH(weigh_values_f16, uint16_t, f8_load_f16)
DEFINE_WEIGH(weigh_values_f32, float, f8_load)

/* q . key for the eight cache rows r0, r0 + stride, ... (the first `valid` of them; row 0 stands in
 * for the others, whose results are not used: the cache may end before them), each summed over d in
 * one 8-lane chain, then across lanes (f8_hsum8), then the tail in order. Eight chains keep the FMA
 * latency hidden. The rows are named pointers and the dots come back in a register (a table of row
 * pointers, or dots stored in halves and loaded whole, made the attention slower). */
#define DEFINE_DOT8(NAME, WT, LOAD8, PARAM)                                                         \
    static inline lp_f8 NAME(const float *q, const WT *r0, long stride, int valid, long d) {       \
        const WT *k0 = r0, *k1 = r0 + (valid > 1) * stride, *k2 = r0 + (valid > 2) * 2 * stride,   \
                 *k3 = r0 + (valid > 3) * 3 * stride, *k4 = r0 + (valid > 4) * 4 * stride,             \
                 *k5 = r0 + (valid > 5) * 5 * stride, *k6 = r0 + (valid > 6) * 6 * stride,             \
                 *k7 = r0 + (valid > 7) * 7 * stride;                                              \
        lp_f8 z = f8_zero(), a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z;       \
        long i = 0;                                                                                \
        for (; i + 8 <= d; i += 8) {                                                               \
            lp_f8 qv = f8_load(q + i);                                                             \
            a0 = f8_fmadd(qv, LOAD8(k0 + i), a0); a1 = f8_fmadd(qv, LOAD8(k1 + i), a1);            \
            a2 = f8_fmadd(qv, LOAD8(k2 + i), a2); a3 = f8_fmadd(qv, LOAD8(k3 + i), a3);            \
            a4 = f8_fmadd(qv, LOAD8(k4 + i), a4); a5 = f8_fmadd(qv, LOAD8(k5 + i), a5);            \
            a6 = f8_fmadd(qv, LOAD8(k6 + i), a6); a7 = f8_fmadd(qv, LOAD8(k7 + i), a7);            \
        }                                                                                          \
        lp_f8 dots = f8_hsum8(a0, a1, a2, a3, a4, a5, a6, a7);                                     \
        if (i < d) { /* the dims past the last whole eight, in order */                            \
            float out[8];                                                                          \
            f8_store(out, dots);                                                                   \
            for (long t = i; t < d; t++) {                                                         \
                out[0] += q[t] * PARAM(k0[t]); out[1] += q[t] * PARAM(k1[t]); out[2] += q[t] * PARAM(k2[t]); \
                out[3] += q[t] * PARAM(k3[t]); out[4] += q[t] * PARAM(k4[t]); out[5] += q[t] * PARAM(k5[t]); \
                out[6] += q[t] * PARAM(k6[t]); out[7] += q[t] * PARAM(k7[t]);                      \
            }                                                                                      \
            dots = f8_load(out);                                                                   \
        }                                                                                          \
        return dots;                                                                               \
    }
#define AS_F32(v) (v)
DEFINE_DOT8(dot8_bf16, uint16_t, f8_load_bf16, bf16_to_f32)
DEFINE_DOT8(dot8_f16, uint16_t, f8_load_f16, f16_to_f32)
DEFINE_DOT8(dot8_f32, float, f8_load, AS_F32)

/* scores[p - first] = q . key[p] * scaling for the cache positions p in [from, to], a run of the
 * query's [first, ...] (-inf where keep[p - first] is 0; keep NULL: every one kept). Eight keys at
 * a time; a key left out is scored all the same, and its score dropped (no branch per key). */
static void score_keys(const float *q, const void *kbase, long stride, long first, long from, long to,
                       const unsigned char *keep, float scaling, int kvt, long d, float *scores) {
    for (long p = from; p <= to; p += 8) {
        int valid = to - p + 1 < 8 ? (int)(to - p + 1) : 8;
        lp_f8 dots = kvt == LP_DTYPE_BF16 ? dot8_bf16(q, (const uint16_t *)kbase + p * stride, stride, valid, d)
                   : kvt == LP_DTYPE_F16  ? dot8_f16(q, (const uint16_t *)kbase + p * stride, stride, valid, d)
                                          : dot8_f32(q, (const float *)kbase + p * stride, stride, valid, d);
        if (!keep && valid == 8) { /* eight kept keys: the same products on eight lanes */
            f8_store(scores + p - first, f8_mul(dots, f8_set1(scaling)));
            continue;
        }
        float dot[8];
        f8_store(dot, dots);
        for (int j = 0; j < valid; j++) scores[p + j - first] = !keep || keep[p + j - first] ? dot[j] * scaling : -INFINITY;
    }
}

/* scores[0 : n] -> exp(score - the largest score), left unnormalised (their sum: sum_scores). A NaN
 * score is passed over by the maximum (f8_max keeps its second operand, as `>` does), and which of
 * two equal zeros is the largest does not matter (x - 0 and x + 0 are x, and exp(-0) = exp(0)). */
static void exp_scores(float *scores, long n) {
    lp_f8 best8 = f8_set1(-INFINITY);
    long p = 0;
    for (; p + 8 <= n; p += 8) best8 = f8_max(f8_load(scores + p), best8);
    float lanes8[8], best = -INFINITY;
    f8_store(lanes8, best8);
    for (int j = 0; j < 8; j++)
        if (lanes8[j] > best) best = lanes8[j];
    for (; p < n; p++)
        if (scores[p] > best) best = scores[p];
    p = 0;
    for (; p + 8 <= n; p += 8) { /* exp in lanes (every position the same way) */
        lp_f8 sc = f8_load(scores + p);
        f8_store(scores + p, f8_zero_where_neg_inf(f8_exp(f8_sub(sc, f8_set1(best))), sc));
    }
    for (; p < n; p += 8) { /* the last, partial eight */
        float in[8], ev[8];
        for (int j = 0; j < 8; j++) in[j] = p + j < n ? scores[p + j] - best : 0.0f;
        f8_store(ev, f8_exp(f8_load(in)));
        for (int j = 0; j < 8 && p + j < n; j++) scores[p + j] = scores[p + j] == -INFINITY ? 0.0f : ev[j];
    }
}

/* totals[s] = the sum of the `count` queries' exp'd scores (exp_scores), each added in position
 * order, one chain a query: the chains of several queries advance together, so the adds of one
 * hide the latency of the others' (each total is its own chain's, whatever the others). */
static void sum_scores(float *const *scores, const long *lengths, long count, float *totals) {
    long s0 = 0;
    for (; s0 + 4 <= count; s0 += 4) { /* four chains at a time, in registers */
        float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
        const float *a = scores[s0], *b = scores[s0 + 1], *c = scores[s0 + 2], *d = scores[s0 + 3];
        long na = lengths[s0], nb = lengths[s0 + 1], nc = lengths[s0 + 2], nd = lengths[s0 + 3];
        long both = na < nb ? na : nb, all = both < nc ? both : nc;
        all = all < nd ? all : nd;
        long p = 0;
        for (; p < all; p++) {
            t0 += a[p];
            t1 += b[p];
            t2 += c[p];
            t3 += d[p];
        }
        for (long q = p; q < na; q++) t0 += a[q];
        for (long q = p; q < nb; q++) t1 += b[q];
        for (long q = p; q < nc; q++) t2 += c[q];
        for (long q = p; q < nd; q++) t3 += d[q];
        totals[s0] = t0, totals[s0 + 1] = t1, totals[s0 + 2] = t2, totals[s0 + 3] = t3;
    }
    if (s0 + 2 <= count) {
        float t0 = 0.0f, t1 = 0.0f;
        const float *a = scores[s0], *b = scores[s0 + 1];
        long na = lengths[s0], nb = lengths[s0 + 1], both = na < nb ? na : nb, p = 0;
        for (; p < both; p++) {
            t0 += a[p];
            t1 += b[p];
        }
        for (long q = p; q < na; q++) t0 += a[q];
        for (long q = p; q < nb; q++) t1 += b[q];
        totals[s0] = t0, totals[s0 + 1] = t1;
        s0 += 2;
    }
    for (; s0 < count; s0++) {
        float t = 0.0f;
        for (long p = 0; p < lengths[s0]; p++) t += scores[s0][p];
        totals[s0] = t;
    }
}

/* One query of attend_group: its vector, its cache positions [first, last] (in the slot), which
 * of them it keeps (NULL: every one), and room for its scores (last - first + 1) and output (d). */
typedef struct {
    const float *q;
    long first, last;
    const unsigned char *keep;
    float *scores, *out;
} lp_query;

/* positions [r0, min(r0 + run, hi + 1)) of a cache run (rows `stride` apart, of dtype kvt) widened
 * to fp32 into buf, which it returns */
static const float *widened_run(const void *base, int kvt, long r0, long hi, long run, long stride, float *buf) {
    long n = hi - r0 + 1 < run ? hi - r0 + 1 : run;
    lp_load_f32((const char *)base + r0 * stride * lp_kv_bytes(kvt), kvt, buf, n * stride);
    return buf;
}

/* Queries that attend over one kv head, each softmax(q . k * scaling) . v into its out. They go
 * through the positions in runs of about LP_RUN_ELEMENTS cache elements: every query scores a run's
 * keys, and later weighs a run's values, while the run is in L1. Each output is one chain of FMAs
 * over the positions in order, carried from run to run in out.
 *
 * Several queries over a 16-bit cache (a grouped-query head's query heads, a pass's rows) take the
 * run widened to fp32 once, in `run_f32`, rather than each converting every element again: the
 * conversion is exact, so the same numbers. The cache's positions [r0, r0 + run) are run_f32's rows
 * 0, 1, ...: the queries' positions go in shifted by r0. */
#define LP_RUN_ELEMENTS 4096
static void attend_group(const lp_query *qs, long count, const void *kbase, const void *vbase, long stride,
                         float scaling, int kvt, long d) {
    long lo = qs[0].first, hi = qs[0].last;
    for (long s = 1; s < count; s++) {
        if (qs[s].first < lo) lo = qs[s].first;
        if (qs[s].last > hi) hi = qs[s].last;
    }
    long run = LP_RUN_ELEMENTS / d / 8 * 8;
    if (run < 8) run = 8;
    _Alignas(64) float run_f32[LP_RUN_ELEMENTS];
    int widen = kvt != LP_DTYPE_F32 && count > 1 && run * stride <= LP_RUN_ELEMENTS;
    for (long r0 = lo; r0 <= hi; r0 += run) {
        long shift = widen ? r0 : 0;
        const void *keys = widen ? widened_run(kbase, kvt, r0, hi, run, stride, run_f32) : kbase;
        for (long s = 0; s < count; s++) {
            long from = r0 > qs[s].first ? r0 : qs[s].first, to = r0 + run - 1 < qs[s].last ? r0 + run - 1 : qs[s].last;
            if (from <= to)
                score_keys(qs[s].q, keys, stride, qs[s].first - shift, from - shift, to - shift, qs[s].keep, scaling,
                           widen ? LP_DTYPE_F32 : kvt, d, qs[s].scores);
        }
    }
    float totals[LP_QUERIES], *exps[LP_QUERIES];
    long lengths[LP_QUERIES];
    for (long s = 0; s < count; s++) {
        lengths[s] = qs[s].last - qs[s].first + 1;
        exp_scores(qs[s].scores, lengths[s]);
        exps[s] = qs[s].scores;
    }
    sum_scores(exps, lengths, count, totals);
    for (long r0 = lo; r0 <= hi; r0 += run) {
        long shift = widen ? r0 : 0;
        int vt = widen ? LP_DTYPE_F32 : kvt;
        const void *values = widen ? widened_run(vbase, kvt, r0, hi, run, stride, run_f32) : vbase;
        for (long s = 0; s < count; s++) {
            long from = r0 > qs[s].first ? r0 : qs[s].first, to = r0 + run - 1 < qs[s].last ? r0 + run - 1 : qs[s].last;
            if (from > to) continue;
            const float *sc = qs[s].scores + (from - qs[s].first);
            const unsigned char *kp = qs[s].keep ? qs[s].keep + (from - qs[s].first) : NULL;
            for (long c = 0; c < d; c += 64) { /* 64 output dims in eight registers */
                long width = d - c < 64 ? d - c : 64, lanes = width / 8;
                if (vt == LP_DTYPE_BF16) weigh_values_bf16(sc, kp, (const uint16_t *)values + c, stride, from - shift, to - from + 1, lanes, qs[s].out + c, from > qs[s].first);
                else if (vt == LP_DTYPE_F16) weigh_values_f16(sc, kp, (const uint16_t *)values + c, stride, from - shift, to - from + 1, lanes, qs[s].out + c, from > qs[s].first);
                else weigh_values_f32(sc, kp, (const float *)values + c, stride, from - shift, to - from + 1, lanes, qs[s].out + c, from > qs[s].first);
            }
        }
    }
    for (long s = 0; s < count; s++) {
        const lp_query *qy = qs + s;
        long n = qy->last - qy->first + 1;
        for (long c = 0; c < d; c += 64) { /* dims past the last whole eight: one scalar chain each */
            long width = d - c < 64 ? d - c : 64;
            for (long t = width / 8 * 8; t < width; t++) {
                float tail = 0.0f;
                for (long q2 = 0; q2 < n; q2++)
                    if (!qy->keep || qy->keep[q2])
                        tail += qy->scores[q2] * lp_param(vbase, kvt, (qy->first + q2) * stride + c + t);
                qy->out[c + t] = tail;
            }
        }
        long i = 0;
        for (; i + 8 <= d; i += 8) f8_store(qy->out + i, f8_div(f8_load(qy->out + i), f8_set1(totals[s])));
        for (; i < d; i++) qy->out[i] /= totals[s];
    }
}

/* The (head, row) items [i0, i1) of one sequence's queries (item = head * rows + row), attended in
 * groups that share a kv head (attend_group). kw / vw: the slot's keys and values widened to fp32
 * (NULL: read as stored); scores and keep: a thread's scratch of LP_QUERIES x (pos0 + rows + 8). */
static void attend_items(const lp_attention *a, const float *q, float *o, long rows, long pos0, const lp_kv *kv,
                         long keep_sink, long keep_recent, const unsigned char *tree, int dtype, const float *kw,
                         const float *vw, long i0, long i1, float *scores, unsigned char *keep) {
    long D = a->head_dim, group = a->heads / a->kv_heads, end = pos0 + rows, capacity = kv->capacity;
    long ces = lp_kv_bytes(kv->dtype), kv_start = kv->start, span = end - kv_start;
    lp_query qs[LP_QUERIES];
    for (long b0 = i0, b1; b0 < i1; b0 = b1) {
        long kh = b0 / rows / group;
        for (b1 = b0; b1 < i1 && b1 - b0 < LP_QUERIES && b1 / rows / group == kh; b1++) {
            long h = b1 / rows, r = b1 % rows, s = b1 - b0;
            long pos = pos0 + r, first = 0;
            if (a->window > 0 && pos - a->window + 1 > 0) first = pos - a->window + 1;
            if (first < kv_start) first = kv_start;
            int masked = tree || (rows == 1 && keep_recent > 0); /* else every position is kept */
            unsigned char *kp = keep + s * (end + 8);
            if (masked)
                for (long p = first; p <= pos; p++)
                    kp[p - first] = !((rows == 1 && keep_recent > 0 && p >= keep_sink && p < end - keep_recent)
                                      || (tree && p >= pos0 && !tree[r * rows + p - pos0]));
            /* the cache holds positions from kv_start on */
            qs[s] = (lp_query){q + (r * a->heads + h) * D, first - kv_start, pos - kv_start, masked ? kp : NULL,
                               scores + s * (end + 8), o + (r * a->heads + h) * D};
        }
        const void *kbase = kw ? (const void *)(kw + kh * span * D) : (const void *)((const char *)kv->k + kh * capacity * D * ces);
        const void *vbase = vw ? (const void *)(vw + kh * span * D) : (const void *)((const char *)kv->v + kh * capacity * D * ces);
        attend_group(qs, b1 - b0, kbase, vbase, D, a->scaling, kw ? LP_DTYPE_F32 : kv->dtype, D);
        for (long s = 0; s < b1 - b0; s++) lp_round_all(qs[s].out, D, dtype);
    }
}

int lp_attend(const lp_attention *a, const float *q, float *o, long rows, long pos0, const lp_kv *kv, long keep_sink,
              long keep_recent, const unsigned char *tree, int dtype, int threads) {
    long D = a->head_dim, group = a->heads / a->kv_heads, end = pos0 + rows, capacity = kv->capacity;
    long kv_start = kv->start;
    /* A pass's queries share each kv head's keys and values. Up to LP_QUERIES of them (a head's
     * group, a verify pass's rows) attend together, and attend_group widens each run of a 16-bit
     * cache to fp32 once for all of them, in L1; more (a prompt's) would widen every run once per
     * LP_QUERIES, so the slot is widened once, whole, first (exact either way, so the same
     * numbers). Widening the slot whole writes and reads back twice its bytes: a verify pass's few
     * queries paid more for that than for their scores. */
    long span = end - kv_start;
    int widen = kv->dtype != LP_DTYPE_F32 && group * rows > LP_QUERIES;
    float *kw = widen ? lp_floats(a->kv_heads * span * D) : NULL;
    float *vw = widen ? lp_floats(a->kv_heads * span * D) : NULL;
    if (widen && (!kw || !vw)) {
        free(kw);
        free(vw);
        return LP_E_MEMORY;
    }
    int failed = 0;
    /* every (head, row) pair is one item, so that a pass has rows x heads items to share */
    #pragma omp parallel num_threads(threads)
    {
        if (widen) {
            #pragma omp for schedule(static)
            for (long hp = 0; hp < a->kv_heads * span; hp++) {
                long h = hp / span, at = (h * capacity + hp % span) * D;
                lp_load_f32((const uint16_t *)kv->k + at, kv->dtype, kw + hp * D, D);
                lp_load_f32((const uint16_t *)kv->v + at, kv->dtype, vw + hp * D, D);
            }
        }
        /* each thread takes an even, contiguous share of the (head, row) items */
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long items = a->heads * rows, i0 = items * t / nt, i1 = items * (t + 1) / nt;
        /* its scores and masks in one block */
        size_t sizes[] = {sizeof(float) * (size_t)(LP_QUERIES * (end + 8)), (size_t)(LP_QUERIES * (end + 8))};
        void *piece[2];
        void *block = lp_pieces(sizes, 2, piece);
        if (!block)
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        else
            attend_items(a, q, o, rows, pos0, kv, keep_sink, keep_recent, tree, dtype, kw, vw, i0, i1,
                         (float *)piece[0], (unsigned char *)piece[1]);
        free(block);
    }
    free(kw);
    free(vw);
    return failed ? LP_E_MEMORY : LP_OK;
}

int lp_attend_segments(const lp_attention *a, const float *q, float *o, const lp_segment *segs, long nsegs,
                       const lp_kv *kvs, int dtype, int threads) {
    /* a segment whose queries would widen a 16-bit cache attends alone (lp_attend), the others in one
     * parallel region: several requests' decode rows are one token each, and a region per request
     * per layer would cost more than their attention */
    long items = 0, longest = 0;
    for (long s = 0, r0 = 0; s < nsegs; r0 += segs[s].rows, s++) {
        int widen = kvs[s].dtype != LP_DTYPE_F32 && a->heads / a->kv_heads * segs[s].rows >= 8;
        if (widen || nsegs == 1) {
            int status = lp_attend(a, q + r0 * a->heads * a->head_dim, o + r0 * a->heads * a->head_dim, segs[s].rows,
                                   segs[s].pos0, kvs + s, 0, 0, NULL, dtype, threads);
            if (status != LP_OK) return status;
            continue;
        }
        items += a->heads * segs[s].rows;
        if (segs[s].pos0 + segs[s].rows > longest) longest = segs[s].pos0 + segs[s].rows;
    }
    if (items == 0) return LP_OK;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        /* each thread takes an even, contiguous share of the items of every such segment in order */
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long g0 = items * t / nt, g1 = items * (t + 1) / nt;
        float *scores = lp_floats(LP_QUERIES * (longest + 8));
        unsigned char *keep = (unsigned char *)malloc((size_t)(LP_QUERIES * (longest + 8)));
        if (!scores || !keep) {
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
            g1 = g0;
        }
        for (long s = 0, r0 = 0, at = 0; s < nsegs && at < g1; r0 += segs[s].rows, s++) {
            if (kvs[s].dtype != LP_DTYPE_F32 && a->heads / a->kv_heads * segs[s].rows >= 8) continue;
            long n = a->heads * segs[s].rows, i0 = g0 - at, i1 = g1 - at;
            if (i0 < 0) i0 = 0;
            if (i1 > n) i1 = n;
            if (i0 < i1)
                attend_items(a, q + r0 * a->heads * a->head_dim, o + r0 * a->heads * a->head_dim, segs[s].rows,
                             segs[s].pos0, kvs + s, 0, 0, NULL, dtype, NULL, NULL, i0, i1, scores, keep);
            at += n;
        }
        free(scores);
        free(keep);
    }
    return failed ? LP_E_MEMORY : LP_OK;
}
