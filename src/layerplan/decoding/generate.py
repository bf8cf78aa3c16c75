"""Generation through a plan: prefill the prompt, then one token per step; with a draft, the
speculative loop (speculative.py) instead."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from layerplan.decoding.drafters.dynamic_exit import DynamicExit, ExitPolicy
from layerplan.decoding.text import GenerationResult
from layerplan.decoding.request import DecodeRequest
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.decoding.speculative import speculative_generate
from layerplan.engine.cache import KVCache
from layerplan.engine.probe_rows import ProbeRow
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan


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
    probe_row: ProbeRow | None = None,
) -> GenerationResult:
    """Generate with the model run by `plan` (the full model by default).

    exit_policy: dynamic early exit per token (an ExitPolicy or its text, e.g.
    "confidence=0.9,min=12"; see drafters/dynamic_exit.py). Lossy, like any plan that is not the full
    model; the prompt always runs through the whole plan.

    draft: a drafter (or its name, e.g. "ngram", "exit:8", "skip:attn=3,5") makes this lossless
    speculative decoding: same greedy output, same sampling distribution (see speculative.py).

    probe_row: this machine's probe row for the model (engine/probe.py checked_model_row): the
    decode compares its passes with it (result.slow_note), and a speculative one takes its verify
    costs from it; None: no comparison, and verify costs learned from the passes seen."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if draft is not None and exit_policy is not None:
        raise ValueError("exit_policy makes generation lossy; as a lossless draft use draft='dynamic:POLICY'")
    if draft is not None:
        return speculative_generate(model, prompt, draft, plan, max_new_tokens, sampling, seed, stop,
                                    stop_at_eos, chat, on_text, draft_length, draft_confidence, should_stop,
                                    probe_row)
    decoding = Decoding(model, prompt, plan if plan is not None else model.plan(), max_new_tokens, sampling, seed,
                        stop, stop_at_eos, chat, on_text, should_stop, probe_row, exit_policy)
    return decoding.run()


def decode_by(model: LoadedModel, probe_row: ProbeRow | None = None):
    """A loaded model's greedy decode as decoding/frontier.py's Decode: (prompt ids, new tokens,
    draft or None, its draft length) -> the result."""
    def decode(prompt: Sequence[int], new_tokens: int, draft=None, draft_length=None) -> GenerationResult:
        return generate(model, prompt, max_new_tokens=new_tokens, draft=draft, draft_length=draft_length,
                        probe_row=probe_row)

    return decode


class Decoding(DecodeRequest):
    """One request's plain decode, a token at a time: the prompt's prefill, then for each token the
    logits of the last one, from a step of its own (step: generate) or from a pass shared with
    other requests (next_pass / take_pass: decoding/batch.py). exit_policy: dynamic early exit per
    token (its steps alone). cache: see DecodeRequest."""

    def __init__(self, model: LoadedModel, prompt, plan: LayerPlan, max_new_tokens: int = 64,
                 sampling: SamplingParams | None = None, seed: int | None = None, stop: Sequence[str] = (),
                 stop_at_eos: bool | Sequence[int] = True, chat: bool = False,
                 on_text: Callable[[str], None] | None = None, should_stop: Callable[[], bool] | None = None,
                 probe_row: ProbeRow | None = None, exit_policy=None, cache: KVCache | None = None) -> None:
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        super().__init__(model, prompt, plan, max_new_tokens, sampling, seed, stop, stop_at_eos, chat, on_text,
                         should_stop, probe_row, cache=cache)
        self.dynamic = None
        if exit_policy is not None:
            policy = ExitPolicy.parse(exit_policy) if isinstance(exit_policy, str) else exit_policy
            self.dynamic = DynamicExit(model, plan, policy)

    def step(self) -> None:
        """The next token from a step of its own (a dynamic exit's, where one is set)."""
        if self.dynamic is None:
            super().step()
            return
        start, token, position = time.perf_counter(), self.context[-1], len(self.context) - 1
        logits = self.dynamic(token, self.cache, position, propagate=True)
        self.pace.add(1, time.perf_counter() - start)
        self.take(logits)

    def next_pass(self, cap: int | None = None, others: int = 0) -> tuple[torch.Tensor, object, int]:
        """(the last token (1, 1), this request's cache, its position): its part of the next pass."""
        return torch.tensor([[self.context[-1]]], device=self.ids.device), self.cache, len(self.context) - 1

    def take_pass(self, logits: torch.Tensor, rows: int = 1, seconds: float | None = None) -> None:
        """Its logits (1, vocab) of a pass of `rows` rows that took `seconds`."""
        if seconds is not None:
            self.pace.add(rows, seconds)
        self.take(logits[-1])

    def result_stats(self) -> dict:
        return self.dynamic.stats() if self.dynamic is not None else {}
