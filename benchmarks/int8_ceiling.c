/* The integer multiply-add ceiling of this machine's AVX2 route, against which the integer tiles
 * (products_int_avx2.c, LP_ARITH_INT8) are measured:
 *
 *   gcc -O3 -mavx2 -mfma -fopenmp -std=c11 benchmarks/int8_ceiling.c -o /tmp/int8_ceiling && /tmp/int8_ceiling 9
 *
 * 1. bare: independent chains of vpmaddubsw + vpaddw (the tiles' inner pair on AVX2: 32 u8 x s8
 *    products a vpmaddubsw, pair sums added in int16), nothing loaded: the issue rate of the pair;
 * 2. tile-shaped: a Q4_K-like sub-block (8 words of nibbles, in L1) unpacked once (load, AND,
 *    shift, AND) and met by R rows' broadcast activation bytes, the int16 sums widened by one
 *    vpmaddwd a row every 8 words, as the tiles do, without the float epilogue: what the tiles'
 *    instruction mix allows with every byte in L1.
 * Figures are G multiply-adds per second (one u8 x s8 product and its add), median of the turns. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* 12 independent chains of vpmaddubsw + vpaddw per thread */
static double bare_pairs(int threads) {
    const long rounds = 20000000;
    double start = omp_get_wtime();
    long sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        __m256i acc[12];
        __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8((char)(1 + omp_get_thread_num()));
        for (int j = 0; j < 12; j++) acc[j] = _mm256_set1_epi16((short)j);
        for (long i = 0; i < rounds; i++) {
            for (int j = 0; j < 12; j++) acc[j] = _mm256_add_epi16(acc[j], _mm256_maddubs_epi16(w, x));
            __asm__ volatile("" : "+x"(w), "+x"(x)); /* the operands are not constants to the compiler */
        }
        for (int j = 1; j < 12; j++) acc[0] = _mm256_add_epi16(acc[0], acc[j]);
        sink += _mm256_extract_epi16(acc[0], 0);
    }
    double seconds = omp_get_wtime() - start;
    volatile long keep = sink;
    (void)keep;
    return threads * rounds * 12.0 * 32 / seconds / 1e9;
}

/* R rows over `blocks` sub-blocks of 32 inputs x 16 outputs (256 bytes of nibbles each), in L1 */
#define TILE(R)                                                                                    \
    static double tile_##R(int threads) {                                                          \
        const long blocks = 16, rounds = 400000;                                                   \
        double start = omp_get_wtime();                                                            \
        long sink = 0;                                                                             \
        _Pragma("omp parallel num_threads(threads) reduction(+ : sink)") {                        \
            _Alignas(32) uint8_t q[16 * 256];                                                      \
            _Alignas(32) int8_t x[R][16 * 32];                                                     \
            for (int i = 0; i < 16 * 256; i++) q[i] = (uint8_t)(i * 37 + omp_get_thread_num());    \
            for (int r = 0; r < R; r++)                                                            \
                for (int i = 0; i < 16 * 32; i++) x[r][i] = (int8_t)((i * 13 + r) % 255 - 127);   \
            __m256i out[R][2];                                                                     \
            for (int r = 0; r < R; r++) out[r][0] = out[r][1] = _mm256_setzero_si256();            \
            const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);              \
            for (long n = 0; n < rounds; n++)                                                      \
                for (long b = 0; b < blocks; b++) {                                                \
                    __m256i pl[R], ph[R];                                                          \
                    for (int r = 0; r < R; r++) pl[r] = ph[r] = _mm256_setzero_si256();            \
                    _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {                          \
                        __m256i v = _mm256_load_si256((const __m256i *)(q + 256 * b + 32 * c));    \
                        __m256i wl = _mm256_and_si256(v, nib);                                     \
                        __m256i wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);               \
                        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                      \
                            int32_t four;                                                          \
                            memcpy(&four, &x[r][32 * b + 4 * c], 4);                               \
                            __m256i xb = _mm256_set1_epi32(four);                                  \
                            pl[r] = _mm256_add_epi16(pl[r], _mm256_maddubs_epi16(wl, xb));         \
                            ph[r] = _mm256_add_epi16(ph[r], _mm256_maddubs_epi16(wh, xb));         \
                        }                                                                          \
                    }                                                                              \
                    for (int r = 0; r < R; r++) {                                                  \
                        out[r][0] = _mm256_add_epi32(out[r][0], _mm256_madd_epi16(pl[r], ones));   \
                        out[r][1] = _mm256_add_epi32(out[r][1], _mm256_madd_epi16(ph[r], ones));   \
                    }                                                                              \
                }                                                                                  \
            for (int r = 0; r < R; r++) sink += _mm256_extract_epi32(_mm256_add_epi32(out[r][0], out[r][1]), 0); \
        }                                                                                          \
        double seconds = omp_get_wtime() - start;                                                  \
        volatile long keep = sink;                                                                 \
        (void)keep;                                                                                \
        return threads * rounds * blocks * 32.0 * 16 * R / seconds / 1e9;                         \
    }
TILE(1)
TILE(4)
TILE(8)

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int turns = argc > 1 ? atoi(argv[1]) : 9;
    enum { KINDS = 8 };
    const char *names[KINDS] = {"bare vpmaddubsw + vpaddw, 1 thread", "the same, 2 threads",
                                "tile-shaped, 1 row, 1 thread", "tile-shaped, 4 rows, 1 thread",
                                "tile-shaped, 8 rows, 1 thread", "tile-shaped, 1 row, 2 threads",
                                "tile-shaped, 4 rows, 2 threads", "tile-shaped, 8 rows, 2 threads"};
    double *t = malloc(sizeof(double) * KINDS * turns);
    for (int i = 0; i < turns; i++) {
        t[0 * turns + i] = bare_pairs(1);
        t[1 * turns + i] = bare_pairs(2);
        t[2 * turns + i] = tile_1(1);
        t[3 * turns + i] = tile_4(1);
        t[4 * turns + i] = tile_8(1);
        t[5 * turns + i] = tile_1(2);
        t[6 * turns + i] = tile_4(2);
        t[7 * turns + i] = tile_8(2);
    }
    printf("G multiply-adds/s (u8 x s8) over %d turns: median (least - most)\n", turns);
    for (int j = 0; j < KINDS; j++) {
        qsort(t + j * turns, turns, sizeof(double), by_value);
        printf("  %-40s %7.1f (%.1f - %.1f)\n", names[j], t[j * turns + turns / 2], t[j * turns],
               t[j * turns + turns - 1]);
    }
    free(t);
    return 0;
}
