/* The weight-format trait table (see formats.h): fp32 and bf16 here, f16 and the GGUF block
 * formats from quant_formats.c (layouts in quant.h), one row each. */
#include "quant.h"

/* fp32: a panel stores, for each input i, its 16 rows' weights in order. */
static void pack_f32(const void *w, long n, long k, void *out) {
    long panels = (n + LP_PANEL - 1) / LP_PANEL;
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++)
        for (long i = 0; i < k; i++)
            for (int j = 0; j < LP_PANEL; j++) {
                long row = p * LP_PANEL + j;
                ((float *)out)[(p * k + i) * LP_PANEL + j] = row < n ? ((const float *)w)[row * k + i] : 0.0f;
            }
}

static void f32_from_f32(const float *src, void *dst, long count) { memcpy(dst, src, sizeof(float) * (size_t)count); }

/* bf16: as fp32, but the 16 weights of an input in the order rows 0, 8, 1, 9, ... 7, 15: the eight
 * 32-bit words then hold rows 0-7 in their low and 8-15 in their high halves, which a shift and a
 * mask widen to fp32 (see widen_bf16 in products_avx2.c). */
static void pack_bf16(const void *w, long n, long k, void *out) {
    static const int lane[LP_PANEL] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};
    long panels = (n + LP_PANEL - 1) / LP_PANEL;
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++)
        for (long i = 0; i < k; i++)
            for (int j = 0; j < LP_PANEL; j++) {
                long row = p * LP_PANEL + lane[j];
                ((uint16_t *)out)[(p * k + i) * LP_PANEL + j] = row < n ? ((const uint16_t *)w)[row * k + i] : 0;
            }
}

static void bf16_from_f32(const float *src, void *dst, long count) {
    for (long i = 0; i < count; i++) ((uint16_t *)dst)[i] = f32_to_bf16(src[i]);
}

static const lp_format_traits formats[LP_FORMATS] = {
    [LP_FORMAT_F32] = {"f32", 1, 4, pack_f32, f32_from_f32, &lp_tiles_f32, NULL},
    [LP_FORMAT_BF16] = {"bf16", 1, 2, pack_bf16, bf16_from_f32, &lp_tiles_bf16, NULL},
    [LP_FORMAT_F16] = {"f16", 1, 2, lp_pack_f16, lp_f16_from_f32, &lp_tiles_f16, NULL},
    [LP_FORMAT_Q8_0] = {"q8_0", 32, 34, lp_pack_q8_0, lp_q8_0_from_f32, &lp_tiles_q8_0, &lp_int_tiles_q8_0},
    [LP_FORMAT_Q4_0] = {"q4_0", 32, 18, lp_pack_q4_0, lp_q4_0_from_f32, &lp_tiles_q4_0, &lp_int_tiles_q4_0},
    [LP_FORMAT_Q4_1] = {"q4_1", 32, 20, lp_pack_q4_1, lp_q4_1_from_f32, &lp_tiles_q4_1, &lp_int_tiles_q4_1},
    [LP_FORMAT_Q5_0] = {"q5_0", 32, 22, lp_pack_q5_0, lp_q5_0_from_f32, &lp_tiles_q5_0, &lp_int_tiles_q5_0},
    [LP_FORMAT_Q5_1] = {"q5_1", 32, 24, lp_pack_q5_1, lp_q5_1_from_f32, &lp_tiles_q5_1, &lp_int_tiles_q5_1},
    [LP_FORMAT_Q2_K] = {"q2_k", 256, 84, lp_pack_q2_k, lp_q2_k_from_f32, &lp_tiles_q2_k, &lp_int_tiles_q2_k},
    [LP_FORMAT_Q3_K] = {"q3_k", 256, 110, lp_pack_q3_k, lp_q3_k_from_f32, &lp_tiles_q3_k, &lp_int_tiles_q3_k},
    [LP_FORMAT_Q4_K] = {"q4_k", 256, 144, lp_pack_q4_k, lp_q4_k_from_f32, &lp_tiles_q4_k, &lp_int_tiles_q4_k},
    [LP_FORMAT_Q5_K] = {"q5_k", 256, 176, lp_pack_q5_k, lp_q5_k_from_f32, &lp_tiles_q5_k, &lp_int_tiles_q5_k},
    [LP_FORMAT_Q6_K] = {"q6_k", 256, 210, lp_pack_q6_k, lp_q6_k_from_f32, &lp_tiles_q6_k, &lp_int_tiles_q6_k},
};

const lp_format_traits *lp_format(int format) {
    return format >= 0 && format < LP_FORMATS ? &formats[format] : NULL;
}

LP_API long lp_packed_bytes(int format, long n, long k) {
    const lp_format_traits *f = lp_format(format);
    if (!f || n < 0 || k < 0 || lp_panel_bytes(f, k) < 0) return -1;
    return (n + LP_PANEL - 1) / LP_PANEL * lp_panel_bytes(f, k);
}

LP_API int lp_pack(const void *w, int format, long n, long k, void *out) {
    const lp_format_traits *f = lp_format(format);
    if (!f) return LP_E_TYPE;
    if (n < 0 || k < 0 || lp_panel_bytes(f, k) < 0) return LP_E_SHAPE;
    f->pack(w, n, k, out);
    return LP_OK;
}
