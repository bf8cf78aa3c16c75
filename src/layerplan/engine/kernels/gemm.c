/* Products over packed matrices: which tile computes which rows and panels, and which thread
 * computes which panels. Neither changes a number (every tile sums by the block rule), only the
 * speed. */
#define _DEFAULT_SOURCE /* madvise */
#include <omp.h>
#include <sys/mman.h>

#include "formats.h"

/* Panels [p0, p1) of the product for the m rows of x into y (row stride ys; panel p's outputs at
 * column 16 (p - ybase), so y may be scratch for the last panels alone). A decoding step or a short
 * verify takes several panels per tile; longer passes take one panel at a time with the rows in
 * groups of at most LP_GROUP_ROWS. With several groups, every group works through a block of
 * LP_BLOCK inputs before the next block, so the block's weights come from memory once and from L1
 * for the other groups, and only the first group prefetches. A format with its own pass for many
 * rows (many_rows) takes every pass of more than LP_GROUP_ROWS rows. */
static void run_panels(const lp_tiles *t, const char *w, long panel_bytes, long k, const float *x, long m, float *y,
                       long ys, long p0, long p1, long ybase) {
    const long G = LP_GROUP_ROWS;
    long groups = (m + G - 1) / G, p = p0, step = groups > 1 ? LP_BLOCK : k;
#define PANEL(q) (w + (q) * panel_bytes)
#define OUT(row, q) (y + (row) * ys + ((q) - ybase) * LP_PANEL)
    if (t->many_rows && m > G) { /* the format's own pass over all the rows */
        t->many_rows(x, m, k, PANEL(p0), panel_bytes, p1 - p0, OUT(0, p0), ys);
        return;
    }
    if (m <= 3) {
        long group = m == 1 ? 4 : 2;
        for (; p + group <= p1; p += group) {
            if (m == 1) t->four_panels(x, k, 0, k, PANEL(p), panel_bytes, OUT(0, p), ys, 1);
            else t->two_panels[m](x, k, 0, k, PANEL(p), panel_bytes, OUT(0, p), ys, 1);
        }
    }
    long rest = m - G * (groups - 1); /* the rows left after full groups */
    if (t->pair_rest && groups > 1 && rest <= 3)
        for (; p + 2 <= p1; p += 2)
            for (long i0 = 0; i0 < k; i0 += step) {
                long i1 = i0 + step;
                for (long g = 0; g < groups - 1; g++)
                    for (long q = p; q < p + 2; q++)
                        t->one_panel[G](x + G * g * k, k, i0, i1, PANEL(q), panel_bytes, OUT(G * g, q), ys, g == 0);
                t->two_panels[rest](x + G * (groups - 1) * k, k, i0, i1, PANEL(p), panel_bytes, OUT(G * (groups - 1), p),
                                    ys, 0);
            }
    for (; p < p1; p++)
        for (long i0 = 0; i0 < k; i0 += step)
            for (long r0 = 0, g = 0, i1 = i0 + step; r0 < m; g++) {
                long nr = t->even_groups ? m / groups + (g < m % groups) : g < groups - 1 ? G : m - G * g;
                t->one_panel[nr](x + r0 * k, k, i0, i1, PANEL(p), panel_bytes, OUT(r0, p), ys, g == 0);
                r0 += nr;
            }
#undef PANEL
#undef OUT
}

/* Each thread owns an even, contiguous run of panels and walks it from its start, claiming a few
 * panels at a time; a thread done with its own run takes half of what is left of the fullest other
 * run, from that run's end. So a thread slowed down (by the host, or by the other's memory traffic)
 * does not leave the others waiting at the end of every product, and each thread still reads long
 * runs of consecutive panels, which the prefetchers need. */
typedef struct {
    _Alignas(64) unsigned long long span; /* first panel << 32 | end panel, of one thread's run */
} lp_run;

/* Claims panels [*from, *to) of run r, from its start (its owner: `take` panels, one at a time once
 * fewer than 2 x take are left) or from its end (another thread: half of what is left, at least
 * one panel); 0 when the run is empty. Small claims at the end keep the threads' ends close. */
