"""Executors: who carries out a loaded model's sub-layers. The runner (runner.py) owns the one loop
over a plan's steps; for each step it hands the attention and the MLP to an executor:

- `ModuleExecutor`: the model's own modules, called as transformers calls them (the reference).
- `PlacedExecutor`: the same modules, where a device map (models/placement.py) spread the layers:
  the residual stream goes to each step's layer, and a layer on disk is brought in for its step.
- `NativeExecutor`: the native kernels (native.py) for the sub-layers they reproduce and the
  modules for the rest; a run of steps, or a whole pass, as one native call where every part of it
  has kernels.

One is chosen at load (engine/load.py) and kept on the model (`LoadedModel.executor`); a model
that was given none runs its modules (`executor_of`). The steps of an attached model (a merge's
'b:' layers) run on that model's executor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from layerplan.engine.cache import KVCache
from layerplan.engine.file_kernels import FileKernels
from layerplan.engine.native import NativeEngine
from layerplan.engine.passes import Pass, positions, rope_by_table, rope_key, softcap, tree_mask
from layerplan.engine.tree import TreeShape
from layerplan.plan.plan import LayerPlan, Step


class Executor(Protocol):
    """What the runner asks of an executor. hidden is the residual stream (B, T, hidden)."""

    # the native kernels' view of the model (None: an executor of modules)
    native: NativeEngine | None

    def for_pass(self, batch: int, rows: int) -> Executor:
        """The executor of a pass of `batch` sequences of `rows` tokens (itself, or one that runs
        the modules where its kernels do not take such a pass)."""

    def for_other(self, other) -> Executor:
        """The executor, within a pass of this one, of the steps of an attached model."""

    @property
    def modules(self) -> Executor:
        """The model's executor of modules (the one its kernels fall back to)."""

    def rope_by_table(self) -> bool:
        """Whether the pass's rotary tables are built as the native kernels take them."""

    def embed(self, model, input_ids: torch.Tensor, start_pos: int, tree: TreeShape | None) -> torch.Tensor: ...

    def head(self, parts, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (before soft-capping) of a residual stream."""

    def whole_pass(self, model, input_ids: torch.Tensor, plan: LayerPlan, cache: KVCache | None, start_pos: int,
                   last_only: bool, tree: TreeShape | None) -> torch.Tensor | None:
        """A whole forward (embedding, steps, head) in one call, or None to run it step by step."""

    def run_steps(self, state: Pass, plan: LayerPlan, first: int, end: int,
                  hidden: torch.Tensor) -> torch.Tensor | None:
        """Steps [first, end) in one call, or None to run them one by one."""

    def batch_pass(self, model, sequences: list[tuple[torch.Tensor, KVCache, int]], plans: list[LayerPlan],
                   wanted: list[int]) -> list[torch.Tensor] | None:
        """Several sequences' whole passes in one call (the logits of each one's last wanted[s]
        rows), each under its own plan (plans[s]), or None to run each on its own."""

    def enter(self, step: Step, hidden: torch.Tensor) -> torch.Tensor:
        """The stream where the step's layer runs (its weights in place for the step)."""

    def leave(self, step: Step) -> None: ...

    def attention(self, state: Pass, index: int, step: Step, layer, hidden: torch.Tensor) -> torch.Tensor:
        """The stream after step `index`'s attention sub-layer and its residual add."""

    def mlp(self, state: Pass, step: Step, layer, hidden: torch.Tensor, block_input: torch.Tensor) -> torch.Tensor:
        """The stream after the step's MLP sub-layer and its residual add (a parallel block's
        MLP reads block_input, the layer's input)."""


