"""One request's decode state on the torch front end's model, as every way of decoding it holds it:
decoding/loop.py's loop (the emitter of its tokens, its KV cache and context, its timing) with its
prompt ids (its sampling settings and seed: the loop's draws, decoding/choice.py). generate.Decoding
(a token a pass) and speculative.SpeculativeDecoding (drafted rounds) build on it; decoding/batch.py
runs either through shared passes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from layerplan.decoding.loop import DecodeLoop
from layerplan.decoding.output import prompt_ids
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.engine.cache import KVCache
from layerplan.engine.probe_rows import PaceCheck, ProbeRow
from layerplan.engine.runner import ModelPasses
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan


class DecodeRequest(DecodeLoop):
    """decoding/loop.py's loop on a loaded model: the prompt given as text (encoded, with the chat
    template where `chat`), ids or a tensor; each token sampled by `sampling` with the request's
    seed; its passes compared with this machine's probe row. The cache holds the prompt, the new
    tokens and `spare` rows more (a verify pass's drafts); a given one: see DecodeLoop."""

    def __init__(self, model: LoadedModel, prompt, plan: LayerPlan, max_new_tokens: int,
                 sampling: SamplingParams | None, seed: int | None, stop: Sequence[str],
                 stop_at_eos: bool | Sequence[int], chat: bool, on_text: Callable[[str], None] | None,
                 should_stop: Callable[[], bool] | None, probe_row: ProbeRow | None, spare: int = 1,
                 cache: KVCache | None = None) -> None:
        self.ids = prompt_ids(model, prompt, chat)  # (1, prompt): what a batch's passes take
        super().__init__(model, self.ids[0].tolist(), plan, max_new_tokens, stop, stop_at_eos, on_text, should_stop,
                         PaceCheck(probe_row), spare, cache, ModelPasses(model), sampling, seed)

    def choose(self, logits: torch.Tensor) -> int:
        if self.plain_greedy:
            return _argmax_token(logits)
        return super().choose(logits.detach().float().cpu().numpy())


def _argmax_token(logits: torch.Tensor) -> int:
    """The index of the first maximum of logits (V,), a NaN counting as the maximum: torch's rule,
    which numpy's argmax follows too. On a CPU float32 row numpy's skips the dispatch of torch's
    parallel reduction, which costs far more than the scan itself at a vocabulary's length (and
    is paid for every token of every request)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 1:
        return int(logits.numpy().argmax())
    return int(logits.argmax())
