"""Finding a decoder-only model's parts from its own modules, by the conventions transformers'
causal LMs share, instead of a hand-written row per architecture.

Two things are learnt from a tiny random model of the architecture (built from the real config,
shrunk: `tiny_config`), never from the real weights:

- which direct children of a decoder layer are its attention, its MLP (or mixture-of-experts
  block) and its norms, and how they are wired: one forward pass of transformers' own model with
  hooks on those children records which norm's output each sub-layer reads and which norm reads a
  sub-layer's output (pre-norms, post-norms, sandwich norms, no pre-norm at all);
- the norm's weight convention (`w * x` or Gemma's `(1 + w) * x`), by feeding it a known input.

What a forward hook cannot see (multipliers applied inside the layer's or the model's forward)
comes from config keys, listed in architectures.CONFIG_SCALES. Discovery only proposes; the check
that makes a discovered architecture usable is engine/verify.py (identity plan == transformers).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import inspect
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerplan.files import cache_dir, write_json_atomic
from layerplan.models.arch_table import ARCHITECTURES, ArchSpec
from layerplan.models.architectures import (ATTENTION_NAMES, CONFIG_SCALES, FINAL_NORM_NAMES, MLP_NAMES, ModelError,
                                            model_parts, refusal_of_config, remember_discovered)

# the code whose behaviour a cached discovery or check depends on: any change to it redoes them
_CODE = ("models/discovery.py", "models/arch_table.py", "models/architectures.py", "engine/verify.py",
         "engine/runner.py", "engine/cache.py", "engine/passes.py", "engine/executors.py", "engine/native.py",
         "engine/kernels.c")

# sizes of the tiny model a discovered architecture is learnt and verified on
TINY_VOCAB = 96
TINY_LAYERS = 3
_TINY_SIZES = {
    "vocab_size": TINY_VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128, "initializer_range": 0.15,
    # mixture of experts: few small experts, two per token, so routing matters
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "decoder_sparse_step": 1,
    # multi-head latent attention (DeepSeek-V2/V3)
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "qk_head_dim": 12,
    # GPT-2 style names
    "n_embd": 32, "n_head": 4, "n_positions": 128, "n_inner": 64, "rotary_dim": 4,
    "word_embed_proj_dim": 32, "ffn_dim": 64,  # OPT's names
    "sliding_window": 4, "window_size": 4,  # shorter than the test sequences, so windows are exercised
    "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}


# keys whose None means "the model has none of this": a tiny config keeps them None
_NONE_MEANS_ABSENT = ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping", "q_lora_rank", "n_group",
                      "rotary_dim", "topk_group", "pad_token_id", "bos_token_id", "eos_token_id")


def tiny_config(config, num_layers: int = TINY_LAYERS):
    """A copy of a transformers config with the same architecture and options but tiny sizes:
    per-layer lists (layer types, which layers use RoPE, ...) keep every distinct value, and the
    config-key multipliers get values that are not 1, so that the check exercises them."""
    values = config.to_dict()
    depth = values.get("num_hidden_layers", values.get("n_layer"))
    for key, value in list(values.items()):
        if isinstance(value, list) and depth and len(value) == depth and "token_id" not in key and key != "architectures":
            distinct = list(dict.fromkeys(map(_hashable, value)))
            picks = [next(v for v in value if _hashable(v) == distinct[i % len(distinct)]) for i in range(num_layers)]
            values[key] = picks
    for key in ("num_hidden_layers", "n_layer"):
        if key in values:
            values[key] = num_layers
    heads, kv_heads = values.get("num_attention_heads"), values.get("num_key_value_heads")
    for key, value in _TINY_SIZES.items():
        if key in values and (values[key] is not None or key not in _NONE_MEANS_ABSENT):
            values[key] = value
    if heads is not None and kv_heads == heads:  # multi-head attention stays multi-head (MLA needs it)
        values["num_key_value_heads"] = values["num_attention_heads"]
    if "qk_rope_head_dim" in values:  # multi-head latent attention: RoPE covers qk_rope_head_dim only
        values["head_dim"] = values["qk_rope_head_dim"]
    for key, (_, tiny_value) in CONFIG_SCALES.items():
        if key in values:
            values[key] = tiny_value
    rope = values.get("rope_parameters")
    if isinstance(rope, dict) and any(isinstance(v, list) for v in rope.values()):
        values["rope_parameters"] = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}
    values.pop("quantization_config", None)
    values.pop("auto_map", None)
    try:
        return type(config).from_dict(values)
    except Exception as error:  # noqa: BLE001 - any refusal of the shrunk config is reported as such
        raise ModelError(f"architecture '{config.model_type}': a tiny config of it cannot be built ({_one_line(error)})") from None


def tiny_model(config, seed: int = 0, attn: str = "sdpa") -> nn.Module:
    """transformers' own CausalLM for a (tiny) config, random weights, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = copy.deepcopy(config)
    config._attn_implementation = attn
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    except Exception as error:  # noqa: BLE001 - any refusal of transformers is reported as such
        if isinstance(error, ValueError) and "attention implementation" in str(error) and attn != "eager":
            return tiny_model(config, seed, "eager")  # soft-capping, sinks: transformers runs these eagerly only
        raise ModelError(f"architecture '{config.model_type}': transformers cannot build it from a config "
                         f"({_one_line(error)})") from None
    _randomise_zero_weights(model)
    return model.eval()