class ModuleExecutor:
    """Every sub-layer by the model's own modules."""

    native = None

    def for_pass(self, batch: int, rows: int) -> Executor:
        return self

    def for_other(self, other) -> Executor:
        return executor_of(other).modules

    @property
    def modules(self) -> Executor:
        """This model's executor of modules (the one its kernels fall back to)."""
        return self

    def rope_by_table(self) -> bool:
        return False

    def embed(self, model, input_ids: torch.Tensor, start_pos: int, tree: TreeShape | None) -> torch.Tensor:
        parts = model.parts
        ids = input_ids.to(model.device)  # ids made on the CPU go where the model is
        hidden = parts.embed(ids)  # (B, T, hidden)
        if parts.position_embed is not None:
            hidden = hidden + parts.position_embed(positions(start_pos, ids.shape[1], tree, ids.device))[None]
        return hidden

    def head(self, parts, hidden: torch.Tensor) -> torch.Tensor:
        return parts.lm_head(parts.final_norm(hidden))

    def whole_pass(self, model, input_ids, plan, cache, start_pos, last_only, tree) -> torch.Tensor | None:
        return None

    def run_steps(self, state, plan, first, end, hidden) -> torch.Tensor | None:
        return None

    def batch_pass(self, model, sequences, plans, wanted) -> list[torch.Tensor] | None:
        return None

    def enter(self, step: Step, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def leave(self, step: Step) -> None:
        pass

    def attention(self, state: Pass, index: int, step: Step, layer, hidden: torch.Tensor) -> torch.Tensor:
        kwargs = {"position_embeddings": state.rope(layer)} if state.parts.rotary is not None else {}
        mask = state.mask(layer)
        if hidden.device != state.device:  # a layer placed on another device than the pass began on
            mask = None if mask is None else mask.to(hidden.device)
            kwargs = {key: tuple(t.to(hidden.device) for t in value) for key, value in kwargs.items()}
        kwargs[layer.cache_argument] = state.cache.views[index] if state.cache is not None else None
        if layer.takes_positions:
            kwargs["position_ids"] = state.positions.to(hidden.device)
        if layer.takes_alibi:
            kwargs["alibi"] = None
        update = layer.attention(layer.attention_norm(hidden), attention_mask=mask, **kwargs)[0]
        if layer.attention_post_norm is not None:
            update = layer.attention_post_norm(update)
        return hidden + update if step.scale == 1.0 else hidden + step.scale * update

    def mlp(self, state: Pass, step: Step, layer, hidden: torch.Tensor, block_input: torch.Tensor) -> torch.Tensor:
        update = layer.mlp(layer.mlp_norm(block_input if layer.parallel else hidden))
        if layer.mlp_post_norm is not None:
            update = layer.mlp_post_norm(update)
        return hidden + update if step.scale == 1.0 else hidden + step.scale * update


MODULES = ModuleExecutor()


class PlacedExecutor(ModuleExecutor):
    """The modules of a model a device map spread (models/placement.py): embeddings and head on
    the map's main device, each step on its layer's device, a disk layer's weights brought in for
    its step and dropped after."""

    def __init__(self, placement) -> None:
        self.placement = placement

    def embed(self, model, input_ids: torch.Tensor, start_pos: int, tree: TreeShape | None) -> torch.Tensor:
        return super().embed(model, input_ids.to(self.placement.main), start_pos, tree)

    def head(self, parts, hidden: torch.Tensor) -> torch.Tensor:
        return super().head(parts, hidden.to(self.placement.main))

    def enter(self, step: Step, hidden: torch.Tensor) -> torch.Tensor:
        self.placement.bring(step.layer)
        return hidden.to(self.placement.device_of(step.layer))

    def leave(self, step: Step) -> None:
        self.placement.release(step.layer)


class StoredExecutor(ModuleExecutor):
    """The modules of a model run as stored (models/stored.py), whose matrices live in the GGUF's
    blocks: each step's layer gets its dequantized weights for the step and drops them after, and
    the head runs by the native kernels where there are any (else it is dequantized for the call).
    The reference the kernels are checked against, one layer at a time, never the whole model."""

    def __init__(self, model) -> None:
        self.model = model

    def enter(self, step: Step, hidden: torch.Tensor) -> torch.Tensor:
        layer = self.model.layers_of(step.model)[step.layer]
        for module in (layer.attention, layer.mlp):
            self.model.stored.materialize(module)
        return hidden

    def leave(self, step: Step) -> None:
        layer = self.model.layers_of(step.model)[step.layer]
        for module in (layer.attention, layer.mlp):
            self.model.stored.release(module)

    def head(self, parts, hidden: torch.Tensor) -> torch.Tensor:
        native = getattr(self.model.executor, "native", None)
        if native is not None:
            return native.head(parts.final_norm, parts.lm_head, hidden)
        self.model.stored.materialize(parts.lm_head)
        try:
            return super().head(parts, hidden)
        finally:
            self.model.stored.release(parts.lm_head)


class NativeExecutor(ModuleExecutor):
    """The native kernels of a model on the CPU: every single-sequence pass they take (up to
    NativeEngine.max_rows tokens) runs the sub-layers they reproduce by kernel, the others by their
    modules; other passes run on the modules alone. The LM head runs by kernel wherever the kernels
    take its rows (NativeEngine.head)."""

    def __init__(self, native: NativeEngine, modules: Executor = MODULES) -> None:
        self.native = native
        self._modules = modules

    def for_pass(self, batch: int, rows: int) -> Executor:
        return self if batch == 1 and self.native.takes(rows) else self._modules

    def for_other(self, other) -> Executor:
        executor = executor_of(other)
        return executor if isinstance(executor, NativeExecutor) else executor.modules

    @property
    def modules(self) -> Executor:
        return self._modules

    def rope_by_table(self) -> bool:
        return True

    def head(self, parts, hidden: torch.Tensor) -> torch.Tensor:
        return self.native.head(parts.final_norm, parts.lm_head, hidden)

    def whole_pass(self, model, input_ids, plan, cache, start_pos, last_only, tree) -> torch.Tensor | None:
        """The pass as one native call (embedding, the plan's steps, final norm, LM head) where
        each of them has kernels: the same kernels as run_steps and the native head, so the same
        logits bit for bit, without the Python between them."""
        native, parts = self.native, model.parts
        length = input_ids.shape[1]
        if cache is None or input_ids.shape[0] != 1 or not native.takes(length):
            return None
        ends = native.pass_ends(parts, 1 if last_only else length)
        if ends is None:
            return None
        run = native.step_run(plan, 0, len(plan.active_steps), rope_key(parts))
        if run is None:
            return None
        mask = tree_mask(model, plan, tree, length, 0, len(plan.active_steps))
        tree_positions = positions(start_pos, length, tree, input_ids.device)[None] if tree is not None else None
        ropes = [rope_by_table(parts, ends.embedding, start_pos, length, tree_positions, layer)
                 for layer in run.rope_layers]
        cache.write_pos = start_pos
        logits = run.logits(ends, input_ids, cache, start_pos, ropes, cache.read_window, mask, last_only)
        return softcap(parts, logits)

    def batch_pass(self, model, sequences: list[tuple[torch.Tensor, KVCache, int]], plans: list[LayerPlan],
                   wanted: list[int]) -> list[torch.Tensor] | None:
        """Several sequences' passes (token ids (1, T_s), own cache, start) as one native call, the
        products shared (continuous batching); each one's logits (wanted[s], vocab: its last rows)
        are those of its pass alone. plans[s]: sequence s's; where they differ, the steps they
        begin with alike run once over every row, then each plan's other steps over its
        sequences' rows (a row's numbers do not depend on the others in its pass, so each is its
        plan's alone). None where a part has no kernels (then each runs its own)."""
        native, parts = self.native, model.parts
        rows = sum(ids.shape[1] for ids, _, _ in sequences)
        if not native.takes(rows) or any(cache.read_window is not None for _, cache, _ in sequences):
            return None
        ends = native.pass_ends(parts, rows)
        if ends is None:
            return None
        if all(plan == plans[0] for plan in plans):
            plan = plans[0]
            run = native.step_run(plan, 0, len(plan.active_steps), rope_key(parts))
            if run is None:
                return None
            return [softcap(parts, logits)
                    for logits in run.batch_logits(ends, sequences, self._ropes(parts, ends, run, sequences), wanted)]
        return self._plans_pass(model, ends, sequences, plans, wanted)

    def _plans_pass(self, model, ends, sequences, plans: list[LayerPlan], wanted: list[int]) -> list[torch.Tensor] | None:
        """batch_pass for sequences of several plans: the shared first steps in one call over every
        row, then a call per plan from there on its rows of the stream, then one call of no steps
        for the LM head over every wanted row (the head is read once, not once a plan)."""
        native, parts = self.native, model.parts
        shared = _shared_steps(plans)
        groups: dict[LayerPlan, list[int]] = {}
        for s, plan in enumerate(plans):
            groups.setdefault(plan, []).append(s)
        runs = {plan: native.step_run(plan, shared, len(plan.active_steps), rope_key(parts)) for plan in groups}
        first = native.step_run(plans[0], 0, shared, rope_key(parts))
        last = native.step_run(plans[0], shared, shared, rope_key(parts))  # no steps: the head alone
        if first is None or any(run is None for run in runs.values()):
            return None
        nothing = [0] * len(sequences)
        _, hidden = first.batch_logits_and_stream(ends, sequences, self._ropes(parts, ends, first, sequences), nothing)
        starts = torch.tensor([0] + [ids.shape[1] for ids, _, _ in sequences]).cumsum(0).tolist()
        for plan, members in groups.items():
            rows = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in members])
            group = [sequences[s] for s in members]
            _, after = runs[plan].batch_hidden(ends, hidden.index_select(0, rows), group,
                                               self._ropes(parts, ends, runs[plan], group), [0] * len(members))
            hidden.index_copy_(0, rows, after)
        # each sequence's wanted rows (its last), in order, as sequences of those rows alone
        picked = torch.cat([torch.arange(starts[s + 1] - wanted[s], starts[s + 1]) for s in range(len(sequences))])
        heads = [(ids[:, ids.shape[1] - n:], cache, start + ids.shape[1] - n)
                 for (ids, cache, start), n in zip(sequences, wanted)]
        logits, _ = last.batch_hidden(ends, hidden.index_select(0, picked), heads, [], wanted)
        return [softcap(parts, rows_logits) for rows_logits in logits]

    @staticmethod
    def _ropes(parts, ends, run, sequences) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each rope table of the run's layers, the rows of every sequence in order."""
        ropes = []
        for layer in run.rope_layers:
            tables = [rope_by_table(parts, ends.embedding, start, ids.shape[1], None, layer)
                      for ids, _, start in sequences]
            ropes.append((torch.cat([c for c, _ in tables], -2), torch.cat([s for _, s in tables], -2)))
        return ropes

    def run_steps(self, state: Pass, plan: LayerPlan, first: int, end: int,
                  hidden: torch.Tensor) -> torch.Tensor | None:
        """Where every switched-on sub-layer of the steps has kernels, the steps in one native call
        (no Python round trip per sub-layer)."""
        run = self.native.step_run(plan, first, end, rope_key(state.parts))
        if run is None:
            return None
        cache = state.cache
        return run(hidden, cache, state.start_pos, [state.rope(layer) for layer in run.rope_layers],
                   cache.read_window, state.tree_mask)

    def attention(self, state: Pass, index: int, step: Step, layer, hidden: torch.Tensor) -> torch.Tensor:
        fast = self.native.layers[step.layer]
        if fast is None or fast.attention is None:
            return super().attention(state, index, step, layer, hidden)
        keys = values = None
        cache = state.cache
        if cache is not None:
            kernels = fast.attention
            keys, values = cache.reserve(index, state.start_pos + state.length, 1, kernels.kv_heads, kernels.head_dim,
                                         kernels.head_dim, self.native.kv_dtype or hidden.dtype, state.device)
        return fast.run_attention(hidden, keys, values, state.start_pos, state.rope(layer), step.scale,
                                  cache.read_window if cache is not None else None, state.tree_mask,
                                  self.native.kv_dtype)

    def mlp(self, state: Pass, step: Step, layer, hidden: torch.Tensor, block_input: torch.Tensor) -> torch.Tensor:
        fast = self.native.layers[step.layer]
        if fast is None or fast.mlp is None or layer.parallel:
            return super().mlp(state, step, layer, hidden, block_input)
        return fast.run_mlp(hidden, step.scale)


