/* The library describing itself, for engine/native.py's checks at load. */
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <omp.h>
#include <stddef.h>
#include <stdio.h>

#include "formats.h"

LP_API int lp_abi_version(void) { return LP_ABI_VERSION; }

LP_API const char *lp_isa(void) { return lp_products_isa; }

LP_API const char *lp_openmp_runtime(void) {
    Dl_info info;
    if (dladdr((void *)&omp_get_num_threads, &info) && info.dli_fname) return info.dli_fname;
    return "";
}

#define LP_STRUCT(T) used += snprintf(out + (used < capacity ? used : capacity), (size_t)(used < capacity ? capacity - used : 0), "%s%s %zu", used ? ";" : "", #T, sizeof(T))
#define LP_FIELD(T, F) used += snprintf(out + (used < capacity ? used : capacity), (size_t)(used < capacity ? capacity - used : 0), " %s %zu", #F, offsetof(T, F))

LP_API long lp_abi_layout(char *out, long capacity) {
    long used = 0;
    if (capacity > 0) out[0] = '\0';
    LP_STRUCT(lp_norm); LP_FIELD(lp_norm, weight); LP_FIELD(lp_norm, eps); LP_FIELD(lp_norm, offset);
    LP_FIELD(lp_norm, mode); LP_FIELD(lp_norm, dtype);
    LP_STRUCT(lp_matrix); LP_FIELD(lp_matrix, w); LP_FIELD(lp_matrix, bias); LP_FIELD(lp_matrix, n);
    LP_FIELD(lp_matrix, k); LP_FIELD(lp_matrix, format);
    LP_FIELD(lp_matrix, arithmetic);
    LP_STRUCT(lp_kv); LP_FIELD(lp_kv, k); LP_FIELD(lp_kv, v); LP_FIELD(lp_kv, capacity); LP_FIELD(lp_kv, start);
    LP_FIELD(lp_kv, dtype);
    LP_STRUCT(lp_attention); LP_FIELD(lp_attention, hidden); LP_FIELD(lp_attention, heads);
    LP_FIELD(lp_attention, kv_heads); LP_FIELD(lp_attention, head_dim); LP_FIELD(lp_attention, norm);
    LP_FIELD(lp_attention, q_norm); LP_FIELD(lp_attention, k_norm); LP_FIELD(lp_attention, post_norm);
    LP_FIELD(lp_attention, qkv); LP_FIELD(lp_attention, v); LP_FIELD(lp_attention, o); LP_FIELD(lp_attention, scaling);
    LP_FIELD(lp_attention, window); LP_FIELD(lp_attention, rotary_dim);
    LP_STRUCT(lp_mlp); LP_FIELD(lp_mlp, hidden); LP_FIELD(lp_mlp, inner); LP_FIELD(lp_mlp, norm);
    LP_FIELD(lp_mlp, post_norm); LP_FIELD(lp_mlp, gate_up); LP_FIELD(lp_mlp, down); LP_FIELD(lp_mlp, activation);
    LP_STRUCT(lp_segment); LP_FIELD(lp_segment, rows); LP_FIELD(lp_segment, pos0); LP_FIELD(lp_segment, logits);
    LP_STRUCT(lp_step); LP_FIELD(lp_step, attention); LP_FIELD(lp_step, mlp); LP_FIELD(lp_step, kv);
    LP_FIELD(lp_step, rope); LP_FIELD(lp_step, scale); LP_FIELD(lp_step, stream); LP_FIELD(lp_step, stream_capacity);
    return used;
}
