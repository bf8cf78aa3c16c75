"""Drafters: cheap guessers of the next few tokens, verified afterwards by the target plan.

A drafter sees a `DraftState` (the context, whose last token is *pending*: chosen but not yet run
through the target, and the target's KV cache) and returns a `Proposal`: tokens, and the
distributions q they were drawn from (after the same logits processing as the target's), or None
for deterministic proposals. Registry: `make_drafter("ngram" | "exit:8" | "skip:attn=3,5" |
"window:4,64" | "exit:20+head" | "exit:20+head+vocab=8192" | "dynamic:confidence=0.8,min=12" |
"model:PATH" | "ngram|exit:8" | "auto")`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from layerplan.cache import KVCache
from layerplan.models import LoadedModel
from layerplan.plan import LayerPlan, PlanError
from layerplan.runner import forward, new_cache, run_hidden
from layerplan.sampling import SamplingParams, process_logits


@dataclass
class DraftState:
    model: LoadedModel
    target: LayerPlan
    cache: KVCache  # the target's cache; self-drafts write the slots of the steps they run
    tokens: list[int]  # the context; tokens[-1] is pending (its KV is not in the cache yet)
    sampling: SamplingParams
    generator: torch.Generator | None = None


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # (len(tokens), V) draft distributions q; None = deterministic


class Drafter(Protocol):
    name: str

    def propose(self, state: DraftState, max_tokens: int) -> Proposal: ...


def _draft_token(logits: torch.Tensor, state: DraftState, seen: list[int]) -> tuple[int, torch.Tensor, float]:
    """(token, q, top-1 probability) from one position's draft logits (V,)."""
    params = state.sampling
    penalty_context = torch.tensor(seen, device=logits.device) if params.repetition_penalty != 1.0 else None
    processed = process_logits(logits, params, penalty_context)
    if params.greedy:
        token = int(processed.argmax())
        confidence = float(torch.softmax(processed, -1)[token])
        q = torch.zeros_like(processed)
        q[token] = 1.0
        return token, q, confidence
    q = torch.softmax(processed, -1)
    token = int(torch.multinomial(q, 1, generator=state.generator))
    return token, q, float(q.max())


class _AutoregressiveDrafter:
    """Drafts token by token with some forward function; stops early on low confidence."""

    name = "autoregressive"
    min_confidence: float = 0.0  # stop drafting when the draft's top-1 probability falls below this

    def _draft_loop(self, state: DraftState, max_tokens: int, step: Callable[[int, int], torch.Tensor]) -> Proposal:
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        seen = list(state.tokens)
        position = len(state.tokens) - 1
        token = state.tokens[-1]
        for _ in range(max_tokens):
            logits = step(token, position)
            token, q, confidence = _draft_token(logits, state, seen)
            if tokens and confidence < self.min_confidence:
                break  # keep at least one token: an unsure guess still costs only one draft step
            tokens.append(token)
            probs.append(q)
            seen.append(token)
            position += 1
        return Proposal(tokens, torch.stack(probs) if probs else None)


class PlanDrafter(_AutoregressiveDrafter):
    """Self-speculation: the same model under a cheaper plan (skipped sub-layers, early exit),
    sharing the target's KV cache. The prompt always went through the full target."""

    def __init__(self, plan: LayerPlan, min_confidence: float = 0.0) -> None:
        self.plan = plan
        self.name = plan.to_string()
        self.min_confidence = min_confidence
        self.reduced_head = None  # a draft_vocab.ReducedHead (+vocab=K): score only frequent tokens

    def check(self, target: LayerPlan) -> None:
        if not self.plan.is_draft_of(target):
            raise PlanError(
                f"draft plan '{self.plan}' is not a sub-plan of the target '{target}': a self-draft may only "
                "switch sub-layers off or exit early, so that both share the KV cache step by step"
            )

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        device = state.model.device

        def step(token: int, position: int) -> torch.Tensor:
            ids = torch.tensor([[token]], device=device)
            if self.reduced_head is not None:
                return self.reduced_head(run_hidden(state.model, ids, self.plan, state.cache, position)[:, -1:])[0, -1]
            return forward(state.model, ids, self.plan, state.cache, position, last_only=True)[0, -1]

        return self._draft_loop(state, max_tokens, step)