static int claim(lp_run *r, long take, int from_end, long *from, long *to) {
    unsigned long long span = __atomic_load_n(&r->span, __ATOMIC_ACQUIRE);
    for (;;) {
        long first = (long)(span >> 32), end = (long)(span & 0xffffffffu), left = end - first;
        if (first >= end) return 0;
        long n = from_end ? (left / 2 > 1 ? left / 2 : 1) : (left >= 2 * take ? take : 1);
        unsigned long long rest = from_end ? (unsigned long long)first << 32 | (unsigned long long)(end - n)
                                           : (unsigned long long)(first + n) << 32 | (unsigned long long)end;
        if (__atomic_compare_exchange_n(&r->span, &span, rest, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *from = from_end ? end - n : first;
            *to = from_end ? end : first + n;
            return 1;
        }
    }
}

/* One product's work, for the threads: the exact tiles on x, or the integer tiles on x quantized. */
typedef struct {
    const lp_tiles *tiles;
    const lp_int_tiles *int_tiles; /* non-NULL: the integer products on xq */
    const lp_q8 *xq;
    const char *w;
    long panel_bytes, k, m;
    const float *x;
} lp_product;

/* The longest panel (in bytes) a product of m rows takes one at a time on the one-panel integer
 * tiles, rather than in pairs on the two-panel ones (the avx512vnni build's; the others have none).
 * A pair of short panels read at once, even with the next pair's first fetched ahead, reads slower
 * than one panel at a time, and a pair of long ones faster: with one or two rows (a step, a
 * two-token verify pass) panels up to 32 KB go one at a time (SmolLM2's k = 576 and 1536, the
 * 1.5B's k = 1536; its down projections, k = 8960, in pairs), with three or four rows those up
 * to 10 KB (SmolLM2's k = 576), with more none (benchmarks/kernel_builds_ab.py). */
static long single_panel_most(long m) { return m <= 2 ? 32768 : m <= 4 ? 10240 : 0; }

/* panels [p0, p1) of the product into y (see run_panels) */
static void run_product(const lp_product *pr, long p0, long p1, float *y, long ys, long ybase) {
    if (!pr->int_tiles) {
        run_panels(pr->tiles, pr->w, pr->panel_bytes, pr->k, pr->x, pr->m, y, ys, p0, p1, ybase);
        return;
    }
    long m = pr->m, groups = (m + pr->int_tiles->most - 1) / pr->int_tiles->most; /* 10 rows = 5 + 5 */
    const lp_int_tiles *t = pr->int_tiles;
    int pairs = t->pair_rows[1] != NULL && pr->panel_bytes > single_panel_most(m);
    for (long p = p0; p < p1;) {
        int pair = pairs && p + 1 < p1;
        for (long g = 0, r0 = 0; g < groups; g++) {
            long nr = m / groups + (g < m % groups);
            const char *w = pr->w + p * pr->panel_bytes;
            float *out = y + r0 * ys + (p - ybase) * LP_PANEL;
            if (pair) t->pair_rows[nr](pr->xq, r0, w, pr->panel_bytes, out, ys);
            else t->rows[nr](pr->xq, r0, w, out, ys);
            r0 += nr;
        }
        p += pair ? 2 : 1;
    }
}

int lp_gemm(const lp_matrix *mat, const float *x, long m, float *y, int threads) {
    const lp_format_traits *f = lp_format(mat->format);
    if (!f) return LP_E_TYPE;
    long n = mat->n, k = mat->k, whole = n / LP_PANEL, panels = (n + LP_PANEL - 1) / LP_PANEL;
    long panel_bytes = lp_panel_bytes(f, k);
    if (panel_bytes < 0) return LP_E_SHAPE;
    if (m <= 0) return LP_OK; /* the tiles for few rows would read rows that are not there */
    if (threads < 1) threads = 1;
    if (panels < 2L * threads) threads = 1; /* too little work to share */
    if (panels >= (1L << 32)) return LP_E_SHAPE; /* a run's span holds panel numbers in 32 bits */
    lp_product pr = {f->tiles, NULL, NULL, (const char *)mat->w, panel_bytes, k, m, x};
    if (mat->arithmetic == LP_ARITH_INT8 && k % 32 == 0) pr.int_tiles = f->int_tiles;
    /* the panels the tiles for few rows take at once (four_panels; two_panels and the pairs) */
    long grain = pr.int_tiles ? 2 : m == 1 ? 4 : 2;
    /* one block for the product's scratch (its pieces 64-byte aligned): the runs, the last partial
     * panel's outputs (whole panels of them, its valid columns then copied to y), and the
     * activations quantized: Q8_0's scales and sums, or Q8_K's scales and integer sums (formats.h) */
    long ksub = pr.int_tiles ? pr.int_tiles->kquant_sub : 0;
    size_t sizes[] = {sizeof(lp_run) * (size_t)threads, whole < panels ? sizeof(float) * (size_t)(m * LP_PANEL) : 0,
                      pr.int_tiles ? (size_t)(m * k) : 0,
                      pr.int_tiles ? sizeof(float) * (size_t)(ksub ? m * (k / 256) : m * (k / 32 + k / 16)) : 0,
                      ksub ? sizeof(int16_t) * (size_t)(m * (k / ksub)) : 0};
    void *piece[5];
    void *block = lp_pieces(sizes, 5, piece);
    if (!block) return LP_E_MEMORY;
    lp_run *runs = (lp_run *)piece[0];
    float *tail = (float *)piece[1], *ds = (float *)piece[3];
    int8_t *q = (int8_t *)piece[2];
    int16_t *bsum = (int16_t *)piece[4];
    lp_q8 xq = {q, ds, ksub ? NULL : ds + m * (k / 32), bsum, k};
    /* (on this thread: a few rows' quantization does not repay the barrier that sharing it among
     * the region's threads would cost) */
    if (ksub) lp_q8k_quantize(x, m, k, ksub, q, ds, bsum);
    else if (pr.int_tiles) lp_q8_quantize(x, m, k, q, ds, ds + m * (k / 32));
    if (pr.int_tiles) pr.xq = &xq;
    for (int t = 0; t < threads; t++) {
        long first = whole * t / threads / grain * grain,
             end = t == threads - 1 ? whole : whole * (t + 1) / threads / grain * grain;
        runs[t].span = (unsigned long long)first << 32 | (unsigned long long)end;
    }
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long from, to;
        if (nt != threads) { /* fewer threads than asked: an even static split */
            run_product(&pr, whole * t / nt, whole * (t + 1) / nt, y, n, 0);
        } else {
            while (claim(&runs[t], grain, 0, &from, &to)) run_product(&pr, from, to, y, n, 0);
            for (;;) {
                int fullest = -1;
                long most = 0;
                for (int r = 0; r < nt; r++) {
                    unsigned long long span = __atomic_load_n(&runs[r].span, __ATOMIC_ACQUIRE);
                    long left = (long)(span & 0xffffffffu) - (long)(span >> 32);
                    if (left > most) { most = left; fullest = r; }
                }
                if (fullest < 0) break;
                if (claim(&runs[fullest], grain, 1, &from, &to)) run_product(&pr, from, to, y, n, 0);
            }
        }
        if (tail && t == nt - 1) {
            run_product(&pr, whole, panels, tail, LP_PANEL, whole);
            for (long r = 0; r < m; r++)
                memcpy(y + r * n + whole * LP_PANEL, tail + r * LP_PANEL, sizeof(float) * (size_t)(n - whole * LP_PANEL));
        }
    }
    free(block);
    if (mat->bias)
        for (long r = 0; r < m; r++)
            for (long j = 0; j < n; j++) y[r * n + j] += mat->bias[j];
    return LP_OK;
}

