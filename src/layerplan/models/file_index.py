"""A GGUF's index made from the file alone: numpy, `tokenizers` and jinja2, no torch, no transformers.

The index (models/gguf_index.py) is what both front ends load a GGUF from: config.json, the
tokenizer's files, and TENSORS_FILE (each tensor's transformers name, type, shape, offset and row
order; the rotary frequencies; how the chat template wraps a prompt). transformers can make it
(models/stored.py index_gguf: its config table, its GGUF tokenizer converter, a model skeleton for
the names), at the cost of importing it and building the skeleton: seconds before a first token.
Here it is made from the header's facts with the tables below, for the architectures and
tokenizers they hold. Each table is transformers' own rule written as data, and
tests/test_file_index.py checks the index against the one transformers makes: the same config
dict, the same tensor names and row orders, the same tokenizer (its tokenizer.json, and its
encodings of a text corpus), the same chat frame. A file outside the tables gets None from
`file_index_refusal`'s reason and is indexed by transformers, as before.

The rotary frequencies are the one value computed differently: transformers raises a float32 base
to float32 exponents with torch's vectorised pow, whose last bit can depend on the CPU's vector
width; here they are computed in float64 and rounded once, the same on every machine. The torch
front end runs a stored GGUF with the index's frequencies (models/stored.py load_stored), so both
front ends compute the same numbers.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from layerplan.files import staging
from layerplan.heap import collector_paused
from layerplan.models.arch_table import ARCHITECTURES, HEAD, ArchSpec
from layerplan.models.gguf_file import GGUFHeader
from layerplan.models.gguf_place import PARTIAL_TOKENIZER_BYTES
from layerplan.models.tokenizer_table import write_table

# GGUF architecture -> (model_type, its config keys after "<arch>." -> the transformers config
# attribute; None: read by transformers but kept nowhere). transformers' GGUF_CONFIG_MAPPING rows
_DECODER_KEYS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size", "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size",
}
CONFIG_KEYS = {
    "llama": {**_DECODER_KEYS, "rope.dimension_count": "head_dim"},
    "qwen2": {**_DECODER_KEYS, "rope.dimension_count": None},
    "qwen3": {**_DECODER_KEYS, "rope.dimension_count": None},
    # (Gemma 3: key_length == value_length == head_dim)
    "gemma3": {**_DECODER_KEYS, "rope.dimension_count": None, "attention.key_length": "head_dim",
               "attention.sliding_window": "sliding_window"},
}
# the model type transformers' reader gives an architecture, where it renames it
_MODEL_TYPES = {"gemma3": "gemma3_text"}
# Gemma 3's facts its config class adds to the file's keys (Gemma3TextConfig's defaults, written as
# data; layer_types and rope_parameters follow from them in gemma3_config): the light front end
# reads them from config.json, which is transformers' own for the same file
_GEMMA3_DEFAULTS = {
    "hidden_activation": "gelu_pytorch_tanh", "initializer_range": 0.02, "use_cache": True,
    "attention_bias": False, "attention_dropout": 0.0, "query_pre_attn_scalar": 256,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
    "_sliding_window_pattern": 6, "dtype": "float32", "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
}
_GEMMA3_LOCAL_ROPE_THETA = 10000.0  # the sliding layers' base (rope_local_base_freq), which files do not carry
_GENERAL_KEYS = {"general.architecture": "model_type", "general.name": "_model_name_or_path",
                 "tokenizer.ggml.bos_token_id": "bos_token_id", "tokenizer.ggml.eos_token_id": "eos_token_id",
                 "tokenizer.ggml.unknown_token_id": "unk_token_id", "tokenizer.ggml.padding_token_id": "pad_token_id"}


def tensor_names(spec: ArchSpec) -> dict[str, str]:
    """GGUF tensor name (without ".weight"/".bias"; blk.{i} for layer i) -> transformers' name, for
    an architecture whose layers are the llama family's (three projections, a gated MLP): gguf-py's
    names of those tensors, each placed where the architecture table puts its part."""
    kernels = spec.kernels
    q, k, v = kernels.qkv
    gate, up = kernels.gate_up
    layer = {"attn_norm": (spec.attention_norm,), "post_attention_norm": (spec.attention_post_norm,),
             "ffn_norm": (spec.mlp_norm,), "post_ffw_norm": (spec.mlp_post_norm,),
             "attn_q": (spec.attention, q), "attn_k": (spec.attention, k), "attn_v": (spec.attention, v),
             "attn_output": (spec.attention, "o_proj"),
             "ffn_gate": (spec.mlp, gate), "ffn_up": (spec.mlp, up), "ffn_down": (spec.mlp, "down_proj")}
    if kernels.qk_norms:
        layer |= {"attn_q_norm": (spec.attention, "q_norm"), "attn_k_norm": (spec.attention, "k_norm")}
    names = {"token_embd": spec.name(spec.embed), "output_norm": spec.name(spec.final_norm), "output": HEAD}
    names |= {f"blk.{{i}}.{gguf}": spec.layer_name("{i}", *path) for gguf, path in layer.items() if None not in path}
    return names


# model type -> its tensors' names, for the table's architectures with the llama family's layers
MODEL_TENSORS = {model_type: tensor_names(spec) for model_type, spec in ARCHITECTURES.items()
                 if spec.kernels is not None and len(spec.kernels.qkv) == 3 and len(spec.kernels.gate_up) == 2}
# what transformers' tensor processor adds to a norm's weight: llama.cpp stores Gemma's offset + w
# (ArchSpec.norm_weight_offset), transformers' module holds w
NORM_SHIFTS = {model_type: -spec.norm_weight_offset for model_type, spec in ARCHITECTURES.items()
               if model_type in MODEL_TENSORS and spec.norm_weight_offset}
# tensors a file may carry that transformers does not load (llama.cpp's own precomputed tables)
_UNLOADED = {"rope_freqs"}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")

# byte-level BPE pre-tokenizer splits by tokenizer.ggml.pre (transformers' GGUF_PRE_TOKENIZER_SPLITS);
# a name not here keeps GPT-2's own ByteLevel split, as transformers does
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    "tekken": _TEKKEN,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}
# architectures whose SentencePiece vocabularies are Gemma's (transformers' GGUF_SENTENCEPIECE_BUILDERS)
_GEMMA_VOCABULARIES = {"gemma", "gemma2", "gemma3"}
# tokenizer.ggml.model values indexed here (others, e.g. "t5" or Phi-3's "llama", go to transformers)
_VOCABULARY_KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}
# tokenizer.ggml.token_type values
_CONTROL, _USER_DEFINED = 3, 4

# the stages of making an index that take seconds (on_progress(stage, done, total)): a SentencePiece
# vocabulary's merges derived (done, total: tokens), the tokenizer built and written (0 or 1 of 1)
IndexProgress = Callable[[str, int, int], None]
DERIVING_MERGES = "deriving the vocabulary's merges"
WRITING_TOKENIZER = "writing its tokenizer"
_PROGRESS_EVERY = 8192

# user messages the chat frame is found with: none is in any template, and each is inserted
# whole only where a template inserts a message's content as it is
CHAT_PROBES = ("\u27e6layerplan\u27e7", " \u27e6two words\u27e7 \n", "\u27e6{{ x }}{% raw %}'\"\u27e7")


def file_index_refusal(header: GGUFHeader) -> str | None:
    """Why this file's index is made by transformers rather than here (one line), or None."""
    architecture = header.architecture
    if architecture not in CONFIG_KEYS:
        return f"architecture '{architecture}' is not in the file index's tables"
    tokenizer = header.metadata.get("tokenizer.ggml.model")
    if tokenizer is not None and (tokenizer not in _VOCABULARY_KINDS or architecture == "phi3"):
        return f"a '{tokenizer}' vocabulary is converted by transformers"
    if tokenizer == "gpt2" and "tokenizer.ggml.merges" not in header.metadata:
        return "a vocabulary without merges (transformers derives them from the scores)"
    if any(key.startswith(f"{architecture}.rope.scaling") for key in header.metadata):
        return "scaled rotary frequencies are computed by transformers"
    model_type = config_of(header)["model_type"]
    if model_type not in MODEL_TENSORS:
        return f"model type '{model_type}' is not in the file index's tables"
    known = {template.removeprefix("blk.{i}.") for template in MODEL_TENSORS[model_type]} | _UNLOADED
    for tensor in header.tensors:
        base = tensor.name.rsplit(".", 1)[0]
        layer = _LAYER.fullmatch(base)
        if (layer.group(2) if layer else base) not in known:
            return f"tensor '{tensor.name}' is not in the file index's tables"
    return None