class ExitHeadDrafter(PlanDrafter):
    """Early exit after E steps, read through a trained exit head (exit_heads.py) instead of
    the bare final norm and LM head."""

    def __init__(self, plan: LayerPlan, head, min_confidence: float = 0.0) -> None:
        super().__init__(plan, min_confidence)
        self.head = head
        self.name = f"exit:{len(plan.active_steps)}+head"

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        from layerplan.runner import head as lm_head

        device = state.model.device

        @torch.inference_mode()
        def step(token: int, position: int) -> torch.Tensor:
            ids = torch.tensor([[token]], device=device)
            hidden = self.head(run_hidden(state.model, ids, self.plan, state.cache, position)[:, -1:])
            if self.reduced_head is not None:
                return self.reduced_head(hidden)[0, -1]
            return lm_head(state.model, hidden)[0, -1]

        return self._draft_loop(state, max_tokens, step)


class WindowedDrafter(PlanDrafter):
    """A self-draft that attends only to the first `sink` tokens and the `recent` latest ones
    (MagicDec / StreamingLLM style): at long context the draft's attention stops growing with
    the context, while the target still verifies against all of it."""

    def __init__(self, plan: LayerPlan, sink: int = 4, recent: int = 64, min_confidence: float = 0.0) -> None:
        if sink < 0 or recent < 1:
            raise ValueError(f"a draft window needs sink >= 0 and recent >= 1, got {sink}, {recent}")
        super().__init__(plan, min_confidence)
        self.window = (sink, recent)
        self.name = f"window:{sink},{recent}" + ("" if plan.is_identity else f"/{plan}")

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        state.cache.read_window = self.window
        try:
            return super().propose(state, max_tokens)
        finally:
            state.cache.read_window = None


class DynamicExitDrafter(_AutoregressiveDrafter):
    """Per-token early exit inside the target plan (dynamic_exit.py): each draft token stops at
    the first step where the policy is satisfied. Lossless: the target verifies."""

    def __init__(self, model: LoadedModel, target: LayerPlan, policy, min_confidence: float = 0.0) -> None:
        from layerplan.dynamic_exit import DynamicExit

        self.runner = DynamicExit(model, target, policy)
        self.name = f"dynamic:{policy.to_string()}"
        self.min_confidence = min_confidence

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        state.cache.fill_gaps = self.runner.policy.kv == "verify"  # deeper slots may skip positions
        try:
            return self._draft_loop(state, max_tokens, lambda token, position: self.runner(token, state.cache, position))
        finally:
            state.cache.fill_gaps = False


class ModelDrafter(_AutoregressiveDrafter):
    """Classic speculative decoding with a separate small model that shares the tokenizer."""

    def __init__(self, model: LoadedModel, min_confidence: float = 0.0) -> None:
        self.model = model
        self.plan = model.plan()
        self.name = f"model:{model.name}"
        self.min_confidence = min_confidence
        self.cache: KVCache | None = None
        self.fed: list[int] = []  # tokens whose KV is in self.cache, in order

    def check(self, target_model: LoadedModel) -> None:
        draft_vocab = self.model.hf.config.vocab_size
        target_vocab = target_model.hf.config.vocab_size
        if draft_vocab != target_vocab:
            raise ValueError(f"draft model vocabulary ({draft_vocab}) differs from the target's ({target_vocab})")

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        if self.cache is None:
            self.cache = new_cache(self.plan, capacity=len(state.tokens) + 256)
        context = state.tokens
        common = 0
        for fed, token in zip(self.fed, context[:-1]):
            if fed != token:
                break
            common += 1
        self.cache.crop(common)
        self.fed = self.fed[:common]
        device = self.model.device
        if common < len(context) - 1:  # catch up on tokens the target accepted since last time
            ids = torch.tensor([context[common:-1]], device=device)
            forward(self.model, ids, self.plan, self.cache, common)
            self.fed = list(context[:-1])

        def step(token: int, position: int) -> torch.Tensor:
            ids = torch.tensor([[token]], device=device)
            logits = forward(self.model, ids, self.plan, self.cache, position, last_only=True)[0, -1]
            self.fed.append(token)
            return logits

        return self._draft_loop(state, max_tokens, step)


