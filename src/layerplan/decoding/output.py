"""What a generation produces and how it stops: the result, streamed text, stop strings, EOS,
the token budget, cancellation. Shared by plain and speculative decoding."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from layerplan.models.loading import LoadedModel


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
    # one line when the decode's passes ran SLOW_DECODE_RATIO times slower than this machine's
    # probe says they cost (engine/probe.py PaceCheck): a busy machine; None otherwise
    slow_note: str | None = None

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
        if not prompt and not chat:
            raise ValueError("the prompt is empty: give some text to continue")
        ids = model.encode(prompt, chat=chat)
    else:
        ids = torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1).to(model.device)
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty (no tokens): give some text to continue")
    return ids


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

    def cancel(self) -> None:
        """The caller lost interest before any token (should_stop, while the prompt prefilled)."""
        self.reason = self.reason or "cancelled"

    def finish(self) -> str:
        if self.reason != "stop":
            self.stream.update([t for t in self.tokens if t not in self.eos])
        self.stream.finish()
        return self.stream.text