def executor_of(model) -> Executor:
    """The executor chosen for the model at load; its modules' where none was."""
    executor = model.executor
    return executor if executor is not None else modules_executor(model)


def modules_executor(model) -> Executor:
    """The executor of the model's own modules: placed by its device map where it has one, a layer
    at a time where its matrices are stored blocks."""
    if getattr(model, "stored", None) is not None:
        return StoredExecutor(model)
    return MODULES if model.placement is None else PlacedExecutor(model.placement)


def use_native(model, on_filled: Callable[[int, int], None] | None = None,
               file_kernels: FileKernels | None = None) -> NativeEngine:
    """Run `model` (a LoadedModel on the CPU, not spread by a device map) on the native kernels
    from now on; returns its kernels. on_filled(done, total): the progress of reading or packing
    its matrices; file_kernels: its GGUF's descriptors, being filled (NativeEngine)."""
    if model.placement is not None:
        raise ValueError("the native engine does not run a model spread by a device map")
    engine = NativeEngine(model, on_filled, file_kernels)
    model.executor = NativeExecutor(engine, modules_executor(model))
    return engine


def use_modules(model) -> None:
    """Run `model` on its own modules from now on (the eager engine)."""
    model.executor = modules_executor(model)


def _shared_steps(plans: list[LayerPlan]) -> int:
    """How many steps the plans begin with alike (the same layer, sub-layers and scale at the
    same index: the same cache slot in each one's cache), within every one's exit."""
    limit = min(len(plan.active_steps) for plan in plans)
    shared = 0
    while shared < limit and all(plan.steps[shared] == plans[0].steps[shared] for plan in plans[1:]):
        shared += 1
    return shared
