"""Plain generation through a plan: prefill the prompt, then one token per step."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from layerplan.models import LoadedModel
from layerplan.plan import LayerPlan
from layerplan.runner import forward, new_cache
from layerplan.sampling import SamplingParams, pick


@dataclass
class GenerationResult:
    text: str  # the new text (stop string removed)
    token_ids: list[int]  # the new tokens
    prompt_tokens: int
    stop_reason: str  # "eos", "stop", "length", or "cancelled" (should_stop said so)
    seconds: float  # decoding time, prefill included
    prefill_seconds: float
    plan: str
    stats: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        decode = self.seconds - self.prefill_seconds
        return len(self.token_ids) / decode if decode > 0 else float("nan")

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


class TextStream:
    """Tracks the decoded text of new tokens, stop strings, and streams text deltas."""

    def __init__(self, tokenizer, stop: Sequence[str], on_text: Callable[[str], None] | None) -> None:
        self.tokenizer, self.stop, self.on_text = tokenizer, tuple(s for s in stop if s), on_text
        self.emitted = 0
        self.text = ""

    def update(self, token_ids: list[int]) -> bool:
        """Decode the tokens so far; return True when a stop string appeared (text is cut there)."""
        if self.tokenizer is None:
            return False
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        hit = min((text.find(s) for s in self.stop if s in text), default=-1)
        stopped = hit >= 0
        if stopped:
            text = text[:hit]
        self.text = text
        # hold back a possible prefix of a stop string and an incomplete UTF-8 character
        safe = len(text) if stopped else len(text) - max((len(s) - 1 for s in self.stop), default=0)
        if text.endswith("\ufffd"):
            safe = min(safe, len(text) - 1)
        if self.on_text and safe > self.emitted:
            self.on_text(text[self.emitted : safe])
            self.emitted = safe
        return stopped

    def finish(self) -> None:
        if self.on_text and len(self.text) > self.emitted:
            self.on_text(self.text[self.emitted :])
            self.emitted = len(self.text)


def prompt_ids(model: LoadedModel, prompt: str | torch.Tensor | Sequence[int], chat: bool = False) -> torch.Tensor:
    if isinstance(prompt, str):
        return model.encode(prompt, chat=chat)
    ids = torch.as_tensor(prompt, dtype=torch.long)
    return ids.reshape(1, -1).to(model.device)


class Emitter:
    """Collects emitted tokens and decides when to stop: EOS, a stop string, the budget, or
    should_stop() (a caller that lost interest, e.g. a server whose client disconnected)."""

    def __init__(self, model: LoadedModel, max_new_tokens: int, stop: Sequence[str], stop_at_eos: bool | Sequence[int],
                 on_text: Callable[[str], None] | None, should_stop: Callable[[], bool] | None = None) -> None:
        self.max_new_tokens = max_new_tokens
        self.should_stop = should_stop
        # stop_at_eos: True = the model's EOS ids, False = none, or the ids to stop at
        self.eos = set(model.eos_token_ids) if stop_at_eos is True else set(stop_at_eos or ())
        self.stream = TextStream(model.tokenizer, stop, on_text)
        self.tokens: list[int] = []
        self.reason: str | None = None if max_new_tokens > 0 else "length"

    @property
    def done(self) -> bool:
        return self.reason is not None

    def emit(self, tokens: Sequence[int]) -> None:
        """Append tokens in order until one of them ends the generation."""
        for token in tokens:
            if self.done:
                return
            self.tokens.append(token)
            if token in self.eos:
                self.reason = "eos"
            elif self.stream.update(self.tokens):
                self.reason = "stop"
            elif len(self.tokens) >= self.max_new_tokens:
                self.reason = "length"
        if self.should_stop is not None and not self.done and self.should_stop():
            self.reason = "cancelled"

    def finish(self) -> str:
        if self.reason != "stop":
            self.stream.update([t for t in self.tokens if t not in self.eos])
        self.stream.finish()
        return self.stream.text


@torch.inference_mode()
def generate(
    model: LoadedModel,
    prompt: str | torch.Tensor | Sequence[int],
    plan: LayerPlan | None = None,
    max_new_tokens: int = 64,
    sampling: SamplingParams | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_at_eos: bool | Sequence[int] = True,
    chat: bool = False,
    on_text: Callable[[str], None] | None = None,
    draft=None,
    draft_length=None,
    draft_confidence: float = 0.0,
    should_stop: Callable[[], bool] | None = None,
    exit_policy=None,
) -> GenerationResult:
    """Generate with the model run by `plan` (the full model by default).

    exit_policy: dynamic early exit per token (an ExitPolicy or its text, e.g.
    "confidence=0.9,min=12"; see dynamic_exit.py). Lossy, like any plan that is not the full
    model; the prompt always runs through the whole plan.

    draft: a drafter (or its name, e.g. "ngram", "exit:8", "skip:attn=3,5") makes this lossless
    speculative decoding: same greedy output, same sampling distribution (see speculative.py)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if draft is not None and exit_policy is not None:
        raise ValueError("exit_policy makes generation lossy; as a lossless draft use draft='dynamic:POLICY'")
    if draft is not None:
        from layerplan.speculative import speculative_generate

        return speculative_generate(model, prompt, draft, plan, max_new_tokens, sampling, seed, stop,
                                    stop_at_eos, chat, on_text, draft_length, draft_confidence, should_stop)
    plan = plan if plan is not None else model.plan()
    sampling = sampling or SamplingParams()
    generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    ids = prompt_ids(model, prompt, chat)
    out = Emitter(model, max_new_tokens, stop, stop_at_eos, on_text, should_stop)

    start = time.perf_counter()
    cache = new_cache(plan, capacity=ids.shape[1] + max_new_tokens + 1)
    logits = forward(model, ids, plan, cache, 0, last_only=True)[0, -1]
    prefill = time.perf_counter() - start
    dynamic = None
    if exit_policy is not None:
        from layerplan.dynamic_exit import DynamicExit, ExitPolicy

        policy = ExitPolicy.parse(exit_policy) if isinstance(exit_policy, str) else exit_policy
        dynamic = DynamicExit(model, plan, policy)
    context = ids[0].tolist()
    while not out.done:
        seen = torch.tensor(context, device=logits.device) if sampling.repetition_penalty != 1.0 else None
        token = pick(logits, sampling, seen, generator)
        context.append(token)
        out.emit([token])
        if not out.done:
            if dynamic is not None:
                logits = dynamic(token, cache, len(context) - 1, propagate=True)
            else:
                step = torch.tensor([[token]], device=ids.device)
                logits = forward(model, step, plan, cache, len(context) - 1, last_only=True)[0, -1]
    elapsed = time.perf_counter() - start
    text = out.finish()
    return GenerationResult(text, out.tokens, ids.shape[1], out.reason, elapsed, prefill, plan.to_string(),
                            stats=dynamic.stats() if dynamic is not None else {})
