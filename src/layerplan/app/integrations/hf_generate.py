"""layerplan's decoding inside transformers' own `model.generate`, via its `custom_generate` hook.

    from layerplan.app.integrations.hf_generate import layerplan_generate
    out = model.generate(**inputs, custom_generate=layerplan_generate, max_new_tokens=64,
                         do_sample=False, draft="ngram")          # or plan="skip:mlp=20", ...

transformers prepares the inputs and the generation config (max_new_tokens, do_sample,
temperature, top_k, top_p, repetition_penalty, eos_token_id); layerplan runs the loop. The
extra keywords `plan`, `draft`, `draft_length` are taken from this function's signature.
"""

from __future__ import annotations

import weakref

import torch

from layerplan.decoding.generate import generate
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.models.loading import LoadedModel
from layerplan.engine.load import wrap_model

# the logits processors transformers builds from the settings we translate into SamplingParams;
# any other (no_repeat_ngram_size, bad_words_ids, ...) has no layerplan equivalent yet
_UNDERSTOOD = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
               "RepetitionPenaltyLogitsProcessor"}
_wrapped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # hf model -> LoadedModel


def loaded(model) -> LoadedModel:
    """The LoadedModel view of a transformers model (built once per model)."""
    if model not in _wrapped:
        _wrapped[model] = wrap_model(model)
    return _wrapped[model]


def sampling_from(config) -> SamplingParams:
    if not config.do_sample:
        return SamplingParams(repetition_penalty=config.repetition_penalty or 1.0)
    return SamplingParams(temperature=config.temperature if config.temperature is not None else 1.0,
                          top_k=config.top_k or 0, top_p=config.top_p if config.top_p is not None else 1.0,
                          repetition_penalty=config.repetition_penalty or 1.0,
                          min_p=getattr(config, "min_p", None) or 0.0)


def _eos_ids(config) -> tuple[int, ...]:
    eos = config.eos_token_id
    if eos is None:
        return ()
    if isinstance(eos, torch.Tensor):
        return tuple(int(v) for v in eos.flatten().tolist())
    return (int(eos),) if isinstance(eos, int) else tuple(int(v) for v in eos)


def layerplan_generate(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                       plan=None, draft=None, draft_length=None, streamer=None, **model_kwargs):
    """A `custom_generate` callable: decode each row of `input_ids` with layerplan (by `plan`,
    speculatively with `draft`) and return what transformers' generate would: the prompt and the
    new tokens, rows padded with pad_token_id, or a GenerateDecoderOnlyOutput when
    return_dict_in_generate is set.

    streamer: receives each row's new tokens once that row is done (not token by token)."""
    unknown = sorted({type(p).__name__ for p in logits_processor} - _UNDERSTOOD)
    if unknown:
        raise ValueError(f"layerplan_generate cannot apply {', '.join(unknown)}; it understands do_sample, "
                         "temperature, top_k, top_p, min_p, repetition_penalty")
    if generation_config.num_beams not in (None, 1):
        raise ValueError("layerplan_generate does not do beam search (num_beams must be 1)")
    lm = loaded(model)
    target = lm.plan(plan) if isinstance(plan, str) or plan is None else plan
    sampling = sampling_from(generation_config)
    eos = _eos_ids(generation_config)
    max_new = generation_config.max_length - input_ids.shape[1]
    mask = model_kwargs.get("attention_mask")
    rows = []
    for i, row in enumerate(input_ids):
        prompt = row[mask[i].bool()] if mask is not None else row  # drop left padding
        result = generate(lm, prompt.tolist(), target, max_new, sampling, stop_at_eos=eos, draft=draft,
                          draft_length=draft_length)
        new = torch.tensor(result.token_ids, dtype=input_ids.dtype, device=input_ids.device)
        if streamer is not None:
            streamer.put(new.cpu())
        rows.append(torch.cat([row, new]))
    if streamer is not None:
        streamer.end()
    pad = generation_config.pad_token_id if generation_config.pad_token_id is not None else (eos[0] if eos else 0)
    width = max(len(r) for r in rows)
    sequences = torch.full((len(rows), width), int(pad), dtype=input_ids.dtype, device=input_ids.device)
    for i, r in enumerate(rows):
        sequences[i, : len(r)] = r
    if generation_config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences
