/* Per-row work: dtype loads and stores, rounding, RMSNorm, RoPE, residuals, gated activations.
 * Eight lanes at a time through the shims (simd.h), each lane computing what the scalar tail
 * computes, bit for bit. */
#include "common.h"

/* A pass's scratch. Blocks of LP_HUGE_SCRATCH bytes or more (a many-token pass's: the gate and up
 * outputs of 512 rows are 37 MB) are 2 MB-aligned and asked onto 2 MB pages: where the C library
 * maps such a block afresh for each call (glibc's default), its first touch then faults once a 2 MB
 * page rather than once a 4 KB one (~250,000 faults a 512-token pass of a 1.5B). */
#define LP_HUGE_SCRATCH (4L << 20)
#define LP_HUGE_PAGE (2L << 20)
float *lp_floats(long count) {
    if (count < 0) return NULL;
    size_t bytes = ((size_t)count * sizeof(float) + 63) / 64 * 64; /* aligned_alloc takes whole alignments */
    if (bytes < (size_t)LP_HUGE_SCRATCH) return (float *)aligned_alloc(64, bytes ? bytes : 64);
    bytes = (bytes + LP_HUGE_PAGE - 1) / LP_HUGE_PAGE * LP_HUGE_PAGE;
    float *p = (float *)aligned_alloc(LP_HUGE_PAGE, bytes);
    if (p) lp_advise_huge_pages(p, (long)bytes);
    return p;
}

void *lp_pieces(const size_t *sizes, int count, void **piece) {
    size_t bytes = 0;
    for (int i = 0; i < count; i++) bytes += (sizes[i] + 63) / 64 * 64;
    char *block = (char *)lp_floats((long)(bytes / sizeof(float)));
    size_t at = 0;
    for (int i = 0; i < count; i++) {
        piece[i] = block && sizes[i] ? block + at : NULL;
        at += (sizes[i] + 63) / 64 * 64;
    }
    return block;
}

void lp_load_f32(const void *src, int dtype, float *dst, long count) {
    const uint16_t *h = (const uint16_t *)src;
    long i = 0;
    if (dtype == LP_DTYPE_BF16) {
        for (; i + 8 <= count; i += 8) f8_store(dst + i, f8_load_bf16(h + i));
        for (; i < count; i++) dst[i] = bf16_to_f32(h[i]);
    } else if (dtype == LP_DTYPE_F16) {
        for (; i + 8 <= count; i += 8) f8_store(dst + i, f8_load_f16(h + i));
        for (; i < count; i++) dst[i] = f16_to_f32(h[i]);
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)count);
    }
}

void lp_store(const float *src, void *dst, int dtype, long count) {
    uint16_t *h = (uint16_t *)dst;
    long i = 0;
    if (dtype == LP_DTYPE_BF16) {
        for (; i + 8 <= count; i += 8) f8_store_bf16(h + i, f8_load(src + i));
        for (; i < count; i++) h[i] = f32_to_bf16(src[i]);
    } else if (dtype == LP_DTYPE_F16) {
        for (; i + 8 <= count; i += 8) f8_store_f16(h + i, f8_load(src + i));
        for (; i < count; i++) h[i] = f32_to_f16(src[i]);
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)count);
    }
}

void lp_round_all(float *v, long count, int dtype) {
    if (dtype != LP_DTYPE_BF16) return;
    long i = 0;
    for (; i + 8 <= count; i += 8) f8_store(v + i, f8_round_bf16(f8_load(v + i)));
    for (; i < count; i++) v[i] = round_bf16(v[i]);
}

