"""Dynamic early exit: per token, a policy decides after each step whether to stop there.

Policies (`ExitPolicy.parse`): `confidence=P` (top-1 probability of the exit's logits >= P),
`entropy=H` (entropy in nats <= H), `cosine=C` (CALM's state saturation: cosine similarity of a
step's input and output residual streams >= C; needs no LM head), or any Python callable
`fn(step_index, hidden, logits_or_None) -> bool` (`ExitPolicy.from_callable`). Options:
`min=N` (never exit before N steps), `every=K` (test every K steps: a confidence test costs an
LM head, or a reduced one with `vocab=K`).

KV of the steps a token skipped. Later tokens attend to every earlier token in every layer, so
the skipped layers' cache entries must hold something defined:
- `kv=propagate` (default, CALM): the exited hidden state is copied up through the remaining
  steps' attention modules, run with a residual scale of 0 and no MLP. Each later layer stores
  K/V computed from the exited state, and the state itself stays unchanged. This costs the
  remaining steps' attention projections but none of their MLPs.
- `kv=verify` (drafting only): nothing is written above the exit. The target's verify pass
  rewrites every draft position in every layer anyway, so the output is unchanged. Later draft
  tokens of the same round then read stale entries above an earlier token's exit, which can
  only lower acceptance.
Plain lossy generation (`generate(..., exit_policy=...)`) always propagates.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from layerplan.decoding.drafters.base import AutoregressiveDrafter
from layerplan.decoding.drafters.heads import Head, final_head, reduced_head
from layerplan.decoding.drafters.proposal import DraftState, Proposal
from layerplan.engine.runner import Resume, embed, run_hidden
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan, PlanError

Criterion = Callable[[int, torch.Tensor, "torch.Tensor | None"], bool]
KINDS = ("confidence", "entropy", "cosine")


@dataclass(frozen=True)
class ExitPolicy:
    kind: str  # confidence | entropy | cosine | callable
    threshold: float = 0.0
    min_steps: int = 1  # never exit before this many steps: the first layers are never enough
    every: int = 1  # test every k-th step only (tests with logits cost an LM head each)
    kv: str = "propagate"  # how later tokens see the skipped layers (module docstring)
    vocab: int = 0  # >0: exit logits over this many frequent tokens (heads.ReducedHead)
    fn: Criterion | None = field(default=None, compare=False)  # the callable policy
    fn_needs_logits: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS + ("callable",):
            raise ValueError(f"unknown exit policy '{self.kind}'; choose from {', '.join(KINDS)} or a callable")
        if self.kind == "callable" and self.fn is None:
            raise ValueError("a callable exit policy needs fn")
        if self.min_steps < 1 or self.every < 1:
            raise ValueError(f"min and every must be >= 1, got min={self.min_steps}, every={self.every}")
        if self.kv not in ("propagate", "verify"):
            raise ValueError(f"kv must be 'propagate' or 'verify', not '{self.kv}'")
        if self.kind == "confidence" and not 0 <= self.threshold <= 1:
            raise ValueError(f"a confidence threshold is a probability in [0, 1], got {self.threshold}")
        if self.vocab < 0:
            raise ValueError(f"vocab must be >= 0, got {self.vocab}")

    @classmethod
    def parse(cls, text: str) -> ExitPolicy:
        """'confidence=0.9,min=8,every=2,kv=verify,vocab=8192'."""
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items or "=" not in items[0]:
            raise ValueError(f"cannot read exit policy '{text}': expected e.g. confidence=0.9, entropy=1.0 or "
                             "cosine=0.95, then optional min=N, every=K, kv=propagate|verify, vocab=K")
        kind, _, value = items[0].partition("=")
        options: dict = {}
        names = {"min": ("min_steps", int), "every": ("every", int), "kv": ("kv", str), "vocab": ("vocab", int)}
        for item in items[1:]:
            key, _, raw = item.partition("=")
            if key not in names:
                raise ValueError(f"unknown exit policy option '{key}' in '{text}'; options: {', '.join(names)}")
            name, cast = names[key]
            try:
                options[name] = cast(raw)
            except ValueError:
                raise ValueError(f"cannot read '{item}' in exit policy '{text}'") from None
        try:
            threshold = float(value)
        except ValueError:
            raise ValueError(f"cannot read the threshold '{value}' in exit policy '{text}'") from None
        return cls(kind.strip(), threshold, **options)

    @classmethod
    def from_callable(cls, fn: Criterion, needs_logits: bool = True, **options) -> ExitPolicy:
        """fn(step_index, hidden (1, 1, H), logits (V,) or None) -> True to exit after that step."""
        return cls("callable", fn=fn, fn_needs_logits=needs_logits, **options)

    def to_string(self) -> str:
        text = f"{self.kind}={self.threshold:g},min={self.min_steps}"
        if self.every != 1:
            text += f",every={self.every}"
        if self.kv != "propagate":
            text += f",kv={self.kv}"
        if self.vocab:
            text += f",vocab={self.vocab}"
        return text

    @property
    def needs_logits(self) -> bool:
        return self.kind in ("confidence", "entropy") or (self.kind == "callable" and self.fn_needs_logits)


class DynamicExit:
    """Runs one token through a plan step by step and stops where the policy says.

    head: hidden (1, 1, H) -> logits (1, 1, V) at an exit; default: a reduced head over
    policy.vocab tokens where the policy names one, else the model's own."""

    def __init__(self, model: LoadedModel, plan: LayerPlan, policy: ExitPolicy, head: Head | None = None) -> None:
        self.model, self.plan, self.policy = model, plan, policy
        if head is None:
            head = reduced_head(model, policy.vocab) if policy.vocab else final_head(model)
        self.head = head
        self._propagation: dict[int, LayerPlan] = {}
        self.exits: Counter[int] = Counter()  # steps run per token -> tokens (bounded: a server reuses drafters)

    def _propagation_plan(self, exit_step: int) -> LayerPlan:
        """The plan with steps after `exit_step` turned into KV writers: attention at residual
        scale 0 (the state does not change), no MLP."""
        if exit_step not in self._propagation:
            steps = list(self.plan.steps)
            for i in range(exit_step, len(steps)):
                steps[i] = replace(steps[i], mlp=False, scale=0.0)
            self._propagation[exit_step] = replace(self.plan, steps=tuple(steps))
        return self._propagation[exit_step]

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)[0, -1]

    def _wants_exit(self, index: int, before: torch.Tensor, after: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
        policy = self.policy
        logits = self._head(after) if policy.needs_logits else None
        if policy.kind == "confidence":
            return float(torch.softmax(logits.float(), -1).max()) >= policy.threshold, logits
        if policy.kind == "entropy":
            logp = F.log_softmax(logits.float(), -1)
            entropy = float(-(logp.exp() * logp.nan_to_num(neginf=0.0)).sum())
            return entropy <= policy.threshold, logits
        if policy.kind == "cosine":
            return float(F.cosine_similarity(before.flatten().float(), after.flatten().float(), dim=0)) >= policy.threshold, None
        return bool(policy.fn(index, after, logits)), logits

    @torch.inference_mode()
    def __call__(self, token: int, cache, position: int, propagate: bool | None = None) -> torch.Tensor:
        """Logits (V,) for the next token after `token` at `position`; writes the cache."""
        plan, policy = self.plan, self.policy
        propagate = policy.kv == "propagate" if propagate is None else propagate
        ids = torch.tensor([[token]], device=self.model.device)
        hidden = embed(self.model, ids, position)
        active = len(plan.active_steps)
        for index in range(active):
            before = hidden
            hidden = run_hidden(self.model, None, plan, cache, position, resume=Resume(hidden, index), stop_step=index + 1)
            steps_run = index + 1
            if steps_run < policy.min_steps or steps_run == active or steps_run % policy.every:
                continue
            stop, logits = self._wants_exit(index, before, hidden)
            if stop:
                self.exits[steps_run] += 1
                if propagate:
                    run_hidden(self.model, None, self._propagation_plan(steps_run), cache, position,
                               resume=Resume(hidden, steps_run))
                return logits if logits is not None else self._head(hidden)
        self.exits[active] += 1
        return self._head(hidden)

    def stats(self) -> dict:
        tokens = sum(self.exits.values())
        mean = sum(steps * n for steps, n in self.exits.items()) / tokens if tokens else math.nan
        return {"exit_policy": self.policy.to_string(), "tokens": tokens, "mean_steps": mean,
                "steps_total": len(self.plan.active_steps)}


class DynamicExitDrafter(AutoregressiveDrafter):
    """Per-token early exit inside the target plan: each draft token stops at the first step
    where the policy is satisfied. Lossless: the target verifies."""

    def __init__(self, model: LoadedModel, target: LayerPlan, policy: ExitPolicy, min_confidence: float = 0.0,
                 head: Head | None = None) -> None:
        self.runner = DynamicExit(model, target, policy, head)
        self.name = f"dynamic:{policy.to_string()}"
        self.min_confidence = min_confidence

    def check(self, model: LoadedModel, target: LayerPlan) -> None:
        if self.runner.model is not model:
            raise ValueError(f"the dynamic-exit draft was built for {self.runner.model.name}, not this {model.name}")
        if not self.runner.plan.is_draft_of(target):
            raise PlanError(f"the dynamic-exit draft runs '{self.runner.plan}', which is not a sub-plan of the "
                            f"target '{target}'")

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        state.cache.fill_gaps = self.runner.policy.kv == "verify"  # deeper slots may skip positions
        try:
            return self._draft_loop(state, max_tokens, lambda token, position: self.runner(token, state.cache, position))
        finally:
            state.cache.fill_gaps = False
