/* The machine's ceilings, measured for `layerplan probe`: a pass's products cannot run faster than
 * the product tiles do on weights already in cache, nor read the weights faster than memory gives
 * them. The arithmetic is timed with the products' own tiles rather than a loop of bare FMAs, which
 * promises more than products get. */
#include <omp.h>

#include "formats.h"

/* GFLOP/s of `rounds` 8-row products (the verify pass's shape) on `threads` threads, over `format`
 * weights filling 576 KB (small enough to stay in the threads' L2 caches); < 0 where the format is
 * unknown or an allocation failed. */
LP_API double lp_product_rate(int format, int threads, long rounds) {
    const lp_format_traits *f = lp_format(format);
    if (!f) return -1.0;
    long k = 576 / f->block * f->block, m = 8;
    long n = 576L * 1024 / (k / f->block * f->block_bytes) / LP_PANEL * LP_PANEL;
    long bytes = lp_packed_bytes(format, n, k);
    float *values = lp_floats(n * k), *x = lp_floats(m * k), *y = lp_floats(m * n);
    void *raw = malloc((size_t)(n * (k / f->block) * f->block_bytes));
    void *packed = aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64);
    double rate = -1.0;
    if (values && x && y && raw && packed) {
        for (long i = 0; i < n * k; i++) /* small values of both signs: no overflow, no denormals */
            values[i] = (float)((i * 7919) % 2001 - 1000) * 1e-4f;
        f->from_f32(values, raw, n * k);
        f->pack(raw, n, k, packed);
        for (long i = 0; i < m * k; i++) x[i] = (float)(i % 17) * 0.01f;
        lp_matrix mat = {packed, NULL, n, k, format};
        int status = lp_gemm(&mat, x, m, y, threads); /* brings the weights into the caches */
        double start = omp_get_wtime();
        for (long r = 0; r < rounds && status == LP_OK; r++) status = lp_gemm(&mat, x, m, y, threads);
        double seconds = omp_get_wtime() - start;
        if (status == LP_OK) rate = seconds > 0 ? 2.0 * m * n * k * rounds / seconds / 1e9 : 0.0;
    }
    free(values); free(x); free(y); free(raw); free(packed);
    return rate;
}

/* GB/s of reading [p, p + bytes) once on `threads` threads (bytes far larger than the last-level
 * cache). Each thread reads its slice as four streams at once, as a step's products read four
 * panels. */
LP_API double lp_read_rate(const void *p, long bytes, int threads) {
    const char *base = (const char *)p;
    double start = omp_get_wtime();
    float sink = 0.0f;
    long read = 0;
    #pragma omp parallel num_threads(threads) reduction(+ : sink, read)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long from = bytes / nt * t, quarter = bytes / nt / 4 / 64 * 64;
        const char *a = base + from, *b = a + quarter, *c = b + quarter, *d = c + quarter;
        lp_f8 s0 = f8_zero(), s1 = s0, s2 = s0, s3 = s0;
        for (long i = 0; i < quarter; i += 64) {
            s0 = f8_add(s0, f8_add(f8_load((const float *)(a + i)), f8_load((const float *)(a + i + 32))));
            s1 = f8_add(s1, f8_add(f8_load((const float *)(b + i)), f8_load((const float *)(b + i + 32))));
            s2 = f8_add(s2, f8_add(f8_load((const float *)(c + i)), f8_load((const float *)(c + i + 32))));
            s3 = f8_add(s3, f8_add(f8_load((const float *)(d + i)), f8_load((const float *)(d + i + 32))));
        }
        float lanes[8];
        f8_store(lanes, f8_add(f8_add(s0, s1), f8_add(s2, s3)));
        sink += lanes[0];
        read += 4 * quarter;
    }
    double seconds = omp_get_wtime() - start;
    volatile float keep = sink; /* the sums are used, or the compiler would drop the loop */
    (void)keep;
    return seconds > 0 ? read / seconds / 1e9 : 0.0;
}
