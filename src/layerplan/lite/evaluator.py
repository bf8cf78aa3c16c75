"""Plans scored against a reference plan on the light front end's model (search/reference.py
ResumingEvaluator): a scan's or a search's candidates, each resumed from the reference's residual
stream at its first difference, run by the kernels' sub-layer blocks and LM head, and scored by
numpy; the model's decode costs (measure_lite_costs); explore's grid of layer orders
(explore_lite). No torch.

Each sub-layer runs as the torch front end's native executor runs it in a pass without a KV cache
(engine/native.py run_attention, run_mlp; its head): the same kernel calls on the same float32
rows, the keys and values held in the arithmetic's KV dtype, so both front ends' scans print the
same numbers (tests/test_lite_research.py)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import numpy as np

from layerplan.engine.kernel_library import ABI, check, library
from layerplan.lite.model import LiteModel
from layerplan.plan.plan import LayerPlan
from layerplan.search.explore import ExploreResult, explore_plans
from layerplan.search.journal import RowJournal
from layerplan.search.reference import CostModel, LogitsReference, ResumingEvaluator, SubLayer, measured_costs
from layerplan.search.windows import Divergence

_Kv = ABI.structs["lp_kv"]


def head_logits(model: LiteModel, hidden: np.ndarray) -> np.ndarray:
    """float32 (rows, vocab): the final norm and LM head on hidden states (rows, hidden)."""
    rows = np.ascontiguousarray(hidden, np.float32)
    logits = np.empty((len(rows), model.vocab), np.float32)
    check(library().lp_norm_linear(ctypes.byref(model.final_norm), rows.ctypes.data, ctypes.byref(model.head),
                                   logits.ctypes.data, len(rows), ABI.LP_DTYPE_F32, model.threads),
          "the native LM head")
    return logits


def measure_lite_costs(model: LiteModel, context: int = 128, repeats: int = 12) -> CostModel:
    """search/reference.py measured_costs on the light front end's model: one-token decode steps
    after a context of `context` random tokens (each plan's cache filled by that plan: a step
    reads as many positions whatever wrote them), and embeddings + LM head alone."""
    ids = np.random.default_rng(0).integers(0, model.vocab, context + 1)

    def step(plan: LayerPlan) -> Callable[[], None]:
        cache = model.new_cache(plan, context + 1)
        model.logits(ids[:context], cache, 0)
        return lambda: model.logits(ids[context:], cache, context)  # (rewrites position `context` each time)

    return measured_costs(step, lambda: head_logits(model, model.embed_rows(ids[context:])), model.num_layers,
                          repeats)


def explore_lite(model: LiteModel, ids: Sequence[int], plans: Sequence[LayerPlan],
                 on_progress: Callable[[int, int], None] | None = None,
                 journal: RowJournal | None = None) -> ExploreResult:
    """search/explore.py explore_plans on the light front end's model: each plan's logits on ids
    from the embeddings (one lp_forward pass), as search/evaluator.py explore on torch's
    (journal: see explore_plans)."""
    def logits_of_plan(plan: LayerPlan | None):
        logits = model.logits(ids, model.new_cache(plan or model.plan(), len(ids)), 0, last_only=False)
        return lambda _, start, end: logits[start:end]

    reference = LogitsReference(logits_of_plan(None), np.asarray(ids, np.int64))
    return explore_plans(reference, logits_of_plan, plans, model.name, model.num_layers, on_progress, journal)


class LitePlanEvaluator(ResumingEvaluator):
    """Plans of a LiteModel against `reference` (default: the full model) on one sequence of ids."""

    def __init__(self, model: LiteModel, ids: Sequence[int], reference: LayerPlan | None = None,
                 reuse: bool = True) -> None:
        super().__init__(reference if reference is not None else model.plan(), reuse)
        self.model = model
        self.ids = np.asarray(ids, np.int64)
        self.name, self.tokens = model.name, len(self.ids)
        config, length = model.config, len(self.ids)
        self._cos, self._sin = model.rope_tables(length)
        # one KV slot for every attention sub-layer: each writes its keys and values, then reads them
        self._keys, self._values = (np.empty((config.kv_heads, length, config.head_dim), model.kv_dtype)
                                    for _ in range(2))
        kv_code = ABI.LP_DTYPE_F16 if model.kv_dtype == np.float16 else ABI.LP_DTYPE_F32
        self._slot = _Kv(self._keys.ctypes.data, self._values.ctypes.data, length, 0, kv_code)
        self.final_hidden = self._steps(self.reference_plan, model.embed_rows(self.ids), 0, "attention",
                                        capture=True)
        self.reference = LogitsReference(self._logits_of(self.final_hidden), self.ids)

    def _steps(self, plan: LayerPlan, hidden: np.ndarray, first_step: int, first_sub: str,
               capture: bool = False) -> np.ndarray:
        """The residual stream after the plan's steps from (first_step, first_sub); capture: keep
        it before every sub-layer (each block writes a new array, so a kept one never changes)."""
        model, lib, rows = self.model, library(), len(self.ids)
        for index in range(first_step, len(plan.active_steps)):
            step = plan.steps[index]
            at_mlp = index == first_step and first_sub == "mlp"
            if capture and not at_mlp:
                self.captured[(index, "attention")] = hidden
            if step.attention and not at_mlp:
                out = np.empty_like(hidden)
                rope = model.rope_of_layer[step.layer]
                check(lib.lp_attention_block(
                    ctypes.byref(model.attention[step.layer]), hidden.ctypes.data, out.ctypes.data, rows, 0,
                    self._cos[rope].ctypes.data, self._sin[rope].ctypes.data, ctypes.byref(self._slot), 0, 0, None,
                    step.scale, ABI.LP_DTYPE_F32, model.threads), "native attention")
                hidden = out
            if capture:
                self.captured[(index, "mlp")] = hidden
            if step.mlp:
                out = np.empty_like(hidden)
                check(lib.lp_mlp_block(ctypes.byref(model.mlp[step.layer]), hidden.ctypes.data, out.ctypes.data, rows,
                                       step.scale, ABI.LP_DTYPE_F32, model.threads), "native MLP")
                hidden = out
        return hidden

    def _logits_of(self, hidden: np.ndarray) -> Callable[[int, int, int], np.ndarray]:
        """LogitsReference's logits_of: the final norm and LM head on rows start..end-1."""
        return lambda _, start, end: head_logits(self.model, hidden[start:end])

    def run(self, plan: LayerPlan, resume: SubLayer | None) -> np.ndarray:
        if resume is None:
            return self._steps(plan, self.model.embed_rows(self.ids), 0, "attention")
        return self._steps(plan, self.captured[resume], *resume)

    def score(self, hidden: np.ndarray, plan: str, give_up: Callable[[Divergence], bool] | None) -> Divergence:
        return self.reference.divergence(self._logits_of(hidden), plan, give_up=give_up)
