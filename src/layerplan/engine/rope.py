"""Rotary embeddings by table, for the native engine: rope_tables.py's rows of the model's own
frequencies (a module that does not expose them: the module itself, run once for each position),
then sliced for every pass after.

Why: calling the module costs a pass a dozen small PyTorch operations, whose code and data are cold
after the layers (a few percent of a small model's step). Every value of a row is a function of its
own position alone (a product of the position and a frequency, its cosine or sine, a scaling, a
cast), so a position gets the same values in every pass and every process. The module called on
many positions does not promise that (its product of frequencies by positions is a matrix product,
which the BLAS library split between two threads in some processes and not in others: values one
rounding apart, and a greedy decode that changed from one run to the next); called on one position
a call it does, and that is how a module without exposed frequencies fills its table. The table
grows in blocks of 64 positions. Only RoPE types whose frequencies never change take a table; the
others (dynamic NTK, LongRoPE: frequencies that depend on the longest position seen) call the
module. The eager engine calls the module as transformers does.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import torch
from torch import nn

from layerplan.engine.rope_tables import rope_rows
from layerplan.models.arch_table import STATIC_ROPE_TYPES

_BLOCK = 64  # positions the table grows by (at least)

# rotary module -> {(layer type, dtype, device): (cos, sin) over positions 0..N-1}
_tables: WeakKeyDictionary[nn.Module, dict[tuple, tuple[torch.Tensor, torch.Tensor]]] = WeakKeyDictionary()


def _call(rotary: nn.Module, like: torch.Tensor, positions: torch.Tensor, layer_type: str | None):
    return rotary(like, positions) if layer_type is None else rotary(like, positions, layer_type)


def takes_table(rotary: nn.Module, layer_type: str | None) -> bool:
    """Whether the module's frequencies are fixed, so a table of it is exact."""
    rope_type = getattr(rotary, "rope_type", None)
    if isinstance(rope_type, dict):
        rope_type = rope_type.get(layer_type)
    return rope_type in STATIC_ROPE_TYPES


# rotary module -> {layer type: its frequencies and scaling, or None where rope_tables.py's rows
# are not its values (a layout of its own: Cohere interleaves the halves)}
_frequencies: WeakKeyDictionary[nn.Module, dict] = WeakKeyDictionary()
_CHECKED_POSITIONS = (1, 37, 1001)


def _own_frequencies(rotary: nn.Module, layer_type: str | None) -> tuple | None:
    """(inv_freq as numpy float32, attention_scaling) where the module exposes them and
    rope_tables.py's rows of them are the module's own values (a position a call, within a
    rounding: checked once); else None, and the table is the module's output itself."""
    known = _frequencies.setdefault(rotary, {})
    if layer_type not in known:
        prefix = f"{layer_type}_" if layer_type is not None else ""  # Gemma 3: frequencies by layer type
        inv_freq = getattr(rotary, f"{prefix}inv_freq", None)
        scaling = getattr(rotary, f"{prefix}attention_scaling", None)
        found = None
        if isinstance(inv_freq, torch.Tensor) and isinstance(scaling, (int, float)):
            found = (inv_freq.float().cpu().numpy(), float(scaling))
            like = torch.zeros(1, dtype=torch.float32, device=inv_freq.device)
            for position in _CHECKED_POSITIONS:
                want = _call(rotary, like, torch.tensor([[position]], device=inv_freq.device), layer_type)
                got = rope_rows(*found, position, position + 1)
                if any(w.shape[-1] != g.shape[-1] or not torch.allclose(w[0].float().cpu(), torch.from_numpy(g),
                                                                         rtol=1e-5, atol=1e-6)
                       for w, g in zip(want, got)):
                    found = None
                    break
        known[layer_type] = found
    return known[layer_type]


def _table(rotary: nn.Module, like: torch.Tensor, end: int, layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, sin) table of a static-frequency module over positions 0..end-1 at least."""
    tables = _tables.setdefault(rotary, {})
    key = (layer_type, like.dtype, like.device)
    table = tables.get(key)
    have = table[0].shape[0] if table is not None else 0
    if have < end:
        size = max(end, 2 * have, 4 * _BLOCK)
        size = -(-size // _BLOCK) * _BLOCK
        frequencies = _own_frequencies(rotary, layer_type)
        if frequencies is not None:  # rope_tables.py's rows: the light front end's too
            new = [torch.from_numpy(t).to(like.dtype).to(like.device) for t in rope_rows(*frequencies, have, size)]
        else:
            rows = [_call(rotary, like, torch.tensor([[position]], device=like.device), layer_type)
                    for position in range(have, size)]
            new = [torch.cat([c[0] for c, _ in rows]), torch.cat([s[0] for _, s in rows])]
        cos = torch.cat(([table[0]] if table is not None else []) + [new[0]])
        sin = torch.cat(([table[1]] if table is not None else []) + [new[1]])
        table = tables[key] = (cos, sin)
    return table


@torch.inference_mode()
def rotary_embedding(rotary: nn.Module, like: torch.Tensor, positions: torch.Tensor,
                     layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of any `positions` (1, T), as rotary(like, positions[, layer_type]) returns them:
    a token tree's positions by depth (a chain takes chain_rotary_embedding, which needs no tensor
    of its positions)."""
    if not takes_table(rotary, layer_type):
        return _call(rotary, like, positions, layer_type)
    table = _table(rotary, like, int(positions.max()) + 1, layer_type)
    return table[0][positions], table[1][positions]


@torch.inference_mode()
def chain_rotary_embedding(rotary: nn.Module, like: torch.Tensor, start: int, length: int,
                           layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding of the positions start..start+length-1, which a table serves without a
    tensor of them (a decoding step's Python runs cold after the layers: every PyTorch call it
    leaves out counts)."""
    if not takes_table(rotary, layer_type):
        return _call(rotary, like, torch.arange(start, start + length, device=like.device)[None], layer_type)
    cos, sin = _table(rotary, like, start + length, layer_type)
    return cos[None, start:start + length], sin[None, start:start + length]