/* Asks the kernel to back [p, p + bytes) with 2 MB pages (p 2 MB-aligned, not yet touched): the
 * packed weights stream through the products once per pass, and on 4 KB pages every 64 cache
 * lines cost a TLB miss and the end of the hardware prefetchers' streams. Where the system gives
 * none, the memory stays on 4 KB pages and nothing else changes. */
LP_API void lp_advise_huge_pages(void *p, long bytes) {
#ifdef MADV_HUGEPAGE
    madvise(p, (size_t)bytes, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}

/* y[m, n] = w[n, :] . norm(x[m, :]) + bias[n] (nm NULL: no norm, else rounded as x's dtype) */
static int norm_linear(const lp_norm *nm, const void *x, int x_dtype, const lp_matrix *w, void *y, int y_dtype, long m,
                       int threads) {
    if (!lp_dtype_bytes(x_dtype) || !lp_dtype_bytes(y_dtype)) return LP_E_TYPE;
    if (m <= 0) return LP_OK;
    long n = w->n, k = w->k;
    int own_y = y_dtype != LP_DTYPE_F32;
    float *xf = lp_floats(m * k), *yf = own_y ? lp_floats(m * n) : (float *)y;
    int status = xf && yf ? LP_OK : LP_E_MEMORY;
    if (status == LP_OK) {
        lp_load_f32(x, x_dtype, xf, m * k);
        if (nm) lp_norm_rows(xf, m, k, nm, x_dtype);
        status = lp_gemm(w, xf, m, yf, threads);
        if (status == LP_OK && own_y) lp_store(yf, y, y_dtype, m * n);
    }
    if (own_y) free(yf);
    free(xf);
    return status;
}

LP_API int lp_linear(const void *x, int x_dtype, const lp_matrix *w, void *y, int y_dtype, long m, int threads) {
    return norm_linear(NULL, x, x_dtype, w, y, y_dtype, m, threads);
}

/* The norm runs in the kernels, as every layer's, rather than as a PyTorch module between two
 * native calls. */
LP_API int lp_norm_linear(const lp_norm *nm, const void *x, const lp_matrix *w, void *y, long m, int dtype,
                          int threads) {
    return norm_linear(nm, x, dtype, w, y, dtype, m, threads);
}
