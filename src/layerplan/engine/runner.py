"""The one loop that runs a layer plan over a model.

    embeddings -> for each plan step: [norm -> attention -> (post-norm) -> residual add]
                                      [norm -> MLP       -> (post-norm) -> residual add]
               -> final norm -> LM head

Prefill (many tokens), incremental decoding (one token) and verification (a few tokens) are the
same call with a different `start_pos`. Each step's attention and MLP are carried out by the
model's executor (executors.py: its modules, the native kernels, or modules placed by a device
map); the loop, the plan's order, the KV cache slots and the observers are the runner's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from layerplan.engine.cache import KVCache
from layerplan.engine.executors import executor_of
from layerplan.engine.passes import Pass, softcap, tree_mask
from layerplan.engine.tree import TreeShape
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan

__all__ = ["ModelPasses", "Observer", "Resume", "embed", "forward", "forward_batch", "head", "new_cache", "run_hidden",
           "softcap"]

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
    logits = executor_of(model).whole_pass(model, input_ids, plan, cache, start_pos, last_only, tree)
    if logits is not None:
        return logits
    hidden = run_hidden(model, input_ids, plan, cache, start_pos, tree=tree)
    return head(model, hidden[:, -1:] if last_only else hidden)


class ModelPasses:
    """decoding/loop.py's TokenPasses on a loaded model, and rounds.py's VerifyPasses: the
    runner's cache and forward."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model

    def new_cache(self, plan: LayerPlan, capacity: int) -> KVCache:
        return new_cache(plan, capacity)

    def last_logits(self, ids: Sequence[int], plan: LayerPlan, cache: KVCache, start: int) -> torch.Tensor:
        return forward(self.model, self._tokens(ids), plan, cache, start, last_only=True)[0, -1]

    def pass_logits(self, ids: Sequence[int], plan: LayerPlan, cache: KVCache, start: int) -> torch.Tensor:
        return forward(self.model, self._tokens(ids), plan, cache, start)[0]

    def with_room(self, cache: KVCache, end: int) -> KVCache:
        """drafters/model.py's DraftModelPasses: the cache itself (its buffers grow when a pass
        needs more)."""
        return cache

    @torch.inference_mode()
    def draft_logits(self, token: int, position: int, plan: LayerPlan, cache: KVCache,
                     draft_head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """rounds.py's DraftPasses: the logits (vocab,) of one token through a self-draft's plan
        (a draft of the cache's plan, writing the slots of the steps it runs), read by draft_head
        (hidden (1, 1, H) -> logits) or the model's own final norm and LM head."""
        hidden = run_hidden(self.model, self._tokens([token]), plan, cache, position)[:, -1:]
        return (draft_head(hidden) if draft_head is not None else head(self.model, hidden))[0, -1]

    def _tokens(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor([list(ids)], dtype=torch.long, device=self.model.device)


@torch.inference_mode()
def forward_batch(model: LoadedModel, sequences: list[tuple[torch.Tensor, KVCache, int]],
                  plan: LayerPlan | Sequence[LayerPlan] | None = None, last_only: bool = False,
                  wanted: list[int] | None = None) -> list[torch.Tensor]:
    """Logits of several sequences' passes: sequences[s] = (its token ids (1, T_s), its own cache,
    its start position); of each one's last wanted[s] rows (0 to T_s: (wanted[s], vocab)), by
    default all T_s, or 1 with last_only. plan: one for every sequence, or each one's own (a
    sequence's cache holds its own plan's slots). The native engine runs them as one pass whose
    products every sequence shares (continuous batching; of sequences of different plans, the
    steps their plans begin with alike); each sequence's logits are those of its own forward(),
    bit for bit. Elsewhere each runs its own."""
    if plan is None or isinstance(plan, LayerPlan):
        plans = [plan if plan is not None else model.plan()] * len(sequences)
    else:
        plans = list(plan)
        if len(plans) != len(sequences):
            raise ValueError(f"{len(plans)} plans for {len(sequences)} sequences")
    if wanted is None:
        wanted = [1 if last_only else ids.shape[1] for ids, _, _ in sequences]
    logits = executor_of(model).batch_pass(model, sequences, plans, wanted) if len(sequences) > 1 else None
    if logits is not None:
        return logits
    every = []
    for (ids, cache, start), rows, own in zip(sequences, wanted, plans):
        logits = forward(model, ids, own, cache, start, last_only=rows <= 1)[0]  # the head on the last row alone
        every.append(logits[logits.shape[0] - rows:])  # where no more is wanted; 0 rows: none
    return every


@torch.inference_mode()
def embed(model: LoadedModel, input_ids: torch.Tensor, start_pos: int = 0,
          tree: TreeShape | None = None) -> torch.Tensor:
    return executor_of(model).embed(model, input_ids, start_pos, tree)


@torch.inference_mode()
def head(model: LoadedModel, hidden: torch.Tensor) -> torch.Tensor:
    """Final norm and LM head (and Gemma's logit soft-capping) on a residual stream."""
    return softcap(model.parts, executor_of(model).head(model.parts, hidden))


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
    executor = executor_of(model)
    if resume is not None:
        hidden, first_step, first_sub = resume.hidden, resume.step, resume.sub_layer
    else:
        hidden, first_step, first_sub = executor.embed(model, input_ids, start_pos, tree), 0, "attention"
    length = hidden.shape[1]
    end_step = len(plan.active_steps) if stop_step is None else min(stop_step, len(plan.active_steps))
    executor = executor.for_pass(hidden.shape[0], length)
    state = Pass(model, hidden, start_pos, cache, tree, tree_mask(model, plan, tree, length, first_step, end_step),
                 executor.rope_by_table())
    # observers and resumed runs see every sub-layer: only a plain run may go as one call
    if cache is not None and observe is None and resume is None:
        done = executor.run_steps(state, plan, first_step, end_step, hidden)
        if done is not None:
            return done

    streams = cache is not None and cache.keeps_streams_of(plan) and hidden.shape[0] == 1
    for index in range(first_step, end_step):
        step = plan.steps[index]
        layer = model.layers_of(step.model)[step.layer]
        if streams and index in cache.stream_steps and not (index == first_step and first_sub == "mlp"):
            cache.keep_stream(index, start_pos, hidden)
        # an attached model's layers (a merge's 'b:') run on that model's executor
        runs = executor if not step.model else executor.for_other(model.others[step.model])
        hidden = runs.enter(step, hidden)
        resumes_at_mlp = index == first_step and first_sub == "mlp"
        if layer.parallel and resumes_at_mlp and step.mlp:
            raise ValueError("a parallel block's MLP reads the layer's input: resume it at its attention")
        block_input = hidden  # a parallel block's (Cohere, Falcon) MLP reads this, not the attention's output
        if observe is not None and not resumes_at_mlp:
            observe(index, "attention", hidden)
        if step.attention and not resumes_at_mlp:
            hidden = runs.attention(state, index, step, layer, hidden)
        if observe is not None:
            observe(index, "mlp", hidden)
        if step.mlp:
            hidden = runs.mlp(state, step, layer, hidden, block_input)
        runs.leave(step)
    return hidden
