/* One product of the native kernels, its packed weights on 2 MB pages against 4 KB pages,
 * alternated in one process (docs/lab/engine-rounds.md, "The engine, seventh round").
 *
 *   gcc -O2 -Isrc/layerplan/engine/kernels benchmarks/product_pages.c -o /tmp/product_pages -ldl
 *   so=$(.venv/bin/python -c "from layerplan.engine import native; print(native.library()._name)")
 *   /tmp/product_pages $so 3072 576 0 12 300 2 8
 *                      (kernels, out, in, bf16 0/1, copies, calls, threads, rows)
 *
 * `copies` packed copies of one random matrix are used in turn, so that with enough of them
 * (12 x 7 MB here) every weight comes from memory, as in a pass; the even copies are advised onto
 * 2 MB pages (lp_advise_huge_pages) before they are packed, the odd ones stay on 4 KB pages.
 * Prints the median time of a product for each kind of page, and checks both give the same bits. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels.h" /* the ABI: lp_matrix and the functions' types */
typedef __typeof__(lp_pack) *pack_fn;
typedef __typeof__(lp_linear) *linear_fn;
typedef __typeof__(lp_advise_huge_pages) *advise_fn;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int by_value(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

int main(int argc, char **argv) {
    if (argc != 9) { fprintf(stderr, "usage: %s KERNELS.so OUT IN BF16 COPIES CALLS THREADS ROWS\n", argv[0]); return 2; }
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    long n = atol(argv[2]), k = atol(argv[3]), rows = atol(argv[8]);
    int bf16 = atoi(argv[4]), copies = atoi(argv[5]), calls = atoi(argv[6]), threads = atoi(argv[7]);
    pack_fn pack = (pack_fn)dlsym(lib, "lp_pack");
    linear_fn linear = (linear_fn)dlsym(lib, "lp_linear");
    advise_fn advise = (advise_fn)dlsym(lib, "lp_advise_huge_pages");
    int (*abi)(void) = (int (*)(void))dlsym(lib, "lp_abi_version");
    if (!abi || abi() != LP_ABI_VERSION) { fprintf(stderr, "kernels of another ABI than kernels.h's %d\n", LP_ABI_VERSION); return 1; }
    if (!pack || !linear || !advise || copies < 2 || rows < 1 || rows > 64) { fprintf(stderr, "bad kernels or arguments\n"); return 1; }
    size_t es = bf16 ? 2 : 4, huge = 2 << 20, bytes = (size_t)(n + 15) / 16 * 16 * k * es;
    size_t size = (bytes + huge - 1) / huge * huge;
    void *raw = malloc(n * k * es);
    srand(1);
    for (long i = 0; i < n * k; i++) {
        float f = (rand() / (float)RAND_MAX - 0.5f) * 0.1f;
        uint32_t u;
        memcpy(&u, &f, 4);
        if (bf16) ((uint16_t *)raw)[i] = (uint16_t)(u >> 16); else ((float *)raw)[i] = f;
    }
    lp_matrix *mats = calloc(copies, sizeof(lp_matrix));
    for (int c = 0; c < copies; c++) {
        void *p = aligned_alloc(huge, size);
        if (c % 2 == 0) advise(p, (long)size);
        int format = bf16 ? LP_FORMAT_BF16 : LP_FORMAT_F32;
        pack(raw, format, n, k, p);
        mats[c] = (lp_matrix){p, NULL, n, k, format};
    }
    float *x = malloc(sizeof(float) * rows * k), *y = malloc(sizeof(float) * rows * n), *y0 = malloc(sizeof(float) * rows * n);
    for (long i = 0; i < rows * k; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
    linear(x, 0, &mats[0], y0, 0, rows, threads);
    linear(x, 0, &mats[1], y, 0, rows, threads);
    int same = !memcmp(y, y0, sizeof(float) * rows * n);
    double *times[2] = {malloc(sizeof(double) * calls), malloc(sizeof(double) * calls)};
    int count[2] = {0, 0};
    for (int call = 0; call < calls; call++) {
        int c = call % copies;
        double start = now();
        linear(x, 0, &mats[c], y, 0, rows, threads);
        times[c % 2][count[c % 2]++] = now() - start;
    }
    double median[2];
    for (int kind = 0; kind < 2; kind++) {
        qsort(times[kind], count[kind], sizeof(double), by_value);
        median[kind] = times[kind][count[kind] / 2];
    }
    printf("%ld x %ld %s, %ld rows, %d threads: 2 MB pages %.1f us, 4 KB pages %.1f us, 4 KB / 2 MB %.3f, same bits: %s\n",
           n, k, bf16 ? "bf16" : "fp32", rows, threads, median[0] * 1e6, median[1] * 1e6, median[1] / median[0], same ? "yes" : "NO");
    return 0;
}
