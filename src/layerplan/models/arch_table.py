"""The architecture table: where each architecture keeps its modules and parameters, and how the
native kernels read its layers. Plain data (no torch): the torch front end resolves it into modules
(models/architectures.py), and the file index (models/file_index.py) and the light front end
(lite/model.py) read a GGUF's tensors by the names it gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

# the LM head's name in every table row's CausalLM (its parameters: lm_head.weight, lm_head.bias)
HEAD = "lm_head"
# config.json's activation names -> the function (as ACTIVATIONS names a module's)
CONFIG_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}

@dataclass(frozen=True)
class KernelLayout:
    """How the native kernels (engine/native.py) read one architecture's decoder layer: the child
    modules of its attention and MLP, and the arithmetic of its RMSNorms. Only the table's rows
    whose layers were checked against transformers with the kernels have one (tests/test_native.py):
    other architectures share module names with other arithmetic (OLMo 2 normalises q and k over
    all heads at once, Granite scales residuals)."""

    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # stacked by rows in this order (Phi-3: one qkv_proj)
    qk_norms: bool = False  # the attention normalises q and k per head (q_norm, k_norm: Qwen3, Gemma 3)
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")  # gate rows, then up rows (Phi-3: one gate_up_proj)
    activation: str = "act_fn"  # the MLP's activation module (its class: ACTIVATIONS)
    norm: str = "llama"  # how its RMSNorms round (NORM_EPSILONS)
    # the light front end (lite/) runs it from a GGUF's index: tests/test_lite.py gives it the
    # torch front end's logits bit for bit
    light: bool = False

    @property
    def attention_children(self) -> frozenset[str]:
        return frozenset((*self.qkv, "o_proj", *(("q_norm", "k_norm") if self.qk_norms else ())))

    @property
    def mlp_children(self) -> frozenset[str]:
        return frozenset((*self.gate_up, "down_proj", self.activation))


# an RMSNorm's arithmetic -> the attribute holding its epsilon. "llama": weight × (the normalised
# input rounded to the dtype); "gemma": ((offset + weight) × the normalised input) rounded
# RoPE types (transformers' rope_parameters["rope_type"]) whose frequencies are fixed at load time:
# a table of them is exact (engine/rope.py), and a GGUF's index keeps them (models/stored.py)
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
NORM_EPSILONS = {"llama": "variance_epsilon", "gemma": "eps"}
# activation module classes -> the function they compute (those the native kernels reproduce)
ACTIVATIONS = {"SiLUActivation": "silu", "SiLU": "silu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh"}


@dataclass(frozen=True)
class ArchSpec:
    """Where one architecture keeps its modules (attribute paths from the CausalLM object).

    Written by hand in ARCHITECTURES for the exceptions; found by models/discovery.py for the rest."""

    backbone: str  # the decoder stack inside the CausalLM ("model", "transformer")
    embed: str  # token embeddings inside the backbone
    layers: str  # the ModuleList of decoder layers inside the backbone
    final_norm: str  # norm applied before the LM head
    attention: str  # attention module inside a decoder layer
    attention_norm: str | None  # norm before attention (None: the layer has none, OLMo 2)
    mlp: str  # MLP (or mixture-of-experts block) inside a decoder layer
    mlp_norm: str | None  # norm before the MLP
    attention_post_norm: str | None = None  # norm on the attention output (Gemma, OLMo 2)
    mlp_post_norm: str | None = None  # norm on the MLP output (Gemma, OLMo 2)
    position_embed: str | None = None  # learned absolute positions (GPT-2); None means RoPE
    rope_per_layer_type: bool = False  # rotary_emb(x, pos, layer_type) gives one RoPE per layer type
    # for exports: the linear whose output is the attention / MLP residual update (scaling its
    # weight and bias scales the update); unused where a post-norm follows (Gemma). None: every
    # parameter of the sub-layer named like an output projection (OUTPUT_NAMES), experts included
    attention_output: str | None = "self_attn.o_proj"
    mlp_output: str | None = "mlp.down_proj"
    norm_weight_offset: float = 0.0  # Gemma's RMSNorm multiplies by (offset + weight)
    mlp_returns_tuple: bool = False  # the MLP returns (update, router scores) (GPT-OSS)
    parallel: bool = False  # attention and MLP both read the layer's input (Cohere, Falcon, GPT-NeoX)
    discovered: bool = False  # found by discovery (checked against transformers before use)
    # a layer with no MLP module: these of its modules, called in order, are its MLP (OPT's
    # fc1, activation_fn, fc2); `mlp` is then unused
    mlp_sequence: tuple[str, ...] | None = None
    kernels: KernelLayout | None = None  # how the native kernels read its layers; None: they run eagerly
    scaled_embedding: bool = False  # the embedding module multiplies its rows by sqrt(hidden) (Gemma)

    def name(self, *path: str) -> str:
        """A module's or parameter's name from the CausalLM object, below the backbone:
        name("norm", "weight") is "model.norm.weight" for the llama family."""
        return ".".join((self.backbone, *path))

    def layer_name(self, layer: int | str, *path: str) -> str:
        """The name of something in decoder layer `layer` (or a template's "{i}"):
        layer_name(0, "self_attn", "q_proj", "weight") is "model.layers.0.self_attn.q_proj.weight"."""
        return ".".join((self.backbone, self.layers, str(layer), *path))


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

_OPT_LIKE = ArchSpec(
    backbone="model.decoder",
    embed="embed_tokens",
    layers="layers",
    final_norm="final_layer_norm",
    attention="self_attn",
    attention_norm="self_attn_layer_norm",
    mlp="",
    mlp_sequence=("fc1", "activation_fn", "fc2"),
    mlp_norm="final_layer_norm",
    position_embed="embed_positions",
    attention_output="self_attn.out_proj",
    mlp_output="fc2",
)

# The exceptions: architectures whose parts are written down instead of discovered (the first
# seven were hand-checked first and stay the reference, REFERENCE_ARCHITECTURES).
ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": replace(_LLAMA_LIKE, kernels=KernelLayout(light=True)),
    "mistral": replace(_LLAMA_LIKE, kernels=KernelLayout()),
    "qwen2": replace(_LLAMA_LIKE, kernels=KernelLayout(light=True)),
    "qwen3": replace(_LLAMA_LIKE, kernels=KernelLayout(qk_norms=True, light=True)),
    "phi3": replace(_LLAMA_LIKE, kernels=KernelLayout(qkv=("qkv_proj",), gate_up=("gate_up_proj",),
                                                      activation="activation_fn")),
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
        scaled_embedding=True,
        kernels=KernelLayout(qk_norms=True, norm="gemma", light=True),
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
    # OPT and its relatives: discovery cannot find them (the MLP is three modules of the layer, the
    # positions are offset by 2; OPT's layers sit in model.decoder)
    "opt": _OPT_LIKE,
    "biogpt": replace(_OPT_LIKE, backbone="biogpt", final_norm="layer_norm"),
    "xglm": replace(_OPT_LIKE, backbone="model", final_norm="layer_norm"),
}
# the rows hand-checked first: the reference that discovery's own test compares against, and
# the architectures every engine test runs (tests/tiny.py builds a tiny model of each)
REFERENCE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "gpt2")


# ----- what config keys mean to every reader of the table ------------------------------------------
# (a config: transformers' config object, or config.json's dict as a SimpleNamespace: keys as attributes)

def context_length(config: Any) -> int:
    """The longest sequence the model was trained for (prompt plus generated tokens)."""
    return int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048)


def layer_attention(config: Any, layers: int) -> list[tuple[str, int | None]]:
    """Each decoder layer's attention as transformers' attention modules read the config: its
    layer type ("full_attention" or "sliding_attention") and its sliding window (None: none)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        window = getattr(config, "sliding_window", None)
        return [(kind, window if kind == "sliding_attention" else None) for kind in layer_types[:layers]]
    if getattr(config, "attention_layers", None) is not None:  # GPT-Neo: "global" / "local" layers
        return [("sliding_attention", config.window_size) if kind == "local" else ("full_attention", None)
                for kind in config.attention_layers[:layers]]
    # Mistral and Phi-3 apply config.sliding_window (when set) to every layer
    window = getattr(config, "sliding_window", None) or None
    return [("sliding_attention" if window is not None else "full_attention", window)] * layers


# config keys two models must share for a plan to take layers from both (LoadedModel.attach, LiteModel.attach)
SHAPE_KEYS = ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_hidden_layers", "n_embd", "n_head", "n_layer")


def attach_refusal(label: str, mine: Callable[[str], Any], theirs: Callable[[str], Any], name: str,
                   other_name: str) -> str | None:
    """Why a model cannot be attached under `label` to plans of the model `name` (one line), or
    None; mine(key), theirs(key): each model's config value of a SHAPE_KEYS key (None: none)."""
    if not label or label == "a" or not label.isidentifier():
        return f"model label '{label}' is taken or not a name: 'a' is this model; use b, c, …"
    for key in SHAPE_KEYS:
        if mine(key) != theirs(key):
            return f"model '{label}' ({other_name}) does not match {name}: {key} is {theirs(key)}, not {mine(key)}"
    return None
