/* The weight-format trait table (see formats.h), one row a row of LP_FORMAT_LIST: fp32's and
 * bf16's functions here, f16's and the GGUF block formats' in quant_formats.c (layouts in quant.h). */
#include "quant.h"

/* fp32: a panel stores, for each input i, its 16 rows' weights in order. */
void lp_pack_f32(const void *w, long n, long k, void *out) {
    long panels = (n + LP_PANEL - 1) / LP_PANEL;
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++)
        for (long i = 0; i < k; i++)
            for (int j = 0; j < LP_PANEL; j++) {
                long row = p * LP_PANEL + j;
                ((float *)out)[(p * k + i) * LP_PANEL + j] = row < n ? ((const float *)w)[row * k + i] : 0.0f;
            }
}

void lp_f32_from_f32(const float *src, void *dst, long count) { memcpy(dst, src, sizeof(float) * (size_t)count); }

/* bf16: as fp32, but the 16 weights of an input in the order rows 0, 8, 1, 9, ... 7, 15: the eight
 * 32-bit words then hold rows 0-7 in their low and 8-15 in their high halves, which a shift and a
 * mask widen to fp32 (see widen_bf16 in products_avx2.c). */
void lp_pack_bf16(const void *w, long n, long k, void *out) {
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

void lp_bf16_from_f32(const float *src, void *dst, long count) {
    for (long i = 0; i < count; i++) ((uint16_t *)dst)[i] = f32_to_bf16(src[i]);
}

#define LP_FORMAT_ROW(ID, name, block, bytes, sub)                                                 \
    [LP_FORMAT_##ID] = {#name, block, bytes, lp_pack_##name, lp_##name##_from_f32, &lp_tiles_##name, &lp_int_tiles_##name},
static const lp_format_traits formats[LP_FORMATS] = {LP_FORMAT_LIST(LP_FORMAT_ROW)};
#define LP_COUNT(...) +1
_Static_assert(0 LP_FORMAT_LIST(LP_COUNT) == LP_FORMATS, "kernels.h's LP_FORMATS is LP_FORMAT_LIST's rows");

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

void lp_q8k_sums(const int8_t *q, long sub, int16_t *out) {
    for (long j = 0; j < 256 / sub; j++) {
        int sum = 0;
        for (long i = 0; i < sub; i++) sum += q[sub * j + i];
        out[j] = (int16_t)sum;
    }
}
