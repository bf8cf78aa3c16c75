"""A GGUF's transformers config and tokenizer, made from its header (models/gguf_file.py).

transformers reads a GGUF's config by parsing the whole header with gguf-py's reader and turning
every value back into Python (load_gguf_checkpoint: ~10 s for a 151,936-token vocabulary on the
project's CPUs), and AutoTokenizer does it a second time to learn the model type. Here the header is
read once, fast, and the config dict is built by the same table transformers keeps
(GGUF_TO_TRANSFORMERS_MAPPING: GGUF key -> config attribute, per architecture) and the same rules
around it, so the result is transformers' own dict (tests/test_gguf_file.py compares them for every
architecture the tiny GGUFs cover). Architectures whose config transformers builds with rules of
their own beyond the table (LEGACY_ARCHITECTURES) go to transformers' reader as before.

The tokenizer is transformers' GGUF converter (convert_gguf_tokenizer, through the tokenizer class
AutoTokenizer picks for the model type) fed from the file: the `tokenizers` library's tokenizer,
with the vocabulary, merges and special tokens as the file gives them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


from layerplan.models.errors import ModelError
from layerplan.models.file_index import CONFIG_KEYS, config_of, header_value
from layerplan.models.gguf_file import GGUFHeader

# architectures whose config transformers' reader builds with rules beyond its key table: read by it
LEGACY_ARCHITECTURES = ("t5", "t5encoder", "stablelm", "lfm2", "gpt-oss", "gpt_oss", "minimax-m2")
# llama.cpp's architecture names that transformers knows under another name (its load_gguf_checkpoint)
_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# GGUF checkpoints of these hold the text backbone only
_TEXT_MODEL_TYPES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}


def config_dict(header: GGUFHeader) -> dict[str, Any] | None:
    """transformers' config dict for the file (load_gguf_checkpoint(...)["config"]); None for an
    architecture read by transformers' own reader (LEGACY_ARCHITECTURES, or one its fast
    reader covers: GGUF_CONFIG_ARCHS)."""
    architecture = header.architecture
    if architecture in CONFIG_KEYS:  # (the file index's own table: no transformers import)
        return config_of(header)
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS

    if not architecture:
        raise ModelError(f"{header.path}: no general.architecture in its metadata")
    if architecture in LEGACY_ARCHITECTURES or architecture in GGUF_CONFIG_ARCHS:
        return None
    name = header.metadata.get("general.name")
    updated = "mistral" if "llama" in architecture and name == "mistral" else _RENAMED.get(architecture, architecture)
    if architecture not in GGUF_CONFIG_MAPPING and updated not in GGUF_CONFIG_MAPPING:
        raise ModelError(f"{header.path.name}: GGUF architecture '{architecture}' is not one transformers reads")
    config: dict[str, Any] = {"tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors)
                              or architecture in ("falcon", "bloom")}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {}).items():
        config.setdefault(key, value)
    for key, value in header.metadata.items():
        prefix, _, rest = key.replace(architecture, updated).partition(".")
        renames = GGUF_CONFIG_MAPPING.get(prefix)
        if renames is None or rest not in renames:
            continue
        target = renames[rest]
        if target is None or target == -1:
            continue
        value = header_value(value)
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, updated)
        config[target] = value
    config["model_type"] = _TEXT_MODEL_TYPES.get(config.get("model_type"), config.get("model_type"))
    if config["model_type"] == "gemma4_text":
        config["eos_token_id"] = [1, 106, 50]  # as transformers' reader sets it (its three end-of-turn tokens)
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in header.metadata:
        config["vocab_size"] = len(header.metadata["tokenizer.ggml.tokens"])
    return config


def load_config(header: GGUFHeader):
    """The file's transformers config (AutoConfig.for_model of config_dict, or transformers' own
    reader where config_dict leaves it)."""
    from transformers import AutoConfig

    found = config_dict(header)
    if found is None:
        return AutoConfig.from_pretrained(header.path.parent, gguf_file=header.path.name)
    config = AutoConfig.for_model(**found)
    config._name_or_path = str(header.path.parent)  # as from_pretrained names it
    return config


def load_tokenizer(header: GGUFHeader, config):
    """The file's tokenizer as AutoTokenizer.from_pretrained(gguf_file=...) makes it, without its
    second read of the whole header: the class AutoTokenizer picks for the model type, built by
    transformers' GGUF converter. None where the file has no vocabulary."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    if "tokenizer.ggml.model" not in header.metadata:
        return None
    path: Path = header.path
    class_name = TOKENIZER_MAPPING_NAMES.get(config.model_type)
    tokenizer_class = tokenizer_class_from_name(class_name) if class_name else None
    if tokenizer_class is None:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return tokenizer_class.from_pretrained(path.parent, gguf_file=path.name)
