/* The integer products over the block formats for AVX2: the 32-byte tiles of int_tiles_avx2.h
 * on vpmaddubsw + vpmaddwd (formats.h: lp_int_tiles_<format>). */
#include "quant_avx2.h"

const char lp_products_isa[] = "avx2"; /* (the build's one file of its own) */

ALWAYS __m256i dot4(__m256i acc, __m256i w, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
#define LP_INT16_SUMS 1
#define CHAINS(R) 1 /* the sums add with a one-cycle vpaddd */

#include "int_tiles_avx2.h"

/* one panel at a time; 7-8 rows on words unpacked once into L1 (ITILE_W) */
#define ITILES(F, f)                                                                               \
    PANEL_TILES(F, f)                                                                              \
    ITILE_W(f##_i7, F, f, 7)                                                                       \
    ITILE_W(f##_i8, F, f, 8)                                                                       \
    INT_TILES_ROW(F, f, NULL)

#define ITILES_OF(F, f, ...) ITILES(F, f)
LP_INT_FORMATS(ITILES_OF)
