"""What `layerplan export` writes (its --to), and which one an output path names where --to does
not: data and one rule, without torch (the command's help and line are read before any model
loads; export.py writes the files)."""

from __future__ import annotations

import os
from pathlib import Path

EXPORT_FORMATS = {
    "checkpoint": "a Hugging Face folder",
    "gguf": "a GGUF file whose tensors keep the source GGUF's stored types (no quantizing again, no dense copy)",
    "mergekit": "passthrough YAML",
}


def export_format_of(out: str | os.PathLike) -> str:
    """The format an output path names where --to does not: NAME.gguf a GGUF file, NAME.yaml (.yml)
    mergekit YAML, anything else a checkpoint folder."""
    suffix = Path(out).suffix.lower()
    return "gguf" if suffix == ".gguf" else "mergekit" if suffix in (".yaml", ".yml") else "checkpoint"
