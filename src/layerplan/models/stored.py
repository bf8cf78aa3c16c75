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
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from layerplan.models.architectures import ModelError

# transformers' tensor processors whose only change to a matrix is a permutation of its rows
# (Llama's q and k) or none at all (the others change 1-D norms only)
ROW_ORDER_PROCESSORS = {"TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor"}


@dataclass(frozen=True)
class StoredTensor:
    """A matrix (rows outputs x columns inputs) as a GGUF file stores it."""

    path: Path
    offset: int  # of the tensor's first byte in the file
    type_name: str  # the GGUF type ("Q4_1", "Q4_K", "F32", ...)
    type_id: int
    rows: int
    columns: int
    row_bytes: int
    row_order: tuple[int, ...] | None = None  # stored row of each transformers row; None: the same
    # the rows in memory, (rows, row_bytes) uint8, for a matrix quantized at load rather than read
    # from a GGUF (then path names the model it came from, and offset is 0)
    data: np.ndarray | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def read_rows(self, out: np.ndarray | None = None, first: int = 0, count: int | None = None) -> np.ndarray:
        """(count, row_bytes) uint8: rows first.. of the matrix in transformers' row order (all of
        them by default), read into memory of its own (the file is not mapped, so its pages do not
        count as the process's): into `out` where given (a C-contiguous array of that shape, as a
        stack of matrices is built without a copy). A part (first, count) of a matrix whose rows
        transformers permutes is refused: it reads whole."""
        count = self.rows - first if count is None else count
        if self.row_order is not None and (first, count) != (0, self.rows):
            raise ValueError("a matrix with permuted rows is read whole")
        if out is None:
            out = np.empty((count, self.row_bytes), np.uint8)
        if out.shape != (count, self.row_bytes) or not out.flags.c_contiguous:
            raise ValueError(f"rows of {count} x {self.row_bytes} bytes go to a contiguous array of that shape")
        if self.data is not None:
            out[:] = self.data[first:first + count]
            return out
        with open(self.path, "rb") as file:
            file.seek(self.offset + first * self.row_bytes)
            if file.readinto(memoryview(out).cast("B")) != count * self.row_bytes:
                raise ModelError(f"{self.path}: the file ends inside a tensor (truncated?)")
        if self.row_order is not None:  # q and k rows in transformers' order: a permutation in place
            out[:] = out[np.asarray(self.row_order)]
        return out

    def map_rows(self) -> np.ndarray:
        """(rows, row_bytes) uint8 mapped from the file in its stored order: only the pages of the
        rows read are brought into memory (an embedding table's lookups)."""
        if self.data is not None:
            return self.data
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.offset, shape=(self.rows, self.row_bytes))

    def dequantize(self) -> torch.Tensor:
        """float32 (rows, columns): gguf-py's values, as transformers' GGUF loader computes them."""
        return self.decode(self.read_rows())

    def decode(self, data: np.ndarray) -> torch.Tensor:
        """float32 (len(data), columns) of stored rows (uint8, (count, row_bytes)) of this tensor."""
        import gguf

        values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(self.type_id))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(len(data), self.columns))


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
    # llama.cpp's arithmetic: activations quantized to int8 per 32 inputs, integer dot products
    "fast": "integer products on activations quantized to int8 per 32 inputs, as llama.cpp computes",
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
        for tensor in self.tensors.values():
            counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
        return counts

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


def _skeleton(config) -> nn.Module:
    """The CausalLM of `config` with its parameters on the meta device (buffers real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return hf.eval()


def index_gguf(path: Path, target: Path) -> Path:
    """Read a GGUF's metadata once into `target`: config.json, the tokenizer's files and
    tensors.json (each mapped tensor's transformers name, GGUF type, shape, file offset, and the
    row order transformers gives a matrix). Parsing a GGUF's metadata in Python takes seconds
    (its vocabulary is tens of thousands of strings); every later load reads these instead."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        reader = gguf.GGUFReader(path)
        # a file without a tokenizer (tests' tiny files) loads as a model of token ids
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name) \
            if gguf.Keys.Tokenizer.MODEL in reader.fields else None
    except Exception as error:  # noqa: BLE001 - a damaged file fails in the gguf reader with any type
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ModelError(f"{path}: cannot read it as a GGUF model (truncated or damaged?): {first}") from None
    architecture = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    if type(processor).__name__ not in ROW_ORDER_PROCESSORS:
        raise ModelError(f"{path.name}: architecture '{config.model_type}' rearranges its GGUF tensors at load "
                         "(split or transposed matrices); run it dequantized (--dtype float32 or bfloat16)")
    names = get_gguf_hf_weights_map(_skeleton(config), processor)
    entries = []
    for tensor in reader.tensors:
        name = names.get(tensor.name)
        if name is None:
            continue
        kind = gguf.GGMLQuantizationType(tensor.tensor_type)
        shape = [int(n) for n in reversed(tensor.shape)]  # GGUF lists the fastest dimension first
        matrix = len(shape) == 2 and shape[1] > 1
        entries.append({
            "gguf_name": tensor.name, "name": name, "type": kind.name, "shape": shape,
            "offset": int(tensor.data_offset), "nbytes": int(tensor.n_bytes),
            "row_order": list(_row_order(processor, tensor.name, shape[0]) or []) if matrix else [],
            "matrix": matrix,
            # what transformers' processor does to a small tensor (Gemma's norms: weight - 1)
            "shift": 0.0 if matrix else float(processor.process(weights=np.zeros(1, np.float32), name=tensor.name).weights[0]),
        })
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        (staging / TENSORS_FILE).write_text(json.dumps({"gguf": str(path), "tensors": entries}))
        try:
            os.replace(staging, target)  # atomic: a half-written index is never found
        except OSError:
            if not (target / TENSORS_FILE).exists():  # another process may have won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


TENSORS_FILE = "tensors.json"


def load_stored(path: Path, index: Path) -> tuple[nn.Module, StoredWeights]:
    """(the CausalLM with every matrix left on the meta device and every other tensor read from
    the GGUF, the stored matrices), from the GGUF and its index (index_gguf). One line naming a
    missing tensor."""
    import gguf
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoConfig

    hf = _skeleton(AutoConfig.from_pretrained(index))
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
            set_module_tensor_to_device(hf, entry["name"], "cpu", value=values)
    embedding, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    named = dict(hf.named_parameters(remove_duplicate=False))
    embedding_name = next(n for n, p in named.items() if p is embedding.weight)
    head_name = next(n for n, p in named.items() if p is head.weight)
    if head_name not in tensors and embedding_name in tensors:  # a tied head reads the embedding table
        tensors[head_name] = tensors[embedding_name]
    missing = [n for n, p in named.items() if p.device.type == "meta" and n not in tensors]
    if missing:
        raise ModelError(f"{path.name}: no tensor for '{missing[0]}' in the file")
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
