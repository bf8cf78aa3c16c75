"""lm-evaluation-harness under a plan: an `LM` subclass registered as "layerplan".

    import lm_eval
    from layerplan.app.integrations.harness import LayerplanLM
    lm = LayerplanLM(pretrained="smollm2", plan="skip:mlp=20", dtype="float32")
    lm_eval.simple_evaluate(model=lm, tasks=["arc_easy"])

or `layerplan eval --tasks arc_easy --plan skip:mlp=20`, or lm_eval's own command line through
`python -m layerplan.app.integrations.lm_eval_cli` (see there why). In lm_eval's own
"key=value,..." model_args a plan that contains commas must be given as a plan file.

Multiple-choice requests share their context: it runs once into the plan's KV cache, and each
continuation runs from there after a crop (the cache's step-owned slots make that free).
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from layerplan.decoding.scheduler import generate_batch
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.engine.runner import forward, new_cache
from layerplan.models.loading import LoadedModel
from layerplan.engine.load import load_model
from layerplan.search.probes import encode_pair, prefix_token


def usable_device(device: str | None) -> str:
    """`device`, or the CPU where it names a CUDA device this machine does not have."""
    if device is None:
        return "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        logging.getLogger(__name__).warning(
            "device '%s' asked for, but this torch sees no CUDA GPU: running on the CPU "
            "(pass --device cpu to lm_eval to silence this)", device)
        return "cpu"
    return device


@register_model("layerplan")
class LayerplanLM(LM):
    def __init__(self, pretrained: str | LoadedModel = "smollm2", plan: str | None = None, dtype: str = "float32",
                 device: str | None = "cpu", draft: str | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, **_ignored) -> None:
        """pretrained: a model source (folder, .gguf, 'smollm2') or an already LoadedModel (then
        device is the model's). device: where to load it; a CUDA device on a machine without one
        (lm_eval's command line asks for cuda:0 unless told otherwise) falls back to the CPU with a
        warning. draft: generate_until decodes speculatively with it (same output, faster).
        _ignored: lm_eval passes batch_size and max_batch_size to every model."""
        super().__init__()
        if isinstance(pretrained, LoadedModel):
            self.model = pretrained
        else:
            self.model = load_model(pretrained, dtype, usable_device(device))
        self.plan = self.model.plan(plan)
        self.draft = draft
        self.max_length = max_length or self.model.context_length
        self.max_gen_toks = max_gen_toks
        self.prefix_token = prefix_token(self.model.tokenizer)  # what an empty context starts from

    # ----- scoring ---------------------------------------------------------------------------
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        return encode_pair(self.model.tokenizer, context, continuation, self.prefix_token)

    @torch.inference_mode()
    def _score(self, context_ids: list[int], continuations: list[list[int]]) -> list[tuple[float, bool]]:
        """(log-likelihood, is greedy) of each continuation after the same context."""
        room = self.max_length - max(len(c) for c in continuations)
        context_ids = context_ids[-max(room, 1):]  # left-truncate, as lm_eval's HF model does
        device = self.model.device
        cache = new_cache(self.plan, capacity=len(context_ids) + max(len(c) for c in continuations) + 1)
        context = torch.tensor([context_ids], device=device)
        last = forward(self.model, context, self.plan, cache, 0, last_only=True)[0]  # (1, V): predicts cont[0]
        results = []
        for continuation in continuations:
            cache.crop(len(context_ids))
            ids = torch.tensor([continuation], device=device)
            logits = last
            if len(continuation) > 1:  # the continuation's own tokens predict its later ones
                logits = torch.cat([last, forward(self.model, ids[:, :-1], self.plan, cache, len(context_ids))[0]])
            logp = F.log_softmax(logits.float(), -1)  # (len(cont), V)
            target = ids[0]
            total = float(logp.gather(1, target[:, None]).sum())
            results.append((total, bool((logp.argmax(-1) == target).all())))
        return results

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        by_context: dict[tuple[int, ...], list[tuple[int, list[int]]]] = defaultdict(list)
        for index, request in enumerate(requests):
            context_ids, continuation = self._encode_pair(*request.args)
            by_context[tuple(context_ids)].append((index, continuation))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for context_ids, items in by_context.items():
            for (index, _), result in zip(items, self._score(list(context_ids), [c for _, c in items])):
                out[index] = result
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for request in requests:
            ids = self.model.tokenizer.encode(request.args[0], add_special_tokens=False)
            windows = get_rolling_token_windows(ids, self.prefix_token, self.max_length, context_len=1)
            out.append(sum(self._score(list(context), [list(target)])[0][0]
                           for context, target in map(make_disjoint_window, windows)))
        return out

    # ----- generation ------------------------------------------------------------------------
    def generate_until(self, requests) -> list[str]:
        """Each request's continuation, as generate() gives it alone. Requests that share their
        generation options go to the scheduler together (decoding/scheduler.py: continuous
        batching, the same tokens; one at a time for a draft that runs a model)."""
        groups: dict[tuple, list[tuple[int, list[int]]]] = defaultdict(list)
        for index, request in enumerate(requests):
            context, options = request.args
            options = dict(options or {})
            until = options.pop("until", None) or []
            until = tuple([until] if isinstance(until, str) else until)
            max_new = int(options.pop("max_gen_toks", self.max_gen_toks))
            sampling = SamplingParams()
            if options.pop("do_sample", False) and float(options.get("temperature", 1.0)) > 0:
                sampling = SamplingParams(temperature=float(options.get("temperature", 1.0)),
                                          top_k=int(options.get("top_k") or 0), top_p=float(options.get("top_p") or 1.0))
            ids = self.model.tokenizer.encode(context, add_special_tokens=False)
            ids = ids[-max(self.max_length - max_new, 1):]
            key = (until, max_new, sampling, options.get("seed"))
            groups[key].append((index, ids))
        out: list[str] = [""] * len(requests)
        for (until, max_new, sampling, seed), members in groups.items():
            results = generate_batch(self.model, [ids for _, ids in members], self.plan, max_new, sampling,
                                     [seed] * len(members), until, draft=self.draft)
            for (index, _), result in zip(members, results):
                out[index] = result.text
        return out
