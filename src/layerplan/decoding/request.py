"""One request's decode state, as every way of decoding it holds it: its prompt ids, sampler and
seed, the emitter of its tokens, its KV cache and context, its timing. generate.Decoding (a token
a pass) and speculative.SpeculativeDecoding (drafted rounds) build on it; decoding/batch.py runs
either through shared passes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from layerplan.decoding.output import prompt_ids
from layerplan.decoding.text import Emitter
from layerplan.decoding.sampling import SamplingParams, penalty_context, pick
from layerplan.engine.cache import KVCache
from layerplan.engine.probe import PaceCheck, ProbeRow
from layerplan.engine.runner import forward, new_cache
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan


class DecodeRequest:
    """The prompt prefills through `plan` (prefill(), or prefilled() with logits from a shared
    pass); each next token comes from the logits of the last one (take()). The cache holds the
    prompt, the new tokens and `spare` rows more (a verify pass's drafts).

    cache: one that already holds the keys and values of the prompt's first cache.length tokens,
    written through the same plan (a conversation's earlier turns, app/chat.py): prefill() runs the
    rest of the prompt only. Its holder made sure those tokens are the prompt's; at least the
    prompt's last token must be left to run (its logits give the first new token)."""

    def __init__(self, model: LoadedModel, prompt, plan: LayerPlan, max_new_tokens: int,
                 sampling: SamplingParams | None, seed: int | None, stop: Sequence[str],
                 stop_at_eos: bool | Sequence[int], chat: bool, on_text: Callable[[str], None] | None,
                 should_stop: Callable[[], bool] | None, probe_row: ProbeRow | None, spare: int = 1,
                 cache: KVCache | None = None) -> None:
        self.model, self.plan = model, plan
        self.sampling = sampling or SamplingParams()
        self.generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
        self.ids = prompt_ids(model, prompt, chat)
        self.out = Emitter(model, max_new_tokens, stop, stop_at_eos, on_text, should_stop)
        if cache is not None and cache.length >= self.ids.shape[1]:
            raise ValueError(f"the cache holds {cache.length} positions of a {self.ids.shape[1]}-token prompt: "
                             "at least its last token must be left to prefill")
        if cache is None:
            cache = new_cache(plan, capacity=self.ids.shape[1] + max_new_tokens + spare)
        self.cache = cache
        self.context: list[int] = self.ids[0].tolist()  # the last one pending: chosen, not yet in the cache
        self.pace = PaceCheck(probe_row)  # its passes against this machine's probe (result.slow_note)
        self.start = time.perf_counter()
        self.prefill_seconds = 0.0

    @property
    def done(self) -> bool:
        return self.out.done

    def prefill(self) -> None:
        """The prompt through the plan alone (from the first token the cache does not hold), and
        the first token (batch.py does several at once)."""
        start = self.cache.length
        self.prefilled(forward(self.model, self.ids[:, start:], self.plan, self.cache, start, last_only=True)[0, -1])

    def prefilled(self, logits: torch.Tensor) -> None:
        """The first token, from the prompt's last logits (vocab,)."""
        self.prefill_seconds = time.perf_counter() - self.start
        self.take(logits)

    def take(self, logits: torch.Tensor) -> None:
        """The next token from the logits (vocab,) of the last one."""
        token = pick(logits, self.sampling, penalty_context(self.context, self.sampling, logits.device), self.generator)
        self.context.append(token)
        self.out.emit([token])
