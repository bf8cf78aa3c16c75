"""Packed panels of a GGUF's matrices kept on disk, so a later load reads them instead of packing.

Packing a file's block rows into the kernels' panel order (kernels/formats.c) reads and rewrites
every weight byte through the format's unpacking: seconds for a 1B file, half a minute for a 7B
one, on every start. The packed bytes depend only on the file's rows and the packing code, so they
are written once per (file, kernels) to the cache folder and read back into the weight arena by
later loads (a copy out of the page cache, at memory speed; the arena keeps its 2 MB pages).

Invariants: an entry is a whole matrix's packed bytes or absent (written to a temporary file and
renamed into place); its name covers the rows it packs (file, offset, type, shape, row order),
and its folder the file's identity (path, size, modification time, inode) and kernels_key, so a
changed file or changed kernels never read old panels. A folder records its file
(models/gguf_index.py SOURCE_RECORD) and the ISA of the kernels that packed it (BUILD_RECORD). Each
time a file's panels are first kept: the file's panels packed by older kernels of the same ISA
beyond KEPT_BUILDS ($LAYERPLAN_PANEL_BUILDS) go (an upgrade's kernels would otherwise leave a 7B's
4 GB behind each time),
then the panels of files gone or changed, then the least recently loaded files' beyond KEPT_BYTES
($LAYERPLAN_PANEL_CACHE_BYTES), then the least recently loaded small files' beyond KEPT_FOLDERS
files (a small file's panels are packed again in a moment; a large file's cost seconds, and go only
for the bytes). LAYERPLAN_PANEL_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from layerplan.engine.kernel_library import NativeUnavailable, choose_isa
from layerplan.files import cache_dir, staging
from layerplan.models.gguf_index import SOURCE_RECORD, StoredTensor, recorded_source, sweep_stale, write_source_record

if TYPE_CHECKING:  # (a start that reads kept panels has no use for the module)
    from concurrent.futures import Future

KEPT_BYTES = 16 << 30  # the most kept panels take on disk (a 7B Q4_K_M file's are ~4.4 GB)
KEPT_FOLDERS = 32  # the most files whose panels are kept, counting only small ones
SMALL_FOLDER_BYTES = 16 << 20  # panels packed again in well under a second
# a file's panels kept per ISA: this build's alone (an upgrade's kernels pack the file again, and the
# older build's panels, the file's size again on disk, go); $LAYERPLAN_PANEL_BUILDS keeps more (two
# checkouts timed in turns: benchmarks/ab_checkouts.py); a folder records its build's ISA here
KEPT_BUILDS = 1
BUILD_RECORD = "kernels.json"


# which matrices are stacked into one packed matrix, and how they are packed, is decided in
# native.py, file_kernels.py and stored_pack.py: their sources are part of the folder's key, so
# that entries of other stacks are never read
_STACKING = hashlib.sha256(b"".join(Path(__file__).with_name(name).read_bytes()
                                    for name in ("native.py", "file_kernels.py", "stored_pack.py"))).hexdigest()[:16]


def _digest(*parts) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:20]


class PanelCache:
    """The packed panels of one GGUF file's matrices under one build of the kernels."""

    READ_BYTES = 64 << 20  # entries are read in parts of this size, on every fill thread

    def __init__(self, folder: Path, source: Path) -> None:
        self.folder = folder
        self.source = source  # the GGUF file

    def holds(self, weights: list[StoredTensor]) -> bool:
        """Whether the stack's panels belong here: rows read from this cache's file."""
        return all(w.data is None and w.path == self.source for w in weights)

    @classmethod
    def for_file(cls, path: Path, kernels: str) -> PanelCache | None:
        """The cache for `path`'s matrices packed by the kernels of `kernels` (kernels_key); None
        where it is turned off or the cache folder cannot be made."""
        if os.environ.get("LAYERPLAN_PANEL_CACHE", "1") in ("0", "off", "no", "false"):
            return None
        try:
            source = Path(path).resolve()
            status = source.stat()
            root = cache_dir() / "panels"
            identity = _digest(source, status.st_size, status.st_mtime_ns, status.st_ino, kernels, _STACKING)
            folder = root / f"{source.stem[:60]}-{identity}"
            if (folder / SOURCE_RECORD).exists():
                os.utime(folder)  # recently used: kept over the others
            else:  # a file's first load under these kernels: what it will add may push others out
                folder.mkdir(parents=True, exist_ok=True)
                (folder / BUILD_RECORD).write_text(json.dumps({"isa": _isa()}))
                write_source_record(folder, source)
                _sweep_builds(root, folder)
                _evict(root, keep=folder)  # (on every start, it cost a light start ~25 ms of stats)
        except OSError:
            return None
        return cls(folder, path)

    def _entry(self, weights: list[StoredTensor], format_code: int, nbytes: int) -> Path:
        rows = [(w.offset, w.type_name, w.rows, w.columns, w.row_bytes,
                 _digest(*w.row_order) if w.row_order else "") for w in weights]
        return self.folder / f"{_digest(format_code, nbytes, rows)}.panels"

    def kept(self, weights: list[StoredTensor], format_code: int, nbytes: int) -> Path | None:
        """The entry holding the stack's `nbytes` of panels, if kept."""
        entry = self._entry(weights, format_code, nbytes)
        try:
            return entry if entry.stat().st_size == nbytes else None
        except OSError:
            return None

    @classmethod
    def read_parts(cls, entry: Path, out, fill: Callable[[Callable[[], object], int], Future],
                   short: Callable[[], object] | None = None) -> list[Future]:
        """Read the entry into `out` in parts of READ_BYTES, each a job for `fill` with its bytes
        (so that a large matrix's fresh pages fault in on every fill thread); a part that comes up
        short calls `short` where given. Each future's result: whether its part was read whole."""
        def part(start: int) -> bool:
            whole = cls.read(entry, out[start:start + cls.READ_BYTES], start)
            if not whole and short is not None:
                short()
            return whole

        return [fill(partial(part, start), min(cls.READ_BYTES, out.nbytes - start))
                for start in range(0, out.nbytes, cls.READ_BYTES)]

    @staticmethod
    def read(entry: Path, out, start: int) -> bool:
        """Fill `out` (uint8: a numpy array or a CPU tensor) with the entry's bytes from `start`; False where they are not all
        there (the entry went, or was cut short, since it was found)."""
        try:
            with open(entry, "rb") as file:
                file.seek(start)
                return file.readinto(_bytes(out)) == out.nbytes
        except OSError:
            return False

    def write(self, weights: list[StoredTensor], format_code: int, packed) -> None:
        """Keep the stack's panels (atomically; a full disk or a read-only cache only costs the
        next load its packing)."""
        entry = self._entry(weights, format_code, packed.nbytes)
        try:
            with staging(entry) as staged:  # no fsync: a lost entry is only packed again
                with open(staged, "wb") as file:
                    file.write(_bytes(packed))
                os.replace(staged, entry)
        except OSError:
            pass


