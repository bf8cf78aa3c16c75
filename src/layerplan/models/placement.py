"""Models bigger than one device: `--device-map auto|FILE` places whole decoder layers on devices,
in CPU memory or on disk, the way accelerate writes and plans a device map.

A map is parsed and validated once into a `DeviceMap` (frozen: one device per decoder layer, plus
the main device, where the embeddings, head and disk layers run). The loaded model owns a
`Placement`: the plan runner asks it where a step's layer lives, moves the residual stream there,
and has it bring a disk layer's weights in for the step (`bring`) and drop them after (`release`).

Loading from a folder goes through transformers' from_pretrained with the map (`accelerate_map`),
so disk layers are never loaded whole: accelerate indexes their weights in the checkpoint's
safetensors files (or writes converted ones to an offload folder). accelerate's hooks would load
weights module by module on every call and move inputs about; `adopt` removes them and keeps their
store for `bring`. A model already in memory (`wrap_model`) is spread by `place`, which writes its
disk layers to an offload folder in accelerate's format.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn

from layerplan.files import cache_dir
from layerplan.models.architectures import ModelError

DISK = "disk"
DEVICE_NAMES = "cpu, disk, cuda, cuda:N or N (a GPU index)"


@dataclass(frozen=True)
class DeviceMap:
    """Where each decoder layer lives ("cpu", "cuda:0", … or "disk") and where everything outside
    the layers (embeddings, final norm, head, rotary) runs: `main`, the first GPU the map names,
    else the CPU. A disk layer runs on `main` too, while its weights are brought in."""

    source: str  # "auto" or the file, for messages
    layers: tuple[str, ...]
    main: str

    @property
    def offloaded(self) -> tuple[int, ...]:
        return tuple(i for i, device in enumerate(self.layers) if device == DISK)

    @property
    def trivial(self) -> bool:
        """Every layer in CPU memory: nothing for the runner to move or bring in."""
        return self.main == "cpu" and all(device == "cpu" for device in self.layers)

    def device_of(self, layer: int) -> torch.device:
        device = self.layers[layer]
        return torch.device(self.main if device == DISK else device)


def _device_name(value, key: str, where: str) -> str:
    """'cpu', 'disk' or 'cuda:N' for a map value; one line naming the entry otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ModelError(f"{where}: entry '{key}' has device {value!r}; valid devices: {DEVICE_NAMES}")
    text = str(value).strip().lower()
    if isinstance(value, int) or text.isdigit():
        text = f"cuda:{int(text)}"
    if text == "cuda":
        text = "cuda:0"
    if text in ("cpu", DISK):
        return text
    if text.startswith("cuda:") and text[5:].isdigit():
        if not torch.cuda.is_available():
            raise ModelError(f"{where}: entry '{key}' puts it on {text}, but this torch sees no CUDA GPU; "
                             "use cpu or disk")
        if int(text[5:]) >= torch.cuda.device_count():
            raise ModelError(f"{where}: entry '{key}' puts it on {text}, but this machine has "
                             f"{torch.cuda.device_count()} GPU(s)")
        return text
    if text == "meta":
        raise ModelError(f"{where}: entry '{key}' puts it on 'meta', which holds no weights to run; "
                         f"valid devices: {DEVICE_NAMES}")
    raise ModelError(f"{where}: entry '{key}' has unknown device '{value}'; valid devices: {DEVICE_NAMES}")


def _covering(entries: dict[str, str], name: str) -> str | None:
    """The entry that places module `name`: itself or its nearest enclosing module ('' = all)."""
    while True:
        if name in entries:
            return name
        if not name:
            return None
        name = name.rpartition(".")[0]


