"""Plans as real checkpoints: copy each step's layer into a new, deeper or shallower model.

The exported folder is what mergekit's passthrough merge would build from `formats.to_mergekit(plan)`;
transformers loads it as an ordinary model whose logits equal the in-memory plan's. A model loaded
from a GGUF also exports as a GGUF whose tensors keep their stored types byte for byte
(export_gguf): llama.cpp runs the frankenmerge without quantizing again.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from layerplan.export_gguf import gguf_pattern_refusal, gguf_scale_refusal, write_gguf_plan
from layerplan.files import replace_folder
from layerplan.models.architectures import config_with_layers, update_parameters
from layerplan.models.discovery import spec_of
from layerplan.models.gguf_file import read_header
from layerplan.models.loading import LoadedModel, gguf_of
from layerplan.plan.plan import LayerPlan


def _dense_state_dict(model: LoadedModel) -> dict[str, torch.Tensor]:
    """The model's state dict with every tensor dense: a GGUF run as stored (models/stored.py)
    gives its matrices dequantized (a Hugging Face checkpoint holds floats)."""
    state = model.hf.state_dict()
    if model.stored is not None:
        state.update({name: tensor.dequantize() for name, tensor in model.stored.tensors.items()})
    return state


def plan_state_dict(model: LoadedModel, plan: LayerPlan) -> dict[str, torch.Tensor]:
    """The model's weights rearranged so that layer j of the result is the layer step j runs.

    A step's residual scale s (and a switched-off sub-layer, s = 0) is folded into the weights
    that produce the sub-layer's update: the output projection (weight and bias), or the post-norm
    where one follows (Gemma: (offset + w) · s; a post-norm's bias times s), every expert's down
    projection for a mixture of experts. The exported layer then adds exactly s times
    its update, as the plan does."""
    spec = spec_of(model.hf.config)
    model.check_plan(plan)
    prefix = f"{spec.backbone}.{spec.layers}."
    result: dict[str, torch.Tensor] = {}
    by_layer: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    sources = {"": model, **{label: model.others[label] for label in plan.models}}
    for label, source in sources.items():
        for key, tensor in _dense_state_dict(source).items():
            if key.startswith(prefix):
                index, rest = key[len(prefix):].split(".", 1)
                by_layer.setdefault((label, int(index)), {})[rest] = tensor
            elif not label:
                result[key] = tensor  # embeddings, final norm and head come from the primary model
    for new_index, step in enumerate(plan.active_steps):
        source_layer = by_layer[(step.model, step.layer)]
        weights = {rest: tensor.clone() for rest, tensor in source_layer.items()}  # repeats: own storage
        for scale, sub_layer in ((step.scale if step.attention else 0.0, "attention"), (step.scale if step.mlp else 0.0, "mlp")):
            if scale == 1.0:
                continue
            names, offset = update_parameters(spec, sub_layer, weights)
            if not names:
                raise ValueError(f"cannot export a scaled or switched-off {sub_layer} for {model.hf.config.model_type}: "
                                 "no output projection or post-norm found in its weights")
            for name in names:
                if offset is not None and name.endswith(".weight"):
                    weights[name] = (offset + weights[name].float()) * scale - offset
                else:
                    weights[name] = weights[name].float() * scale
        for rest, tensor in weights.items():
            result[f"{prefix}{new_index}.{rest}"] = tensor.to(source_layer[rest].dtype)
    return result


def plan_config(model: LoadedModel, plan: LayerPlan):
    """The model's config with the plan's depth (and per-layer `layer_types` rebuilt)."""
    return config_with_layers(model.hf.config, [s.layer for s in plan.active_steps])


def export_checkpoint(model: LoadedModel, plan: LayerPlan, folder: str | os.PathLike) -> Path:
    """Write the plan as a Hugging Face folder (config.json, safetensors, tokenizer), atomically and
    with the user's umask; an existing folder is replaced only when it is an earlier checkpoint or
    empty (files.replace_folder)."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    config = plan_config(model, plan)
    state = plan_state_dict(model, plan)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    skeleton.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        skeleton.tie_weights()
    missing = [name for name, p in skeleton.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"export left parameters unset: {missing[:5]}")
    with replace_folder(folder) as staging:
        skeleton.save_pretrained(staging)
        if model.tokenizer is not None:
            model.tokenizer.save_pretrained(staging)
    return folder


def gguf_layer_types(config, depth: int) -> list[str]:
    """The kind of each layer a GGUF of this architecture with `depth` layers is read with: the
    architecture's pattern, as transformers' config computes it where no list is given (llama.cpp
    keeps the same pattern: Gemma 3's every sixth layer full, Gemma 2's every second)."""
    settings = {**config.to_dict(), "num_hidden_layers": depth}
    settings.pop("layer_types", None)
    return list(getattr(type(config)(**settings), "layer_types", None) or [])


def gguf_refusal(model: LoadedModel, plan: LayerPlan) -> str | None:
    """Why export_gguf cannot write the plan (one line), or None: a model not loaded from a GGUF, a
    plan over two models, a residual scale other than 0 or 1 (it would need the weights quantized
    again), layers of several kinds out of their pattern (a GGUF names the pattern, not each layer's
    kind)."""
    if (gguf_of(model.source) if model.source else None) is None:
        return f"--to gguf writes a model loaded from a GGUF file, not {model.source}; use --to checkpoint"
    if plan.models:
        return "--to gguf writes one model's layers; a plan over two models exports --to checkpoint"
    layer_types = getattr(model.hf.config, "layer_types", None) or []
    if len(set(layer_types)) > 1:
        refusal = gguf_pattern_refusal(model.hf.config.model_type, layer_types,
                                       gguf_layer_types(model.hf.config, len(plan.active_steps)), plan)
        if refusal is not None:
            return refusal
    return gguf_scale_refusal(plan)


def export_gguf(model: LoadedModel, plan: LayerPlan, path: str | os.PathLike) -> Path:
    """Write the plan as a GGUF file: layer j is a byte-for-byte copy of the tensors of the layer
    step j runs, in the source file's stored types, with the source's metadata (its block count,
    and every per-layer array, following the plan). Atomic. Refused, with the reason, where
    gguf_refusal says why."""
    model.check_plan(plan)
    refusal = gguf_refusal(model, plan)
    if refusal is not None:
        raise ValueError(refusal)
    return write_gguf_plan(read_header(gguf_of(model.source)), plan, path)