def _randomise_zero_weights(model: nn.Module) -> None:
    """Norm weights initialised to 1 (or 0 for `1 + w` norms) and zero biases make a norm
    indistinguishable from its absence; random values make the check see every module."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1 and param.numel() and torch.all(param == param[0]):
                param.add_(0.2 * torch.randn(param.shape, generator=generator))


def discover_spec(hf_model: nn.Module) -> ArchSpec:
    """The ArchSpec of a (tiny) transformers CausalLM, from its module names and one traced pass."""
    config = hf_model.config
    refusal = refusal_of_config(config)
    if refusal:
        raise ModelError(f"architecture '{config.model_type}' is refused: {refusal}")
    backbone_name = getattr(hf_model, "base_model_prefix", "model") or "model"
    backbone = getattr(hf_model, backbone_name, None)
    if backbone is None:
        raise ModelError(f"architecture '{config.model_type}': no decoder stack at .{backbone_name}")
    depth = config.num_hidden_layers if hasattr(config, "num_hidden_layers") else getattr(config, "n_layer", None)
    layers_name = next((name for name, child in backbone.named_children()
                        if isinstance(child, nn.ModuleList) and len(child) == depth), None)
    if layers_name is None and hasattr(backbone, "encoder"):
        raise ModelError(f"architecture '{config.model_type}' is refused: an encoder (BERT style) that transformers can "
                         "run as a decoder; not a decoder-only causal LM")
    if layers_name is None:
        raise ModelError(f"architecture '{config.model_type}': no list of {depth} decoder layers in its {type(backbone).__name__}")
    layers = getattr(backbone, layers_name)
    embed = hf_model.get_input_embeddings()
    embed_name = next((name for name, child in backbone.named_children() if child is embed), None)
    if embed_name is None:
        raise ModelError(f"architecture '{config.model_type}': its token embeddings are not a child of {type(backbone).__name__}")
    position_embed = next((name for name, child in backbone.named_children()
                           if isinstance(child, nn.Embedding) and child is not embed and name in ("wpe", "embed_positions")), None)
    final_norm = next((name for name in FINAL_NORM_NAMES if isinstance(getattr(backbone, name, None), nn.Module)), None)
    if final_norm is None:
        raise ModelError(f"architecture '{config.model_type}': no final norm ({', '.join(FINAL_NORM_NAMES)}) in its {type(backbone).__name__}")
    unknown = [name for name, child in backbone.named_children()
               if name not in (embed_name, layers_name, final_norm, position_embed, "rotary_emb")
               and not isinstance(child, (nn.Dropout, nn.Identity))]
    if unknown:
        raise ModelError(f"architecture '{config.model_type}': its {type(backbone).__name__} has modules layerplan does not "
                         f"know how to run: {', '.join(unknown)}")
    wiring = [_trace_layer(hf_model, layers, i, config.model_type) for i in range(len(layers))]
    first = wiring[0]
    for i, other in enumerate(wiring[1:], 1):
        if other != first:
            raise ModelError(f"architecture '{config.model_type}': decoder layer {i} is wired differently from layer 0 "
                             f"({other} vs {first})")
    rotary = getattr(backbone, "rotary_emb", None)
    rope_per_type = rotary is not None and "layer_type" in _parameters(rotary.forward)
    layer0 = layers[0]
    offset = 0.0
    for norm_name in (first["attention_norm"], first["mlp_norm"], first["attention_post_norm"], first["mlp_post_norm"]):
        if norm_name is not None:
            offset = _norm_offset(getattr(layer0, norm_name))
            break
    return ArchSpec(
        backbone=backbone_name, embed=embed_name, layers=layers_name, final_norm=final_norm,
        attention=first["attention"], attention_norm=first["attention_norm"], mlp=first["mlp"], mlp_norm=first["mlp_norm"],
        attention_post_norm=first["attention_post_norm"], mlp_post_norm=first["mlp_post_norm"],
        position_embed=position_embed, rope_per_layer_type=rope_per_type, mlp_returns_tuple=first["mlp_returns_tuple"],
        parallel=first["parallel"],
        attention_output=None, mlp_output=None, norm_weight_offset=offset, discovered=True,
    )


def _trace_layer(hf_model: nn.Module, layers: nn.ModuleList, index: int, model_type: str) -> dict[str, Any]:
    """Run the model once and record, for decoder layer `index`, which child reads which tensor."""
    layer = layers[index]
    children = {name: child for name, child in layer.named_children() if not isinstance(child, (nn.Dropout, nn.Identity))}
    attention = next((n for n in ATTENTION_NAMES if n in children), None)
    mlp = next((n for n in MLP_NAMES if n in children), None)
    if attention is None:
        raise ModelError(f"architecture '{model_type}': decoder layer {index} has no attention module "
                         f"({', '.join(ATTENTION_NAMES)}); it has {', '.join(children) or 'none'}")
    if mlp is None:
        raise ModelError(f"architecture '{model_type}': decoder layer {index} has no MLP module "
                         f"({', '.join(MLP_NAMES)}); it has {', '.join(children)}")
    norms = [n for n, child in children.items() if n not in (attention, mlp) and _is_norm(child)]
    other = [n for n in children if n not in (attention, mlp) and n not in norms]
    if other:
        raise ModelError(f"architecture '{model_type}': decoder layer {index} has modules layerplan does not know "
                         f"how to run: {', '.join(other)}")
    calls: dict[str, list[tuple[Any, Any]]] = {}

    def hook(name):
        def record(module, args, kwargs, output):
            first_input = args[0] if args else kwargs.get("hidden_states")
            calls.setdefault(name, []).append((first_input, output))
        return record

    handles = [children[n].register_forward_hook(hook(n), with_kwargs=True) for n in (attention, mlp, *norms)]
    try:
        with torch.no_grad():
            hf_model(torch.arange(3, 9)[None] % hf_model.config.vocab_size)
    except Exception as error:  # noqa: BLE001
        raise ModelError(f"architecture '{model_type}': transformers' own forward pass fails on a tiny config "
                         f"({_one_line(error)})") from None
    finally:
        for handle in handles:
            handle.remove()
    for name in (attention, mlp, *norms):
        if len(calls.get(name, ())) != 1:
            raise ModelError(f"architecture '{model_type}': decoder layer {index}'s {name} ran {len(calls.get(name, ()))} "
                             "times in one forward pass, not once")
    (attn_in, attn_out), (mlp_in, mlp_out) = calls[attention][0], calls[mlp][0]
    attn_out, mlp_out = (out[0] if isinstance(out, tuple) else out for out in (attn_out, mlp_out))

    def norm_reading(tensor):
        return next((n for n in norms if calls[n][0][0] is tensor), None)

    def norm_writing(tensor):
        return next((n for n in norms if calls[n][0][1] is tensor), None)

    attention_norm, mlp_norm = norm_writing(attn_in), norm_writing(mlp_in)
    wiring = {"attention": attention, "mlp": mlp, "attention_norm": attention_norm, "mlp_norm": mlp_norm,
              "attention_post_norm": norm_reading(attn_out), "mlp_post_norm": norm_reading(mlp_out),
              "mlp_returns_tuple": isinstance(calls[mlp][0][1], tuple)}
    # a parallel block: the MLP reads the attention's input, or its own norm of the layer's input
    wiring["parallel"] = mlp_in is attn_in or bool(
        attention_norm and mlp_norm and calls[attention_norm][0][0] is calls[mlp_norm][0][0])
    if mlp_in is attn_in:
        wiring["mlp_norm"] = attention_norm
    unused = [n for n in norms if n not in (wiring["attention_norm"], wiring["mlp_norm"], wiring["attention_post_norm"],
                                            wiring["mlp_post_norm"])]
    if unused:
        raise ModelError(f"architecture '{model_type}': decoder layer {index}'s norm(s) {', '.join(unused)} are not applied "
                         "right before or after its attention or MLP")
    return wiring


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() or isinstance(module, nn.LayerNorm)


def _norm_offset(norm: nn.Module) -> float:
    """1.0 for a norm that multiplies by (1 + weight) (Gemma), else 0.0."""
    weight = getattr(norm, "weight", None)
    if weight is None or weight.dim() != 1:
        return 0.0
    x = torch.linspace(-1, 1, weight.numel())[None]
    bias = getattr(norm, "bias", None)
    saved = [(p, p.detach().clone()) for p in (weight, bias) if isinstance(p, torch.Tensor)]
    try:
        with torch.no_grad():
            for p, _ in saved:
                p.fill_(0.0)
            zero = norm(x)
    finally:
        with torch.no_grad():
            for p, value in saved:
                p.copy_(value)
    return 1.0 if zero.abs().max() > 1e-6 else 0.0


def _parameters(function) -> set[str]:
    return set(inspect.signature(function).parameters)


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


# ----- what was found (and checked) once, cached ------------------------------------------------
_SPECS: dict[str, ArchSpec] = {}


def architecture_key(config) -> str:
    """Names one architecture-and-options for the caches: the tiny config (every option, no
    sizes), transformers' version and the code that discovers and checks (_CODE)."""
    values = tiny_config(config).to_dict()
    for volatile in ("_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype", "_attn_implementation"):
        values.pop(volatile, None)
    text = json.dumps(values, sort_keys=True, default=str) + f"|{_code_version()}"
    return f"{config.model_type}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


