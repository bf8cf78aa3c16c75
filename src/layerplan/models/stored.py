"""GGUF files with their weights as stored: the model's modules without dense matrices, and each
matrix as the block-quantized rows the file holds.

The transformers model is built without weights (accelerate's init_empty_weights): its matrices
stay on the meta device and every small tensor (norms, biases) is read and dequantized. Each
matrix is a `StoredTensor`: where its rows lie in the file, their GGUF type, and the order the
rows take in transformers' layout (llama.cpp's converter permutes the rows of Llama's q and k
projections; transformers undoes it at load, and so does `read_rows`). The engine packs these
rows for its block-format kernels; `dequantize` gives the very values transformers' own GGUF
loader computes (gguf-py's dequantization), for the eager reference and for tests.

Tensor names are mapped as transformers maps them (get_gguf_hf_weights_map with the
architecture's tensor processor); architectures whose processor rearranges matrices in other
ways (split or transposed tensors) are refused with one line, and run dequantized instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from layerplan.models.arch_table import STATIC_ROPE_TYPES
from layerplan.models.errors import ModelError
from layerplan.models.file_index import frame_of, merges_as_strings, staged_index
from layerplan.models.gguf_config import load_config, load_tokenizer
from layerplan.models.gguf_file import read_header
from layerplan.models.gguf_index import StoredTensor
from layerplan.models.gguf_place import INDEX_VERSION, TENSORS_FILE

# transformers' tensor processors whose only change to a matrix is a permutation of its rows
# (Llama's q and k) or none at all (the others change 1-D norms only)
ROW_ORDER_PROCESSORS = {"TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor"}


class StoredEmbedding(nn.Module):
    """Token embeddings looked up in a stored (possibly quantized) table: each pass dequantizes
    only its own tokens' rows."""

    def __init__(self, table: StoredTensor, scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.table = table
        # what the replaced module multiplied its rows by (Gemma's sqrt(hidden)), as it does it:
        # rows * scale in float32
        self.scale = scale
        self._rows = table.map_rows() if table.row_order is None else table.read_rows()

    @property
    def num_embeddings(self) -> int:
        return self.table.rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids)

    def lookup(self, ids: torch.Tensor, decode: Callable[[np.ndarray], torch.Tensor] | None = None) -> torch.Tensor:
        """The ids' rows (ids.shape + (columns,)), dequantized by `decode` (stored rows (count,
        row_bytes) -> float32 (count, columns); default gguf-py's, table.decode): the native
        kernels pass theirs, the same values bit for bit without gguf-py's ~50 us a call."""
        flat = ids.reshape(-1).cpu().numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.table.rows):
            bad = int(flat[(flat < 0) | (flat >= self.table.rows)][0])
            raise ModelError(f"token id {bad} is outside the vocabulary (0-{self.table.rows - 1})")
        values = (decode or self.table.decode)(self._rows[flat]).reshape(*ids.shape, self.table.columns)
        return values if self.scale is None else values * self.scale


# How the native kernels compute products over stored blocks (engine/kernels/kernels.h LP_ARITH_):
ARITHMETICS = {
    # fp32 on the weights' exact values: transformers' numbers on the dequantized model
    "exact": "fp32 products of the dequantized weights (transformers' numbers)",
    # llama.cpp's arithmetic: activations quantized to int8 as llama.cpp does for the weight type
    # (Q8_0's per 32 inputs; Q8_K's per 256 for the K-quants), integer dot products
    "fast": "integer products on activations quantized to int8 (per 32 inputs; per 256 for the K-quants), "
            "as llama.cpp computes",
}


