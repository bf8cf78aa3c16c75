"""A GGUF's index and its stored matrices, without torch: what both front ends read.

A GGUF's metadata is read once into a folder of the cache, its index: config.json, the
tokenizer's files and TENSORS_FILE (each mapped tensor's transformers name, GGUF type, shape, file
offset and row order; the model's rotary frequencies; how its chat template wraps a prompt).
`file_index` makes it from the file alone (models/file_index.py) where that module's tables cover
the file; models/stored.py `index_gguf` makes it with transformers for the others. The torch front
end (models/stored.py) and the light one (layerplan/lite/) both load from it; a `StoredTensor` is
one matrix as the file stores it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from layerplan.models.errors import ModelError
from layerplan.models.file_index import IndexProgress, file_index_refusal, write_file_index
from layerplan.models.gguf_file import read_header
from layerplan.models.gguf_place import INDEX_VERSION, TENSORS_FILE, file_key, index_folder
# (read from here by the commands of recorded figures, benchmarks/figures/)
from layerplan.models.gguf_place import default_gguf_path  # noqa: F401

if TYPE_CHECKING:  # (torch only where a tensor is asked for: the light front end runs without it)
    import torch

# in each folder of the cache made from a GGUF (its index, its dense conversion, its panels): the
# file's path and file_key, so that a later sweep finds the folders no load can ask for again
SOURCE_RECORD = "layerplan-source.json"


def write_source_record(folder: Path, gguf: Path) -> None:
    """Record `gguf` as the source of `folder` (a torn record reads as none: never swept)."""
    (folder / SOURCE_RECORD).write_text(json.dumps({"path": str(gguf.resolve()), "key": file_key(gguf)}))


def stale_source(folder: Path) -> bool:
    """Whether the folder's recorded source file is gone or changed since (its key, the file's path,
    size and time, can never be asked for again); False for a folder with no record."""
    record = recorded_source(folder)
    try:
        return file_key(Path(record["path"])) != record["key"]
    except OSError:
        return True
    except (TypeError, KeyError):
        return False


def recorded_source(folder: Path) -> dict | None:
    """The source a cache folder records ({"path", "key"}), or None: the folder's SOURCE_RECORD,
    or an older index's tensors file."""
    try:
        record = json.loads((folder / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        return _index_source(folder)
    return record if isinstance(record, dict) else None


def _index_source(folder: Path) -> dict | None:
    """An index made before SOURCE_RECORD: its tensors file names its GGUF, and its folder name
    (index_folder) ends with that file's key and the index version."""
    try:
        path = json.loads((folder / TENSORS_FILE).read_text())["gguf"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    stem, _, version = folder.name.rpartition("-v")
    return {"path": path, "key": stem.rpartition("-")[2]} if version.isdigit() else None


def sweep_stale(root: Path, keep: Path) -> list[Path]:
    """Remove the folders in `root` (but `keep`, and staging folders) whose source is stale; return
    them. A folder with no record (an older layerplan's conversion or panels) is left."""
    removed = []
    for folder in root.iterdir():
        if folder != keep and not folder.name.startswith(".") and folder.is_dir() and stale_source(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def file_index(gguf: Path, on_progress: IndexProgress | None = None) -> Path | None:
    """The GGUF's index: kept from an earlier load, or made now from the file alone; None where
    the file index's tables do not cover the file (then transformers makes it). on_progress: see
    models/file_index.py write_file_index."""
    target = index_folder(gguf)
    if (target / TENSORS_FILE).exists():
        return target
    header = read_header(gguf)  # one line where the file is not a GGUF
    if file_index_refusal(header) is not None:
        return None
    return kept_index(write_file_index(header, target, INDEX_VERSION, TENSORS_FILE, on_progress), gguf)


def kept_index(target: Path, gguf: Path) -> Path:
    """A new index of `gguf`, recorded as its, with the indexes of files gone or changed swept."""
    write_source_record(target, gguf)
    sweep_stale(target.parent, keep=target)
    return target


@dataclass(frozen=True)
class StoredTensor:
    """A matrix (rows outputs x columns inputs) as a GGUF file stores it."""

    path: Path
    offset: int  # of the tensor's first byte in the file
    type_name: str  # the GGUF type ("Q4_1", "Q4_K", "F32", ...)
    type_id: int
    rows: int
    columns: int
    row_bytes: int
    row_order: tuple[int, ...] | None = None  # stored row of each transformers row; None: the same
    # the rows in memory, (rows, row_bytes) uint8, for a matrix quantized at load rather than read
    # from a GGUF (then path names the model it came from, and offset is 0)
    data: np.ndarray | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def read_rows(self, out: np.ndarray | None = None, first: int = 0, count: int | None = None) -> np.ndarray:
        """(count, row_bytes) uint8: rows first.. of the matrix in transformers' row order (all of
        them by default), read into memory of its own (the file is not mapped, so its pages do not
        count as the process's): into `out` where given (a C-contiguous array of that shape, as a
        stack of matrices is built without a copy). A part (first, count) of a matrix whose rows
        transformers permutes is refused: it reads whole."""
        count = self.rows - first if count is None else count
        if self.row_order is not None and (first, count) != (0, self.rows):
            raise ValueError("a matrix with permuted rows is read whole")
        if out is None:
            out = np.empty((count, self.row_bytes), np.uint8)
        if out.shape != (count, self.row_bytes) or not out.flags.c_contiguous:
            raise ValueError(f"rows of {count} x {self.row_bytes} bytes go to a contiguous array of that shape")
        if self.data is not None:
            out[:] = self.data[first:first + count]
            return out
        with open(self.path, "rb") as file:
            file.seek(self.offset + first * self.row_bytes)
            if file.readinto(memoryview(out).cast("B")) != count * self.row_bytes:
                raise ModelError(f"{self.path}: the file ends inside a tensor (truncated?)")
        if self.row_order is not None:  # q and k rows in transformers' order: a permutation in place
            out[:] = out[np.asarray(self.row_order)]
        return out

    def map_rows(self) -> np.ndarray:
        """(rows, row_bytes) uint8 mapped from the file in its stored order: only the pages of the
        rows read are brought into memory (an embedding table's lookups)."""
        if self.data is not None:
            return self.data
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.offset, shape=(self.rows, self.row_bytes))

    def dequantize(self) -> "torch.Tensor":
        """float32 (rows, columns): gguf-py's values, as transformers' GGUF loader computes them."""
        return self.decode(self.read_rows())

    def decode(self, data: np.ndarray) -> "torch.Tensor":
        """float32 (len(data), columns) of stored rows (uint8, (count, row_bytes)) of this tensor."""
        import gguf
        import torch

        values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(self.type_id))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(len(data), self.columns))
