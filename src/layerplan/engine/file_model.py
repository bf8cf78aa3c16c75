"""A GGUF's model on the torch front end without transformers' modules until something needs them.

Where the file describes its model (engine/file_kernels.py), the native engine runs every layer,
the final norm and the LM head by the file's descriptors, so a command that only runs passes
(generate, ppl, scan, search, chat, serve, bench, probe) needs nothing of transformers'
modelling code: importing it and building the meta skeleton is most of a later load (record
435). The LoadedModel made here holds what the runner reads besides the kernels, built from the
file and its index:
- the embedding (models/stored.py StoredEmbedding over the file's table, Gemma's scale as its
  module applies it), the LM head (a linear on the meta device whose weight is the file's
  matrix, as models/stored.py load_stored leaves it), the rotary tables (FileRotary, from the
  index's frequencies, which the skeleton's rotary module is given too);
- each layer's facts (its attention type and window).

The modules themselves (a layer's attention or MLP, the final norm's module) are built on first
use: the first access builds the whole skeleton as load_stored does and hands them out from
then on, so an eager sub-layer, an export or transformers' own generate still get
transformers' modules, with their stored matrices known to the same StoredWeights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from layerplan.engine.file_kernels import FileKernels, read_index
from layerplan.models import loading
from layerplan.models.arch_table import ARCHITECTURES
from layerplan.models.architectures import LayerParts, ModelParts
from layerplan.models.depth import display_name
from layerplan.models.discovery import parts_of
from layerplan.models.stored import StoredEmbedding, StoredWeights, load_stored


class FileRotary(nn.Module):
    """The rotary embedding of a GGUF's index (models/stored.py _rotary_facts): the frequencies and
    scaling of every layer, or of each layer type (Gemma 3), as the skeleton's rotary module holds
    them once given the index's (_rotary_of_index). Called as that module is, it computes what it
    computes: cos and sin of the positions times the frequencies, times the scaling, in x's dtype."""

    def __init__(self, rotary: dict) -> None:
        super().__init__()
        by_type = rotary.get("by_layer_type")
        # (an index keeps only frequencies fixed at load, of STATIC_ROPE_TYPES: engine/rope.py
        # takes a table of them; "default" says that much, whatever formula made them)
        self.rope_type = "default" if by_type is None else {layer_type: "default" for layer_type in by_type}
        for layer_type, facts in ({"": rotary} if by_type is None else by_type).items():
            prefix = f"{layer_type}_" if layer_type else ""
            self.register_buffer(f"{prefix}inv_freq", torch.tensor(facts["inv_freq"], dtype=torch.float32),
                                 persistent=False)
            setattr(self, f"{prefix}attention_scaling", float(facts["attention_scaling"]))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = f"{layer_type}_" if layer_type else ""
        inv_freq = getattr(self, f"{prefix}inv_freq").to(x.device)
        scaling = getattr(self, f"{prefix}attention_scaling")
        freqs = position_ids[..., None].float() * inv_freq  # (batch, T, dim / 2)
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * scaling).to(x.dtype), (angles.sin() * scaling).to(x.dtype)


class DeferredModule(nn.Module):
    """A module that is the skeleton's `find(parts)` once built: a stable object for the native
    engine to know (the final norm, whose descriptor is the file's), whose call builds the
    skeleton only where a module runs it."""

    def __init__(self, model: DeferredCausalLM, find: Callable[[ModelParts], nn.Module]) -> None:
        super().__init__()
        self._deferred = (model, find)  # (a tuple: not registered as a child module)

    def resolve(self) -> nn.Module:
        model, find = self._deferred
        return find(model.parts())

    def forward(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)


_LAYER_MODULES = ("attention_norm", "attention", "attention_post_norm", "mlp_norm", "mlp", "mlp_post_norm",
                  "cache_argument", "takes_positions", "takes_alibi")


class DeferredLayer(LayerParts):
    """A decoder layer's facts from the file (attention type, window); its modules, and the facts
    read off them, from the skeleton on first access. Compared and hashed by identity (its
    fields would build the skeleton)."""

    def __init__(self, model: DeferredCausalLM, index: int, layer_type: str, sliding_window: int | None) -> None:
        # (LayerParts is frozen: its fields are set as its own __init__ sets them)
        object.__setattr__(self, "_deferred", (model, index))
        object.__setattr__(self, "layer_type", layer_type)
        object.__setattr__(self, "sliding_window", sliding_window)
        object.__setattr__(self, "parallel", False)

    __hash__ = object.__hash__

    def __eq__(self, other) -> bool:
        return self is other

    def __repr__(self) -> str:
        return f"DeferredLayer({self._deferred[1]}, {self.layer_type}, window={self.sliding_window})"


