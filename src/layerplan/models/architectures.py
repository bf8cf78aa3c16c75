"""Every per-architecture fact in one place: where modules live (the table, models/arch_table.py,
resolved here into a model's modules), and what config keys mean.

The table is the only place that knows module names. Everything else works on `ModelParts`: the
embeddings, one `LayerParts` per decoder layer, the final norm and the LM head, all of them the
model's own modules (nothing copied, nothing patched). Config-key facts (depth, context length,
the `model_type` a GGUF conversion reports, how an exported checkpoint states its depth) live
here too, next to the table.
"""

from __future__ import annotations

import copy
import inspect
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from torch import nn

from layerplan.models.arch_table import ARCHITECTURES, ArchSpec, layer_attention
from layerplan.models.errors import ModelError


# ----- the conventions discovery looks for (models/discovery.py) ---------------------------------
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward", "moe", "ffn")
FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "norm_f", "final_layer_norm")
# last name of a parameter (or of the module holding it) that produces a sub-layer's update:
# scaling these scales the update (experts' stacked down projections included)
OUTPUT_NAMES = ("o_proj", "c_proj", "out_proj", "dense", "down_proj", "down_proj_bias", "w2", "fc2", "fc_out", "wo",
                "dense_4h_to_h", "output_proj", "output_linear")
# multipliers that transformers applies in a model's or layer's forward, not in a module, named by
# config key: key -> (where it applies, a value != 1 that tiny configs use so the check sees it)
CONFIG_SCALES = {
    "embedding_multiplier": ("embeddings *", 1.5),  # Granite
    "residual_multiplier": ("sub-layer update *", 0.7),  # Granite
    "logits_scaling": ("logits /", 2.0),  # Granite
    "logit_scale": ("logits *", 0.5),  # Cohere
}
# the router inside a mixture-of-experts block; transformers' routers return (router logits
# (tokens, experts), top-k weights, top-k expert indices (tokens, k)); ROUTER_COUNTS: the exceptions
ROUTER_NAMES = ("gate", "router")
ROUTER_COUNTS = {"jetmoe": "counts"}  # JetMoE's gating returns (…, selections per expert, logits)
KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")
_STATE_WORDS = ("linear", "mamba", "conv", "recurrent", "ssm", "rwkv", "lstm", "deltanet", "lightning", "hybrid")


def refusal_of_config(config) -> str | None:
    """Why the plan runner cannot run an architecture, from its config alone (None: no reason)."""
    for key in ("layer_types", "layers_block_type", "hybrid_override_pattern", "block_types"):
        types = getattr(config, key, None)
        if not isinstance(types, (list, tuple)):
            continue
        for kind in dict.fromkeys(map(str, types)):
            if kind in KNOWN_LAYER_TYPES:
                continue
            if any(word in kind.lower() for word in _STATE_WORDS) or key != "layer_types":
                return (f"its layers keep recurrent or linear-attention state (layer type '{kind}'); "
                        "the plan runner's KV cache holds attention keys and values only")
            return f"layer type '{kind}' is not one the plan runner knows ({', '.join(KNOWN_LAYER_TYPES)})"
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model, not a decoder-only causal LM"
    if getattr(config, "do_layer_norm_before", True) is False:  # OPT-350m
        return ("its layers normalise the residual stream after each sub-layer (do_layer_norm_before=false), "
                "so a skipped or repeated sub-layer would change what every later layer reads")
    if getattr(config, "word_embed_proj_dim", None) not in (None, getattr(config, "hidden_size", None)):
        return "its embeddings are projected into and out of the layers' width (word_embed_proj_dim)"
    if getattr(config, "add_cross_attention", False):
        return "its layers attend to an encoder's states too (add_cross_attention), which a causal LM does not have"
    if getattr(config, "alibi", False):  # Falcon-RW; the plan runner's positions are rotary or learned
        return "it positions tokens by ALiBi biases (config alibi=True), which the plan runner does not build"
    text = vars(config).get("text_config")
    if text is not None and text is not config:
        return (f"a multimodal wrapper (its text model is '{text.model_type}'); its CausalLM takes more than "
                "token ids")
    parts = [key for key, value in vars(config).items() if hasattr(value, "model_type")]
    if parts:
        return f"a composite model (sub-models {', '.join(parts)}), not one decoder stack over token ids"
    return None