def header_value(value: Any) -> Any:
    """A header value as transformers' reader gives it: arrays as lists, one-element lists unwrapped."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, list):
        return value[0] if len(value) == 1 else value
    return value


def config_of(header: GGUFHeader) -> dict[str, Any]:
    """transformers' config dict for the file (load_gguf_checkpoint(...)["config"]), for an
    architecture of CONFIG_KEYS."""
    architecture = header.architecture
    config: dict[str, Any] = {"tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors)}
    keys = {**_GENERAL_KEYS, **{f"{architecture}.{key}": name for key, name in CONFIG_KEYS[architecture].items()}}
    for key, value in header.metadata.items():
        name = keys.get(key)
        if name is not None:
            config[name] = header_value(value)
    if architecture == "llama" and header.metadata.get("general.name") == "mistral":
        config["model_type"] = "mistral"  # (as transformers' reader renames it)
    config["model_type"] = _MODEL_TYPES.get(config["model_type"], config["model_type"])
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in header.metadata:
        config["vocab_size"] = len(header.metadata["tokenizer.ggml.tokens"])
    return config


def parameter_names(header: GGUFHeader, model_type: str) -> dict[str, str]:
    """GGUF tensor name -> transformers parameter name, for the tensors transformers loads."""
    names: dict[str, str] = {}
    wanted = MODEL_TENSORS[model_type]
    for tensor in header.tensors:
        base, _, suffix = tensor.name.rpartition(".")
        layer = _LAYER.fullmatch(base)
        template = f"blk.{{i}}.{layer.group(2)}" if layer else base
        if template not in wanted:
            continue
        target = wanted[template].replace("{i}", layer.group(1)) if layer else wanted[template]
        names[tensor.name] = f"{target}.{suffix}"
    return names


def row_order(architecture: str, gguf_name: str, rows: int, config: dict[str, Any]) -> list[int]:
    """The order transformers reads a matrix's rows in (empty: as stored): llama.cpp's converter
    interleaves the two halves of each head's rows of Llama's q and k projections, and
    transformers' LlamaTensorProcessor undoes it."""
    if architecture != "llama" or not gguf_name.endswith((".attn_q.weight", ".attn_k.weight")):
        return []
    heads = config["num_attention_heads"]
    if gguf_name.endswith(".attn_k.weight"):
        heads = config.get("num_key_value_heads") or heads
    index = np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)
    order = np.empty(rows, np.int64)
    order[index] = np.arange(rows)  # the rows were stored permuted by `index`: read them back
    return [] if np.array_equal(order, np.arange(rows)) else order.tolist()


