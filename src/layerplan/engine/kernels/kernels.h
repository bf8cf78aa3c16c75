/* layerplan's native engine: the only definition of its ABI.
 *
 * engine/native.py reads this file (structs, functions and the LP_ constants below) to build its
 * ctypes view of the library, and at load asserts that the library was built from the same
 * definition: lp_abi_version() must equal LP_ABI_VERSION and lp_abi_layout() (every struct's size
 * and every field's offset, as the compiler laid them out) must equal the layout Python computed.
 * So this file is kept to the subset native.py parses: `#define LP_NAME <integer>`, typedef'd
 * structs of simple fields (one type per declaration; pointers, long, int, float, double, and the
 * structs above them), and prototypes marked LP_API. Change it, and bump LP_ABI_VERSION.
 *
 * Element types are named twice, on purpose: a weight FORMAT (lp_matrix.format: how a packed
 * matrix stores its weights; one row each of the trait table in formats.c) and an activation or
 * cache DTYPE (the hidden states, the rotary tables, the KV cache, a norm's weight). Any format
 * may meet any dtype: products widen weights to fp32 and accumulate in fp32.
 */
#ifndef LP_KERNELS_H
#define LP_KERNELS_H

#define LP_ABI_VERSION 10

/* activation / cache / norm-weight element types; F16 for a KV cache only (lp_kv.dtype) */
#define LP_DTYPE_F32 0
#define LP_DTYPE_BF16 1
#define LP_DTYPE_F16 2

/* weight formats of a packed matrix: rows of the trait table (formats.c); F16 and the GGUF block
 * formats are laid out in kernels/quant.h */
#define LP_FORMAT_F32 0
#define LP_FORMAT_BF16 1
#define LP_FORMAT_F16 2
#define LP_FORMAT_Q8_0 3
#define LP_FORMAT_Q4_0 4
#define LP_FORMAT_Q4_1 5
#define LP_FORMAT_Q5_0 6
#define LP_FORMAT_Q5_1 7
#define LP_FORMAT_Q2_K 8
#define LP_FORMAT_Q3_K 9
#define LP_FORMAT_Q4_K 10
#define LP_FORMAT_Q5_K 11
#define LP_FORMAT_Q6_K 12
#define LP_FORMATS 13

/* output rows of one packed panel, for every weight format: a matrix packs in whole panels, so
 * rows from a multiple of LP_PANEL on may be packed apart, at their panels' place */
#define LP_PANEL 16