class FirstOutput(nn.Module):
    """The first element of what a module returns: a mixture-of-experts block that also returns
    its router scores, as the update the plan runner adds."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)[0]


def router_of(mlp: nn.Module) -> nn.Module | None:
    """The router module of a layer's mixture-of-experts block (None for a dense MLP)."""
    inner = mlp.inner if isinstance(mlp, FirstOutput) else mlp
    for name in ROUTER_NAMES:
        router = getattr(inner, name, None)
        if isinstance(router, nn.Module):
            return router
    return None


def expert_selections(model_type: str, router_output: Any) -> torch.Tensor | None:
    """How many top-k selections each expert got in one router call, shape (experts,); None when
    the output is not a router's (a dense MLP's linear that happens to be called 'gate')."""
    if not isinstance(router_output, tuple):
        return None
    if ROUTER_COUNTS.get(model_type) == "counts":
        return torch.as_tensor(router_output[3])
    logits, indices = router_output[0], router_output[-1]
    if not (torch.is_tensor(indices) and torch.is_tensor(logits)) or indices.is_floating_point():
        return None
    return torch.bincount(indices.reshape(-1).cpu(), minlength=logits.shape[-1])


class Scaled(nn.Module):
    """A module's output (or its input, without a module) times a constant: the multipliers a
    model applies in its forward (CONFIG_SCALES), as a part the plan runner calls."""

    def __init__(self, inner: nn.Module | None, factor: float) -> None:
        super().__init__()
        self.inner = inner
        self.factor = factor

    def forward(self, x):
        return (self.inner(x) if self.inner is not None else x) * self.factor


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer's modules, looked up once so the hot loop does no attribute walking."""

    attention_norm: nn.Module
    attention: nn.Module
    attention_post_norm: nn.Module | None
    mlp_norm: nn.Module
    mlp: nn.Module  # a mixture-of-experts block is the layer's MLP sub-layer
    mlp_post_norm: nn.Module | None
    layer_type: str  # "full_attention" or "sliding_attention" (selects mask and RoPE)
    sliding_window: int | None  # attend to at most this many most recent positions
    parallel: bool = False  # the MLP reads the layer's input, as the attention does (a parallel block)
    cache_argument: str = "past_key_values"  # the attention's name for the KV cache (cache_argument_of)
    takes_positions: bool = False  # the attention computes its own rotary from position_ids (GPT-J, CodeGen)
    takes_alibi: bool = False  # the attention takes an ALiBi bias argument, None here (Falcon without ALiBi)


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


# an attention module's name for its KV cache, newest first: transformers 5.24 renamed
# `past_key_values` to `cache` (the old name still works there with a FutureWarning, and goes in
# 5.40); the GPT-NeoX family of older releases says `layer_past`
CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")


def cache_argument_of(arguments) -> str:
    """The name under which an attention module's forward takes its KV cache."""
    return next((name for name in CACHE_ARGUMENTS if name in arguments), "past_key_values")


def _mlp_of(layer: nn.Module, spec: ArchSpec) -> nn.Module:
    if spec.mlp_sequence:  # not attached to the layer: the same modules, called in order
        return nn.Sequential(*(_get(layer, name) for name in spec.mlp_sequence))
    return FirstOutput(_get(layer, spec.mlp)) if spec.mlp_returns_tuple else _get(layer, spec.mlp)


class OffsetPositions(nn.Module):
    """A position table whose rows start at `offset` (2 in OPT, BioGPT, XGLM), called with
    positions: a learned nn.Embedding's weight, or XGLM's sinusoidal `weights` buffer."""

    def __init__(self, table: nn.Module) -> None:
        super().__init__()
        self.table = table

    def forward(self, positions):
        weights = self.table.weight if isinstance(self.table, nn.Embedding) else self.table.weights
        return nn.functional.embedding(positions + self.table.offset, weights)


