"""The decode loop, over a small model protocol and without torch: the prompt prefills through
the plan, then each next token comes from the logits of the last one, until the Emitter says the
generation is done (EOS, a stop string, the budget, cancellation). Every plain decode runs it: the
torch front end's (decoding/request.py DecodeRequest, generate.py Decoding, and speculative.py's
rounds on the same prefill) and the light front end's (lite/cli.py, on a LiteModel).

What it asks of a model (TokenPasses): a KV cache for a plan, and the logits of a pass of new
tokens written into that cache at their positions; of its caller: the prompt's token ids. How a
token is chosen from logits is `choose`: greedy, or sampled by the request's settings and seed
(decoding/choice.py, numpy logits; DecodeRequest hands its torch rows to it)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from layerplan.decoding.choice import choose_token, seeded_generator
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.decoding.text import Emitter, GenerationResult
from layerplan.plan.plan import LayerPlan


class TokenPasses(Protocol):
    """A model's passes as the loop runs them."""

    def new_cache(self, plan: LayerPlan, capacity: int) -> Any:
        """An empty KV cache for `plan` (a slot per attention step), `capacity` positions; its
        `length` is the positions it holds."""

    def last_logits(self, ids: Sequence[int], plan: LayerPlan, cache: Any, start: int) -> Any:
        """The logits (vocab,) of the last of `ids`, run through `plan` at positions start.. with
        their keys and values written into `cache` (made for `plan`)."""


class Pace(Protocol):
    """A decode's passes against what they should cost here (engine/probe.py PaceCheck)."""

    def add(self, tokens: int, seconds: float) -> None: ...

    def note(self) -> str | None: ...


class NoPace:
    """No expectation to compare with: no note."""

    def add(self, tokens: int, seconds: float) -> None:
        pass

    def note(self) -> str | None:
        return None


class DecodeLoop:
    """One request's decode: prefill(), then step() until done, then result() (run(): all of it).

    model: its tokenizer and EOS ids (the Emitter's), and its passes unless `passes` is given
    (LiteModel is its own); ids: the prompt's token ids (at least one); spare: cache rows beyond
    the prompt and the new tokens (a verify pass's drafts). cache: one that already holds the keys
    and values of the prompt's first cache.length tokens, written through the same plan (a
    conversation's earlier turns, app/chat.py): prefill() runs the rest of the prompt only. Its
    holder made sure those tokens are the prompt's; at least the prompt's last token must be left
    to run (its logits give the first new token)."""

    def __init__(self, model, ids: Sequence[int], plan: LayerPlan, max_new_tokens: int, stop: Sequence[str] = (),
                 stop_at_eos: bool | Sequence[int] = True, on_text: Callable[[str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, pace: Pace | None = None, spare: int = 1,
                 cache=None, passes: TokenPasses | None = None, sampling: SamplingParams | None = None,
                 seed: int | None = None) -> None:
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if not ids:
            raise ValueError("the prompt is empty (no tokens): give some text to continue")
        self.model, self.plan = model, plan
        self.sampling = sampling or SamplingParams()
        # (the first maximum of the logits as they come, unless a setting changes the choice)
        self.plain_greedy = self.sampling.greedy and not self.sampling.changes_greedy_choice
        self.draws = seeded_generator(seed) if not self.sampling.greedy else None  # a sample's (choice.py)
        self.passes = passes = passes if passes is not None else model
        self.prompt = list(ids)
        self.out = Emitter(model, max_new_tokens, stop, stop_at_eos, on_text, should_stop)
        if cache is not None and cache.length >= len(self.prompt):
            raise ValueError(f"the cache holds {cache.length} positions of a {len(self.prompt)}-token prompt: "
                             "at least its last token must be left to prefill")
        if cache is None:
            cache = passes.new_cache(plan, len(self.prompt) + max_new_tokens + spare)
        self.cache = cache
        self.context: list[int] = list(self.prompt)  # the last one pending: chosen, not yet in the cache
        self.pace = pace if pace is not None else NoPace()  # its passes against this machine's probe
        self.start = time.perf_counter()
        self.prefill_seconds = 0.0

    @property
    def done(self) -> bool:
        return self.out.done

    def run(self) -> GenerationResult:
        """The whole decode: the prompt, then a step a token until done."""
        self.prefill()
        while not self.done:
            self.step()
        return self.result()

    def prefill(self) -> None:
        """The prompt through the plan alone (from the first token the cache does not hold), and
        the first token (decoding/batch.py does several at once and calls prefilled)."""
        start = self.cache.length
        self.prefilled(self.passes.last_logits(self.prompt[start:], self.plan, self.cache, start))

    def prefilled(self, logits) -> None:
        """The first token, from the prompt's last logits (vocab,)."""
        self.prefill_seconds = time.perf_counter() - self.start
        self.take(logits)

    def step(self) -> None:
        """The next token, from a pass of the last one."""
        start, position = time.perf_counter(), len(self.context) - 1
        logits = self.passes.last_logits(self.context[-1:], self.plan, self.cache, position)
        self.pace.add(1, time.perf_counter() - start)
        self.take(logits)

    def choose(self, logits) -> int:
        """The token the logits (vocab,) pick: the first maximum (numpy's argmax and torch's) where
        plainly greedy, else decoding/choice.py's under the sampling settings (numpy logits)."""
        if self.plain_greedy:
            return int(logits.argmax())
        return choose_token(logits, self.sampling, self.context, len(self.prompt), self.draws)

    def take(self, logits) -> None:
        """The next token from the logits (vocab,) of the last one."""
        token = self.choose(logits)
        self.context.append(token)
        self.out.emit([token], rows=(logits,))

    def result_stats(self) -> dict:
        """What the result's stats carry (a drafter's, a dynamic exit's); none here."""
        return {}

    def result(self) -> GenerationResult:
        text = self.out.finish()
        return GenerationResult(text, self.out.tokens, len(self.prompt), self.out.reason,
                                time.perf_counter() - self.start, self.prefill_seconds, self.plan.to_string(),
                                stats=self.result_stats(), slow_note=self.pace.note(), provenance=self.out.provenance(),
                                pieces=self.out.stream.pieces(), logprobs=self.logprobs())

    def logprobs(self) -> list | None:
        """The logprobs of the new tokens, where kept (Emitter.keep_logprobs): every one, an EOS
        that ended the reply too, but those of a stop string cut from the text."""
        kept = self.out.logprobs
        if kept is None:
            return None
        return kept[:self.out.stream.text_tokens()] if self.out.reason == "stop" else list(kept)
