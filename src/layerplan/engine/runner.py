"""The one loop that runs a layer plan over a model's own modules.

    embeddings -> for each plan step: [norm -> attention -> (post-norm) -> residual add]
                                      [norm -> MLP       -> (post-norm) -> residual add]
               -> final norm -> LM head

Prefill (many tokens), incremental decoding (one token) and verification (a few tokens) are the
same call with a different `start_pos`. Attention modules are called as transformers calls them,
with our RoPE, our mask and a per-step view of our KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from layerplan.engine.cache import KVCache
from layerplan.engine.rope import chain_rotary_embedding, rotary_embedding
from layerplan.engine.tree import TreeShape
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan

# observe(step_index, sub_layer, hidden) is called before each sub-layer ("attention" / "mlp")
Observer = Callable[[int, str, torch.Tensor], None]


@dataclass(frozen=True)
class Resume:
    """Start a run mid-plan from a residual stream captured before `sub_layer` of step `step`."""

    hidden: torch.Tensor  # (B, T, hidden)
    step: int
    sub_layer: str = "attention"  # "attention" or "mlp"


def new_cache(plan: LayerPlan, capacity: int = 256) -> KVCache:
    return KVCache(len(plan.steps), capacity)


@torch.inference_mode()
def forward(
    model: LoadedModel,
    input_ids: torch.Tensor,
    plan: LayerPlan | None = None,
    cache: KVCache | None = None,
    start_pos: int = 0,
    last_only: bool = False,
    tree: TreeShape | None = None,
) -> torch.Tensor:
    """Logits (B, T, vocab) — or (B, 1, vocab) with last_only — for tokens at positions
    [start_pos, start_pos+T). With a cache, earlier positions come from it and the new ones are
    written to it. tree: the T tokens are the nodes of a token tree (engine/tree.py), not a chain."""
    plan = plan if plan is not None else model.plan()
    logits = _one_native_call(model, input_ids, plan, cache, start_pos, last_only, tree)
    if logits is not None:
        return logits
    hidden = run_hidden(model, input_ids, plan, cache, start_pos, tree=tree)
    return head(model, hidden[:, -1:] if last_only else hidden)


def _one_native_call(model: LoadedModel, input_ids: torch.Tensor, plan: LayerPlan, cache: KVCache | None,
                     start_pos: int, last_only: bool, tree: TreeShape | None) -> torch.Tensor | None:
    """forward's pass as one native call (embedding, the plan's steps, final norm, LM head) where
    each of them has kernels, else None. The same kernels as run_hidden's one native call and the
    native head, so the same logits bit for bit; without the Python between them, which cost a
    pass about 1 ms (SmolLM2, AVX2 EPYC: its memory cold after the weights went through the caches)."""
    native, parts = model.native, model.parts
    length = input_ids.shape[1]
    if (native is None or cache is None or model.placement is not None or input_ids.shape[0] != 1
            or not native.takes(length)):
        return None
    ends = native.pass_ends(parts, 1 if last_only else length)
    if ends is None:
        return None
    run = native.step_run(plan, 0, len(plan.active_steps), _rope_key(parts))
    if run is None:
        return None
    tree_mask = _tree_mask(model, plan, tree, length, 0, len(plan.active_steps))
    tree_positions = _positions(start_pos, length, tree, input_ids.device)[None] if tree is not None else None
    ropes = [_rope_by_table(parts, ends.embedding, start_pos, length, tree_positions, layer) for layer in run.rope_layers]
    cache.write_pos = start_pos
    logits = run.logits(ends, input_ids, cache, start_pos, ropes, cache.read_window, tree_mask, last_only)
    return softcap(parts, logits)


def _rope_key(parts) -> Callable:
    """layer -> the name of its rotary table ("" where every layer shares one)."""
    return (lambda layer: layer.layer_type) if parts.rope_per_layer_type else (lambda layer: "")


def _rope_by_table(parts, like: torch.Tensor, start_pos: int, length: int, tree_positions: torch.Tensor | None,
                   layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's (cos, sin) for the native engine (engine/rope.py): for a chain of `length`
    positions from start_pos (tree_positions None: no tensor of them is built, see
    chain_rotary_embedding), or for a token tree's positions by depth (1, T). The eager engine calls
    the rotary module as transformers does."""
    layer_type = layer.layer_type if parts.rope_per_layer_type else None
    if tree_positions is None:
        return chain_rotary_embedding(parts.rotary, like, start_pos, length, layer_type)
    return rotary_embedding(parts.rotary, like, tree_positions, layer_type)