def rotary(config: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The default RoPE's frequencies base ** (-2i / dim), computed in float64 and rounded once;
    by layer type where the config gives each its own base (Gemma 3's sliding and full layers)."""
    by_type = config.get("rope_parameters") if config.get("layer_types") else None
    if by_type:
        return {"by_layer_type": {kind: _default_rope(facts["rope_theta"], head_dim)  # the types its layers have
                                  for kind, facts in sorted(by_type.items()) if kind in config["layer_types"]}}
    return _default_rope(config.get("rope_theta", 10000.0), head_dim)


def _default_rope(base: float, head_dim: int) -> dict[str, Any]:
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv_freq = (1.0 / np.power(np.float64(np.float32(base)), exponents)).astype(np.float32)
    return {"inv_freq": [float(f) for f in inv_freq], "attention_scaling": 1.0}


def full_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json for the index: the file's keys as transformers' reader gives them, and for
    Gemma 3 what its config class adds (as transformers writes it: defaults, a full-attention layer
    every _sliding_window_pattern, each layer type's rotary base in place of rope_theta)."""
    if config["model_type"] != "gemma3_text":
        return config
    full = {**_GEMMA3_DEFAULTS, **config}
    pattern = full["_sliding_window_pattern"]
    full["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                           for i in range(full["num_hidden_layers"])]
    full["rope_parameters"] = {"full_attention": {"rope_theta": full.pop("rope_theta", 1000000.0),
                                                  "rope_type": "default"},
                               "sliding_attention": {"rope_theta": _GEMMA3_LOCAL_ROPE_THETA, "rope_type": "default"}}
    return full


def byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    spelled, extra = dict(zip(printable, map(chr, printable))), 0
    for byte in range(256):
        if byte not in spelled:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return spelled


def _token_of(header: GGUFHeader, key: str) -> str | None:
    token_id = header.metadata.get(f"tokenizer.ggml.{key}")
    return header.metadata["tokenizer.ggml.tokens"][int(token_id)] if token_id is not None else None


@dataclass(frozen=True)
class VocabularyParts:
    """A file's tokenizer as built (a `tokenizers` Tokenizer, its BPE model without merges where
    they are kept apart), the vocabulary it maps and the merges."""

    tokenizer: Any
    vocab: dict[str, int]
    merges: list[tuple[str, ...]]
    derived: bool = False  # the merges derived from the vocabulary (sentencepiece_merges), not the file's


def byte_level_tokenizer(header: GGUFHeader):
    """The file's byte-level BPE vocabulary as transformers' GGUF converter builds it (GPT2Tokenizer
    over the vocabulary respelled in GPT-2's byte alphabet and the file's merges; control tokens
    added as special, user-defined ones as plain added tokens; the pre-tokenizer's split by
    tokenizer.ggml.pre; a post-processor adding BOS / EOS where the file asks)."""
    return _byte_level_parts(header, merges_in_model=True).tokenizer


def _byte_level_parts(header: GGUFHeader, merges_in_model: bool) -> VocabularyParts:
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    metadata = header.metadata
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    spelling = byte_spelling()
    alphabet = set(spelling.values())
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in metadata.get("tokenizer.ggml.merges", ())]
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges if merges_in_model else [], dropout=None,
                              continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    tokenizer.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else
                               pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                        pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                 use_regex=False)]))
    tokenizer.decoder = decoders.ByteLevel()
    return VocabularyParts(_with_special_tokens(tokenizer, header, vocab, control=lambda token: set(token) <= alphabet),
                           vocab, merges)


