"""Write a GGUF with a real architecture's shapes and random weights, quantized the way
llama.cpp's Q4_K_M writes that architecture: for speed and memory figures where no real file of
that size is in the package registries (the values are random: acceptance and text mean nothing).

    python benchmarks/random_gguf.py qwen2-1.5b /tmp/qwen2-1.5b-random-Q4_K_M.gguf
    python benchmarks/random_gguf.py qwen2-7b /tmp/qwen2-7b-random-Q4_K_M.gguf \
        --vocab-from ~/.cache/layerplan-real-models/qwen2.5-coder-1.5b-instruct-Q4_K_M.gguf

Q4_K_M's choice per tensor (llama.cpp's llama_tensor_get_type): Q6_K for the tied token table and
for attn_v and ffn_down in the first and last eighth of the layers and every third layer between,
Q4_K for every other matrix; norms and biases F32. Blocks are random bytes with scales chosen so
that weights are ~0.02 in size.

The vocabulary: with --vocab-from, a real file's (every tokenizer.* key copied: tokens, types,
merges, special ids, chat template), padded with "[PAD<i>]" tokens to the shape's row count as
the published Qwen2 GGUFs are — so a first run pays what a real file of that size costs
(tokenizer build, chat template). Without it, a synthetic byte-level BPE one (256 byte tokens,
one merge, then "t<i>"): enough to load, but far cheaper to read than a real 150k vocabulary.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

SHAPES = {  # the published configs' sizes (Qwen2-1.5B; Qwen2-7B)
    "qwen2-1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, inner=8960, vocab=151936, tied=True),
    "qwen2-7b": dict(hidden=3584, layers=28, heads=28, kv_heads=4, inner=18944, vocab=152064, tied=False),
}


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for _, c in sorted(zip(printable, codes))]


def _random_blocks(kind, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes a row) uint8 of random blocks with sane f16 scales."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(rows * columns // block, size), dtype=np.uint8)
    if kind == gguf.GGMLQuantizationType.Q4_K:  # d, dmin (f16) then 12 bytes of 6-bit scales and mins
        blocks[:, 0:2] = np.frombuffer(np.float16(3e-4).tobytes(), np.uint8)
        blocks[:, 2:4] = np.frombuffer(np.float16(2e-3).tobytes(), np.uint8)
    elif kind == gguf.GGMLQuantizationType.Q6_K:  # ql, qh, 16 int8 scales, d (f16) last
        blocks[:, 192:208] = rng.integers(-20, 21, size=(len(blocks), 16), dtype=np.int8).view(np.uint8)
        blocks[:, 208:210] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    else:
        raise ValueError(kind)
    return blocks.reshape(rows, -1)


def _tokenizer_fields(path: Path) -> list[tuple[str, object, object, object]]:
    """(key, value, type, array item type) of every tokenizer.* key of the GGUF at `path`."""
    import gguf

    fields = []
    for key, field in gguf.GGUFReader(str(path)).fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            item = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), kind, item))
    return fields


def _add_real_vocabulary(writer, source: Path, rows: int) -> None:
    import gguf

    fields = _tokenizer_fields(source)
    count = next(len(value) for key, value, _, _ in fields if key == "tokenizer.ggml.tokens")
    if count > rows:
        raise ValueError(f"{source.name} has {count} tokens, more than this shape's {rows} rows")
    padded = {"tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(count, rows)],
              "tokenizer.ggml.token_type": [int(gguf.TokenType.USER_DEFINED)] * (rows - count),
              "tokenizer.ggml.scores": [0.0] * (rows - count)}
    for key, value, kind, item in fields:
        if key in padded:
            value = list(value) + padded[key]
        writer.add_key_value(key, value, kind, item)


def write(shape_name: str, path: Path, seed: int = 0, vocab_from: Path | None = None) -> Path:
    import gguf

    s = SHAPES[shape_name]
    rng = np.random.default_rng(seed)
    q4k, q6k, f32 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.F32
    head_dim = s["hidden"] // s["heads"]
    writer = gguf.GGUFWriter(str(path) + ".partial", "qwen2")
    writer.add_name(f"{shape_name}-random")
    writer.add_context_length(32768)
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(s["inner"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    if vocab_from is not None:
        _add_real_vocabulary(writer, vocab_from, s["vocab"])
    else:
        tokens = _byte_tokens() + ["\u0120t"] + [f"t{i}" for i in range(s["vocab"] - 257)]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types([1] * len(tokens))
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_merges(["\u0120 t"])  # llama.cpp refuses a BPE vocabulary without merges
        writer.add_bos_token_id(s["vocab"] - 2)
        writer.add_eos_token_id(s["vocab"] - 1)

    def matrix(name: str, kind, rows: int, columns: int) -> None:
        writer.add_tensor(name, _random_blocks(kind, rows, columns, rng), raw_dtype=kind)  # shape from the bytes

    def vector(name: str, size: int, value: float | None = None) -> None:
        data = np.full(size, value, np.float32) if value is not None else rng.normal(0, 0.02, size).astype(np.float32)
        writer.add_tensor(name, data, raw_dtype=f32)

    matrix("token_embd.weight", q6k if s["tied"] else q4k, s["vocab"], s["hidden"])
    vector("output_norm.weight", s["hidden"], 1.0)
    if not s["tied"]:
        matrix("output.weight", q6k, s["vocab"], s["hidden"])
    eighth = s["layers"] // 8
    for i in range(s["layers"]):
        more_bits = i < eighth or i >= s["layers"] - eighth or (i - eighth) % 3 == 2
        kv_rows = s["kv_heads"] * head_dim
        vector(f"blk.{i}.attn_norm.weight", s["hidden"], 1.0)
        vector(f"blk.{i}.ffn_norm.weight", s["hidden"], 1.0)
        matrix(f"blk.{i}.attn_q.weight", q4k, s["hidden"], s["hidden"])
        matrix(f"blk.{i}.attn_k.weight", q4k, kv_rows, s["hidden"])
        matrix(f"blk.{i}.attn_v.weight", q6k if more_bits else q4k, kv_rows, s["hidden"])
        vector(f"blk.{i}.attn_q.bias", s["hidden"])
        vector(f"blk.{i}.attn_k.bias", kv_rows)
        vector(f"blk.{i}.attn_v.bias", kv_rows)
        matrix(f"blk.{i}.attn_output.weight", q4k, s["hidden"], s["hidden"])
        matrix(f"blk.{i}.ffn_gate.weight", q4k, s["inner"], s["hidden"])
        matrix(f"blk.{i}.ffn_up.weight", q4k, s["inner"], s["hidden"])
        matrix(f"blk.{i}.ffn_down.weight", q6k if more_bits else q4k, s["hidden"], s["inner"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(path) + ".partial", path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-from", type=Path, default=None, metavar="GGUF",
                        help="copy this real file's vocabulary, merges and chat template")
    args = parser.parse_args(argv)
    path = write(args.shape, args.out, args.seed, args.vocab_from)
    print(f"{path}: {path.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main(sys.argv[1:])