def parse_device_map(entries: dict, hf: nn.Module, layers_path: str, where: str) -> DeviceMap:
    """Validate accelerate-style entries (module name -> device) against a model, once."""
    if not isinstance(entries, dict) or not entries:
        raise ModelError(f"{where}: a device map is a mapping of module names to devices, e.g. "
                         "{\"model.layers.0\": \"cpu\", \"model.layers.1\": \"disk\"}")
    modules = dict(hf.named_modules())
    num_layers = len(hf.get_submodule(layers_path))
    devices: dict[str, str] = {}
    for key, value in entries.items():
        key = str(key)
        if key not in modules:
            raise ModelError(f"{where}: entry '{key}' names no module of this model (its layers are "
                             f"{layers_path}.0 … {layers_path}.{num_layers - 1})")
        if key.startswith(layers_path + ".") and key.count(".") > layers_path.count(".") + 1:
            raise ModelError(f"{where}: entry '{key}' places part of a decoder layer; layerplan places whole "
                             f"layers ({key.rsplit('.', key.count('.') - layers_path.count('.') - 1)[0]})")
        devices[key] = _device_name(value, key, where)
    for name, _ in hf.named_parameters():
        if _covering(devices, name.rpartition(".")[0]) is None:
            raise ModelError(f"{where}: the map places no entry over '{name.rpartition('.')[0]}'; cover every "
                             "module (an entry '' places everything)")
    layers = tuple(devices[_covering(devices, f"{layers_path}.{i}")] for i in range(num_layers))
    gpus = [d for d in devices.values() if d.startswith("cuda")]
    return DeviceMap(where, layers, gpus[0] if gpus else "cpu")


def read_device_map(spec: str, hf: nn.Module, layers_path: str, max_memory: dict | None = None) -> DeviceMap:
    """`auto` (accelerate's plan for the memory available, or `max_memory`) or a JSON / YAML file."""
    if spec == "auto":
        try:
            from accelerate import infer_auto_device_map
        except ImportError:
            raise ModelError("--device-map auto needs the accelerate package (pip install accelerate); "
                             "or give a map file") from None
        entries = infer_auto_device_map(hf, max_memory=max_memory,
                                        no_split_module_classes=list(getattr(hf, "_no_split_modules", None) or ()))
        return parse_device_map(dict(entries), hf, layers_path, "device map auto")
    path = Path(spec)
    if not path.is_file():
        raise ModelError(f"device map '{spec}': no such file; give auto or a .json / .yaml file of module -> device")
    try:
        text = path.read_text()
        entries = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        raise ModelError(f"{path}: cannot read it as a JSON or YAML device map ({first})") from None
    return parse_device_map(entries, hf, layers_path, str(path))


class Placement:
    """A model's layers on their devices; a disk layer's weights read from accelerate's offload
    store (the checkpoint's safetensors files, or .dat files accelerate wrote) for its step only.

    Between its steps a disk layer's parameters are meta tensors of their shapes. At most one disk
    layer is resident at a time (bringing one releases any other), so a step that failed half-way
    never leaves more than one layer's weights in memory."""

    def __init__(self, device_map: DeviceMap, layer_modules: nn.ModuleList, layers_path: str,
                 weights: Mapping[str, torch.Tensor] | None, keep: frozenset[int] = frozenset()) -> None:
        self.map = device_map
        self.weights = weights  # full parameter name -> tensor, read on access
        self.resident: int | None = None
        # per offloaded layer: (module, parameter name, full name, shape, dtype); `keep`: ids of
        # parameters that stay in memory (shared with a module outside the offloaded layers)
        self._slots: dict[int, list[tuple[nn.Module, str, str, torch.Size, torch.dtype]]] = {
            index: [(module, name, f"{layers_path}.{index}.{path + '.' if path else ''}{name}", p.shape, p.dtype)
                    for path, module in layer_modules[index].named_modules()
                    for name, p in module.named_parameters(recurse=False) if id(p) not in keep]
            for index in device_map.offloaded}

    def device_of(self, layer: int) -> torch.device:
        return self.map.device_of(layer)

    @property
    def main(self) -> torch.device:
        return torch.device(self.map.main)

    def bring(self, layer: int) -> None:
        """Read an offloaded layer's weights into its modules (nothing for a layer in memory)."""
        if layer not in self._slots or self.resident == layer:
            return
        if self.resident is not None:
            self.release(self.resident)
        with torch.inference_mode(False), torch.no_grad():
            for module, name, full, _, dtype in self._slots[layer]:
                weight = self.weights[full].to(device=self.main, dtype=dtype)
                module._parameters[name] = nn.Parameter(weight, requires_grad=False)
        self.resident = layer

    def release(self, layer: int) -> None:
        """Drop an offloaded layer's weights (meta tensors of their shapes until the next bring)."""
        if layer not in self._slots:
            return
        with torch.inference_mode(False), torch.no_grad():
            for module, name, _, shape, dtype in self._slots[layer]:
                module._parameters[name] = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"),
                                                        requires_grad=False)
        if self.resident == layer:
            self.resident = None