def _layer_field(name: str) -> property:
    def get(self: DeferredLayer):
        model, index = self._deferred
        return getattr(model.parts().layers[index], name)

    return property(get)


for _name in _LAYER_MODULES:
    setattr(DeferredLayer, _name, _layer_field(_name))


class DeferredCausalLM:
    """Stands for the GGUF's transformers CausalLM (LoadedModel.hf): its config, its embeddings;
    anything else of it builds the skeleton (models/stored.py load_stored) once and is the
    skeleton's. The skeleton's stored matrices join `stored`, so the engine's StoredWeights knows
    its modules as it knows the stand-in head."""

    def __init__(self, gguf: Path, index: Path, config, stored: StoredWeights) -> None:
        self.config = config
        self.generation_config = None  # (a skeleton's is its config's: LoadedModel.eos_token_ids reads that)
        self._place = (gguf, index, stored)
        self._skeleton: nn.Module | None = None
        self._parts: ModelParts | None = None
        self.embedding: nn.Module | None = None
        self.head: nn.Module | None = None

    def get_input_embeddings(self) -> nn.Module:
        return self.embedding

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def skeleton(self) -> nn.Module:
        """transformers' CausalLM of the file, built now if not yet (its matrices on the meta device)."""
        if self._skeleton is None:
            gguf, index, stored = self._place
            hf, built = load_stored(gguf, index)
            for name, tensor in built.tensors.items():
                stored.tensors.setdefault(name, tensor)
            stored.modules.update(built.modules)
            self._skeleton = hf
        return self._skeleton

    def parts(self) -> ModelParts:
        """The skeleton's parts (models/architectures.py model_parts)."""
        if self._parts is None:
            self._parts = parts_of(self.skeleton())
        return self._parts

    def __getattr__(self, name: str):
        if name.startswith("_"):  # (attributes of this object not set yet: copy, pickle)
            raise AttributeError(name)
        return getattr(self.skeleton(), name)

    def __call__(self, *args, **kwargs):
        return self.skeleton()(*args, **kwargs)


def file_model(kernels: FileKernels, arithmetic: str) -> loading.LoadedModel:
    """The LoadedModel (models/loading.py load_stored_model's) of the GGUF `kernels` describes, its
    parts from the file (see the module's docstring); `kernels`: filled or being filled."""
    gguf, index = kernels.source, kernels.index
    config = loading.model_config(gguf)
    spec = ARCHITECTURES[config.model_type]
    facts = read_index(index)[1]
    # the stored matrices as load_stored names them, with gguf-py's type numbers (their dequantization)
    import gguf as gguf_py

    tensors = {name: replace(tensor, type_id=int(gguf_py.GGMLQuantizationType[tensor.type_name]))
               for name, tensor in kernels.tensors.items()}
    stored = StoredWeights(gguf, tensors, {}, arithmetic)
    hf = DeferredCausalLM(gguf, index, config, stored)
    shape = kernels.config
    embed_name = spec.name(spec.embed, "weight")
    scale = torch.tensor(shape.hidden ** 0.5, dtype=torch.float32) if spec.scaled_embedding else None
    hf.embedding = StoredEmbedding(tensors[embed_name], scale)
    head_name = kernels.head_name + ".weight"
    hf.head = nn.Linear(shape.hidden, kernels.vocab, bias=False, device="meta")
    stored.modules[id(hf.head)] = head_name  # (a tied head's name is the embedding's)
    layers = tuple(DeferredLayer(hf, i, kind, window or None)
                   for i, (kind, window) in enumerate(zip(shape.layer_types, shape.windows)))
    parts = ModelParts(
        embed=hf.embedding, position_embed=None, layers=layers,
        final_norm=DeferredModule(hf, lambda parts: parts.final_norm), lm_head=hf.head,
        rotary=FileRotary(facts["rotary"]), rope_per_layer_type=spec.rope_per_layer_type,
        final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
        layer_types=tuple(sorted(set(shape.layer_types))))
    return loading.LoadedModel(name=display_name(gguf), hf=hf, tokenizer=loading.folder_tokenizer(index),
                               source=str(gguf), stored=stored, given_parts=parts)
