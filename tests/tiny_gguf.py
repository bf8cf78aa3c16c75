"""Tiny GGUF files written from tiny random models (tests/tiny.py), as llama.cpp's converter
writes them: its tensor names, Llama's q and k rows permuted, matrices in a chosen GGUF type
(1-D tensors in F32; the K-quants by the kernels' quantizer), no tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# model_type -> (GGUF architecture, the config keys it writes)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}
# written too, but not among the architectures the GGUF tests sweep: Gemma 3 (its norms stored as
# 1 + w, as llama.cpp's converter writes them; its head width and sliding window in the header)
WRITTEN = {**ARCHITECTURES, "gemma3_text": "gemma3"}


def _permute(weights: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for Llama's q (heads) and k (kv_heads) projections."""
    groups = kv_heads if kv_heads != heads else heads
    return weights.reshape(groups, 2, weights.shape[0] // groups // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _quantized(values: np.ndarray, kind) -> np.ndarray:
    """gguf-py's blocks of `values`; the kernels' (lp_quantize_rows) for the K-quants, which
    gguf-py does not quantize."""
    import gguf

    try:
        return gguf.quants.quantize(values, kind)
    except NotImplementedError:
        from layerplan.engine.kernel_library import ABI, check, library

        rows = np.ascontiguousarray(values.reshape(-1, values.shape[-1]), np.float32)
        row_bytes = gguf.quant_shape_to_byte_shape((1, rows.shape[1]), kind)[1]
        out = np.empty((rows.shape[0], row_bytes), np.uint8)
        check(library().lp_quantize_rows(getattr(ABI, f"LP_FORMAT_{kind.name}"), rows.ctypes.data, rows.shape[0],
                                         rows.shape[1], out.ctypes.data), f"quantizing to {kind.name}")
        return out.reshape(*values.shape[:-1], row_bytes)


def write_tiny_gguf(hf: torch.nn.Module, path: Path, matrix_type: str = "Q8_0",
                    types: dict[str, str] | None = None) -> Path:
    """Write `hf` (a tiny llama-family CausalLM) as a GGUF whose matrices are `matrix_type`, but
    for those `types` names by GGUF tensor kind ({"attn_v": "Q8_0"}, as Q4_K_M mixes types)."""
    import gguf

    config = hf.config
    arch = WRITTEN[config.model_type]
    kind = gguf.GGMLQuantizationType[matrix_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)  # (Gemma 3's by layer type: the file holds the full layers')
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or rope["rope_theta"]))
    writer.add_vocab_size(config.vocab_size)
    if arch == "gemma3":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_sliding_window(config.sliding_window)
    writer.add_file_type(int(kind) if kind != gguf.GGMLQuantizationType.F32 else 0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for name, tensor in hf.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        if gguf_name is None:
            continue
        values = tensor.detach().float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            values = values + 1  # (llama.cpp's RMSNorm multiplies by the weight; Gemma's module by 1 + w)
        if arch == "llama" and gguf_name.endswith(("attn_q", "attn_k")):
            kv = config.num_key_value_heads if gguf_name.endswith("attn_k") else config.num_attention_heads
            values = _permute(values, config.num_attention_heads, kv)
        matrix = values.ndim == 2
        kind_of_tensor = gguf.GGMLQuantizationType[(types or {}).get(gguf_name.rsplit(".", 1)[-1], matrix_type)]
        stored = kind_of_tensor if matrix else gguf.GGMLQuantizationType.F32
        writer.add_tensor(f"{gguf_name}.{suffix}", _quantized(values, stored), raw_dtype=stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
