"""Plans as real checkpoints: copy each step's layer into a new, deeper or shallower model.

The exported folder is what mergekit's passthrough merge would build from `formats.to_mergekit(plan)`;
transformers loads it as an ordinary model whose logits equal the in-memory plan's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from layerplan.files import replace_folder
from layerplan.models.architectures import config_with_layers, update_parameters
from layerplan.models.discovery import spec_of
from layerplan.models.loading import LoadedModel
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