@lru_cache(maxsize=1)
def _code_version() -> str:
    import transformers

    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256(transformers.__version__.encode())
    for name in _CODE:
        path = package / name
        digest.update(path.read_bytes() if path.exists() else b"-")
    return digest.hexdigest()[:16]


def _record_path(key: str, kind: str):
    return cache_dir() / "architectures" / f"{key}.{kind}.json"


def read_record(key: str, kind: str) -> dict | None:
    try:
        return json.loads(_record_path(key, kind).read_text())
    except (OSError, ValueError):
        return None


def write_record(key: str, kind: str, record: dict) -> None:
    write_json_atomic(_record_path(key, kind), record)


def spec_of(config, sample: nn.Module | None = None) -> ArchSpec:
    """Where a model keeps its parts: the table's row, else discovered on a tiny model of the
    architecture (cached in memory and in the cache folder). `sample`: an already built tiny model
    of this config to discover on (the check's own)."""
    table = ARCHITECTURES.get(config.model_type)
    if table is not None:
        return table
    refusal = refusal_of_config(config)
    if refusal:
        raise ModelError(f"architecture '{config.model_type}' is refused: {refusal}")
    key = architecture_key(config)
    spec = _SPECS.get(key)
    if spec is None:
        record = read_record(key, "spec")
        names = {f.name for f in dataclasses.fields(ArchSpec)}
        spec = ArchSpec(**record) if record is not None and set(record) == names else None
    if spec is None:
        spec = discover_spec(sample if sample is not None else tiny_model(tiny_config(config)))
        write_record(key, "spec", dataclasses.asdict(spec))
    _SPECS[key] = spec
    remember_discovered(config.model_type, spec)
    return spec


def parts_of(hf_model: nn.Module):
    """The ModelParts of a transformers CausalLM (see spec_of)."""
    return model_parts(hf_model, spec_of(hf_model.config))


def native_allowed(config) -> bool:
    """Whether the native kernels may run this architecture: the table's rows (checked by the test
    suite), and discovered ones whose check passed with the kernels on."""
    if config.model_type in ARCHITECTURES:
        return True
    record = read_record(architecture_key(config), "check")
    return bool(record and record.get("passed") and record.get("native"))


def require_checked(config) -> None:
    """Refuse a discovered architecture that has not passed its check (engine/verify.py)."""
    if config.model_type in ARCHITECTURES:
        return
    record = read_record(architecture_key(config), "check")
    if record is None:
        raise ModelError(f"architecture '{config.model_type}': its parts were discovered but not yet checked against "
                         "transformers; load it with layerplan.load_model or the CLI, which check it once")
    if not record.get("passed"):
        raise ModelError(record.get("detail") or f"architecture '{config.model_type}' failed its check")