def sentencepiece_tokenizer(header: GGUFHeader, on_progress: IndexProgress | None = None):
    """The file's SentencePiece vocabulary (tokenizer.ggml.model "llama") as transformers' GGUF
    converter builds it: BPE with byte fallback over the vocabulary as the file spells it, with
    the file's merges or, where it has none, the merges its vocabulary implies (sentencepiece_merges);
    Gemma's files respell their tokens of spaces and rank merges by file order (GemmaTokenizer's
    pipeline), the others by score (LlamaTokenizer's: Metaspace, a space prefixed to the first word);
    control and user-defined tokens and BOS / EOS as for byte-level vocabularies. on_progress:
    the merges' derivation, a token at a time (seconds for a large vocabulary)."""
    return _sentencepiece_parts(header, on_progress, merges_in_model=True).tokenizer


def _sentencepiece_parts(header: GGUFHeader, on_progress: IndexProgress | None,
                         merges_in_model: bool) -> VocabularyParts:
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    metadata = header.metadata
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    gemma = header.architecture in _GEMMA_VOCABULARIES
    if gemma:  # a token of two or more spaces is looked up as "▁▁", as GemmaTokenizer spells it
        spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks = {token: -index for index, token in enumerate(spelled)}  # file order, not scores
    else:
        spelled = tokens
        ranks = None
    vocab = {token: index for index, token in enumerate(spelled)}
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    else:
        if ranks is None:
            ranks = dict(zip(tokens, np.asarray(metadata["tokenizer.ggml.scores"]).tolist()))
        on_token = (lambda done, total: on_progress(DERIVING_MERGES, done, total)) if on_progress else None
        merges = sentencepiece_merges(vocab, ranks, on_token)
    in_model = merges if merges_in_model else []
    if gemma:
        tokenizer = Tokenizer(BPE(vocab=vocab, merges=in_model, fuse_unk=True, unk_token="<unk>", dropout=None,
                                  byte_fallback=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                               decoders.Fuse()])
        tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    else:
        tokenizer = Tokenizer(BPE(vocab=vocab, merges=in_model, fuse_unk=True, byte_fallback=True, dropout=None))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                           split=False)
        tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                               decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    # (user-defined tokens are looked up as the file spells them: a Gemma token of spaces is not)
    return VocabularyParts(_with_special_tokens(tokenizer, header, vocab, control=lambda token: True, named=True),
                           vocab, merges, derived="tokenizer.ggml.merges" not in metadata)