void lp_norm_rows(float *x, long rows, long dim, const lp_norm *nm, int dtype) {
    if (!nm->weight) return;
    int wbf16 = nm->dtype == LP_DTYPE_BF16;
    for (long r = 0; r < rows; r++) {
        float *v = x + r * dim;
        double ss = lp_sum_squares(v, dim);
        float inv = 1.0f / sqrtf((float)(ss / dim) + nm->eps);
        lp_f8 inv8 = f8_set1(inv), offset8 = f8_set1(nm->offset);
        long i = 0;
        for (; i + 8 <= dim; i += 8) {
            lp_f8 w = f8_add(f8_load_as(nm->weight, wbf16, i), offset8);
            lp_f8 t = f8_mul(f8_load(v + i), inv8);
            if (nm->mode == LP_NORM_ROUND_NORMALISED) t = lp_rnd8(t, dtype);
            f8_store(v + i, lp_rnd8(f8_mul(w, t), dtype));
        }
        for (; i < dim; i++) {
            float w = lp_param(nm->weight, nm->dtype, i) + nm->offset;
            if (nm->mode == LP_NORM_ROUND_NORMALISED) v[i] = lp_rnd(w * lp_rnd(v[i] * inv, dtype), dtype);
            else v[i] = lp_rnd(w * (v[i] * inv), dtype);
        }
    }
}

void lp_rope_rows(float *q, long rows, long heads, long head_dim, long rotary_dim, const float *cs, const float *sn,
                  int dtype) {
    long half = rotary_dim / 2;
    for (long r = 0; r < rows; r++) {
        const float *c = cs + r * rotary_dim, *s = sn + r * rotary_dim;
        for (long h = 0; h < heads; h++) {
            float *v = q + (r * heads + h) * head_dim;
            float tmp[512];
            long i = 0;
            if (half % 8 == 0)
                for (; i < rotary_dim; i += 8) {
                    lp_f8 rot = i < half ? f8_neg(f8_load(v + i + half)) : f8_load(v + i - half);
                    lp_f8 a = lp_rnd8(f8_mul(f8_load(v + i), f8_load(c + i)), dtype);
                    lp_f8 b = lp_rnd8(f8_mul(rot, f8_load(s + i)), dtype);
                    f8_store(tmp + i, lp_rnd8(f8_add(a, b), dtype));
                }
            for (; i < rotary_dim; i++) {
                float rot = i < half ? -v[i + half] : v[i - half];
                tmp[i] = lp_rnd(lp_rnd(v[i] * c[i], dtype) + lp_rnd(rot * s[i], dtype), dtype);
            }
            memcpy(v, tmp, sizeof(float) * (size_t)rotary_dim);
        }
    }
}

void lp_residual_add(const void *hidden, const float *update, float *scratch, void *out, long count, float scale,
                     int dtype) {
    lp_load_f32(hidden, dtype, scratch, count);
    lp_f8 scale8 = f8_set1(scale);
    long i = 0;
    for (; i + 8 <= count; i += 8) {
        lp_f8 up = f8_load(update + i);
        if (scale != 1.0f) up = lp_rnd8(f8_mul(scale8, up), dtype);
        f8_store(scratch + i, lp_rnd8(f8_add(f8_load(scratch + i), up), dtype));
    }
    for (; i < count; i++)
        scratch[i] = lp_rnd(scratch[i] + (scale == 1.0f ? update[i] : lp_rnd(scale * update[i], dtype)), dtype);
    lp_store(scratch, out, dtype, count);
}

static inline float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* rounded as the PyTorch modules round; SiLU on eight lanes with f8_exp (the scalar expf was a
 * tenth of an 8-token pass), GELU in scalar code */
void lp_gated_activation(const float *gate, const float *up, float *out, long n, int activation, int dtype) {
    long i = 0;
    if (activation == LP_ACT_SILU)
        for (; i + 8 <= n; i += 8) {
            lp_f8 g = lp_rnd8(f8_load(gate + i), dtype), u = lp_rnd8(f8_load(up + i), dtype);
            lp_f8 act = lp_rnd8(f8_div(g, f8_add(f8_set1(1.0f), f8_exp(f8_sub(f8_zero(), g)))), dtype);
            f8_store(out + i, lp_rnd8(f8_mul(act, u), dtype));
        }
    for (; i < n; i++) {
        float gv = lp_rnd(gate[i], dtype), uv = lp_rnd(up[i], dtype);
        float act = activation == LP_ACT_SILU ? gv / (1.0f + expf(-gv)) : gelu_tanh(gv);
        out[i] = lp_rnd(lp_rnd(act, dtype) * uv, dtype);
    }
}
