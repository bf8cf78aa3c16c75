"""What the steps of one pass share: the tokens' positions, the attention masks, the rotary tables,
a token tree's "attends to" table and the KV cache's window. The runner (runner.py) makes one
`Pass` per run of steps; executors (executors.py) read it to carry out each sub-layer."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from layerplan.engine.cache import KVCache
from layerplan.engine.rope import chain_rotary_embedding, rotary_embedding
from layerplan.engine.tree import TreeShape


class Pass:
    """One run of a plan's steps over `length` tokens at positions start_pos.. (a chain) or at
    start_pos + depth (a token tree's nodes). With a cache, earlier positions come from it and the
    new keys and values are written at start_pos..; without one, the tokens attend to each other
    only. Masks and rotary tables are built on first use and shared by the steps that need them."""

    def __init__(self, model, like: torch.Tensor, start_pos: int, cache: KVCache | None, tree: TreeShape | None,
                 tree_mask: torch.Tensor | None, rope_by_table: bool) -> None:
        self.model, self.parts = model, model.parts
        self.start_pos, self.length = start_pos, like.shape[1]
        self.cache, self.tree, self.tree_mask = cache, tree, tree_mask
        self.like, self.dtype, self.device = like, like.dtype, like.device
        self.positions = positions(start_pos, self.length, tree, like.device)[None]  # (1, T)
        # rotary tables as the native kernels take them (rope.py), rather than the rotary module's
        self.rope_by_table = rope_by_table
        self.windowed_read = cache is not None and cache.read_window is not None and self.length == 1
        if cache is not None:
            cache.write_pos = start_pos
            self.kv_start = 0
        else:
            self.kv_start = start_pos  # without a cache, keys are this chunk's tokens only
        self.kv_length = start_pos + self.length - self.kv_start
        # eager attention adds its mask to the scores; SDPA takes a boolean one
        self.eager_masks = getattr(model.hf.config, "_attn_implementation", "sdpa") == "eager"
        self._rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._masks: dict[int | None, torch.Tensor | None] = {}

    def rope(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's (cos, sin), one per layer type where the model has one per type."""
        parts = self.parts
        key = layer.layer_type if parts.rope_per_layer_type else ""
        if key not in self._rope:
            if self.rope_by_table:
                tree_positions = self.positions if self.tree is not None else None
                self._rope[key] = rope_by_table(parts, self.like, self.start_pos, self.length, tree_positions, layer)
            elif parts.rope_per_layer_type:
                self._rope[key] = parts.rotary(self.like, self.positions, key)
            else:
                self._rope[key] = parts.rotary(self.like, self.positions)
        return self._rope[key]

    def mask(self, layer) -> torch.Tensor | None:
        """The attention mask of a layer's window as the attention module takes it (None: SDPA's
        own causal default says it)."""
        window = layer.sliding_window
        if window not in self._masks:
            if self.tree is not None:
                self._masks[window] = tree_attention_mask(self.tree, self.start_pos, self.kv_start, self.kv_length,
                                                          self.eager_masks, self.dtype, self.device)
            else:
                self._masks[window] = None if self.windowed_read else attention_mask(
                    self.start_pos, self.length, self.kv_start, self.kv_length, window, self.eager_masks, self.dtype,
                    self.device)
        return self._masks[window]


def rope_key(parts) -> Callable:
    """layer -> the name of its rotary table ("" where every layer shares one)."""
    return (lambda layer: layer.layer_type) if parts.rope_per_layer_type else (lambda layer: "")


def rope_by_table(parts, like: torch.Tensor, start_pos: int, length: int, tree_positions: torch.Tensor | None,
                  layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's (cos, sin) for the native engine (engine/rope.py): for a chain of `length`
    positions from start_pos (tree_positions None: no tensor of them is built, see
    chain_rotary_embedding), or for a token tree's positions by depth (1, T). The module executor
    calls the rotary module as transformers does."""
    layer_type = layer.layer_type if parts.rope_per_layer_type else None
    if tree_positions is None:
        return chain_rotary_embedding(parts.rotary, like, start_pos, length, layer_type)
    return rotary_embedding(parts.rotary, like, tree_positions, layer_type)


def softcap(parts, logits: torch.Tensor) -> torch.Tensor:
    """Gemma's final logit soft-capping (identity for models without it)."""
    if parts.final_logit_softcapping is None:
        return logits
    cap = parts.final_logit_softcapping
    return torch.tanh(logits / cap) * cap


def tree_mask(model, plan, tree: TreeShape | None, length: int, first: int, end: int) -> torch.Tensor | None:
    """The (T, T) uint8 "attends to" table of a token tree, checked against the steps it runs
    through; None for a chain."""
    if tree is None:
        return None
    _check_tree(model, plan, tree, length, first, end)
    return torch.from_numpy(tree.ancestors.astype(np.uint8))


def _check_tree(model, plan, tree: TreeShape, length: int, first: int, end: int) -> None:
    if len(tree) != length:
        raise ValueError(f"a token tree of {len(tree)} nodes for a pass over {length} tokens")
    for index in range(first, end):
        step = plan.steps[index]
        layer = model.layers_of(step.model)[step.layer]
        if step.attention and layer.sliding_window:
            raise ValueError(f"token trees need full attention; layer {step.layer} attends to a sliding window "
                             f"of {layer.sliding_window}")


def tree_attention_mask(tree: TreeShape, start_pos: int, kv_start: int, kv_length: int, eager: bool,
                        dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(1, 1, nodes, kv_length): every cached position, and among the pass's own its ancestors."""
    allowed = torch.ones(len(tree), kv_length, dtype=torch.bool, device=device)
    offset = start_pos - kv_start
    allowed[:, offset: offset + len(tree)] = torch.from_numpy(tree.ancestors).to(device)
    return _as_mask(allowed[None, None], eager, dtype, device)


def positions(start_pos: int, length: int, tree: TreeShape | None, device: torch.device) -> torch.Tensor:
    """(T,) positions of a pass's tokens: consecutive for a chain, by depth for a tree's nodes."""
    if tree is not None:
        return start_pos + torch.tensor(tree.depths, device=device)
    return torch.arange(start_pos, start_pos + length, device=device)


def _as_mask(allowed: torch.Tensor, eager: bool, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (1, 1, q, kv) "may attend" mask as the attention takes it: boolean for SDPA, additive
    floats for eager attention."""
    if not eager:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def attention_mask(
    q_start: int,
    q_length: int,
    kv_start: int,
    kv_length: int,
    window: int | None,
    eager: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """Causal (and sliding-window) mask, shape (1, 1, q_length, kv_length); True = may attend.

    None where SDPA's defaults already say it: a single query sees every key, and a chunk that
    starts at its keys' first position is plainly causal. Eager attention adds the mask to the
    scores, so it gets an additive float mask and never None for several queries."""
    last_query = q_start + q_length - 1
    if window is not None and last_query - window < kv_start:
        window = None  # the window reaches back past the first key: it hides nothing
    if not eager and window is None and (q_length == 1 or (q_start == kv_start and q_length == kv_length)):
        return None
    if eager and q_length == 1 and window is None:
        return None
    q_pos = torch.arange(q_start, q_start + q_length, device=device)[:, None]
    kv_pos = torch.arange(kv_start, kv_start + kv_length, device=device)[None, :]
    allowed = kv_pos <= q_pos
    if window is not None:
        allowed &= kv_pos > q_pos - window
    return _as_mask(allowed[None, None], eager, dtype, device)