def sentencepiece_merges(vocab: dict[str, int], ranks: dict[str, float],
                         on_token: Callable[[int, int], None] | None = None) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies, as transformers derives them: every split of
    a token into two tokens of the vocabulary, ranked by the token's rank (highest first), then by
    the lengths of the two halves (longest first); a token's own splits by their halves' ids.
    on_token(done, total) every _PROGRESS_EVERY tokens, and at the end."""
    found = []
    add = found.append
    for done, (token, rank) in enumerate(ranks.items()):
        if on_token is not None and done % _PROGRESS_EVERY == 0:
            on_token(done, len(ranks))
        size = len(token)
        for cut in range(1, size):
            left = token[:cut]
            if left in vocab:
                right = token[cut:]
                if right in vocab:
                    add((rank, cut, size - cut, left, right))
    if on_token is not None:
        on_token(len(ranks), len(ranks))
    # (a stable sort: equal keys keep the tokens' order; a token's own splits never tie, their
    # halves' lengths differ, so transformers' order of them by id needs no sort of its own)
    found.sort(key=lambda merge: merge[:3], reverse=True)
    return [(left, right) for _, _, _, left, right in found]


def _with_special_tokens(tokenizer, header: GGUFHeader, vocab, control: Callable[[str], bool], named: bool = False):
    """tokenizer with the file's control tokens added as special (those `control` admits; named:
    its BOS, EOS, unknown and padding tokens too, as transformers adds a tokenizer class's named
    tokens), its user-defined ones found in `vocab` as plain added tokens, and a post-processor
    adding BOS / EOS where the file asks (a SentencePiece vocabulary adds BOS unless it says not to)."""
    from tokenizers import AddedToken, processors

    metadata = header.metadata
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type")
    types = [] if types is None else np.asarray(types).tolist()
    special = [AddedToken(token, normalized=False, special=True) for token, kind in zip(tokens, types)
               if kind == _CONTROL and control(token)]
    if named:
        names = [_token_of(header, key) for key in ("bos_token_id", "eos_token_id", "unknown_token_id",
                                                    "padding_token_id")]
        special += [AddedToken(token, normalized=False, special=True) for token in names if token is not None]
    if special:
        tokenizer.add_special_tokens(special)
    plain = [AddedToken(token, normalized=False, special=False) for token, kind in zip(tokens, types)
             if kind == _USER_DEFINED and token in vocab]
    if plain:
        tokenizer.add_tokens(plain)
    bos, eos = _token_of(header, "bos_token_id"), _token_of(header, "eos_token_id")
    bos_default = metadata.get("tokenizer.ggml.model") == "llama"
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", bos_default)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair,
        special_tokens=[*([(bos, tokenizer.token_to_id(bos))] if add_bos else []),
                        *([(eos, tokenizer.token_to_id(eos))] if add_eos else [])])
    return tokenizer


def with_string_merges(data: dict) -> dict:
    """A BPE tokenizer.json's data with its merges written "a b" rather than ["a", "b"], where no
    merged token holds a space: the same tokenizer (the `tokenizers` package reads both forms),
    parsed in three quarters of the time — a quarter of the light front end's start."""
    merges = (data.get("model") or {}).get("merges")
    if merges and all(isinstance(m, list) and len(m) == 2 for m in merges):
        data["model"]["merges"] = _written_merges(merges)
    return data