def _positions_of(module: nn.Module) -> nn.Module:
    tabled = isinstance(module, nn.Embedding) or isinstance(getattr(module, "weights", None), torch.Tensor)
    return OffsetPositions(module) if tabled and isinstance(getattr(module, "offset", None), int) else module


def _get(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


# specs found by discovery in this process, by model_type (arch_spec's answer for them)
_DISCOVERED: dict[str, ArchSpec] = {}


def remember_discovered(model_type: str, spec: ArchSpec) -> None:
    _DISCOVERED[model_type] = spec


def arch_spec(model_type: str) -> ArchSpec:
    spec = ARCHITECTURES.get(model_type) or _DISCOVERED.get(model_type)
    if spec is None:
        raise ModelError(
            f"architecture '{model_type}' is not supported yet; see `layerplan models --architectures`"
        )
    return spec


def model_parts(hf_model: nn.Module, spec: ArchSpec) -> ModelParts:
    """The parts of a loaded CausalLM, found where `spec` says."""
    config = hf_model.config
    refusal = refusal_of_config(config)
    if refusal:
        raise ModelError(f"architecture '{config.model_type}' is refused: {refusal}")
    unknown = [t for t in (getattr(config, "layer_types", None) or ()) if t not in KNOWN_LAYER_TYPES]
    if unknown:
        raise ModelError(f"architecture '{config.model_type}': layer type '{unknown[0]}' is not one the plan runner knows")
    backbone = _get(hf_model, spec.backbone)
    residual = getattr(config, "residual_multiplier", None)
    residual = None if residual in (None, 1, 1.0) else float(residual)
    layers = []
    decoder_layers = _get(backbone, spec.layers)
    windows = layer_attention(config, len(decoder_layers))
    for i, layer in enumerate(decoder_layers):
        layer_type, window = windows[i]
        attention_post = _get(layer, spec.attention_post_norm) if spec.attention_post_norm else None
        mlp_post = _get(layer, spec.mlp_post_norm) if spec.mlp_post_norm else None
        if residual is not None:  # Granite: residual + multiplier * update
            attention_post, mlp_post = Scaled(attention_post, residual), Scaled(mlp_post, residual)
        attention = _get(layer, spec.attention)
        arguments = inspect.signature(attention.forward).parameters
        layers.append(
            LayerParts(
                attention_norm=_get(layer, spec.attention_norm) if spec.attention_norm else nn.Identity(),
                attention=attention,
                attention_post_norm=attention_post,
                mlp_norm=_get(layer, spec.mlp_norm) if spec.mlp_norm else nn.Identity(),
                mlp=_mlp_of(layer, spec),
                mlp_post_norm=mlp_post,
                layer_type=layer_type,
                sliding_window=window,
                parallel=spec.parallel,
                # the attention's own arguments: the installed transformers' cache name; position
                # ids; Falcon's ALiBi bias
                cache_argument=cache_argument_of(arguments),
                takes_positions="position_ids" in arguments,
                takes_alibi="alibi" in arguments,
            )
        )
    embed = _get(backbone, spec.embed)
    multiplier = getattr(config, "embedding_multiplier", None)
    if multiplier not in (None, 1, 1.0):
        embed = Scaled(embed, float(multiplier))
    lm_head = hf_model.get_output_embeddings()
    final_norm = _get(backbone, spec.final_norm)
    logit_factor = 1.0 / float(getattr(config, "logits_scaling", None) or 1.0) * float(getattr(config, "logit_scale", None) or 1.0)
    if logit_factor != 1.0:
        # the head is linear: scaling its input scales the logits (a head bias would not be scaled)
        if getattr(lm_head, "bias", None) is not None:
            raise ModelError(f"architecture '{config.model_type}': logit scaling with a biased LM head is not supported")
        final_norm = Scaled(final_norm, logit_factor)
    return ModelParts(
        embed=embed,
        position_embed=_positions_of(_get(backbone, spec.position_embed)) if spec.position_embed else None,
        layers=tuple(layers),
        final_norm=final_norm,
        lm_head=lm_head,
        rotary=getattr(backbone, "rotary_emb", None),
        rope_per_layer_type=spec.rope_per_layer_type,
        final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
        layer_types=tuple(sorted({p.layer_type for p in layers})),
    )


def update_parameters(spec: ArchSpec, sub_layer: str, layer_state: dict[str, Any]) -> tuple[list[str], float | None]:
    """(names in a layer's state dict whose scaling by s scales the sub-layer's update by s, the
    norm offset when those are a post-norm's weight (scaled as (offset + w) * s - offset), else None)."""
    post_norm = spec.attention_post_norm if sub_layer == "attention" else spec.mlp_post_norm
    if post_norm is not None:
        names = [f"{post_norm}.weight"] + ([f"{post_norm}.bias"] if f"{post_norm}.bias" in layer_state else [])
        return names, spec.norm_weight_offset
    output = spec.attention_output if sub_layer == "attention" else spec.mlp_output
    if output is not None:
        return [n for n in (f"{output}.weight", f"{output}.bias") if n in layer_state], None
    module = spec.attention if sub_layer == "attention" else spec.mlp
    inside = [name for name in layer_state if name.startswith(f"{module}.")]
    # a norm that ends the sub-layer inside its module (AXK1's post_mlp_layernorm) undoes any
    # scaling before it: scale that norm instead
    post = [n for n in inside if "post" in n and "norm" in n.rsplit(".", 2)[-2] and n.rsplit(".", 1)[-1] in ("weight", "bias")]
    if post:
        return post, spec.norm_weight_offset
    names = []
    for name in inside:
        pieces = name.split(".")
        if (pieces[-1] in OUTPUT_NAMES or (pieces[-1] in ("weight", "bias") and pieces[-2] in OUTPUT_NAMES)
                or (pieces[-1] == "bias" and pieces[-2] in (module, "experts"))):  # a bias added to the experts' sum (JetMoE)
            names.append(name)
    return names, None


# ----- config keys ------------------------------------------------------------------------------
# config fields that must match for one model's layers to run inside another's plan
# config.json model_type of a multimodal wrapper -> the text model transformers' CausalLM loads
TEXT_MODEL_TYPES = {"gemma3": "gemma3_text"}


def text_model_type(config: dict[str, Any]) -> str:
    """The model_type transformers' CausalLM loads for a config.json (multimodal wrappers mapped)."""
    model_type = config.get("model_type", "?")
    return TEXT_MODEL_TYPES.get(model_type, model_type)


_NOT_PER_LAYER = ("architectures", "eos_token_id", "bos_token_id", "pad_token_id", "mlp_only_layers")


def config_with_layers(config, layers: list[int]):
    """A copy of a transformers config for a model whose layer j is the original's layers[j]:
    the depth key of the architecture, per-layer `layer_types` rebuilt."""
    original = config
    config = copy.deepcopy(config)
    if hasattr(config, "n_layer") and config.model_type == "gpt2":
        config.n_layer = len(layers)
    else:
        config.num_hidden_layers = len(layers)
    depth = original.num_hidden_layers if hasattr(original, "num_hidden_layers") else getattr(original, "n_layer", None)
    for key, value in vars(original).items():
        # per-layer lists (layer_types, which layers use RoPE, ...) follow their layers
        if isinstance(value, list) and depth and len(value) == depth and key not in _NOT_PER_LAYER:
            setattr(config, key, [value[i] for i in layers])
    if getattr(original, "mlp_only_layers", None):  # Qwen-MoE: indices of the dense layers
        config.mlp_only_layers = [j for j, i in enumerate(layers) if i in original.mlp_only_layers]
    if hasattr(config, "max_window_layers") and getattr(config, "layer_types", None) is not None:
        config.max_window_layers = len(layers)  # layer_types already says which layers slide
    return config


# ----- the status of every causal LM of the installed transformers -------------------------------
# `layerplan models --architectures` and docs/architectures.md list these;
# tests/test_architectures.py checks every TINY_CHECKED one (identity, exit, repeat/export,
# speculative) and that the lists cover all of transformers' causal LMs. They are data,
# generated: architecture_status.json beside this file
# (package data), written by `python -m layerplan.app.architecture_status` from the check of
# engine/verify.py (`layerplan models --check TYPE` runs it for one type).
STATUS_FILE = "architecture_status.json"
_STATUS = json.loads(resources.files(__package__).joinpath(STATUS_FILE).read_text(encoding="utf-8"))
CHECKED_WITH: str = _STATUS["checked_with"]  # the transformers whose causal LMs the lists cover
REAL_CHECKED: dict[str, str] = _STATUS["real_checkpoint"]  # model type -> the real checkpoint it was verified on
TINY_CHECKED: tuple[str, ...] = tuple(_STATUS["tiny_checked"])  # verified on a tiny config by the test suite
MIXTURE_OF_EXPERTS: frozenset[str] = frozenset(_STATUS["mixture_of_experts"])
REFUSED: dict[str, str] = _STATUS["refused"]  # model type -> why the plan runner cannot run it
NOT_SUPPORTED: dict[str, str] = _STATUS["not_supported"]  # model type -> what failed (runnable in principle)
# the families issue 15 names -> the model_type that runs them
NAMED_FAMILIES = {
    "Llama 3.x": "llama", "Qwen2 / Qwen2.5": "qwen2", "Qwen3": "qwen3", "Mistral": "mistral", "Ministral": "ministral",
    "Gemma 2": "gemma2", "Gemma 3": "gemma3_text", "Phi-3 / Phi-4": "phi3", "OLMo 2": "olmo2", "OLMo 3": "olmo3",
    "OLMoE": "olmoe", "Granite": "granite", "SmolLM3": "smollm3", "Cohere": "cohere", "DeepSeek-V2": "deepseek_v2",
    "DeepSeek-V3": "deepseek_v3", "Mixtral": "mixtral", "Qwen-MoE": "qwen2_moe", "Qwen3-MoE": "qwen3_moe",
    "GPT-OSS": "gpt_oss", "GLM-4": "glm4", "StarCoder2": "starcoder2",
}


@dataclass(frozen=True)
class ArchitectureStatus:
    model_type: str
    status: str  # one of STATUSES
    detail: str
    mixture_of_experts: bool

    def to_json(self) -> dict[str, Any]:
        return {"model_type": self.model_type, "status": self.status, "detail": self.detail,
                "mixture_of_experts": self.mixture_of_experts}


STATUSES = ("verified on a real checkpoint", "verified on a tiny config", "refused", "not supported yet", "not checked")


def architecture_statuses() -> list[ArchitectureStatus]:
    """One status per causal LM of the installed transformers (and per type listed above)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(TINY_CHECKED) | set(REFUSED) | set(NOT_SUPPORTED)):
        if model_type in REAL_CHECKED:
            status, detail = STATUSES[0], REAL_CHECKED[model_type]
        elif model_type in TINY_CHECKED:
            status, detail = STATUSES[1], f"identity, exit, repeat/export and speculative tests ({CHECKED_WITH})"
        elif model_type in REFUSED:
            status, detail = STATUSES[2], REFUSED[model_type]
        elif model_type in NOT_SUPPORTED:
            status, detail = STATUSES[3], NOT_SUPPORTED[model_type]
        else:
            status, detail = STATUSES[4], f"new since {CHECKED_WITH}: `layerplan models --check {model_type}` checks it"
        found.append(ArchitectureStatus(model_type, status, detail, model_type in MIXTURE_OF_EXPERTS))
    return found