class NgramDrafter:
    """Prompt-lookup drafting: find the latest earlier occurrence of the context's last n tokens
    (n from max_n down to min_n) and propose what followed it. Costs no model call."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.name = "ngram" if (max_n, min_n) == (4, 1) else f"ngram:{max_n}"

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        tokens = state.tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + max_tokens]
                    if follow:
                        return Proposal(list(follow), None)
        return Proposal()


class StagedDrafter:
    """Several drafters in order of cost: the first one with a proposal drafts this round
    (e.g. free n-gram lookup first, a layer-plan draft when the lookup finds nothing)."""

    def __init__(self, drafters: list[Drafter]) -> None:
        self.drafters = drafters
        self.name = "|".join(d.name for d in drafters)

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        for drafter in self.drafters:
            proposal = drafter.propose(state, max_tokens)
            if proposal.tokens:
                return proposal
        return Proposal()

    def check(self, target) -> None:
        for drafter in self.drafters:
            if isinstance(drafter, PlanDrafter):
                drafter.check(target)


def make_drafter(spec: str | Drafter, model: LoadedModel, target: LayerPlan | None = None,
                 min_confidence: float = 0.0) -> Drafter:
    """A drafter from its name: "ngram", "ngram:N", "model:PATH", any plan string ("exit:8",
    "skip:attn=3,5;mlp=9", a plan file), or several joined with '|' (tried in order)."""
    if not isinstance(spec, str):
        return spec
    target = target if target is not None else model.plan()
    parts = [p.strip() for p in spec.split("|")]
    if len(parts) > 1:
        staged = StagedDrafter([make_drafter(p, model, target, min_confidence) for p in parts])
        return staged
    text = parts[0]
    if "+vocab=" in text:  # a self-draft whose LM head scores only the K most frequent tokens
        inner, _, size = text.rpartition("+vocab=")
        if not size.isdigit():
            raise ValueError(f"cannot read '{text}': expected DRAFT+vocab=K with K a token count, e.g. exit:24+head+vocab=8192")
        drafter = make_drafter(inner, model, target, min_confidence)
        if not isinstance(drafter, PlanDrafter):
            raise ValueError(f"+vocab=K applies to layer-plan drafts (exit:E, exit:E+head, skip:...), not '{inner}'")
        from layerplan.draft_vocab import reduced_head

        drafter.reduced_head = reduced_head(model, int(size))
        drafter.name = f"{drafter.name}+vocab={size}"
        return drafter
    if text.startswith("dynamic:"):
        from layerplan.dynamic_exit import ExitPolicy

        return DynamicExitDrafter(model, target, ExitPolicy.parse(text[len("dynamic:"):]), min_confidence)
    if text == "auto":
        saved = saved_draft_path(model)
        if saved.exists():
            return StagedDrafter([NgramDrafter(), make_drafter(str(saved), model, target, min_confidence)])
        return NgramDrafter()
    if text.startswith("exit:") and "+head" in text:
        from layerplan.exit_heads import default_head_path, load_head

        exit_text, _, path = text[len("exit:"):].partition("+head")
        if not exit_text.isdigit():
            raise ValueError(f"cannot read '{text}': expected exit:E+head or exit:E+head=PATH")
        exit = int(exit_text)
        head = load_head(path[1:] if path.startswith("=") else default_head_path(model, exit), model)
        if head.exit and head.exit != exit:
            raise ValueError(f"the exit head was trained for exit:{head.exit}, not exit:{exit}")
        drafter = ExitHeadDrafter(target.with_exit(exit), head, min_confidence)
        drafter.check(target)
        return drafter
    if text.startswith("exit:") and text[5:].isdigit() and not target.is_identity:
        drafter = PlanDrafter(target.with_exit(int(text[5:])), min_confidence)  # exit within the target plan
        return drafter
    if text.startswith("window:"):
        window, _, rest = text[len("window:"):].partition("/")
        sizes = window.split(",")
        if len(sizes) != 2 or not all(v.strip().isdigit() for v in sizes):
            raise ValueError(f"cannot read '{text}': expected window:SINK,RECENT (e.g. window:4,64), "
                             "optionally /PLAN for a cheaper draft plan")
        plan = model.plan(rest) if rest else target
        drafter = WindowedDrafter(plan, int(sizes[0]), int(sizes[1]), min_confidence)
        drafter.check(target)
        return drafter
    if text == "ngram":
        return NgramDrafter()
    if text.startswith("ngram:"):
        value = text.partition(":")[2]
        if not value.isdigit():
            raise ValueError(f"cannot read '{text}': expected ngram or ngram:N with N the longest n-gram")
        return NgramDrafter(max_n=int(value))
    if text.startswith("model:"):
        from layerplan.models import load_model

        drafter = ModelDrafter(load_model(text.partition(":")[2], dtype=model.dtype, device=model.device),
                               min_confidence)
        drafter.check(model)
        return drafter
    drafter = PlanDrafter(model.plan(text), min_confidence)
    drafter.check(target)
    return drafter


def saved_draft_path(model: LoadedModel):
    """Where a search saves the best draft plan for a model; `--draft auto` reads it."""
    from layerplan.models import cache_dir

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model.name)
    return cache_dir() / "plans" / f"{safe}.json"
