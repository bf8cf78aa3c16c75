"""Peers for `layerplan bench` beyond transformers: llama.cpp through llama-cpp-python.

A peer is compared at the same precision as layerplan. The packaged default model is a Q4_1
GGUF; transformers dequantises it to the floats layerplan runs, so `gguf_at_precision` writes the
very same dequantised weights back as an F32 or BF16 GGUF (metadata and tokenizer copied), and
llama.cpp then runs what layerplan runs. llama-cpp-python is optional (it builds llama.cpp from
source on install): without it the bench leaves the row out and says why.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from pathlib import Path

import numpy as np

# layerplan dtype -> (GGUF tensor type name, general.file_type value of llama.cpp's LLAMA_FTYPE)
GGUF_PRECISIONS = {"float32": ("F32", 0), "bfloat16": ("BF16", 32)}


def llama_cpp_missing() -> str | None:
    """None when llama-cpp-python can be imported, else what to do about it."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama.cpp row left out: pip install llama-cpp-python (builds llama.cpp from source, ~10 min)"
    return None


def gguf_at_precision(source: Path, dtype: str, target: Path) -> Path:
    """Write `source`'s tensors dequantised to `dtype` (1-D tensors stay F32, as llama.cpp's
    converter writes them) with its metadata; atomic, and skipped when `target` exists."""
    if target.exists():
        return target
    import gguf

    type_name, file_type = GGUF_PRECISIONS[dtype]
    qtype = gguf.GGMLQuantizationType[type_name]
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(staging, arch)
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            value = file_type if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
        for tensor in reader.tensors:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            kind = qtype if values.ndim > 1 else gguf.GGMLQuantizationType.F32
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(staging, target)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return target


def llama_cpp_runner(gguf_path: Path, threads: int, context: int = 2048):
    """A bench Runner: llama.cpp's own greedy decoding of the same token ids (prompt included in
    the time, as for every other row)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False)

    def run(ids, new_tokens: int):
        llm.reset()
        tokens: list[int] = []
        start = time.perf_counter()
        for token in llm.generate(ids[0].tolist(), top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(int(token))
            if len(tokens) >= new_tokens or token == llm.token_eos():
                break
        return time.perf_counter() - start, tokens, None

    run.close = llm.close  # free llama.cpp's model before interpreter shutdown tears its bindings down
    return run
