"""The rotary tables both front ends give the native kernels: one definition, without torch.

A row is transformers' rotary module's for one position — angles = position x inv_freq in float32
(one rounding a product), each half of the head twice, cos and sin times attention_scaling in
float32 — except that the cosine and sine are computed in float64 and rounded once to float32:
the correctly rounded value but for double-rounding ties, where torch's float32 kernels are a unit
in the last place off in about one entry in twenty. So a table is the same numbers in every
process whichever vector unit runs it, and the torch front end (engine/rope.py) and the light one
(layerplan/lite/) give the kernels the same bits.
"""

from __future__ import annotations

import numpy as np


def rope_rows(inv_freq: np.ndarray, attention_scaling: float, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), float32 (end - start, 2 * len(inv_freq)), of positions start..end-1."""
    positions = np.arange(start, end, dtype=np.float32)[:, None]
    angles = positions * np.asarray(inv_freq, np.float32)[None, :]
    angles = np.concatenate([angles, angles], axis=1).astype(np.float64)
    scale = np.float32(attention_scaling)
    return np.cos(angles).astype(np.float32) * scale, np.sin(angles).astype(np.float32) * scale