@torch.inference_mode()
def embed(model: LoadedModel, input_ids: torch.Tensor, start_pos: int = 0,
          tree: TreeShape | None = None) -> torch.Tensor:
    parts = model.parts
    if model.placement is not None:  # a model spread by a device map embeds on its main device
        input_ids = input_ids.to(model.placement.main)
    hidden = parts.embed(input_ids)  # (B, T, hidden)
    if parts.position_embed is not None:
        hidden = hidden + parts.position_embed(_positions(start_pos, input_ids.shape[1], tree, input_ids.device))[None]
    return hidden


@torch.inference_mode()
def head(model: LoadedModel, hidden: torch.Tensor) -> torch.Tensor:
    """Final norm and LM head (and Gemma's logit soft-capping) on a residual stream."""
    parts = model.parts
    if model.placement is not None:
        hidden = hidden.to(model.placement.main)
    if model.native is not None:
        logits = model.native.head(parts.final_norm, parts.lm_head, hidden)
    else:
        logits = parts.lm_head(parts.final_norm(hidden))
    return softcap(parts, logits)


def softcap(parts, logits: torch.Tensor) -> torch.Tensor:
    """Gemma's final logit soft-capping (identity for models without it)."""
    if parts.final_logit_softcapping is None:
        return logits
    cap = parts.final_logit_softcapping
    return torch.tanh(logits / cap) * cap


@torch.inference_mode()
def run_hidden(
    model: LoadedModel,
    input_ids: torch.Tensor | None,
    plan: LayerPlan | None = None,
    cache: KVCache | None = None,
    start_pos: int = 0,
    resume: Resume | None = None,
    observe: Observer | None = None,
    stop_step: int | None = None,
    tree: TreeShape | None = None,
) -> torch.Tensor:
    """The residual stream after the plan's active steps (before the final norm).

    resume: start from a captured residual stream instead of the embeddings (input_ids unused).
    stop_step: run steps [.., stop_step) only (an exit that does not change the plan object).
    tree: the tokens are the nodes of a token tree: each at start_pos + its depth, attending to the
    cached prefix and its ancestors (their keys and values are written at start_pos + node index).
    """
    plan = plan if plan is not None else model.plan()
    parts = model.parts
    if resume is not None:
        hidden, first_step, first_sub = resume.hidden, resume.step, resume.sub_layer
    else:
        hidden, first_step, first_sub = embed(model, input_ids, start_pos, tree), 0, "attention"
    length = hidden.shape[1]
    device = hidden.device
    positions = _positions(start_pos, length, tree, device)[None]  # (1, T)
    end_step = len(plan.active_steps) if stop_step is None else min(stop_step, len(plan.active_steps))
    tree_mask = _tree_mask(model, plan, tree, length, first_step, end_step)

    windowed_read = cache is not None and cache.read_window is not None and length == 1
    if cache is not None:
        cache.write_pos = start_pos
        kv_start = 0
    else:
        kv_start = start_pos  # without a cache, keys are this chunk's tokens only
    kv_length = start_pos + length - kv_start
    eager = getattr(model.hf.config, "_attn_implementation", "sdpa") == "eager"

    rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    masks: dict[int | None, torch.Tensor | None] = {}

    def rope_of(layer) -> tuple[torch.Tensor, torch.Tensor]:
        key = layer.layer_type if parts.rope_per_layer_type else ""
        if key not in rope:
            if native is not None:
                rope[key] = _rope_by_table(parts, hidden, start_pos, length, positions if tree is not None else None, layer)
            else:
                rope[key] = parts.rotary(hidden, positions, key) if parts.rope_per_layer_type else parts.rotary(hidden, positions)
        return rope[key]

    # the native engine runs the sub-layers it reproduces (engine/native.py) on single-sequence
    # passes; everything else, and every pass of an eager model, calls the modules themselves
    native = model.native if hidden.shape[0] == 1 and model.native is not None and model.placement is None else None
    if native is not None and not native.takes(length):
        native = None
    # where every switched-on sub-layer of the steps has kernels, the same loop runs in one native
    # call (no Python round trip per sub-layer); observers and resumed runs take the loop below
    if native is not None and cache is not None and observe is None and resume is None:
        run = native.step_run(plan, first_step, end_step, _rope_key(parts))
        if run is not None:
            return run(hidden, cache, start_pos, [rope_of(layer) for layer in run.rope_layers],
                       cache.read_window, tree_mask)

    for index in range(first_step, end_step):
        step = plan.steps[index]
        layer = model.layers_of(step.model)[step.layer]
        fast = native.layer(step.model, step.layer) if native is not None else None
        placement = model.placement_of(step.model)
        if placement is not None:  # a device map placed the layer: the stream goes there, disk weights come in
            placement.bring(step.layer)
            hidden = hidden.to(placement.device_of(step.layer))
        resumes_at_mlp = index == first_step and first_sub == "mlp"
        if layer.parallel and resumes_at_mlp and step.mlp:
            raise ValueError("a parallel block's MLP reads the layer's input: resume it at its attention")
        block_input = hidden  # a parallel block's (Cohere, Falcon) MLP reads this, not the attention's output
        if observe is not None and not resumes_at_mlp:
            observe(index, "attention", hidden)
        if step.attention and not resumes_at_mlp:
            if fast is not None and fast.attention is not None:
                keys = values = None
                if cache is not None:
                    keys, values = cache.reserve(index, start_pos + length, 1, fast.attention.kv_heads,
                                                 fast.attention.head_dim, fast.attention.head_dim, hidden.dtype, device)
                hidden = fast.run_attention(hidden, keys, values, start_pos, rope_of(layer), step.scale,
                                            cache.read_window if cache is not None else None, tree_mask)
            else:
                window = layer.sliding_window
                if window not in masks:
                    if tree is not None:
                        masks[window] = _tree_attention_mask(tree, start_pos, kv_start, kv_length, eager, hidden.dtype,
                                                             device)
                    else:
                        masks[window] = None if windowed_read else _attention_mask(
                            start_pos, length, kv_start, kv_length, window, eager, hidden.dtype, device)
                kwargs = {"position_embeddings": rope_of(layer)} if parts.rotary is not None else {}
                mask = masks[window]
                if hidden.device != device:  # a layer placed on another device than the pass began on
                    mask = None if mask is None else mask.to(hidden.device)
                    kwargs = {key: tuple(t.to(hidden.device) for t in value) for key, value in kwargs.items()}
                kwargs[layer.cache_argument] = cache.views[index] if cache is not None else None
                if layer.takes_positions:
                    kwargs["position_ids"] = positions.to(hidden.device)
                if layer.takes_alibi:
                    kwargs["alibi"] = None
                update = layer.attention(layer.attention_norm(hidden), attention_mask=mask, **kwargs)[0]
                if layer.attention_post_norm is not None:
                    update = layer.attention_post_norm(update)
                hidden = hidden + update if step.scale == 1.0 else hidden + step.scale * update
        if observe is not None:
            observe(index, "mlp", hidden)
        if step.mlp:
            if fast is not None and fast.mlp is not None and not layer.parallel:
                hidden = fast.run_mlp(hidden, step.scale)
            else:
                update = layer.mlp(layer.mlp_norm(block_input if layer.parallel else hidden))
                if layer.mlp_post_norm is not None:
                    update = layer.mlp_post_norm(update)
                hidden = hidden + update if step.scale == 1.0 else hidden + step.scale * update
        if placement is not None:
            placement.release(step.layer)
    return hidden


