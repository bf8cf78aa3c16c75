"""A GGUF's stored rows into the kernels' packed panels (lp_pack), without torch: what both front
ends' packed matrices (engine/native.py PackedMatrix, layerplan/lite/) are filled with, and which
stored matrices they stack into one (the key of their kept panels, engine/panel_cache.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from layerplan.engine.kernel_library import ABI, check, library
from layerplan.models.gguf_index import StoredTensor

# rows read and packed at a time where a matrix is packed in parts: the transient copy of the
# file's rows stays this small beside the packed matrix (a 152k-token LM head is ~200 MB)
PACK_ROWS = 4096


def stack_format(weights: Sequence[StoredTensor]) -> int | None:
    """The kernels' format (LP_FORMAT_) of a stack of stored matrices: their GGUF type where all
    share one the kernels hold, else None (the stack is dequantized to fp32)."""
    kinds = {w.type_name for w in weights}
    return getattr(ABI, f"LP_FORMAT_{kinds.pop()}", None) if len(kinds) == 1 else None


def v_apart(formats: Sequence[str]) -> bool:
    """Whether an attention's v projection is packed apart from q and k (formats: of q, k, v): where
    its weight format differs (Q4_K_M's Q6_K attn_v)."""
    return len(formats) == 3 and len(set(formats)) > 1


def pack_stored(weights: Sequence[StoredTensor], format_code: int, k: int, out: int,
                part_rows: int = PACK_ROWS) -> None:
    """The stack's stored rows packed in `format_code` into the memory at address `out`
    (lp_packed_bytes of the stack): in parts of whole panels where every matrix's rows are, each
    part read from the file and packed at its panels' place; else the stack at once."""
    panel_bytes = library().lp_packed_bytes(format_code, ABI.LP_PANEL, k)
    if any(w.rows % ABI.LP_PANEL for w in weights[:-1]):  # a stack whose parts share panels
        rows = np.empty((sum(w.rows for w in weights), weights[0].row_bytes), np.uint8)
        at = 0
        for weight in weights:
            weight.read_rows(rows[at:at + weight.rows])
            at += weight.rows
        parts: Iterator[tuple[int, np.ndarray]] = iter([(0, rows)])
    else:
        parts = _row_parts(weights, part_rows)
    for first, rows in parts:
        check(library().lp_pack(rows.ctypes.data, format_code, rows.shape[0], k,
                                out + first // ABI.LP_PANEL * panel_bytes), "packing a stored matrix")


def _row_parts(weights: Sequence[StoredTensor], part_rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first row in the stack, its rows) for parts of at most part_rows rows (whole panels)."""
    at = 0
    for weight in weights:
        if weight.row_order is not None or weight.rows <= part_rows:
            yield at, weight.read_rows()
        else:
            for first in range(0, weight.rows, part_rows):
                yield at + first, weight.read_rows(first=first, count=min(part_rows, weight.rows - first))
        at += weight.rows
