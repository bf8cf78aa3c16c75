"""A GGUF run as stored by the native kernels alone: numpy, ctypes and the kernels' library, no
torch, no transformers.

What it reads is what the torch front end made of the file once (its index: config.json, the
tokenizer's files, tensors.json with each tensor's place, type and transformers name, and the
rotary frequencies; the packed panels kept for the file and kernels, engine/panel_cache.py). From
those it builds the same kernel descriptors engine/native.py builds from the modules — the same
packed matrices (engine/stored_pack.py), norm weights, biases, rotary tables
(engine/rope_tables.py), KV slots by plan step — and runs a pass as one lp_forward call, as the
torch front end's whole_pass does. So its logits are the torch front end's bit for bit
(tests/test_lite.py), and a start costs the interpreter, numpy, the tokenizer and the panels' read.

It reads the model as the architecture table (models/arch_table.py) describes it: its tensors by
the names the table gives, its norms, activation and embedding by the table's facts. It takes the
architectures whose kernel layout the table marks `light` (the llama family and Gemma 3: their
layers run whole in the kernels, with nothing the torch front end decides from modules) and plans
of this one model; `lite_refusal` says why not, and then the caller runs the torch front end.
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

from layerplan.engine.kernel_library import (ABI, ACTIVATION_CODES, NORM_ROUNDING, check, huge_page_buffer, kernels_key,
                                             library)
from layerplan.engine.panel_cache import PanelCache
from layerplan.engine.rope_tables import rope_rows
from layerplan.engine.stored_pack import pack_stored, stack_format, v_apart
from layerplan.lite.tokenizer import LiteTokenizer
from layerplan.lite.tokenizer_process import TokenizerProcess
from layerplan.machine import physical_cores
from layerplan.models.arch_table import (ARCHITECTURES, CONFIG_ACTIVATIONS, HEAD, ArchSpec, context_length,
                                        layer_attention)
from layerplan.models.errors import ModelError
from layerplan.models.gguf_index import StoredTensor, file_index
from layerplan.models.gguf_place import DEFAULT_DISPLAY_NAME, INDEX_VERSION, TENSORS_FILE, default_gguf_path, index_folder
from layerplan.plan.plan import LayerPlan

_Norm, _Matrix, _Kv, _Attention, _Mlp, _Step = (ABI.structs[name] for name in (
    "lp_norm", "lp_matrix", "lp_kv", "lp_attention", "lp_mlp", "lp_step"))

ARITHMETIC_CODES = {"exact": ABI.LP_ARITH_EXACT, "fast": ABI.LP_ARITH_INT8}
# the small tensors (norms, biases) a file may store, as numpy reads them
_SMALL_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class TorchFrontEnd(Exception):
    """What the light front end found it cannot run (the message says what); the torch front end runs it."""


@lru_cache(maxsize=4)
def read_index(index: Path) -> tuple[dict, dict]:
    """(config.json, TENSORS_FILE) of an index, parsed once a process: the command line's check
    (lite/cli.py runnable) and the model read the same files on the start's path. An index is
    written whole and never changed (models/stored.py index_gguf), so a parse stays its own."""
    return json.loads((index / "config.json").read_text()), json.loads((index / TENSORS_FILE).read_text())


def _activation(config: dict) -> str:
    """config.json's name of the MLP's activation (Gemma's key, or the llama family's)."""
    return config.get("hidden_activation") or config.get("hidden_act") or "silu"


def lite_refusal(index: Path) -> str | None:
    """Why the GGUF of this index cannot run here (one line), or None."""
    try:
        config, tensors = read_index(index)
    except (OSError, ValueError):
        return "the file has no index yet (the first load makes it)"
    if tensors.get("version") != INDEX_VERSION or tensors.get("rotary") is None:
        return "its index holds no fixed rotary frequencies"
    model_type = config.get("model_type")
    spec = ARCHITECTURES.get(model_type)
    if spec is None or spec.kernels is None or not spec.kernels.light:
        return f"architecture '{model_type}' runs on the torch front end"
    if _activation(config) not in CONFIG_ACTIVATIONS or config.get("partial_rotary_factor", 1.0) != 1.0:
        return "an activation or rotary layout the light front end does not take"
    if config.get("final_logit_softcapping") or config.get("attn_logit_softcapping"):
        return "logit soft-capping runs on the torch front end"
    types = config.get("layer_types") or ()
    by_type = tensors["rotary"].get("by_layer_type")
    sliding = any(kind != "full_attention" for kind, _ in
                  layer_attention(SimpleNamespace(**config), int(config.get("num_hidden_layers") or 0)))
    if by_type is None and (config.get("use_sliding_window") or sliding):
        return "sliding-window attention runs on the torch front end"
    if by_type is not None and (not types or set(types) - set(by_type)
                                or set(types) - {"full_attention", "sliding_attention"}):
        return "rotary frequencies by layer type that do not match its layers"
    kinds = {entry["type"] for entry in tensors["tensors"]}
    unknown = sorted(k for k in kinds if getattr(ABI, f"LP_FORMAT_{k}", None) is None)
    if unknown:
        return f"tensor type {unknown[0]} has no kernels' format"
    return None


@dataclass(frozen=True)
class LiteConfig:
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
    def read(cls, config: dict, query_rows: int) -> LiteConfig:
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
            raise TorchFrontEnd(f"{weights[0].type_name} matrices stacked with others of another type")
        offset = self._size
        self._wanted.append((weights, code, nbytes, offset))
        self._size += -(-nbytes // 4096) * 4096
        return code, offset

    def start(self) -> None:
        """Start filling every reserved stack's bytes on `threads` threads, while the caller goes
        on (it parses the tokenizer meanwhile): each thread reads its share of the kept entries
        by one lp_read_files call (without the interpreter's lock), then packs its share of what
        was not kept (a first start: from the file's rows, and keeps it). Shares are balanced by
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


class LiteModel:
    """A GGUF's model as the kernels run it, from its index (see the module's docstring)."""

    def __init__(self, gguf: Path, arithmetic: str = "exact", threads: int | None = None,
                 on_packed: Callable[[int, int], None] | None = None,
                 tokenizer: LiteTokenizer | TokenizerProcess | None = None) -> None:
        """on_packed(bytes, of bytes): the progress of packing the file's matrices (its first start);
        tokenizer: the index's, already started (lite/tokenizer_process.py), else read here. The
        index is made from the file where the file index covers it (else transformers' must be kept)."""
        index = file_index(gguf) or index_folder(gguf)
        refusal = lite_refusal(index)
        if refusal is not None:
            raise TorchFrontEnd(f"{gguf.name}: {refusal}")
        config, facts = read_index(index)
        self.spec: ArchSpec = ARCHITECTURES[config["model_type"]]
        kernels = self.spec.kernels
        query_name = self.spec.layer_name(0, self.spec.attention, kernels.qkv[0], "weight")
        query = next(e for e in facts["tensors"] if e["name"] == query_name)
        self.config = LiteConfig.read(config, query["shape"][0])
        self.name = DEFAULT_DISPLAY_NAME if gguf == default_gguf_path() else gguf.stem
        self.source = str(gguf)
        self.arithmetic = ARITHMETIC_CODES[arithmetic]
        self.threads = threads or physical_cores()  # (torch's default, as the torch front end runs)
        # (llama.cpp's arithmetic keeps its keys and values in f16, as engine/native.py's does)
        self.kv_dtype = np.float16 if self.arithmetic == ABI.LP_ARITH_INT8 else np.float32
        self.activation = ACTIVATION_CODES[CONFIG_ACTIVATIONS[_activation(config)]]
        self.rounding = NORM_ROUNDING[kernels.norm]
        self.index = index
        self.chat = facts.get("chat") or {"template": True}  # (models/stored.py _chat_frame)
        self.tensors: dict[str, StoredTensor] = {}
        self.small: dict[str, np.ndarray] = {}
        for entry in facts["tensors"]:
            self._read_entry(gguf, entry)
        # one rotary table a layer type (Gemma 3's sliding and full attention), or one for all
        rotary = facts["rotary"]
        by_type = rotary.get("by_layer_type") or {"": rotary}
        self._ropes = [(np.asarray(f["inv_freq"], np.float32), f["attention_scaling"]) for f in by_type.values()]
        order = {layer_type: i for i, layer_type in enumerate(by_type)}
        self.rope_of_layer = tuple(order.get(t, 0) for t in self.config.layer_types)
        self._cos = [np.empty((0, 2 * len(inv_freq)), np.float32) for inv_freq, _ in self._ropes]
        self._sin = list(self._cos)
        self.embed_scale = np.float32(self.config.hidden ** 0.5) if self.spec.scaled_embedding else None
        self._build(gguf, on_packed, tokenizer)

    # ----- the file's tensors ------------------------------------------------------------------
    def _read_entry(self, gguf: Path, entry: dict) -> None:
        shape = entry["shape"]
        rows, columns = shape if entry["matrix"] else (1, int(np.prod(shape)))
        # (type_id: gguf-py's number, for its dequantization; the kernels go by type_name)
        stored = StoredTensor(path=gguf, offset=entry["offset"], type_name=entry["type"],
                              type_id=-1, rows=rows, columns=columns, row_bytes=entry["nbytes"] // rows,
                              row_order=tuple(entry["row_order"]) or None)
        if entry["matrix"]:
            self.tensors[entry["name"]] = stored
            return
        kind = _SMALL_TYPES.get(entry["type"])
        if kind is None:
            raise TorchFrontEnd(f"{gguf.name}: {entry['name']} is stored as {entry['type']}")
        raw = stored.read_rows().view(kind).reshape(-1)
        values = (raw.astype(np.uint32) << 16).view(np.float32) if kind is np.uint16 else raw.astype(np.float32)
        if entry["shift"]:  # what transformers' processor adds (Gemma's norms), in float32 as torch does
            values = values + np.float32(entry["shift"])
        self.small[entry["name"]] = np.ascontiguousarray(values, np.float32)

    def _small(self, name: str) -> np.ndarray:
        found = self.small.get(name)
        if found is None:
            raise ModelError(f"{Path(self.source).name}: no tensor for '{name}' in the file")
        return found

    def _matrix(self, name: str) -> StoredTensor:
        found = self.tensors.get(name)
        if found is None:
            raise ModelError(f"{Path(self.source).name}: no tensor for '{name}' in the file")
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
        """A stack of linears by transformers name (their weights, and biases where the file has
        them): its place in the packed buffer, to describe once filled."""
        weights = [self._matrix(f"{name}.weight") for name in names]
        code, offset = self.packed.add(weights)
        bias = self._bias([f"{name}.bias" for name in names], [w.rows for w in weights])
        if bias is not None:
            self._held.append(bias)
        return {"code": code, "offset": offset, "n": sum(w.rows for w in weights), "k": weights[0].columns,
                "bias": bias}

    def _describe(self, stack: dict | None) -> ctypes.Structure:
        if stack is None:
            return _Matrix()
        bias = stack["bias"]
        return _Matrix(self.packed.address(stack["offset"]), bias.ctypes.data if bias is not None else None,
                       stack["n"], stack["k"], stack["code"], self.arithmetic)

    def _build(self, gguf: Path, on_packed: Callable[[int, int], None] | None,
               tokenizer: LiteTokenizer | TokenizerProcess | None) -> None:
        """Every layer's attention and MLP descriptors, the final norm and the LM head."""
        c = self.config
        self._held: list[np.ndarray] = []
        panels = PanelCache.for_file(gguf, kernels_key())
        self.packed = Packed(panels, self.threads)
        spec, kernels = self.spec, self.spec.kernels
        stacks = []
        for i in range(c.layers):
            qkv = [spec.layer_name(i, spec.attention, name) for name in kernels.qkv]
            apart = v_apart([self._matrix(f"{name}.weight").type_name for name in qkv])
            stacks.append({
                "qkv": self._stack(qkv[:2] if apart else qkv),
                "v": self._stack(qkv[2:]) if apart else None,
                "o": self._stack([spec.layer_name(i, spec.attention, "o_proj")]),
                "gate_up": self._stack([spec.layer_name(i, spec.mlp, name) for name in kernels.gate_up]),
                "down": self._stack([spec.layer_name(i, spec.mlp, "down_proj")]),
            })
        head = self._stack([HEAD if f"{HEAD}.weight" in self.tensors else spec.name(spec.embed)])
        self.packed.start()
        # the tokenizer's JSON is parsed while the panels are read (it holds the GIL; they do not),
        # here or in its own process; a file without one is a model of token ids (its text cannot
        # be encoded)
        if tokenizer is None and (self.index / "tokenizer.json").exists():
            tokenizer = LiteTokenizer(self.index)
        self.tokenizer = tokenizer.ready() if tokenizer is not None else None
        eos_ids = self.tokenizer.eos_ids if self.tokenizer is not None else ()
        self.eos_token_ids = tuple(sorted(set(self.config.eos_token_ids) | set(eos_ids)))
        self.packed.finish(on_packed)
        self.attention, self.mlp = [], []

        def norm_of(layer: int, *path: str | None) -> ctypes.Structure:
            """A layer's norm at `path` (None in it: the layer has none there)."""
            return self._norm(None if None in path else spec.layer_name(layer, *path, "weight"))

        qk_norms = spec.attention if kernels.qk_norms else None  # (q_norm and k_norm in the attention)
        for i, stack in enumerate(stacks):
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
        self.head = self._describe(head)
        self.vocab = head["n"]
        embedding = self._matrix(spec.name(spec.embed, "weight"))
        self.embedding = embedding
        self.embedding_format = stack_format([embedding])
        self.embedding_rows = embedding.map_rows() if embedding.row_order is None else embedding.read_rows()

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of a prompt, as models/loading.py's LoadedModel.encode gives them: with chat,
        the chat template's frame around it, tokenized whole without added special tokens (as
        transformers' apply_chat_template); without (or for a tokenizer without a template), the
        text with the special tokens its post-processor adds."""
        if self.tokenizer is None:
            raise ModelError(f"{self.name} has no tokenizer: text cannot be turned into tokens")
        if chat and self.chat.get("template"):
            if "prefix" not in self.chat:
                raise TorchFrontEnd("a chat template that does more than wrap the prompt")
            return self.tokenizer.encode(self.chat["prefix"] + text + self.chat["suffix"], special_tokens=False)
        return self.tokenizer.encode(text)

    # ----- plans and passes ----------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.layers

    @property
    def context_length(self) -> int:
        return self.config.context_length

    def plan(self, text: str | os.PathLike | None = None) -> LayerPlan:
        """A plan (string or file) parsed against this model; None: the full model."""
        if text is None:
            return LayerPlan.full(self.num_layers, self.name)
        # (here: plan files' readers import yaml, and a start without a plan counts every import)
        from layerplan.plan.formats import load_plan

        plan = load_plan(text, self.num_layers, self.name)
        if plan.models:
            raise TorchFrontEnd("a plan that takes layers from a second model")
        return plan

    def new_cache(self, plan: LayerPlan, capacity: int) -> LiteCache:
        return LiteCache(self, plan, capacity)

    def _rope(self, end: int) -> None:
        """Every rotary table over positions 0..end-1 at least."""
        for i, (inv_freq, scaling) in enumerate(self._ropes):
            have = self._cos[i].shape[0]
            if have < end:
                size = -(-max(end, 2 * have, 256) // 64) * 64
                cos, sin = rope_rows(inv_freq, scaling, have, size)
                self._cos[i], self._sin[i] = np.concatenate([self._cos[i], cos]), np.concatenate([self._sin[i], sin])

    def embed_rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 (len(ids), hidden): the ids' embedding rows, dequantized by the kernels."""
        if ids.size and (ids.min() < 0 or ids.max() >= self.embedding.rows):
            bad = int(ids[(ids < 0) | (ids >= self.embedding.rows)][0])
            raise ModelError(f"token id {bad} is outside the vocabulary (0-{self.embedding.rows - 1})")
        rows = np.ascontiguousarray(self.embedding_rows[ids])
        out = np.empty((len(ids), self.embedding.columns), np.float32)
        check(library().lp_dequantize_rows(self.embedding_format, rows.ctypes.data, len(ids), self.embedding.columns,
                                           out.ctypes.data), f"dequantizing {self.embedding.type_name} embedding rows")
        if self.embed_scale is not None:  # (Gemma's rows * sqrt(hidden) in float32, as its module scales them)
            out *= self.embed_scale
        return out

    def logits(self, ids: Sequence[int], cache: LiteCache, start_pos: int, last_only: bool = True) -> np.ndarray:
        """float32 (1 or len(ids), vocab): the logits of a pass of `ids` at positions start_pos..,
        their keys and values written into the cache (lp_forward, as engine/native.py's whole pass)."""
        ids = np.asarray(ids, np.int64)
        rows = len(ids)
        if start_pos + rows > cache.capacity:
            raise ValueError(f"positions up to {start_pos + rows} do not fit a cache of {cache.capacity}")
        table = self.embed_rows(ids)
        order = np.arange(rows, dtype=np.int64)
        hidden = np.empty((rows, self.config.hidden), np.float32)
        logits = np.empty((1 if last_only else rows, self.vocab), np.float32)
        self._rope(start_pos + rows)
        tables = len(self._ropes)
        cos = (ctypes.c_void_p * tables)(*(table[start_pos:].ctypes.data for table in self._cos))
        sin = (ctypes.c_void_p * tables)(*(table[start_pos:].ctypes.data for table in self._sin))
        check(library().lp_forward(
            table.ctypes.data, rows, order.ctypes.data, rows, hidden.ctypes.data, cache.table, len(cache.table),
            start_pos, cos, sin, 0, 0, None, ctypes.byref(self.final_norm), ctypes.byref(self.head),
            rows - 1 if last_only else 0, logits.ctypes.data, ABI.LP_DTYPE_F32, self.threads), "a native pass")
        return logits


class LiteCache:
    """A plan's KV cache: a slot (keys, values: (kv_heads, capacity, head_dim)) for each of its
    steps whose attention runs, and the step table lp_forward reads, pointing at them."""

    def __init__(self, model: LiteModel, plan: LayerPlan, capacity: int) -> None:
        c = model.config
        self.capacity = capacity
        steps = [step for step in plan.active_steps if step.active]
        self.slots: list[tuple[np.ndarray, np.ndarray]] = []
        self.table = (_Step * len(steps))()
        kv_code = ABI.LP_DTYPE_F16 if model.kv_dtype == np.float16 else ABI.LP_DTYPE_F32
        for entry, step in zip(self.table, steps):
            if step.attention:
                keys, values = (np.zeros((c.kv_heads, capacity, c.head_dim), model.kv_dtype) for _ in range(2))
                self.slots.append((keys, values))
                entry.attention = ctypes.pointer(model.attention[step.layer])
                entry.kv = _Kv(keys.ctypes.data, values.ctypes.data, capacity, 0, kv_code)
            if step.mlp:
                entry.mlp = ctypes.pointer(model.mlp[step.layer])
            entry.rope = model.rope_of_layer[step.layer]
            entry.scale = step.scale