def _tree_mask(model: LoadedModel, plan: LayerPlan, tree: TreeShape | None, length: int, first: int,
               end: int) -> torch.Tensor | None:
    """The (T, T) uint8 "attends to" table of a token tree, checked against the steps it runs
    through; None for a chain."""
    if tree is None:
        return None
    _check_tree(model, plan, tree, length, first, end)
    return tree.ancestors.to(torch.uint8).contiguous()


def _check_tree(model: LoadedModel, plan: LayerPlan, tree: TreeShape, length: int, first: int, end: int) -> None:
    if len(tree) != length:
        raise ValueError(f"a token tree of {len(tree)} nodes for a pass over {length} tokens")
    for index in range(first, end):
        step = plan.steps[index]
        layer = model.layers_of(step.model)[step.layer]
        if step.attention and layer.sliding_window:
            raise ValueError(f"token trees need full attention; layer {step.layer} attends to a sliding window "
                             f"of {layer.sliding_window}")


def _tree_attention_mask(tree: TreeShape, start_pos: int, kv_start: int, kv_length: int, eager: bool,
                         dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(1, 1, nodes, kv_length): every cached position, and among the pass's own its ancestors."""
    allowed = torch.ones(len(tree), kv_length, dtype=torch.bool, device=device)
    offset = start_pos - kv_start
    allowed[:, offset: offset + len(tree)] = tree.ancestors.to(device)
    return _as_mask(allowed[None, None], eager, dtype, device)


def _positions(start_pos: int, length: int, tree: TreeShape | None, device: torch.device) -> torch.Tensor:
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


def _attention_mask(
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
