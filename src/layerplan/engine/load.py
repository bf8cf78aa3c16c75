"""Models loaded to run: models/loading.py finds and loads a model's modules; here a discovered
architecture is checked first (verify.py), and the engine is chosen and attached as the model's
executor (executors.py). These are the package's `load_model` and `wrap_model`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerplan.collection import collection_paused
from layerplan.engine.cpu_pack import pack_linears, packing_supported
from layerplan.engine.choices import GGUF_DEFAULT, QUANTIZED, STORED_ARITHMETIC
from layerplan.engine.executors import modules_executor, use_native
from layerplan.engine.file_kernels import ARITHMETIC_CODES, FileKernels, NotDescribed, file_refusal, read_index
from layerplan.engine.file_model import file_model
from layerplan.engine.kernel_library import ABI, check, library, native_available
from layerplan.engine.native import resolve_engine, row_decoder
from layerplan.engine.probe_rows import ProbeResult
from layerplan.engine.verify import ensure_checked
from layerplan.models import loading
from layerplan.models.architectures import ModelError
from layerplan.models.discovery import native_allowed, parts_of
from layerplan.models.loading import LoadedModel
from layerplan.models.gguf_index import file_index
from layerplan.models.gguf_place import index_folder
from layerplan.models.stored import StoredTensor, StoredWeights




def choose_dtype(dtype: str, engine: str = "auto", device: str | torch.device = "cpu",
                 probe: ProbeResult | None = None, source: str | os.PathLike | None = None,
                 dense: str | None = None) -> str:
    """`dtype`, or for "auto": on the CPU a GGUF `source` as stored (GGUF_DEFAULT) where the native
    kernels run (its blocks are read, not dense copies of 2-8x the bytes); else `dense` where
    given (the research commands: float32, transformers' reference numbers); else the one that
    decodes fastest here: bfloat16 on a GPU, the fastest in `probe` (this machine's probe of the
    model, engine/probe.py load_probe) on the engine `engine` resolves to, else bfloat16 where bf16
    weights are read at full speed (the native kernels, or a CPU with native bf16 instructions),
    else float32."""
    if dtype != "auto":
        return dtype
    on_cpu = loading.resolve_device(device).type == "cpu"
    # (source None: the packaged default, a GGUF too)
    if on_cpu and loading.gguf_of(source) is not None and resolve_engine(engine, torch.float32, device) == "native":
        return GGUF_DEFAULT
    if dense is not None:
        return dense
    if not on_cpu:
        return "bfloat16"
    kind = resolve_engine(engine, torch.bfloat16, device)
    measured = probe.fastest_dtype(kind) if probe is not None else None
    if measured is not None:
        return measured
    return "bfloat16" if kind == "native" or packing_supported(torch.bfloat16, "cpu") else "float32"


def load_model(
    source: str | os.PathLike | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    pack: bool | None = None,
    engine: str = "auto",
    device_map: str | None = None,
    on_tensor: Callable[[int, int], None] | None = None,
) -> LoadedModel:
    """Load a HF folder, a GGUF file or the packaged default ('smollm2') for plan-driven runs, after
    its architecture's check (cached; a discovered one runs it once).

    dtype: 'auto' (a GGUF as stored, GGUF_DEFAULT, where the native kernels run; any other model
    float32), float32, bfloat16, float16, or 'stored': a GGUF's matrices kept in their block formats
    for the native kernels (models/stored.py; activations float32), or 'stored-fast': the same with
    integer products on int8-quantized activations (llama.cpp's arithmetic; not transformers' numbers).
    engine: 'auto', 'native' or 'eager' (see engine/native.py ENGINES).
    device_map: 'auto' or a JSON / YAML file placing decoder layers on devices, CPU memory or disk
    (models/placement.py); instead of `device`. Such a model runs on the eager engine.
    pack: prepack bf16 linears for oneDNN (see engine/cpu_pack.py) when the eager engine runs;
    None = when dtype is bf16 on a CPU that supports it.
    on_tensor(done, total): after each matrix a GGUF loaded dense (float32, bfloat16) dequantizes,
    or a GGUF run as stored reads or packs for the kernels."""
    if dtype == "auto":
        dtype = choose_dtype("auto", engine, device, source=source, dense="float32")
    with collection_paused():  # the modules' objects live as long as the model (layerplan/collection.py)
        kernels = _fill_early(source, STORED_ARITHMETIC[dtype]) if dtype in STORED_ARITHMETIC and engine != "eager" else None
        ensure_checked(loading.model_config(source))
        if dtype in STORED_ARITHMETIC or dtype in QUANTIZED:
            if device_map is not None or torch.device(device).type != "cpu":
                raise ModelError(f"--dtype {dtype} runs on the CPU only, without --device-map; "
                                 "use --dtype float32 or bfloat16")
            if dtype in STORED_ARITHMETIC:
                arithmetic = STORED_ARITHMETIC[dtype]
                # a file whose model its descriptors describe: no transformers modules until needed
                model = (file_model(kernels, arithmetic) if kernels is not None
                         else loading.load_stored_model(source, arithmetic))
                return prepare(model, engine, pack=False, on_filled=on_tensor, file_kernels=kernels)
            block_format, arithmetic = QUANTIZED[dtype]
            if loading.gguf_of(source) is not None:  # a GGUF's matrices, each from its blocks to the format's
                model = loading.load_stored_model(source)
                taken = requantized_linears(model, block_format)
                return prepare(quantize_linears(model, block_format, arithmetic, taken), engine, pack=False)
            taker = QuantizingTaker(block_format)
            model = loading.load_by_tensor(source, taker)
            if model is None:  # not a folder of safetensors the model's names read: loaded whole first
                model, taker.quantized = loading.load_model(source, "float32"), {}
            return prepare(quantize_linears(model, block_format, arithmetic, taker.quantized), engine, pack=False)
        return prepare(loading.load_model(source, dtype, device, device_map, on_tensor), engine, pack)


def _fill_early(source, arithmetic: str) -> FileKernels | None:
    """The GGUF's descriptors (engine/file_kernels.py), their panels being read or packed on
    threads of their own from now on (a load spends seconds importing transformers and building
    the modules, without the GIL's readers waiting for it); None where its index is neither made
    from the file nor kept, or does not describe its model (no kernels' format, no fixed rotary
    frequencies): its transformers modules are built then, and NativeEngine looks again."""
    gguf = loading.gguf_of(source)
    if gguf is None or native_available() is not None:
        return None
    index = file_index(gguf) or index_folder(gguf)  # (made here from the file where it covers it)
    if file_refusal(index) is not None or read_index(index)[1].get("rotary") is None:
        return None
    try:
        return FileKernels(gguf, index, ARITHMETIC_CODES[arithmetic], torch.get_num_threads())
    except NotDescribed:
        return None


def _quantized_rows(weight: torch.Tensor, block_format: str) -> StoredTensor | None:
    """A matrix (out, in) quantized to `block_format` by the native kernels (lp_quantize_rows), as
    stored rows in memory; None where the format's blocks do not divide its width."""
    import gguf  # (gguf-py and numpy only where a model is quantized at load)
    import numpy as np

    kind = gguf.GGMLQuantizationType[block_format.upper()]
    block, type_bytes = gguf.GGML_QUANT_SIZES[kind]
    rows, columns = weight.shape
    if columns % block:
        return None
    weight = weight.detach().to(torch.float32).contiguous()
    data = np.empty((rows, columns // block * type_bytes), np.uint8)
    check(library().lp_quantize_rows(ABI.constants[f"LP_FORMAT_{block_format.upper()}"], weight.data_ptr(), rows,
                                     columns, data.ctypes.data), f"quantizing a matrix to {block_format}")
    return StoredTensor(Path(), 0, kind.name, int(kind), rows, columns, data.shape[1], data=data)


def _quantized_linears(hf: nn.Module) -> list[nn.Module]:
    """The linears quantize_linears quantizes: the decoder layers' and the LM head."""
    parts = parts_of(hf)
    linears = [m for layer in parts.layers for part in (layer.attention, layer.mlp) for m in part.modules()
               if isinstance(m, nn.Linear)]
    return linears + ([parts.lm_head] if isinstance(parts.lm_head, nn.Linear) else [])


class QuantizingTaker:
    """loading.load_by_tensor's taker: each matrix quantize_linears would quantize, quantized as it
    is read (its module's weight stays on the meta device), so no dense copy of the model is ever
    whole in memory. `quantized`: parameter name -> (its module, its stored rows), for
    quantize_linears to adopt."""

    def __init__(self, block_format: str) -> None:
        if native_available() is not None:
            raise ModelError(f"--dtype {block_format} quantizes with the native kernels: {native_available()}")
        self.block_format = block_format
        self.quantized: dict[str, tuple[nn.Module, StoredTensor]] = {}

    def __call__(self, hf: nn.Module) -> Callable[[str, torch.Tensor], bool]:
        names = {id(m): n for n, m in hf.named_modules()}
        wanted = {f"{names[id(m)]}.weight": m for m in _quantized_linears(hf)}

        def take(name: str, values: torch.Tensor) -> bool:
            module = wanted.get(name)
            stored = _quantized_rows(values, self.block_format) if module is not None and values.dim() == 2 else None
            if stored is None:
                return False
            self.quantized[name] = (module, stored)
            return True

        return take


def requantized_linears(model: LoadedModel, block_format: str) -> dict[str, tuple[nn.Module, StoredTensor]]:
    """The matrices quantize_linears quantizes, of a GGUF run as stored (loading.load_stored_model),
    each dequantized from the file's blocks (the kernels' lp_dequantize_rows: gguf's values) and
    quantized to `block_format`, one at a time: no dense copy of the model is ever whole in memory
    (a 1.5B's `self:bits=q2_k` held 8.4 GB loaded through transformers). A matrix whose width the
    format's blocks do not divide gets its dense weight back. Parameter name -> (module, rows),
    for quantize_linears to adopt; the model's stored weights are let go (its embedding keeps its
    table)."""
    names = {id(m): n for n, m in model.hf.named_modules()}
    taken = {}
    for module in _quantized_linears(model.hf):
        stored = model.stored.of(module)
        if stored is None:
            continue
        values = dequantized_matrix(stored)
        rows = _quantized_rows(values, block_format)
        if rows is None:
            module.weight = nn.Parameter(values, requires_grad=False)
            continue
        taken[f"{names[id(module)]}.weight"] = (module, rows)
        del values
    model.stored = None
    return taken


def dequantized_matrix(stored: StoredTensor) -> torch.Tensor:
    """float32 (rows, columns) of a stored matrix: the kernels' decoding where they hold its type
    (gguf's values bit for bit), else gguf-py's."""
    decode = row_decoder(stored)
    return decode(stored.read_rows()) if decode is not None else stored.dequantize()


def quantize_linears(model: LoadedModel, block_format: str, arithmetic: str = "exact",
                     taken: dict[str, tuple[nn.Module, StoredTensor]] | None = None) -> LoadedModel:
    """The model with the matrices of its decoder layers and LM head quantized to `block_format`
    (QUANTIZE_AT_LOAD) by the native kernels (lp_quantize_rows), held as stored rows in memory and
    run by the block-format kernels in `arithmetic`: the dense matrices are freed. A matrix whose
    width the format's blocks do not divide stays dense. `taken`: matrices quantized as they were
    read (QuantizingTaker.quantized), adopted as they are."""
    if native_available() is not None:
        raise ModelError(f"--dtype {block_format} quantizes with the native kernels: {native_available()}")
    source = Path(model.source or model.name)
    names = {id(m): n for n, m in model.hf.named_modules()}
    tensors, modules = {}, {}
    for name, (module, stored) in (taken or {}).items():
        tensors[name], modules[id(module)] = replace(stored, path=source), name
    for module in _quantized_linears(model.hf):
        name = f"{names[id(module)]}.weight"
        if name in tensors or module.weight.device.type == "meta":
            continue
        stored = _quantized_rows(module.weight, block_format)
        if stored is None:
            continue
        tensors[name], modules[id(module)] = replace(stored, path=source), name
        # the dense matrix goes (a tied head unties: the embedding keeps its own)
        module.weight = nn.Parameter(torch.empty(module.weight.shape, device="meta"), requires_grad=False)
    missing = [n for n, p in model.hf.named_parameters() if p.device.type == "meta" and n not in tensors]
    if missing:
        raise ModelError(f"{model.name}: no tensor for '{missing[0]}' in its checkpoint")
    if not tensors:
        import gguf

        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[block_format.upper()]][0]
        raise ModelError(f"no matrix of {model.name} is {block} inputs wide or a multiple of it, as {block_format} "
                         "blocks need; choose another format (q8_0, q4_0, q4_1: blocks of 32)")
    model.stored = StoredWeights(source, tensors, modules, arithmetic, block_format)
    return model


def prepare(model: LoadedModel, engine: str = "auto", pack: bool | None = None,
            on_filled: Callable[[int, int], None] | None = None, file_kernels: FileKernels | None = None) -> LoadedModel:
    """Attach the executor of `engine` to a loaded model (see load_model): the native kernels where
    they run here and the architecture passed its check with them, else the modules (bf16 linears
    packed where `pack` says). file_kernels: a GGUF's descriptors, being filled (NativeEngine)."""
    dtype, device = model.dtype, model.device
    if model.placement is not None:  # the native kernels and packed linears hold their own copies of the weights
        if engine == "native":
            raise ModelError("the native engine does not run a model spread by --device-map; use --engine eager or auto")
        resolve_engine(engine, dtype, "cpu")  # an unknown name is refused all the same
        kind, pack = "eager", False
    else:
        kind = resolve_engine(engine, dtype, device)
    if kind == "eager" and (pack or (pack is None and packing_supported(dtype, device))):
        if not packing_supported(dtype, device):
            raise ModelError(f"weight packing needs bfloat16 on a CPU with oneDNN bf16 support, not {dtype} on {device}")
        pack_linears(model.hf)
        model.parts = parts_of(model.hf)  # the packed linears (the LM head among them) are its parts now
    if kind == "native" and native_allowed(model.hf.config):
        use_native(model, on_filled, file_kernels)
    else:
        model.executor = modules_executor(model)
    return model


def wrap_model(hf_model: nn.Module, tokenizer: Any = None, name: str | None = None, **placing) -> LoadedModel:
    """loading.wrap_model (placing: its device_map, max_memory), after the architecture's check; it
    runs on its modules (use_native runs it on the native kernels)."""
    ensure_checked(hf_model.config)
    model = loading.wrap_model(hf_model, tokenizer, name, **placing)
    model.executor = modules_executor(model)
    return model
