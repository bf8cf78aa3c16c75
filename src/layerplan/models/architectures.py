"""Every per-architecture fact in one place: where modules live, and what config keys mean.

The table is the only place that knows module names. Everything else works on `ModelParts`: the
embeddings, one `LayerParts` per decoder layer, the final norm and the LM head, all of them the
model's own modules (nothing copied, nothing patched). Config-key facts (depth, context length,
the `model_type` a GGUF conversion reports, how an exported checkpoint states its depth) live
here too, next to the table.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from torch import nn

class ModelError(ValueError):
    """A model that cannot be found or is not supported; the message says what was looked for."""


@dataclass(frozen=True)
class ArchSpec:
    """Where one architecture keeps its modules (attribute paths from the CausalLM object)."""

    backbone: str  # the decoder stack inside the CausalLM ("model", "transformer")
    embed: str  # token embeddings inside the backbone
    layers: str  # the ModuleList of decoder layers inside the backbone
    final_norm: str  # norm applied before the LM head
    attention: str  # attention module inside a decoder layer
    attention_norm: str  # norm before attention
    mlp: str  # MLP module inside a decoder layer
    mlp_norm: str  # norm before the MLP
    attention_post_norm: str | None = None  # norm on the attention output (Gemma)
    mlp_post_norm: str | None = None  # norm on the MLP output (Gemma)
    position_embed: str | None = None  # learned absolute positions (GPT-2); None means RoPE
    rope_per_layer_type: bool = False  # rotary_emb(x, pos, layer_type) gives one RoPE per layer type
    # for exports: the linear whose output is the attention / MLP residual update (scaling its
    # weight and bias scales the update); unused where a post-norm follows (Gemma)
    attention_output: str = "self_attn.o_proj"
    mlp_output: str = "mlp.down_proj"
    norm_weight_offset: float = 0.0  # Gemma's RMSNorm multiplies by (offset + weight)


_LLAMA_LIKE = ArchSpec(
    backbone="model",
    embed="embed_tokens",
    layers="layers",
    final_norm="norm",
    attention="self_attn",
    attention_norm="input_layernorm",
    mlp="mlp",
    mlp_norm="post_attention_layernorm",
)

ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "phi3": _LLAMA_LIKE,
    "gemma3_text": ArchSpec(
        backbone="model",
        embed="embed_tokens",
        layers="layers",
        final_norm="norm",
        attention="self_attn",
        attention_norm="input_layernorm",
        attention_post_norm="post_attention_layernorm",
        mlp="mlp",
        mlp_norm="pre_feedforward_layernorm",
        mlp_post_norm="post_feedforward_layernorm",
        rope_per_layer_type=True,
        norm_weight_offset=1.0,
    ),
    "gpt2": ArchSpec(
        backbone="transformer",
        embed="wte",
        layers="h",
        final_norm="ln_f",
        attention="attn",
        attention_norm="ln_1",
        mlp="mlp",
        mlp_norm="ln_2",
        position_embed="wpe",
        attention_output="attn.c_proj",
        mlp_output="mlp.c_proj",
    ),
}


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer's modules, looked up once so the hot loop does no attribute walking."""

    attention_norm: nn.Module
    attention: nn.Module
    attention_post_norm: nn.Module | None
    mlp_norm: nn.Module
    mlp: nn.Module
    mlp_post_norm: nn.Module | None
    layer_type: str  # "full_attention" or "sliding_attention" (selects mask and RoPE)
    sliding_window: int | None  # attend to at most this many most recent positions


@dataclass(frozen=True)
class ModelParts:
    embed: nn.Module
    position_embed: nn.Module | None
    layers: tuple[LayerParts, ...]
    final_norm: nn.Module
    lm_head: nn.Module
    rotary: nn.Module | None
    rope_per_layer_type: bool
    final_logit_softcapping: float | None
    layer_types: tuple[str, ...]  # distinct layer types, for RoPE computed once per type


def _get(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def arch_spec(model_type: str) -> ArchSpec:
    spec = ARCHITECTURES.get(model_type)
    if spec is None:
        raise ModelError(
            f"architecture '{model_type}' is not supported yet; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return spec


def model_parts(hf_model: nn.Module) -> ModelParts:
    config = hf_model.config
    spec = arch_spec(config.model_type)
    backbone = _get(hf_model, spec.backbone)
    layer_types = getattr(config, "layer_types", None)
    layers = []
    for i, layer in enumerate(_get(backbone, spec.layers)):
        if layer_types is not None:
            layer_type = layer_types[i]
            window = config.sliding_window if layer_type == "sliding_attention" else None
        else:
            # Mistral and Phi-3 apply config.sliding_window (when set) to every layer.
            window = getattr(config, "sliding_window", None)
            layer_type = "sliding_attention" if window is not None else "full_attention"
        layers.append(
            LayerParts(
                attention_norm=_get(layer, spec.attention_norm),
                attention=_get(layer, spec.attention),
                attention_post_norm=_get(layer, spec.attention_post_norm) if spec.attention_post_norm else None,
                mlp_norm=_get(layer, spec.mlp_norm),
                mlp=_get(layer, spec.mlp),
                mlp_post_norm=_get(layer, spec.mlp_post_norm) if spec.mlp_post_norm else None,
                layer_type=layer_type,
                sliding_window=window,
            )
        )
    return ModelParts(
        embed=_get(backbone, spec.embed),
        position_embed=_get(backbone, spec.position_embed) if spec.position_embed else None,
        layers=tuple(layers),
        final_norm=_get(backbone, spec.final_norm),
        lm_head=hf_model.get_output_embeddings(),
        rotary=getattr(backbone, "rotary_emb", None),
        rope_per_layer_type=spec.rope_per_layer_type,
        final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
        layer_types=tuple(sorted({p.layer_type for p in layers})),
    )


# ----- config keys ------------------------------------------------------------------------------
# config fields that must match for one model's layers to run inside another's plan
SHAPE_KEYS = ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_hidden_layers", "n_embd", "n_head", "n_layer")
# config.json model_type of a multimodal wrapper -> the text model transformers' CausalLM loads
TEXT_MODEL_TYPES = {"gemma3": "gemma3_text"}


def spec_for_config(config: dict[str, Any]) -> ArchSpec:
    """The ArchSpec for a config.json (read before loading weights: fail early)."""
    model_type = config.get("model_type", "?")
    return arch_spec(TEXT_MODEL_TYPES.get(model_type, model_type))


def config_depth(config: dict[str, Any]) -> int | None:
    """Number of decoder layers from a config.json dict (None if it does not say)."""
    config = config.get("text_config", config)
    depth = config.get("num_hidden_layers", config.get("n_layer"))
    return int(depth) if depth is not None else None


def context_length(config) -> int:
    """The longest sequence the model was trained for (prompt plus generated tokens)."""
    return int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048))


def layer_prefix(model_type: str) -> str:
    """State-dict prefix of decoder layer i's weights, without i ("model.layers.")."""
    spec = arch_spec(model_type)
    return f"{spec.backbone}.{spec.layers}."


def config_with_layers(config, layers: list[int]):
    """A copy of a transformers config for a model whose layer j is the original's layers[j]:
    the depth key of the architecture, per-layer `layer_types` rebuilt."""
    original = config
    config = copy.deepcopy(config)
    if hasattr(config, "n_layer") and config.model_type == "gpt2":
        config.n_layer = len(layers)
    else:
        config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [original.layer_types[i] for i in layers]
    if hasattr(config, "max_window_layers") and getattr(config, "layer_types", None) is not None:
        config.max_window_layers = len(layers)  # layer_types already says which layers slide
    return config