def _layer_index(name: str, layers_path: str) -> int | None:
    prefix = layers_path + "."
    return int(name[len(prefix):].split(".")[0]) if name.startswith(prefix) else None


def offload_folder() -> Path:
    """A fresh folder under the cache for offloaded weights (removed with its model: `_owned`)."""
    root = cache_dir() / "offload"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root, prefix="layers-"))


def _owned(hf: nn.Module, folder: Path) -> None:
    weakref.finalize(hf, shutil.rmtree, folder, True)


def accelerate_map(device_map: DeviceMap, hf: nn.Module, layers_path: str) -> dict[str, int | str]:
    """The map for transformers' from_pretrained(device_map=…): every layer where ours says, and
    every module outside the layers on the main device."""
    def device(name: str) -> int | str:
        return int(name[5:]) if name.startswith("cuda:") else name

    entries: dict[str, int | str] = {f"{layers_path}.{i}": device(d) for i, d in enumerate(device_map.layers)}
    for name, module in hf.named_modules():
        owns = any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))
        if owns and _layer_index(name, layers_path) is None:
            entries[name] = device(device_map.main)
    return entries


def adopt(hf: nn.Module, device_map: DeviceMap, layers_path: str, folder: Path) -> Placement:
    """The placement of a model transformers loaded with `accelerate_map` (disk layers left on
    meta, their weights indexed by accelerate): accelerate's hooks sit on the modules the plan
    runner calls, so they go, and the placement brings disk layers in per step instead."""
    from accelerate.hooks import remove_hook_from_module

    weights = None
    for module in hf.modules():
        mapped = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        if mapped is not None:
            weights = getattr(mapped, "dataset", mapped)  # a PrefixedDataset over the whole store
            break
    remove_hook_from_module(hf, recurse=True)
    _owned(hf, folder)
    if device_map.offloaded and weights is None:
        raise ModelError("transformers loaded the model without an offload store for its disk layers")
    return Placement(device_map, hf.get_submodule(layers_path), layers_path, weights)


def place(hf: nn.Module, device_map: DeviceMap, layers_path: str) -> Placement:
    """Spread an already loaded (CPU) model by the map: its parts moved to their devices, each
    disk layer's weights written to accelerate's offload format (.dat files, read through a
    memory map) in a fresh folder under the cache, removed with the model, and dropped."""
    from accelerate.utils import OffloadedWeightsLoader, offload_state_dict

    on_disk = set(device_map.offloaded)
    # tensor by tensor, so a big model never has to fit on one device on its way to its places;
    # everything outside the layers (and a disk layer's buffers) runs on the main device
    with torch.no_grad():
        for name, tensor in [*hf.named_parameters(), *hf.named_buffers()]:
            layer = _layer_index(name, layers_path)
            if layer in on_disk and isinstance(tensor, nn.Parameter):
                continue  # written to the offload folder below, then dropped
            target = device_map.device_of(layer) if layer is not None else torch.device(device_map.main)
            if tensor.device != target:
                tensor.data = tensor.data.to(target)
    # a parameter shared with a module outside the offloaded layers (tied weights) stays in memory
    shared = frozenset(id(p) for name, p in hf.named_parameters(remove_duplicate=False)
                       if _layer_index(name, layers_path) not in on_disk)
    placement = Placement(device_map, hf.get_submodule(layers_path), layers_path, None, shared)
    if not on_disk:  # a map of devices alone (all on a GPU, say): no offload store
        return placement
    folder = offload_folder()
    _owned(hf, folder)
    state = {full: getattr(module, name).detach().cpu() for index in sorted(on_disk)
             for module, name, full, _, _ in placement._slots[index]}
    offload_state_dict(str(folder), state)
    placement.weights = OffloadedWeightsLoader(save_folder=str(folder))
    del state
    for index in on_disk:
        placement.release(index)
    return placement
