"""Models bigger than one device: `--device-map auto|FILE` places whole decoder layers on devices,
in CPU memory or on disk, the way accelerate writes a device map.

A map is parsed and validated once into a `DeviceMap` (frozen: one device per decoder layer, plus
where the embeddings and head run). `place` applies it to a loaded transformers model and returns
the `Placement` the loaded model owns: the plan runner asks it where a step's layer lives, moves the
residual stream there, and brings a disk layer's weights in for the step (`bring`) and drops them
after it (`release`). A disk layer's weights live in a safetensors file (read through a memory map);
between its steps the layer's parameters are empty tensors. accelerate's own offload hooks sit on
whole decoder layers, which the runner does not call (it calls attention and MLP itself), so they
are not used.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
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
    """A model's layers on their devices; a disk layer's weights in a file, brought in per step.

    At most one disk layer is resident at a time (bringing one releases any other), so a step that
    failed half-way never leaves more than one layer's weights in memory."""

    def __init__(self, device_map: DeviceMap, layer_modules: nn.ModuleList, folder: Path,
                 keep: frozenset[int] = frozenset()) -> None:
        self.map = device_map
        self.folder = folder
        self.resident: int | None = None
        # per offloaded layer: (parameter, its name in the layer's file); `keep`: ids of parameters
        # that stay in memory (shared with a module outside the offloaded layers)
        self._parameters: dict[int, list[tuple[nn.Parameter, str]]] = {
            index: [(p, name) for name, p in layer_modules[index].named_parameters() if id(p) not in keep]
            for index in device_map.offloaded}

    def device_of(self, layer: int) -> torch.device:
        return self.map.device_of(layer)

    @property
    def main(self) -> torch.device:
        return torch.device(self.map.main)

    def file_of(self, layer: int) -> Path:
        return self.folder / f"layer-{layer}.safetensors"

    def bring(self, layer: int) -> None:
        """Read an offloaded layer's weights into its parameters (nothing for a layer in memory)."""
        if layer not in self._parameters or self.resident == layer:
            return
        if self.resident is not None:
            self.release(self.resident)
        from safetensors import safe_open

        device = self.main
        with torch.inference_mode(False), torch.no_grad(), safe_open(self.file_of(layer), "pt") as weights:
            for parameter, name in self._parameters[layer]:
                parameter.data = weights.get_tensor(name).to(device)
        self.resident = layer

    def offload(self, layer: int) -> None:
        """Write an offloaded layer's weights to its file and drop them (once, when placing)."""
        from safetensors.torch import save_file

        save_file({name: p.detach().contiguous().cpu() for p, name in self._parameters[layer]}, str(self.file_of(layer)))
        self.release(layer)

    def release(self, layer: int) -> None:
        """Drop an offloaded layer's weights (its parameters become empty until the next bring)."""
        if layer not in self._parameters:
            return
        with torch.inference_mode(False), torch.no_grad():
            for parameter, _ in self._parameters[layer]:
                parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
        if self.resident == layer:
            self.resident = None


def place(hf: nn.Module, device_map: DeviceMap, layers_path: str, folder: Path | None = None) -> Placement:
    """Move a (CPU-loaded) model's parts where the map says; write each disk layer's weights to
    its own safetensors file (in `folder`, default a fresh folder under the cache, removed with the
    model) and drop them from memory."""
    layer_modules = hf.get_submodule(layers_path)
    on_disk = set(device_map.offloaded)
    prefix = layers_path + "."

    def layer_of(name: str) -> int | None:
        return int(name[len(prefix):].split(".")[0]) if name.startswith(prefix) else None

    # tensor by tensor, so a big model never has to fit on one device on its way to its places;
    # everything outside the layers (and a disk layer's buffers) runs on the main device
    with torch.no_grad():
        for name, tensor in [*hf.named_parameters(), *hf.named_buffers()]:
            layer = layer_of(name)
            if layer is not None and layer in on_disk and isinstance(tensor, nn.Parameter):
                continue  # written to its file below, then dropped
            target = device_map.device_of(layer) if layer is not None else torch.device(device_map.main)
            if tensor.device != target:
                tensor.data = tensor.data.to(target)
    if folder is None:
        root = cache_dir() / "offload"
        root.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(dir=root, prefix="layers-"))
        weakref.finalize(hf, shutil.rmtree, folder, True)
    # a parameter shared with a module outside the offloaded layers (tied weights) stays in memory
    shared = frozenset(id(p) for name, p in hf.named_parameters(remove_duplicate=False)
                       if layer_of(name) not in on_disk)
    placement = Placement(device_map, layer_modules, folder, shared)
    for index in sorted(on_disk):
        placement.offload(index)
    return placement
