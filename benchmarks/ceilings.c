/* What this machine lets the products do, measured in turns in one process
 * (docs/lab/engine-rounds.md, "The engine, ninth round"): bare FMAs on one and two threads, then
 * 8-row bf16 products on weights in cache (576 KB, so each thread's half stays in its L2) on one
 * thread, on two threads sharing one product (gemm, as a pass runs them), and on two threads each
 * running its own product with nothing shared (no claims, no waiting).
 *
 *   k=src/layerplan/engine/kernels
 *   gcc -O3 -mavx2 -mfma -mf16c -fopenmp -std=c11 -I$k benchmarks/ceilings.c \
 *       $(ls $k/*.c | grep -v products_) $k/products_avx2.c -o /tmp/ceilings -lm -ldl && /tmp/ceilings 10
 *
 * Where two independent threads of products run at less than twice one thread, what is short is
 * the machine's (the cores' shared resources, or the host's neighbours), not the kernels' claims
 * or waits; where bare FMAs scale and products do not, the loads and stores are what is shared. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

#include "formats.h"

/* GFLOP/s of twelve independent FMA chains per thread */
static double bare_fma(int threads) {
    long rounds = 4000000;
    double start = omp_get_wtime();
    float sink = 0.0f;
    #pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        __m256 c[12];
        for (int j = 0; j < 12; j++) c[j] = _mm256_set1_ps(1.0f + 0.1f * j);
        const __m256 scale = _mm256_set1_ps(0.9999f), shift = _mm256_set1_ps(1e-4f);
        for (long i = 0; i < rounds; i++)
            for (int j = 0; j < 12; j++) c[j] = _mm256_fmadd_ps(c[j], scale, shift);
        for (int j = 1; j < 12; j++) c[0] = _mm256_add_ps(c[0], c[j]);
        sink += _mm256_cvtss_f32(c[0]);
    }
    double seconds = omp_get_wtime() - start;
    volatile float keep = sink;
    (void)keep;
    return threads * rounds * 12.0 * 16 / seconds / 1e9;
}

/* GFLOP/s of two threads each running `rounds` 8-row products over its own matrix */
static double independent_products(void **packed, long n, long k, long rounds) {
    double start = omp_get_wtime();
    #pragma omp parallel num_threads(2)
    {
        int t = omp_get_thread_num();
        lp_matrix mat = {packed[t], NULL, n, k, LP_FORMAT_BF16};
        float *x = lp_floats(8 * k), *y = lp_floats(8 * n);
        for (long i = 0; i < 8 * k; i++) x[i] = (float)(i % 17) * 0.01f;
        for (long r = 0; r < rounds; r++) lp_gemm(&mat, x, 8, y, 1); /* one thread: no other run to take from */
        free(x); free(y);
    }
    return 2 * 2.0 * 8 * n * k * rounds / (omp_get_wtime() - start) / 1e9;
}

/* an (n, k) bf16 matrix of small values, packed */
static void *prepare_product(long n, long k) {
    const lp_format_traits *f = lp_format(LP_FORMAT_BF16);
    float *values = lp_floats(n * k);
    void *raw = malloc(sizeof(uint16_t) * n * k), *packed = aligned_alloc(64, (size_t)lp_packed_bytes(LP_FORMAT_BF16, n, k));
    for (long i = 0; i < n * k; i++) values[i] = (float)((i * 7919) % 2001 - 1000) * 1e-4f;
    f->from_f32(values, raw, n * k);
    f->pack(raw, n, k, packed);
    free(values);
    free(raw);
    return packed;
}

static int by_value(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

int main(int argc, char **argv) {
    int turns = argc > 1 ? atoi(argv[1]) : 10;
    long n = 512, k = 576, rounds = 400;
    void *packed[2] = {prepare_product(n, k), prepare_product(n, k)};
    double *t = malloc(sizeof(double) * 5 * turns);
    const char *names[5] = {"bare FMAs, 1 thread", "bare FMAs, 2 threads", "8-row bf16 products, 1 thread",
                            "the same, 2 threads sharing each product", "the same, 2 threads, a product each"};
    for (int i = 0; i < turns; i++) {
        t[0 * turns + i] = bare_fma(1);
        t[1 * turns + i] = bare_fma(2);
        t[2 * turns + i] = lp_product_rate(LP_FORMAT_BF16, 1, rounds);
        t[3 * turns + i] = lp_product_rate(LP_FORMAT_BF16, 2, rounds);
        t[4 * turns + i] = independent_products(packed, n, k, rounds);
    }
    printf("GFLOP/s over %d turns: median (least - most)\n", turns);
    for (int j = 0; j < 5; j++) {
        qsort(t + j * turns, turns, sizeof(double), by_value);
        printf("  %-42s %6.1f (%.1f - %.1f)\n", names[j], t[j * turns + turns / 2], t[j * turns], t[j * turns + turns - 1]);
    }
    return 0;
}
