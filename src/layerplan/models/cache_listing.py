"""What the cache holds for each model file, and what it weighs (`layerplan models`): a GGUF's
index (stored/), its panels packed for the kernels (panels/, one folder a build of the kernels),
and any dense copy a command was asked to make (models/: float32 or bfloat16 safetensors). Each
folder names its source file in its record (gguf_index.py SOURCE_RECORD); folders of files gone
or changed are swept when the next folder of their kind is made. Without torch."""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from layerplan.models.gguf_index import recorded_source
from layerplan.models.gguf_place import default_gguf_path, file_key

STALE = ("gone", "changed")  # a model file's states whose folders can never be used again
# cache sub-folder -> what its folders hold, for each model file
KINDS = {"stored": "index", "panels": "panels", "models": "dense copy"}
# the cache's other sub-folders, by what they hold
OTHERS = {"llama.cpp": "llama.cpp's tools", "native": "the kernels' library", "architectures": "architecture checks",
          "scans": "scans", "plans": "saved draft plans", "offload": "offloaded weights"}


@dataclass
class CacheFolder:
    kind: str  # KINDS' values
    path: str
    bytes: int


@dataclass
class CachedModel:
    """A model file and its cache folders. state: "present", "changed" (the file differs from the
    one the folders were made of) or "gone"; source None: folders that record no source."""

    source: str | None
    state: str
    default: bool = False
    file_bytes: int | None = None
    folders: list[CacheFolder] = field(default_factory=list)

    @property
    def cache_bytes(self) -> int:
        return sum(folder.bytes for folder in self.folders)


@dataclass
class CacheListing:
    cache: str
    models: list[CachedModel]
    others: dict[str, int]  # OTHERS' labels -> bytes

    @property
    def total_bytes(self) -> int:
        return sum(m.cache_bytes for m in self.models) + sum(self.others.values())

    def to_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}


def folder_bytes(path: Path) -> int:
    """The bytes of the files under `path` (0 where it cannot be read)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _state(path: Path, key: str | None) -> str:
    try:
        return "present" if key is None or file_key(path) == key else "changed"
    except OSError:
        return "gone"


def cache_listing(cache: Path) -> CacheListing:
    """The cache's folders by the model file each was made of, the packaged default first (listed
    even where nothing is cached for it), then the rest by path; the cache's other parts by kind."""
    default = default_gguf_path()
    by_source: dict[str | None, CachedModel] = {}
    if default is not None:
        resolved = str(default.resolve())
        by_source[resolved] = CachedModel(resolved, "present", default=True)
    for sub, kind in KINDS.items():
        root = cache / sub
        if not root.is_dir():
            continue
        for folder in sorted(root.iterdir()):
            if not folder.is_dir() or folder.name.startswith("."):
                continue
            record = recorded_source(folder) or {}
            source = record.get("path")
            model = by_source.get(source)
            if model is None:
                state = _state(Path(source), record.get("key")) if source else "unrecorded"
                model = by_source[source] = CachedModel(source, state)
            model.folders.append(CacheFolder(kind, str(folder), folder_bytes(folder)))
    for model in by_source.values():
        if model.source is not None and model.state != "gone":
            try:
                model.file_bytes = Path(model.source).stat().st_size
            except OSError:
                model.state = "gone"
    models = sorted(by_source.values(), key=lambda m: (not m.default, m.source is None, m.source or ""))
    others = {label: folder_bytes(cache / sub) for sub, label in OTHERS.items() if (cache / sub).is_dir()}
    return CacheListing(str(cache), models, {label: size for label, size in others.items() if size})


@dataclass
class Pruned:
    listing: CacheListing  # what is left
    files: int  # model files whose folders were removed
    freed_bytes: int


def prune_stale(listing: CacheListing) -> Pruned:
    """Remove the folders of the model files gone or changed (`layerplan models --prune`; the test
    suite's own cache at each run's start)."""
    stale = [m for m in listing.models if m.state in STALE]
    for model in stale:
        for folder in model.folders:
            shutil.rmtree(folder.path, ignore_errors=True)
    kept = [m for m in listing.models if m.state not in STALE]
    return Pruned(CacheListing(listing.cache, kept, listing.others), len(stale), sum(m.cache_bytes for m in stale))