@dataclass
class StoredWeights:
    """The matrices of a model loaded from a GGUF as stored, by transformers parameter name, and
    the arithmetic of their products (ARITHMETICS)."""

    path: Path
    tensors: dict[str, StoredTensor]
    modules: dict[int, str]  # id() of each linear module with a stored weight -> its weight's name
    arithmetic: str = "exact"
    # the block format the matrices were quantized to at load ("q4_k"); None: as the GGUF stores them
    quantized: str | None = None
    # name -> a linear given a stored weight after load (adopt), kept alive with the model
    adopted: dict[str, nn.Module] = field(default_factory=dict, repr=False)

    @property
    def precision(self) -> str:
        """"stored" (a GGUF's blocks) or the format quantized to at load, "-fast" with integer products."""
        base = self.quantized or "stored"
        return base if self.arithmetic == "exact" else f"{base}-{self.arithmetic}"

    def of(self, module: nn.Module) -> StoredTensor | None:
        """The stored weight of a linear module, None for a module whose weight is dense."""
        name = self.modules.get(id(module))
        return self.tensors.get(name) if name is not None else None

    @property
    def formats(self) -> dict[str, int]:
        """GGUF type -> how many matrices have it."""
        counts: dict[str, int] = {}
        for name, tensor in self.tensors.items():
            if name in self.adopted:  # derived after load (adopt): not one of the file's
                continue
            counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
        return counts

    def adopt(self, module: nn.Module, name: str, tensor: StoredTensor) -> None:
        """Make `tensor` the stored weight of linear `module` (on the meta device), under a name
        of its own (`name`, made unique): a matrix derived from the model's, such as a draft's
        head over part of the vocabulary. It lives as long as the model."""
        unique, n = name, 1
        while unique in self.tensors:
            n += 1
            unique = f"{name}#{n}"
        self.tensors[unique] = tensor
        self.modules[id(module)] = unique
        self.adopted[unique] = module  # held, so that its id() is never another module's

    def materialize(self, module: nn.Module) -> None:
        """Give every linear in `module` its dequantized weight (a sub-layer the kernels do not
        run, or a layer the modules run for one step)."""
        for inner in module.modules():
            stored = self.of(inner)
            if stored is not None and inner.weight.device.type == "meta":
                inner.weight = nn.Parameter(stored.dequantize(), requires_grad=False)

    def release(self, module: nn.Module) -> None:
        """Drop what materialize gave `module`: its linears are stored rows again."""
        for inner in module.modules():
            if self.of(inner) is not None and inner.weight.device.type != "meta":
                inner.weight = nn.Parameter(torch.empty(inner.weight.shape, device="meta"), requires_grad=False)


def _row_order(processor, name: str, rows: int) -> tuple[int, ...] | None:
    """The permutation the tensor processor applies to a matrix's rows, found by running it on
    the row numbers themselves; None where it leaves them in place."""
    index = np.arange(rows, dtype=np.int64)[:, None]
    moved = processor.process(weights=index, name=name).weights
    if moved.shape != index.shape:
        raise ModelError(f"{name}: transformers reshapes this tensor at load; it cannot run as stored")
    order = moved[:, 0]
    return None if np.array_equal(order, index[:, 0]) else tuple(int(i) for i in order)


