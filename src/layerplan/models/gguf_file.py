"""A GGUF file's header read directly: its metadata (key -> value) and its tensor table, without
torch, transformers or gguf-py's reader.

gguf-py's GGUFReader makes a numpy view of every part of every field (four a string: a 151,936-token
vocabulary and its merges are over a million arrays, ~8 s on the project's CPUs), and transformers
then turns each back into a Python value, once for the config and again for the tokenizer. Here the
header is read once, in one pass over a memory map: numbers and arrays of numbers as numpy arrays,
strings and arrays of strings as Python strings (~0.3 s for that vocabulary). The tensor data is not
touched.

GGUF (version 2 and 3): magic "GGUF", version u32, tensor count u64, metadata count u64; each
metadata entry a key (u64 length + UTF-8), a value type u32 and the value; each tensor info a name, a
dimension count u32, the dimensions (u64, fastest first), a type u32 and an offset u64 from the start
of the data, which begins at the next multiple of general.alignment (32 unless given).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from layerplan.models.errors import ModelError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value types: id -> (struct format, numpy dtype); 8 string, 9 array
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9
# (for writers: a value type's struct format, and the string and array types)
SCALAR_FORMATS = {kind: fmt for kind, (fmt, _) in _SCALARS.items()}
STRING_TYPE, ARRAY_TYPE = _STRING, _ARRAY


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its GGUF name, shape as GGUF lists it (fastest dimension first),
    GGML type id, and where its bytes start in the file (absolute)."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int

    @property
    def values(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        import gguf  # (gguf-py's table of block sizes: numpy only)

        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.type_id)]
        return self.values // block * block_bytes

    @property
    def type_name(self) -> str:
        """The GGML type's name ("Q4_K", "F32", ...)."""
        import gguf

        return gguf.GGMLQuantizationType(self.type_id).name


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_offset: int  # where the tensor data begins
    # each metadata entry's (key, where its bytes start and end in the file): key, type and value
    entry_spans: tuple[tuple[str, int, int], ...] = ()

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """metadata[key], with "{arch}." expanded to the file's architecture."""
        return self.metadata.get(key.replace("{arch}", self.architecture), default)


class _Cursor:
    def __init__(self, data, path: Path) -> None:
        self.data, self.at, self.path = data, 0, path

    def take(self, count: int):
        end = self.at + count
        if end > len(self.data):
            raise ModelError(f"{self.path}: cannot read it as a GGUF model: its header ends early (truncated?)")
        view = self.data[self.at:end]
        self.at = end
        return view

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.unpack("<Q")
        raw = self.take(length)
        return raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else bytes(raw).decode(
            "utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind][0])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item][1])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).copy()
            if item == _STRING:
                return self.strings(count)
            return [self.value(item) for _ in range(count)]
        raise ModelError(f"{self.path}: cannot read it as a GGUF model: unknown value type {kind} at byte {self.at}")

    def strings(self, count: int) -> list[str]:
        """count strings in a row: one slice and decode each, no intermediate arrays."""
        data, at, out = self.data, self.at, []
        size = len(data)
        for _ in range(count):
            if at + 8 > size:
                raise ModelError(f"{self.path}: cannot read it as a GGUF model: its header ends early (truncated?)")
            length = int.from_bytes(data[at:at + 8], "little")
            at += 8
            if at + length > size:
                raise ModelError(f"{self.path}: cannot read it as a GGUF model: its header ends early (truncated?)")
            out.append(str(data[at:at + length], "utf-8", "replace"))
            at += length
        self.at = at
        return out


def read_header(path: str | Path) -> GGUFHeader:
    """The file's metadata and tensor table; one line naming the file where it is not a GGUF."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            if file.read(4) != MAGIC:
                raise ModelError(f"{path}: cannot read it as a GGUF model: it does not start with 'GGUF'")
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _parse(data, path)
    except (OSError, ValueError) as error:
        if isinstance(error, ModelError):
            raise
        raise ModelError(f"{path}: cannot read it as a GGUF model: {error}") from None


def _parse(data, path: Path) -> GGUFHeader:
    cursor = _Cursor(data, path)
    cursor.take(4)
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise ModelError(f"{path}: cannot read it as a GGUF model: GGUF version {version} (2 and 3 are read)")
    tensor_count, metadata_count = cursor.unpack("<Q"), cursor.unpack("<Q")
    metadata: dict[str, Any] = {}
    spans = []
    for _ in range(metadata_count):
        start = cursor.at
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
        spans.append((key, start, cursor.at))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = cursor.unpack("<I")
        shape = tuple(int(cursor.unpack("<Q")) for _ in range(dims))
        infos.append((name, shape, cursor.unpack("<I"), cursor.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.at // alignment) * alignment
    tensors = tuple(TensorInfo(name, shape, kind, start + offset) for name, shape, kind, offset in infos)
    return GGUFHeader(path, version, metadata, tensors, start, tuple(spans))
