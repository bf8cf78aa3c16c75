"""What a model's load can be asked for, as plain data (no torch): the precisions (`--dtype`),
the engines (`--engine`), and the pass lengths the probe times (`layerplan probe --max-length`). The command line's choices and help come from here, so a command's
options can be defined, and a command line read, before torch is imported (app/launch.py);
engine/load.py and engine/native.py carry them out."""

from __future__ import annotations

STORED = "stored"
STORED_FAST = "stored-fast"
STORED_ARITHMETIC = {STORED: "exact", STORED_FAST: "fast"}
STORED_PRECISION = {arithmetic: dtype for dtype, arithmetic in STORED_ARITHMETIC.items()}  # arithmetic -> its dtype
# block formats any model's matrices are quantized to at load ("--dtype q4_k", "q4_k-fast"): a
# Hugging Face checkpoint then runs as a GGUF of that type would (kernels/quant.h says how each
# quantizes: the legacy formats as gguf-py does, the K-quants by plain min / max)
QUANTIZE_AT_LOAD = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
QUANTIZED = {**{name: (name, "exact") for name in QUANTIZE_AT_LOAD},
             **{f"{name}-fast": (name, "fast") for name in QUANTIZE_AT_LOAD}}
# every precision of the native kernels' block formats, for the CLI's choices
BLOCK_PRECISIONS = (STORED, STORED_FAST, *QUANTIZED)
# the dense precisions (torch dtypes by name)
DENSE_PRECISIONS = ("float32", "bfloat16", "float16")
# What a GGUF runs as by default ("auto"): its blocks as stored, in llama.cpp's arithmetic. A
# GGUF's user compares against llama.cpp, which quantizes activations to 8 bits and takes integer
# products; the exact products (transformers' numbers on the dequantized weights, --dtype stored)
# unpack every K-quant weight to float and decode slower than llama.cpp on the AVX2 machines
# (docs/gguf-stored.md). What is promised exactly holds in either arithmetic: speculative output
# equals plain output, and `--dtype stored` gives transformers' numbers.
GGUF_DEFAULT = STORED_FAST

ENGINES = {
    "auto": "the native kernels where they can run (CPU, AVX2 and FMA, a C compiler, fp32 or bf16), else eager",
    "native": "layerplan's C kernels for the sub-layers they reproduce, PyTorch modules for the rest",
    "eager": "every module as transformers runs it (the reference)",
}

# the new tokens of the passes the probe times (engine/probe.py): a verify pass of up to 16 tokens
PASS_LENGTHS = tuple(range(1, 17))
