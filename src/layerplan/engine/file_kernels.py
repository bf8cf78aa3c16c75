"""A GGUF's model as the native kernels run it, described from the file: the one builder of the
kernel descriptors (kernels.h lp_attention, lp_mlp, lp_norm, lp_matrix) of a file's matrices.

It reads the file's index (config.json and tensors.json: each tensor's place, type and name, the
names being the architecture table's, models/arch_table.py) and describes every layer by the
table's facts: which matrices stack into one product (q, k and v; gate and up), its norms and
their rounding, the q/k norms, the activation, each layer's attention window. The packed panels
go into one buffer on 2 MB pages, read from the file's kept panels (engine/panel_cache.py) or
packed from its rows, on threads that run while the caller goes on.

Both front ends take these descriptors: the light one (lite/model.py) runs them by lp_forward,
and the torch one (engine/native.py) runs a GGUF's layers by them where the modules it built
agree with the file's facts. A dense checkpoint's layers are described from their modules
(native.py NativeLayer).
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from layerplan.engine.kernel_library import (ABI, ACTIVATION_CODES, NORM_ROUNDING, huge_page_buffer, kernels_key,
                                             library)
from layerplan.engine.panel_cache import PanelCache
from layerplan.engine.stored_pack import pack_stored, stack_format, v_apart
from layerplan.models.arch_table import (ARCHITECTURES, CONFIG_ACTIVATIONS, HEAD, ArchSpec, context_length,
                                        layer_attention)
from layerplan.models.errors import ModelError
from layerplan.models.gguf_index import StoredTensor
from layerplan.models.gguf_place import INDEX_VERSION, TENSORS_FILE

_Norm, _Matrix, _Attention, _Mlp = (ABI.structs[name] for name in ("lp_norm", "lp_matrix", "lp_attention", "lp_mlp"))

ARITHMETIC_CODES = {"exact": ABI.LP_ARITH_EXACT, "fast": ABI.LP_ARITH_INT8}
# the small tensors (norms, biases) a file may store, as numpy reads them
_SMALL_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class NotDescribed(Exception):
    """What the file's descriptors do not cover (the message says what): the model's modules
    describe it instead (the torch front end)."""


@lru_cache(maxsize=4)
def read_index(index: Path) -> tuple[dict, dict]:
    """(config.json, TENSORS_FILE) of an index, parsed once a process: the command line's check
    (lite/cli.py runnable) and the model read the same files on the start's path. An index is
    written whole and never changed (models/stored.py index_gguf), so a parse stays its own."""
    return json.loads((index / "config.json").read_text()), json.loads((index / TENSORS_FILE).read_text())



def activation_of(config: dict) -> str:
    """config.json's name of the MLP's activation (Gemma's key, or the llama family's)."""
    return config.get("hidden_activation") or config.get("hidden_act") or "silu"


def file_refusal(index: Path) -> str | None:
    """Why the GGUF of this index cannot be described from the file (one line), or None."""
    try:
        config, tensors = read_index(index)
    except (OSError, ValueError):
        return "the file has no index yet (the first load makes it)"
    if tensors.get("version") != INDEX_VERSION:
        return "its index is of another version"
    model_type = config.get("model_type")
    spec = ARCHITECTURES.get(model_type)
    if spec is None or spec.kernels is None or spec.parallel or spec.position_embed is not None:
        return f"architecture '{model_type}' has no kernel layout"
    if activation_of(config) not in CONFIG_ACTIVATIONS or config.get("partial_rotary_factor", 1.0) != 1.0:
        return "an activation or rotary layout the kernels do not take"
    if config.get("attn_logit_softcapping"):
        return "attention logit soft-capping runs on the modules"
    kinds = {entry["type"] for entry in tensors["tensors"]}
    unknown = sorted(k for k in kinds if getattr(ABI, f"LP_FORMAT_{k}", None) is None)
    if unknown:
        return f"tensor type {unknown[0]} has no kernels' format"
    return None


@dataclass(frozen=True)
class FileConfig:
    """What the kernels' descriptors need of the model's config.json."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inner: int
    layers: int
    eps: float
    context_length: int
    eos_token_ids: tuple[int, ...]
    scaling: float  # of the attention's scores: head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5
    layer_types: tuple[str, ...]  # each layer's ("full_attention", "sliding_attention")
    windows: tuple[int, ...]  # each layer's sliding window (0: none)

    @classmethod
    def read(cls, config: dict, query_rows: int) -> FileConfig:
        """From config.json and the rows of layer 0's q projection: the heads' width is the file's
        (hidden / heads is not every model's: Qwen3's are 128 wide whatever its hidden size)."""
        heads = config["num_attention_heads"]
        eos = config.get("eos_token_id")
        eos_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
        layers = config["num_hidden_layers"]
        keys = SimpleNamespace(**config)  # (the table's config rules read keys as attributes)
        attention = layer_attention(keys, layers)
        return cls(hidden=config["hidden_size"], heads=heads,
                   kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=query_rows // heads,
                   inner=config["intermediate_size"], layers=layers,
                   eps=float(config["rms_norm_eps"]),
                   context_length=context_length(keys),
                   eos_token_ids=tuple(int(i) for i in eos_ids),
                   scaling=float((config.get("query_pre_attn_scalar") or query_rows // heads) ** -0.5),
                   layer_types=tuple(kind for kind, _ in attention),
                   windows=tuple(int(window or 0) for _, window in attention))


class Packed:
    """The model's packed matrices in one buffer on 2 MB pages (as engine/arena.py keeps them):
    each a kept entry of the file's panels read back, or packed from the file's rows and kept."""

    def __init__(self, panels: PanelCache | None, threads: int) -> None:
        self.panels = panels
        self.threads = threads
        self._wanted: list[tuple[list[StoredTensor], int, int, int]] = []  # (weights, format, bytes, offset)
        self._size = 0
        self.buffer: np.ndarray | None = None

    def add(self, weights: list[StoredTensor]) -> tuple[int, int]:
        """Reserve a stack's place: (its format, its offset in the buffer)."""
        code = stack_format(weights)
        nbytes = library().lp_packed_bytes(code, sum(w.rows for w in weights), weights[0].columns) \
            if code is not None else -1
        if nbytes < 0:
            raise NotDescribed(f"{weights[0].type_name} matrices stacked with others of another type")
        offset = self._size
        self._wanted.append((weights, code, nbytes, offset))
        self._size += -(-nbytes // 4096) * 4096
        return code, offset

    def start(self) -> None:
        """Start filling every reserved stack's bytes on `threads` threads, while the caller goes
        on (the light front end parses the tokenizer meanwhile, the torch one builds its modules):
        each thread reads its share of the kept entries by one lp_read_files call (without the
        interpreter's lock), then packs its share of what was not kept (a first start: from the file's rows, and keeps it). Shares are balanced by
        bytes, the largest stacks first. finish() waits for them."""
        self.buffer = huge_page_buffer(self._size)
        kept, missing = [], []
        for wanted in self._wanted:
            entry = self.panels.kept(*wanted[:3]) if self.panels is not None else None
            (kept if entry is not None else missing).append((entry, wanted))
        count = max(self.threads, 1)
        self._reads, self._packs = [[] for _ in range(count)], [[] for _ in range(count)]
        load = [0] * count
        # (packing costs a byte about as much as reading a kept one costs ten)
        for item, cost, lists in sorted([(i, i[1][2] // 10, self._reads) for i in kept]
                                        + [(i, i[1][2], self._packs) for i in missing], key=lambda x: -x[1]):
            least = load.index(min(load))
            lists[least].append(item)
            load[least] += cost
        self._missing = len(missing)
        self._to_pack = sum(w[2] for _, w in missing)
        self._done, self._short, self._failures = [0] * count, [0] * count, []
        self._workers = [threading.Thread(target=self._fill, args=(i,), name="layerplan-fill", daemon=True)
                         for i in range(count) if self._reads[i] or self._packs[i]]
        for worker in self._workers:
            worker.start()

    def _fill(self, mine: int) -> None:
        try:
            share = self._reads[mine]
            if share:
                paths = [ctypes.create_string_buffer(os.fsencode(entry)) for entry, _ in share]
                sizes = np.array([wanted[2] for _, wanted in share], np.int64)
                outs = (ctypes.c_void_p * len(share))(*(self.address(wanted[3]) for _, wanted in share))
                whole = np.zeros(len(share), np.uint8)
                library().lp_read_files((ctypes.c_void_p * len(share))(*(ctypes.addressof(p) for p in paths)),
                                        sizes.ctypes.data, outs, whole.ctypes.data, len(share))
                short = [(None, wanted) for (_, wanted), done in zip(share, whole) if not done]
                self._packs[mine].extend(short)  # (an entry cut short since it was found: packed again)
                self._short[mine] = len(short)
            for _, (weights, code, nbytes, offset) in self._packs[mine]:
                out = self.buffer[offset:offset + nbytes]
                pack_stored(weights, code, weights[0].columns, out.ctypes.data)
                if self.panels is not None:
                    self.panels.write(weights, code, out)
                self._done[mine] += nbytes  # (this thread's own count; read for progress only)
        except BaseException as error:  # noqa: BLE001 - raised again on the caller's thread
            self._failures.append(error)

    def finish(self, on_packed: Callable[[int, int], None] | None = None) -> None:
        """Wait for the threads; on_packed(bytes packed, bytes to pack) now and then while some
        pack (a first start's progress bar)."""
        reported = 0
        for worker in self._workers:
            while worker.is_alive():
                worker.join(0.25)
                if on_packed is not None and self._to_pack:
                    reported = sum(self._done)
                    on_packed(reported, self._to_pack)
        if on_packed is not None and self._to_pack and reported < self._to_pack:  # (the whole, once)
            on_packed(self._to_pack, self._to_pack)
        if self._failures:
            raise self._failures[0]
        self.packed_here = self._missing + sum(self._short)  # stacks no kept entry held (0 once the file was loaded)

    def address(self, offset: int) -> int:
        return self.buffer.ctypes.data + offset



class FileKernels:
    """The kernel descriptors of a GGUF's model, from its index (see the module's docstring).

    Made in two halves: the constructor reads the index, reserves each stack's panels and starts
    filling them on threads; finish() waits for them and describes every layer. Each descriptor
    points into the packed buffer, `small` (norm weights) or `_held` (biases), which live as long
    as this object."""

    def __init__(self, gguf: Path, index: Path, arithmetic: int, threads: int) -> None:
        """arithmetic: the products' LP_ARITH_ code; threads: the fill threads'. Raises NotDescribed
        where file_refusal finds a reason."""
        refusal = file_refusal(index)
        if refusal is not None:
            raise NotDescribed(f"{gguf.name}: {refusal}")
        config, facts = read_index(index)
        self.source, self.index = gguf, index
        self.spec: ArchSpec = ARCHITECTURES[config["model_type"]]
        kernels = self.spec.kernels
        query_name = self.spec.layer_name(0, self.spec.attention, kernels.qkv[0], "weight")
        query = next((e for e in facts["tensors"] if e["name"] == query_name), None)
        if query is None:
            raise ModelError(f"{gguf.name}: no tensor for '{query_name}' in the file")
        # (a fused qkv's rows are (heads + 2 kv_heads) head_dim: the heads' width from its q rows alone)
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        query_rows = query["shape"][0] if len(kernels.qkv) > 1 else query["shape"][0] * heads // (heads + 2 * kv_heads)
        self.config = FileConfig.read(config, query_rows)
        self.arithmetic = arithmetic
        self.activation = ACTIVATION_CODES[CONFIG_ACTIVATIONS[activation_of(config)]]
        self.rounding = NORM_ROUNDING[kernels.norm]
        self.tensors: dict[str, StoredTensor] = {}
        self.small: dict[str, np.ndarray] = {}
        for entry in facts["tensors"]:
            self._read_entry(entry)
        self._held: list[np.ndarray] = []
        self.packed = Packed(PanelCache.for_file(gguf, kernels_key()), threads)
        spec = self.spec
        self._stacks = []
        for i in range(self.config.layers):
            qkv = [spec.layer_name(i, spec.attention, name) for name in kernels.qkv]
            apart = v_apart([self.matrix(f"{name}.weight").type_name for name in qkv])
            self._stacks.append({
                "qkv": self._stack(qkv[:2] if apart else qkv),
                "v": self._stack(qkv[2:]) if apart else None,
                "o": self._stack([spec.layer_name(i, spec.attention, "o_proj")]),
                "gate_up": self._stack([spec.layer_name(i, spec.mlp, name) for name in kernels.gate_up]),
                "down": self._stack([spec.layer_name(i, spec.mlp, "down_proj")]),
            })
        self.head_name = HEAD if f"{HEAD}.weight" in self.tensors else spec.name(spec.embed)
        self._head = self._stack([self.head_name])
        self.attention: list[ctypes.Structure] = []
        self.mlp: list[ctypes.Structure] = []
        self.packed.start()

    # ----- the file's tensors ------------------------------------------------------------------
    def _read_entry(self, entry: dict) -> None:
        shape = entry["shape"]
        rows, columns = shape if entry["matrix"] else (1, int(np.prod(shape)))
        # (type_id: gguf-py's number, for its dequantization; the kernels go by type_name)
        stored = StoredTensor(path=self.source, offset=entry["offset"], type_name=entry["type"],
                              type_id=-1, rows=rows, columns=columns, row_bytes=entry["nbytes"] // rows,
                              row_order=tuple(entry["row_order"]) or None)
        if entry["matrix"]:
            self.tensors[entry["name"]] = stored
            return
        kind = _SMALL_TYPES.get(entry["type"])
        if kind is None:
            raise NotDescribed(f"{self.source.name}: {entry['name']} is stored as {entry['type']}")
        raw = stored.read_rows().view(kind).reshape(-1)
        values = (raw.astype(np.uint32) << 16).view(np.float32) if kind is np.uint16 else raw.astype(np.float32)
        if entry["shift"]:  # what transformers' processor adds (Gemma's norms), in float32 as torch does
            values = values + np.float32(entry["shift"])
        self.small[entry["name"]] = np.ascontiguousarray(values, np.float32)

    def _small(self, name: str) -> np.ndarray:
        found = self.small.get(name)
        if found is None:
            raise ModelError(f"{self.source.name}: no tensor for '{name}' in the file")
        return found

    def matrix(self, name: str) -> StoredTensor:
        found = self.tensors.get(name)
        if found is None:
            raise ModelError(f"{self.source.name}: no tensor for '{name}' in the file")
        return found

    # ----- descriptors ---------------------------------------------------------------------------
    def _norm(self, name: str | None) -> ctypes.Structure:
        """The norm whose weight is `name` (None: no norm there)."""
        if name is None:
            return _Norm(None, 0.0, 0.0, self.rounding, ABI.LP_DTYPE_F32)
        weight = self._small(name)
        return _Norm(weight.ctypes.data, self.config.eps, self.spec.norm_weight_offset, self.rounding, ABI.LP_DTYPE_F32)

    def _bias(self, names: Sequence[str], rows: Sequence[int]) -> np.ndarray | None:
        """The stack's biases in fp32 (zeros for a part without one), None where none has one."""
        if not any(name in self.small for name in names):
            return None
        return np.ascontiguousarray(np.concatenate([self.small.get(name, np.zeros(r, np.float32))
                                                    for name, r in zip(names, rows)]))

    def _stack(self, names: Sequence[str]) -> dict:
        """A stack of linears by name (their weights, and biases where the file has them): its
        place in the packed buffer, to describe once filled."""
        weights = [self.matrix(f"{name}.weight") for name in names]
        code, offset = self.packed.add(weights)
        bias = self._bias([f"{name}.bias" for name in names], [w.rows for w in weights])
        if bias is not None:
            self._held.append(bias)
        return {"weights": weights, "code": code, "offset": offset, "n": sum(w.rows for w in weights),
                "k": weights[0].columns, "bias": bias}

    def _describe(self, stack: dict | None) -> ctypes.Structure:
        if stack is None:
            return _Matrix()
        bias = stack["bias"]
        return _Matrix(self.packed.address(stack["offset"]), bias.ctypes.data if bias is not None else None,
                       stack["n"], stack["k"], stack["code"], self.arithmetic)

    def finish(self, on_packed: Callable[[int, int], None] | None = None) -> FileKernels:
        """Wait for the panels (on_packed(bytes, of bytes): the progress of packing, a first
        start's), then describe every layer's attention and MLP, the final norm and the LM head."""
        if self.attention:
            return self
        self.packed.finish(on_packed)
        c, spec, kernels = self.config, self.spec, self.spec.kernels

        def norm_of(layer: int, *path: str | None) -> ctypes.Structure:
            """A layer's norm at `path` (None in it: the layer has none there)."""
            return self._norm(None if None in path else spec.layer_name(layer, *path, "weight"))

        qk_norms = spec.attention if kernels.qk_norms else None  # (q_norm and k_norm in the attention)
        for i, stack in enumerate(self._stacks):
            self.attention.append(_Attention(
                hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim,
                norm=norm_of(i, spec.attention_norm), q_norm=norm_of(i, qk_norms, "q_norm"),
                k_norm=norm_of(i, qk_norms, "k_norm"), post_norm=norm_of(i, spec.attention_post_norm),
                qkv=self._describe(stack["qkv"]), v=self._describe(stack["v"]),
                o=self._describe(stack["o"]), scaling=c.scaling, window=c.windows[i], rotary_dim=c.head_dim))
            self.mlp.append(_Mlp(hidden=c.hidden, inner=c.inner, norm=norm_of(i, spec.mlp_norm),
                                 post_norm=norm_of(i, spec.mlp_post_norm), gate_up=self._describe(stack["gate_up"]),
                                 down=self._describe(stack["down"]), activation=self.activation))
        self.final_norm = self._norm(spec.name(spec.final_norm, "weight"))
        self.head = self._describe(self._head)
        return self

    @property
    def vocab(self) -> int:
        """The LM head's rows."""
        return self._head["n"]

    def head_weight(self) -> StoredTensor:
        """The LM head's stored matrix (the embedding's, where the file ties them)."""
        return self._head["weights"][0]