def _bytes(buffer) -> memoryview:
    """A uint8 numpy array's or CPU tensor's bytes, writable where it is."""
    return memoryview(buffer if isinstance(buffer, np.ndarray) else buffer.numpy()).cast("B")


def _isa() -> str:
    try:
        return choose_isa().name
    except NativeUnavailable:
        return ""


def _build_isa(folder: Path) -> str | None:
    """The ISA a folder's panels were packed by (None: a folder made before BUILD_RECORD)."""
    try:
        return json.loads((folder / BUILD_RECORD).read_text())["isa"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _sweep_builds(root: Path, new: Path) -> None:
    """Of the folders holding `new`'s file's panels (the same file, unchanged) packed by kernels of
    `new`'s ISA, or recording none, keep the KEPT_BUILDS most recently used (`new` among them) and
    remove the rest, but any used in the last minute (another process may be reading it)."""
    source, isa = recorded_source(new), _build_isa(new)
    builds = []
    for folder in root.iterdir():
        try:
            if (folder != new and folder.is_dir() and not folder.name.startswith(".")
                    and recorded_source(folder) == source and _build_isa(folder) in (isa, None)):
                builds.append((folder.stat().st_mtime, folder))
        except OSError:  # removed meanwhile by another process
            pass
    try:
        kept = max(1, int(os.environ.get("LAYERPLAN_PANEL_BUILDS", KEPT_BUILDS)))
    except ValueError:
        kept = KEPT_BUILDS
    for mtime, folder in sorted(builds, reverse=True)[kept - 1:]:
        if time.time() - mtime > 60:
            shutil.rmtree(folder, ignore_errors=True)


def _evict(root: Path, keep: Path) -> None:
    """Drop the panels of files gone or changed, then the least recently loaded files' beyond
    KEPT_BYTES, then the least recently loaded small files' beyond KEPT_FOLDERS (never `keep`, nor
    for the budgets a folder used in the last minute: another process may be writing it)."""
    sweep_stale(root, keep)
    folders = []
    for folder in root.iterdir():
        try:
            if folder.is_dir() and not folder.name.startswith("."):
                folders.append((folder.stat().st_mtime, folder))
        except OSError:  # removed meanwhile by another process's eviction
            pass
    budget = int(os.environ.get("LAYERPLAN_PANEL_CACHE_BYTES", KEPT_BYTES))
    used, small = 0, 0
    for mtime, folder in sorted(folders, reverse=True):
        size = _size(folder)
        used += size
        small += size < SMALL_FOLDER_BYTES
        over = used > budget or (size < SMALL_FOLDER_BYTES and small > KEPT_FOLDERS)
        if over and folder != keep and time.time() - mtime > 60:
            shutil.rmtree(folder, ignore_errors=True)


def _size(folder: Path) -> int:
    """Bytes of the folder's entries (0 for one another process removes meanwhile)."""
    total = 0
    try:
        for entry in folder.iterdir():
            total += entry.stat().st_size
    except OSError:
        pass
    return total