def _written_merges(pairs: Sequence[Sequence[str]]) -> list:
    """Merge pairs as tokenizer.json holds them: "a b", or [a, b] (all of them) where a part holds a space."""
    if any(" " in part for pair in pairs for part in pair):
        return [list(pair) for pair in pairs]
    return [f"{a} {b}" for a, b in pairs]


def merges_as_strings(path: Path) -> None:
    """The tokenizer.json at `path` rewritten with_string_merges (where it exists)."""
    if path.exists():
        data = json.loads(path.read_text(encoding="utf-8"))
        path.write_text(json.dumps(with_string_merges(data), ensure_ascii=False), encoding="utf-8")


def tokenizer_config(header: GGUFHeader) -> dict[str, Any]:
    """tokenizer_config.json for the generic tokenizers class (TokenizersBackend): the special
    tokens by their text, and whether BOS / EOS are added."""
    config: dict[str, Any] = {"tokenizer_class": "TokenizersBackend", "backend": "tokenizers",
                              "clean_up_tokenization_spaces": False}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        config[name] = _token_of(header, key)
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in header.metadata:
            config[flag] = bool(header.metadata[f"tokenizer.ggml.{flag}"])
    if header.metadata.get("tokenizer.ggml.model") == "llama":  # llama.cpp adds BOS unless the file says not
        config.setdefault("add_bos_token", True)
    return config


def vocabulary_json(header: GGUFHeader, on_progress: IndexProgress | None = None) -> dict:
    """The file's tokenizer (by its tokenizer.ggml.model) as tokenizer.json holds it, its merges
    written "a b" (with_string_merges). The BPE model is built without its merges and they are
    written beside it (merge_entries): building a large vocabulary's merges into the model, writing
    them out and parsing them back took a quarter of a Gemma 3 file's first run."""
    if header.metadata.get("tokenizer.ggml.model") == "llama":
        parts = _sentencepiece_parts(header, on_progress, merges_in_model=False)
    else:
        parts = _byte_level_parts(header, merges_in_model=False)
    data = json.loads(parts.tokenizer.to_str())
    data["model"]["merges"] = merge_entries(parts.vocab, parts.merges, derived=parts.derived)
    return data


def merge_entries(vocab: dict[str, int], merges: Sequence[tuple[str, ...]], derived: bool = False) -> list:
    """`merges` as the `tokenizers` package writes a BPE model built of them (Tokenizer.to_str),
    without building it: each pair once, where it last occurs (a later one replaces an earlier in
    the model's map, and the model writes its pairs by rank), "a b" where no part holds a space
    (with_string_merges), else [a, b]. A merge that is not two tokens whose join is a token too
    raises ValueError, where building the model would refuse it. derived: merges
    sentencepiece_merges derived from `vocab` (two of its tokens joined into a third, each once, by
    construction: not checked)."""
    if not derived:
        for pair in merges:
            if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
                raise ValueError(f"the vocabulary's merge {' '.join(pair)!r} is not two of its tokens joined into a third")
        last = {pair: rank for rank, pair in enumerate(merges)}
        if len(last) < len(merges):
            merges = sorted(last, key=last.__getitem__)
    return _written_merges(merges)


def frame_of(template: str | None, render: Callable[[str], str]) -> dict:
    """How a chat template wraps one user message with the assistant's turn after it, from
    render(message) (the template rendered for that lone user message, generation prompt added):
    {"template": False} without a template; with one, its "prefix" and "suffix" where every probe
    message renders as prefix + message + suffix (the light front end then wraps a prompt itself,
    layerplan/lite/); neither where the template does more (a date, a message changed) or refuses."""
    if not template:
        return {"template": False}
    frames = set()
    for text in CHAT_PROBES:
        try:
            rendered = render(text)
        except Exception:  # noqa: BLE001 - a template that refuses a lone user message: no frame
            return {"template": True}
        if not isinstance(rendered, str) or rendered.count(text) != 1:
            return {"template": True}
        frames.add(tuple(rendered.split(text)))
    if len(frames) != 1 or "strftime_now" in template:
        return {"template": True}
    prefix, suffix = frames.pop()
    return {"template": True, "prefix": prefix, "suffix": suffix}