/* arithmetic of a packed matrix's products (lp_matrix.arithmetic) */
#define LP_ARITH_EXACT 0 /* fp32 on the weights' exact values: the fp32 product of the dequantized matrix */
#define LP_ARITH_INT8 1  /* block formats: integer dot products on activations quantized to int8 per 32
                          * inputs (llama.cpp's arithmetic; formats.h); formats without them run exact */

/* statuses of the functions that return int */
#define LP_OK 0
#define LP_E_SHAPE -1    /* a shape the kernels do not take (head_dim > 512, a tree in a sliding window, ...) */
#define LP_E_TOKEN -2    /* a token id outside [0, vocab) */
#define LP_E_MEMORY -3   /* an allocation failed */
#define LP_E_CAPACITY -4 /* the positions written do not fit the KV slot */
#define LP_E_TYPE -5     /* an unknown weight format or dtype */

/* norm modes: how a norm rounds, as the transformers module does it */
#define LP_NORM_ROUND_NORMALISED 0 /* weight * (normalised rounded to the dtype) (Llama, Qwen, Mistral, Phi-3) */
#define LP_NORM_ROUND_PRODUCT 1    /* (offset + weight) * normalised in fp32, then rounded (Gemma) */

/* activations of a gated MLP */
#define LP_ACT_SILU 0
#define LP_ACT_GELU_TANH 1

#ifndef LP_API
#define LP_API __attribute__((visibility("default")))
#endif

/* An RMSNorm: weight (dim,) in `dtype` (NULL = no norm). */
typedef struct {
    const void *weight;
    float eps;
    float offset;
    int mode;
    int dtype;
} lp_norm;

/* A packed weight matrix (n outputs, k inputs; see lp_pack), its bias in fp32 (NULL = none) and
 * the arithmetic of its products (LP_ARITH_). */
typedef struct {
    const void *w;
    const float *bias;
    long n;
    long k;
    int format;
    int arithmetic;
} lp_matrix;

/* One step's KV slot: keys and values (kv_heads, capacity, head_dim) in `dtype`, holding the
 * positions from `start` on (0 for a KV cache; a pass that attends to its own tokens only starts
 * at its first position). */
typedef struct {
    void *k;
    void *v;
    long capacity;
    long start;
    int dtype;
} lp_kv;

/* An attention sub-layer (the llama family: RMSNorm, RoPE, grouped-query attention). */
typedef struct {
    long hidden;
    long heads;
    long kv_heads;
    long head_dim;
    lp_norm norm;
    lp_norm q_norm;
    lp_norm k_norm;
    lp_norm post_norm;
    lp_matrix qkv;   /* q, k and v projections stacked by output rows (q and k only when v.n > 0) */
    lp_matrix v;     /* the v projection apart (n = 0: stacked in qkv), as where its weight format differs */
    lp_matrix o;
    float scaling;   /* scores = q.k * scaling */
    long window;     /* sliding window (keys > position - window); 0 = none */
    long rotary_dim; /* dims rotated (head_dim for full RoPE); 0 = no RoPE */
} lp_attention;

/* A gated MLP sub-layer: down(act(gate(n)) * up(n)). */
typedef struct {
    long hidden;
    long inner;
    lp_norm norm;
    lp_norm post_norm;
    lp_matrix gate_up; /* gate and up stacked (2 inner, hidden) */
    lp_matrix down;    /* (hidden, inner) */
    int activation;    /* LP_ACT_ */
} lp_mlp;

/* One sequence's rows in a pass over several (lp_forward_batch): `rows` tokens at positions pos0.. */
typedef struct {
    long rows;
    long pos0;
    long logits; /* its last rows whose logits lp_forward_batch computes: 0 to rows */
} lp_segment;

/* One plan step: its sub-layers (NULL = off), its KV slot and its residual scale; and where the
 * residual stream entering it is kept, by position (NULL: not kept; a pass of one sequence writes
 * row r at stream + (pos0 + r) * hidden elements of the pass's dtype, below stream_capacity
 * positions): what a plan changed from this step on starts from (engine/cache.py). */
typedef struct {
    const lp_attention *attention;
    const lp_mlp *mlp;
    lp_kv kv;
    long rope;  /* index into the pass's cos / sin tables (the layer's type) */
    float scale;
    void *stream;
    long stream_capacity;
} lp_step;

/* ----- the library itself ----- */
LP_API int lp_abi_version(void);
/* writes "name size field offset field offset ...;" for every struct above, as compiled, into out
 * (capacity bytes, NUL-terminated); returns the length of the whole text */
LP_API long lp_abi_layout(char *out, long capacity);
/* the file of the OpenMP runtime the library's OpenMP calls resolve to ("" if unknown) */
LP_API const char *lp_openmp_runtime(void);
/* the instruction set the product kernels were written for ("avx2", "generic") */
LP_API const char *lp_isa(void);

/* ----- packed matrices ----- */
/* bytes lp_pack writes for an (n, k) matrix in `format`; -1 for an unknown format or a k the
 * format's blocks do not divide */
LP_API long lp_packed_bytes(int format, long n, long k);
/* packs w (n, k, the format's unpacked rows: for F16 and the block formats, the rows as a GGUF
 * file stores them) into out (lp_packed_bytes of it) */
LP_API int lp_pack(const void *w, int format, long n, long k, void *out);
/* rows (count, k) of `format` as a GGUF file stores them -> fp32 (count, k): exactly gguf's values
 * (for embedding lookups and the eager path) */
LP_API int lp_dequantize_rows(int format, const void *rows, long count, long k, float *out);
/* fp32 rows (count, k) -> rows of `format` as a GGUF file stores them (kernels/quant.h says how
 * each format quantizes) */
LP_API int lp_quantize_rows(int format, const float *x, long count, long k, void *out);
/* asks for 2 MB pages behind [p, p + bytes) (p 2 MB-aligned, not yet touched) */
LP_API void lp_advise_huge_pages(void *p, long bytes);
/* y[m, n] = x[m, :] . w[n, :] + bias[n]; x and y in their dtypes */
LP_API int lp_linear(const void *x, int x_dtype, const lp_matrix *w, void *y, int y_dtype, long m, int threads);
/* the LM head on the final norm of m rows of x: y = w . norm(x), x and y in `dtype` */
LP_API int lp_norm_linear(const lp_norm *nm, const void *x, const lp_matrix *w, void *y, long m, int dtype,
                          int threads);

/* ----- decoder sub-layers and passes (hidden states in `dtype`, (rows, hidden)) ----- */
LP_API int lp_attention_block(const lp_attention *a, const void *hidden, void *out, long rows, long pos0,
                              const void *cos, const void *sin, const lp_kv *kv, long keep_sink, long keep_recent,
                              const unsigned char *tree, float residual_scale, int dtype, int threads);
LP_API int lp_mlp_block(const lp_mlp *m, const void *hidden, void *out, long rows, float residual_scale, int dtype,
                        int threads);
LP_API int lp_run_steps(const lp_step *steps, long count, void *hidden, long rows, long pos0, const void *const *cos,
                        const void *const *sin, long keep_sink, long keep_recent, const unsigned char *tree,
                        int dtype, int threads);
LP_API int lp_forward(const void *embedding, long vocab, const long *ids, long rows, void *hidden,
                      const lp_step *steps, long count, long pos0, const void *const *cos, const void *const *sin,
                      long keep_sink, long keep_recent, const unsigned char *tree, const lp_norm *final_norm,
                      const lp_matrix *head, long head_from, void *logits, int dtype, int threads);
/* several sequences' passes as one: each its own KV slots (kvs: count x nsegs, step-major) and
 * positions, the products shared; the logits of each segment's last `logits` rows (see passes.c) */
LP_API int lp_forward_batch(const void *embedding, long vocab, const long *ids, long rows, void *hidden,
                            const lp_step *steps, long count, const lp_kv *kvs, const lp_segment *segments, long nsegs,
                            const void *const *cos, const void *const *sin, const lp_norm *final_norm,
                            const lp_matrix *head, void *logits, int dtype, int threads);

/* ----- kept files ----- */
/* reads file i (paths[i], its first sizes[i] bytes) into outs[i] for i < count, in this thread and
 * without the caller's interpreter lock; whole[i] = 1 where every byte was read; returns how many
 * were (files.c) */
LP_API long lp_read_files(const char *const *paths, const long *sizes, void *const *outs, unsigned char *whole,
                          long count);

/* ----- the machine's ceilings (layerplan probe) ----- */
/* GFLOP/s of 8-row products over `format` weights in cache; < 0 where an allocation failed */
LP_API double lp_product_rate(int format, int threads, long rounds);
/* GB/s of reading [p, p + bytes) once */
LP_API double lp_read_rate(const void *p, long bytes, int threads);

#endif
