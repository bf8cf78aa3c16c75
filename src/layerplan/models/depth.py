"""What a model source names, read without torch: its GGUF file (readable_gguf), its Hugging Face
folder (config_folder), its depth and display name from the header or config.json alone
(model_depth: what a plan is validated against, before anything loads)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from layerplan.models.errors import ModelError
from layerplan.models.gguf_file import GGUFHeader, read_header
from layerplan.models.gguf_place import DEFAULT_DISPLAY_NAME, DEFAULT_MODEL, default_gguf_path, gguf_of


def display_name(gguf: Path) -> str:
    return DEFAULT_DISPLAY_NAME if gguf == default_gguf_path() else gguf.stem


def gguf_depth(header: GGUFHeader) -> int:
    """The number of decoder layers a GGUF's header gives (its block_count)."""
    depth = header.get("{arch}.block_count")
    if not isinstance(depth, int) or depth < 1:
        raise ModelError(f"{header.path}: its metadata gives no block_count")
    return depth


def readable_gguf(source: str | os.PathLike | None) -> Path | None:
    """gguf_of, with a place this user may not read (or '~nobody') as one line."""
    try:
        return gguf_of(source)
    except (OSError, RuntimeError) as error:
        raise _unreadable(source, error) from None


def config_folder(source: str | os.PathLike | None) -> tuple[Path, str] | None:
    """(the folder, its display name) where the source is a folder with a config.json; None where
    it is not one; a place this user may not read as one line."""
    try:
        path = Path(str(source) if source is not None else DEFAULT_MODEL).expanduser()
        if path.is_dir() and (path / "config.json").exists():
            return path, path.name
    except (OSError, RuntimeError) as error:  # a folder this user may not read; '~nobody'
        raise _unreadable(source, error) from None
    return None


def no_model(source: str | os.PathLike | None) -> ModelError:
    """The one line for a source that names no model."""
    text = str(source) if source is not None else DEFAULT_MODEL
    return ModelError(f"no model at '{text}': looked for a folder with config.json and safetensors weights, a .gguf "
                      f"file, or the name '{DEFAULT_MODEL}' (see `layerplan models`)")


def _unreadable(source, error: BaseException) -> ModelError:
    text = str(source) if source is not None else DEFAULT_MODEL
    return ModelError(f"cannot read the model at '{text}': {getattr(error, 'strerror', None) or error}")


def config_depth(config: dict[str, Any]) -> int | None:
    """Number of decoder layers from a config.json dict (None if it does not say)."""
    config = config.get("text_config", config)
    depth = config.get("num_hidden_layers", config.get("n_layer"))
    return int(depth) if depth is not None else None


def model_depth(source: str | os.PathLike | None = None) -> tuple[int, str]:
    """(number of decoder layers, display name) from the config alone, without loading weights (a
    GGUF's from its header: nothing is converted or indexed)."""
    gguf = readable_gguf(source)
    if gguf is not None:
        return gguf_depth(read_header(gguf)), display_name(gguf)
    found = config_folder(source)
    if found is None:
        raise no_model(source)
    folder, name = found
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelError(f"{folder / 'config.json'}: cannot read it as JSON ({error})") from None
    depth = config_depth(config) if isinstance(config, dict) else None
    if depth is None:
        raise ModelError(f"{folder / 'config.json'} gives no num_hidden_layers / n_layer")
    return depth, name