def chat_frame(template: str | None, special_tokens: dict[str, str | None]) -> dict:
    """frame_of the template rendered as transformers renders a chat template (models/chat_template.py;
    one that cannot be compiled has no frame)."""
    if not template:
        return {"template": False}
    # (here: jinja2 is imported only where an index is made, not at every start that reads one)
    from layerplan.models.chat_template import ChatTemplate, ChatTemplateError

    try:
        compiled = ChatTemplate(template, special_tokens)
    except ChatTemplateError:
        return {"template": True}
    return frame_of(template, lambda text: compiled.render([{"role": "user", "content": text}]))


@contextmanager
def staged_index(target: Path, tensors_file: str) -> Iterator[Path]:
    """A staging folder beside `target` (files.staging) that becomes the index when the block
    ends: renamed atomically, so a half-written index is never found; where another process won
    the race, its index stands."""
    with staging(target, folder=True) as staged:
        yield staged
        try:
            os.replace(staged, target)
        except OSError:
            if not (target / tensors_file).exists():
                raise


def write_file_index(header: GGUFHeader, target: Path, version: int, tensors_file: str,
                     on_progress: IndexProgress | None = None) -> Path:
    """Write the file's index into `target` (atomically: staged beside it, then renamed), for a
    file file_index_refusal passes. on_progress(stage, done, total): the stages that take seconds
    on a large vocabulary (DERIVING_MERGES, WRITING_TOKENIZER)."""
    config = full_config(config_of(header))
    model_type = config["model_type"]
    names = parameter_names(header, model_type)
    norm_shift = NORM_SHIFTS.get(model_type, 0.0)
    entries = []
    for tensor in header.tensors:
        name = names.get(tensor.name)
        if name is None:
            continue
        shape = [int(n) for n in reversed(tensor.shape)]  # GGUF lists the fastest dimension first
        matrix = len(shape) == 2 and shape[1] > 1
        entries.append({"gguf_name": tensor.name, "name": name, "type": tensor.type_name, "shape": shape,
                        "offset": tensor.offset, "nbytes": tensor.nbytes,
                        "row_order": row_order(header.architecture, tensor.name, shape[0], config) if matrix else [],
                        "matrix": matrix,
                        "shift": norm_shift if not matrix and tensor.name.endswith("norm.weight") else 0.0})
    query = next(e for e in entries if e["gguf_name"] == "blk.0.attn_q.weight")
    head_dim = config.get("head_dim") or query["shape"][0] // config["num_attention_heads"]
    has_vocabulary = "tokenizer.ggml.tokens" in header.metadata
    special = tokenizer_config(header) if has_vocabulary else {}
    template = header.metadata.get("tokenizer.chat_template") if has_vocabulary else None
    chat = chat_frame(template, {k: special.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")})
    with staged_index(target, tensors_file) as staged:
        (staged / "config.json").write_text(json.dumps(config, indent=2))
        if has_vocabulary:
            with collector_paused():  # (a large vocabulary: millions of strings, lists and tuples)
                tokenizer_json = vocabulary_json(header, on_progress)
                if on_progress is not None:
                    on_progress(WRITING_TOKENIZER, 0, 1)
                source = staged / "tokenizer.json"
                source.write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
                if source.stat().st_size >= PARTIAL_TOKENIZER_BYTES:  # (what a later start reads instead)
                    write_table(staged, tokenizer_json)
            (staged / "tokenizer_config.json").write_text(json.dumps(special, indent=2))
            if on_progress is not None:
                on_progress(WRITING_TOKENIZER, 1, 1)
            if template:
                (staged / "chat_template.jinja").write_text(template)
        (staged / tensors_file).write_text(json.dumps({
            "gguf": str(header.path), "version": version, "made_by": "file", "rotary": rotary(config, head_dim),
            "chat": chat, "tensors": entries}))
    return target