def meta_skeleton(config, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The CausalLM of `config` with its parameters on the meta device (buffers real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return hf.eval()


def _rotary_facts(hf: nn.Module) -> dict | None:
    """The model's rotary frequencies and scaling as its module holds them (engine/rope_tables.py
    turns them into tables), where they are fixed at load: {"inv_freq", "attention_scaling"} where
    one serves every layer; {"by_layer_type": {layer type: the same}} where each layer type has its
    own (Gemma 3's sliding and full attention); else None."""
    rotary = getattr(getattr(hf, "model", None), "rotary_emb", None)
    rope_type = getattr(rotary, "rope_type", None)
    if not isinstance(rope_type, dict):
        return _rope_of(rotary, "", rope_type)
    found = {layer_type: _rope_of(rotary, f"{layer_type}_", kind) for layer_type, kind in rope_type.items()}
    return {"by_layer_type": found} if found and None not in found.values() else None


def _rope_of(rotary: nn.Module | None, prefix: str, rope_type) -> dict | None:
    inv_freq = getattr(rotary, f"{prefix}inv_freq", None)
    scaling = getattr(rotary, f"{prefix}attention_scaling", None)
    if (not isinstance(inv_freq, torch.Tensor) or not isinstance(scaling, (int, float))
            or rope_type not in STATIC_ROPE_TYPES):
        return None
    return {"inv_freq": [float(f) for f in inv_freq.float().tolist()], "attention_scaling": float(scaling)}


def _rotary_of_index(hf: nn.Module, rotary: dict | None) -> None:
    """The rotary module's frequencies set to the index's: an index made from the file computes
    them rounded once (models/file_index.py), and the light front end reads the same values, so
    both front ends compute the same numbers."""
    module = getattr(getattr(hf, "model", None), "rotary_emb", None)
    if rotary is None or module is None:
        return
    by_type = rotary.get("by_layer_type") or {"": rotary}
    for layer_type, facts in by_type.items():
        prefix = f"{layer_type}_" if layer_type else ""
        current = getattr(module, f"{prefix}inv_freq", None)
        if not isinstance(current, torch.Tensor):
            return
        values = torch.tensor(facts["inv_freq"], dtype=torch.float32)
        if values.shape != current.shape:
            raise ModelError(f"the index's {len(values)} rotary frequencies do not fit the model's {current.numel()}")
        setattr(module, f"{prefix}inv_freq", values)
        if isinstance(getattr(module, f"{prefix}original_inv_freq", None), torch.Tensor):
            setattr(module, f"{prefix}original_inv_freq", values.clone())


def _chat_frame(tokenizer) -> dict:
    """frame_of the tokenizer's chat template as transformers renders it (apply_chat_template)."""
    return frame_of(getattr(tokenizer, "chat_template", None), lambda text: tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False))


def gguf_to_parameter_names(hf: nn.Module, processor, architecture: str) -> dict[str, str]:
    """GGUF tensor name -> the transformers parameter it loads into: transformers' own mapping
    (get_gguf_hf_weights_map: gguf-py's name table, asked for every module's state-dict names, a
    parent's entries before its children's), with the table built once rather than once a module
    (hundreds of times: 2-5 s on a 28-layer model) and the file's own architecture name."""
    import gguf

    arch = next((key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ModelError(f"GGUF architecture '{architecture}' is not one gguf-py names")
    table = gguf.get_tensor_name_map(arch, hf.config.num_hidden_layers)
    keys = list(hf.state_dict().keys())
    found: dict[str, str] = {}
    for module_name, _ in hf.named_modules():  # depth first, a parent before its children
        prefix = f"{module_name}." if module_name else ""
        local: dict[str, str] = {}
        for key in keys:
            if not key.startswith(prefix):
                continue
            name = processor.preprocess_name(key[len(prefix):])
            base, suffix = name, ""
            if name.endswith((".weight", ".bias")):
                base, suffix = name.rsplit(".", 1)
                suffix = "." + suffix
            gguf_name = table.get_name(base)
            if gguf_name is None:
                processor.perform_fallback_tensor_mapping(local, suffix, prefix, name)
                continue
            local[gguf_name + suffix] = prefix + name
        for gguf_name, parameter in local.items():
            found.setdefault(gguf_name, parameter)
    return found


def index_gguf(path: Path, target: Path) -> Path:
    """Read a GGUF's metadata once into `target`: config.json, the tokenizer's files and
    tensors.json (each mapped tensor's transformers name, GGUF type, shape, file offset, and the
    row order transformers gives a matrix; the rotary frequencies; how the chat template wraps a
    prompt). The header is read once (models/gguf_file.py) and the config and tokenizer made from
    it (models/gguf_config.py); making the tokenizer takes seconds for a large vocabulary, and every
    later load reads these files instead."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    header = read_header(path)  # one line where the file is not a GGUF
    try:
        config = load_config(header)
        # a file without a tokenizer (tests' tiny files) loads as a model of token ids
        tokenizer = load_tokenizer(header, config)
    except ModelError:
        raise
    except Exception as error:  # noqa: BLE001 - a damaged file fails in transformers' readers with any type
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ModelError(f"{path}: cannot read it as a GGUF model (truncated or damaged?): {first}") from None
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config.to_dict())
    if type(processor).__name__ not in ROW_ORDER_PROCESSORS:
        raise ModelError(f"{path.name}: architecture '{config.model_type}' rearranges its GGUF tensors at load "
                         "(split or transposed matrices); run it dequantized (--dtype float32 or bfloat16)")
    skeleton = meta_skeleton(config)
    names = gguf_to_parameter_names(skeleton, processor, header.architecture)
    entries = []
    for tensor in header.tensors:
        name = names.get(tensor.name)
        if name is None:
            continue
        kind = gguf.GGMLQuantizationType(tensor.type_id)
        shape = [int(n) for n in reversed(tensor.shape)]  # GGUF lists the fastest dimension first
        matrix = len(shape) == 2 and shape[1] > 1
        entries.append({
            "gguf_name": tensor.name, "name": name, "type": kind.name, "shape": shape,
            "offset": tensor.offset, "nbytes": tensor.nbytes,
            "row_order": list(_row_order(processor, tensor.name, shape[0]) or []) if matrix else [],
            "matrix": matrix,
            # what transformers' processor does to a small tensor (Gemma's norms: weight - 1)
            "shift": 0.0 if matrix else float(processor.process(weights=np.zeros(1, np.float32), name=tensor.name).weights[0]),
        })
    with staged_index(target, TENSORS_FILE) as staged:
        config.save_pretrained(staged)
        if tokenizer is not None:
            tokenizer.save_pretrained(staged)
            merges_as_strings(staged / "tokenizer.json")
        chat = _chat_frame(tokenizer) if tokenizer is not None else {"template": False}
        (staged / TENSORS_FILE).write_text(json.dumps({"gguf": str(path), "version": INDEX_VERSION,
                                                       "rotary": _rotary_facts(skeleton), "chat": chat,
                                                       "tensors": entries}))
    return target



def load_stored(path: Path, index: Path) -> tuple[nn.Module, StoredWeights]:
    """(the CausalLM with every matrix left on the meta device and every other tensor read from
    the GGUF, the stored matrices), from the GGUF and its index (index_gguf). One line naming a
    missing tensor."""
    hf, tensors, embedding_name = _skeleton_with_small_tensors(path, index)
    _rotary_of_index(hf, json.loads((index / TENSORS_FILE).read_text()).get("rotary"))
    embedding, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    head_name = _name_of(hf, head.weight)
    modules = {id(module): f"{name}.weight" for name, module in hf.named_modules()
               if f"{name}.weight" in tensors and module is not embedding}
    modules[id(head)] = head_name
    if embedding_name in tensors:
        scale = None
        if type(embedding) is not nn.Embedding:  # Gemma's scaled lookup is known; anything else is refused
            scale = getattr(embedding, "embed_scale", None)
            if not isinstance(scale, torch.Tensor):
                raise ModelError(f"{path.name}: its token embedding ({type(embedding).__name__}) does more than a "
                                 "lookup; run it dequantized (--dtype float32 or bfloat16)")
            scale = scale.detach().to(torch.float32)
        hf.set_input_embeddings(StoredEmbedding(tensors[embedding_name], scale))
    return hf, StoredWeights(path, tensors, modules)


def load_dense(path: Path, index: Path, dtype: torch.dtype, on_tensor: Callable[[int, int], None] | None = None
               ) -> nn.Module:
    """The CausalLM with every weight dequantized from the GGUF (gguf-py's values, in transformers'
    row order: the model transformers' own GGUF loader makes) and cast to `dtype`, one matrix at a
    time: nothing is written to disk. on_tensor(done, total) after each matrix (a progress bar)."""
    from accelerate.utils import set_module_tensor_to_device

    hf, tensors, _ = _skeleton_with_small_tensors(path, index, dtype)
    wanted = [n for n, p in hf.named_parameters(remove_duplicate=False) if p.device.type == "meta"]
    read: set[int] = set()
    for done, name in enumerate(wanted, 1):
        if id(tensors[name]) not in read:  # a tied head reads the embedding's table: tied again below
            read.add(id(tensors[name]))
            set_module_tensor_to_device(hf, name, "cpu", value=tensors[name].dequantize().to(dtype))
        if on_tensor is not None:
            on_tensor(done, len(wanted))
    hf.tie_weights()
    missing = [n for n, p in hf.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ModelError(f"{path.name}: no tensor for '{missing[0]}' in the file")
    return hf


def _name_of(hf: nn.Module, parameter: nn.Parameter) -> str:
    return next(n for n, p in hf.named_parameters(remove_duplicate=False) if p is parameter)


def _skeleton_with_small_tensors(path: Path, index: Path, dtype: torch.dtype = torch.float32
                                 ) -> tuple[nn.Module, dict[str, StoredTensor], str]:
    """(the CausalLM of `dtype` with its matrices on the meta device and its small tensors read,
    the stored matrices by parameter name (a tied head under its own name too), the embedding's
    name)."""
    import gguf
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoConfig

    hf = meta_skeleton(AutoConfig.from_pretrained(index), dtype)
    tensors: dict[str, StoredTensor] = {}
    for entry in json.loads((index / TENSORS_FILE).read_text())["tensors"]:
        kind = gguf.GGMLQuantizationType[entry["type"]]
        rows, columns = entry["shape"] if entry["matrix"] else (1, int(np.prod(entry["shape"])))
        stored = StoredTensor(path=path, offset=entry["offset"], type_name=kind.name, type_id=int(kind), rows=rows,
                              columns=columns, row_bytes=entry["nbytes"] // rows,
                              row_order=tuple(entry["row_order"]) or None)
        if entry["matrix"]:
            tensors[entry["name"]] = stored
        else:
            parameter = hf.get_parameter(entry["name"])
            values = stored.dequantize().reshape(parameter.shape)
            if entry["shift"]:
                values = values + entry["shift"]
            set_module_tensor_to_device(hf, entry["name"], "cpu", value=values.to(dtype))
    embedding, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    named = dict(hf.named_parameters(remove_duplicate=False))
    embedding_name = _name_of(hf, embedding.weight)
    head_name = _name_of(hf, head.weight)
    if head_name not in tensors and embedding_name in tensors:  # a tied head reads the embedding table
        tensors[head_name] = tensors[embedding_name]
    missing = [n for n, p in named.items() if p.device.type == "meta" and n not in tensors]
    if missing:
        raise ModelError(f"{path.name}: no tensor for '{missing[0]}' in the file")
    return hf, tensors, embedding_name
