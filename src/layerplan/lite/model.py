"""A GGUF run as stored by the native kernels alone: numpy, ctypes and the kernels' library, no
torch, no transformers.

The model is the file's own descriptors (engine/file_kernels.py FileKernels: the builder the
torch front end runs a GGUF's layers by too), run as one lp_forward call a pass, as the torch
front end's whole_pass does; what this module adds is what the torch front end takes from its
modules: the embedding's rows, the rotary tables (from the index's frequencies,
engine/rope_tables.py), the KV slots by plan step, the tokenizer and the chat template. So its
logits are the torch front end's bit for bit (tests/test_lite.py), and a start costs the
interpreter, numpy, the tokenizer and the panels' read.

It takes the architectures whose kernel layout the table marks `light` (the llama family and
Gemma 3: their layers run whole in the kernels, with nothing the torch front end decides from
modules) and plans of this model and of GGUFs of its architecture and sizes attached to it
(attach: --model-b); `lite_refusal` says why not, and then the caller runs the torch front end.
"""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from layerplan.engine.choices import STORED_PRECISION
from layerplan.engine.file_kernels import (ARITHMETIC_CODES, FileKernels, NotDescribed, file_refusal,
                                           read_index)
from layerplan.engine.kernel_library import ABI, check, library
from layerplan.engine.probe_rows import ProbeRow, read_probe
from layerplan.engine.rope_tables import rope_rows
from layerplan.engine.stored_pack import stack_format
from layerplan.files import cache_dir
from layerplan.lite import TorchFrontEnd
from layerplan.lite.tokenizer import LiteTokenizer
from layerplan.lite.tokenizer_process import TokenizerProcess
from layerplan.machine import physical_cores
from layerplan.models.arch_table import ARCHITECTURES, attach_refusal, layer_attention
from layerplan.models.errors import ModelError
from layerplan.models.gguf_index import file_index
from layerplan.models.gguf_place import DEFAULT_DISPLAY_NAME, INDEX_VERSION, default_gguf_path, gguf_of, index_folder
from layerplan.plan.plan import LayerPlan, PlanError, check_attached

_Kv, _Step = (ABI.structs[name] for name in ("lp_kv", "lp_step"))


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
    if config.get("final_logit_softcapping") or config.get("attn_logit_softcapping"):
        return "logit soft-capping runs on the torch front end"
    refusal = file_refusal(index)
    if refusal is not None:
        return refusal
    types = config.get("layer_types") or ()
    by_type = tensors["rotary"].get("by_layer_type")
    sliding = any(kind != "full_attention" for kind, _ in
                  layer_attention(SimpleNamespace(**config), int(config.get("num_hidden_layers") or 0)))
    if by_type is None and (config.get("use_sliding_window") or sliding):
        return "sliding-window attention runs on the torch front end"
    if by_type is not None and (not types or set(types) - set(by_type)
                                or set(types) - {"full_attention", "sliding_attention"}):
        return "rotary frequencies by layer type that do not match its layers"
    return None


def model_name_of(gguf: Path) -> str:
    """The model's name, as the torch front end names the file's model (its probe's and scans'
    caches are kept under it)."""
    return DEFAULT_DISPLAY_NAME if gguf == default_gguf_path() else gguf.stem


class LiteModel:
    """A GGUF's model as the kernels run it, from its index (see the module's docstring)."""

    def __init__(self, gguf: Path, arithmetic: str = "exact", threads: int | None = None,
                 on_packed: Callable[[int, int], None] | None = None,
                 tokenizer: LiteTokenizer | TokenizerProcess | None = None, with_tokenizer: bool = True) -> None:
        """on_packed(bytes, of bytes): the progress of packing the file's matrices (its first start);
        tokenizer: the index's, already started (lite/tokenizer_process.py), else read here
        (with_tokenizer False: none read, for a model whose layers another's plans take). The
        index is made from the file where the file index covers it (else transformers' must be kept)."""
        index = file_index(gguf) or index_folder(gguf)
        refusal = lite_refusal(index)
        if refusal is not None:
            raise TorchFrontEnd(f"{gguf.name}: {refusal}")
        self.name = model_name_of(gguf)
        self.source = str(gguf)
        self.arithmetic = arithmetic
        self.threads = threads or physical_cores()  # (torch's default, as the torch front end runs)
        try:  # (its panels fill on threads from here on)
            self.kernels = FileKernels(gguf, index, ARITHMETIC_CODES[arithmetic], self.threads)
        except NotDescribed as error:
            raise TorchFrontEnd(str(error)) from None
        kernels = self.kernels
        self.spec, self.config, self.packed = kernels.spec, kernels.config, kernels.packed
        # (llama.cpp's arithmetic keeps its keys and values in f16, as engine/native.py's does)
        self.kv_dtype = np.float16 if kernels.arithmetic == ABI.LP_ARITH_INT8 else np.float32
        self.index = index
        self.hf_config, facts = read_index(index)  # (config.json's keys, and the index's facts)
        self.others: dict[str, LiteModel] = {}  # models whose layers plans take ("b": attach)
        self.chat = facts.get("chat") or {"template": True}  # (models/stored.py _chat_frame)
        self._chat_template = None  # chat_template(), compiled at its first use
        # one rotary table a layer type (Gemma 3's sliding and full attention), or one for all
        rotary = facts["rotary"]
        by_type = rotary.get("by_layer_type") or {"": rotary}
        self._ropes = [(np.asarray(f["inv_freq"], np.float32), f["attention_scaling"]) for f in by_type.values()]
        order = {layer_type: i for i, layer_type in enumerate(by_type)}
        self.rope_of_layer = tuple(order.get(t, 0) for t in self.config.layer_types)
        self._cos = [np.empty((0, 2 * len(inv_freq)), np.float32) for inv_freq, _ in self._ropes]
        self._sin = list(self._cos)
        self.embed_scale = np.float32(self.config.hidden ** 0.5) if self.spec.scaled_embedding else None
        # the tokenizer's JSON is parsed while the panels are read (it holds the GIL; they do not),
        # here or in its own process; a file without one is a model of token ids (its text cannot
        # be encoded)
        if tokenizer is None and with_tokenizer and (index / "tokenizer.json").exists():
            tokenizer = LiteTokenizer(index)
        self.tokenizer = tokenizer.ready() if tokenizer is not None else None
        eos_ids = self.tokenizer.eos_ids if self.tokenizer is not None else ()
        self.eos_token_ids = tuple(sorted(set(self.config.eos_token_ids) | set(eos_ids)))
        kernels.finish(on_packed)
        self.attention, self.mlp, self.final_norm, self.head = (kernels.attention, kernels.mlp, kernels.final_norm,
                                                                kernels.head)
        self.vocab = kernels.vocab
        embedding = kernels.matrix(self.spec.name(self.spec.embed, "weight"))
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
            if "prefix" in self.chat:  # (no template to compile: the index keeps its frame)
                return self.tokenizer.encode(self.chat["prefix"] + text + self.chat["suffix"], special_tokens=False)
            rendered = self.chat_template().render([{"role": "user", "content": text}])
            return self.tokenizer.encode(rendered, special_tokens=False)
        return self.tokenizer.encode(text)

    def encode_text(self, text: str) -> list[int]:
        """A text's token ids without special tokens (a suffix draft's corpus), as
        models/loading.py's LoadedModel.encode_text gives them."""
        return self.tokenizer.encode(text, special_tokens=False)

    def chat_template(self):
        """The index's chat template, compiled once (models/chat_template.py ChatTemplate; None: the
        model has none); TorchFrontEnd where the index names one it does not hold, or one that does
        not compile here (the torch front end says what transformers says of it)."""
        if not self.chat.get("template"):
            return None
        if self._chat_template is None:
            # (here: jinja2 is imported only where a template is rendered, not at every start)
            from layerplan.models.chat_template import ChatTemplate, ChatTemplateError, special_tokens_of

            try:
                text = (self.index / "chat_template.jinja").read_text(encoding="utf-8")
                config = json.loads((self.index / "tokenizer_config.json").read_text(encoding="utf-8"))
                self._chat_template = ChatTemplate(text, special_tokens_of(config))
            except (OSError, ValueError) as error:  # (ChatTemplateError among them)
                what = "does not compile here" if isinstance(error, ChatTemplateError) else "is not in its index"
                raise TorchFrontEnd(f"the model's chat template {what}") from None
        return self._chat_template

    def probe_row(self) -> ProbeRow | None:
        """This machine's cached probe row for the model as it runs here (the native engine, its
        arithmetic's precision, its threads: engine/probe_rows.py read_probe), as cached: the
        torch front end checks a row by a timed step after a 100-token prefill, which a start here
        does not wait for. None: none cached."""
        probe = read_probe(cache_dir(), self.name, self.threads)
        return probe.row("native", self.precision) if probe is not None else None

    # ----- plans and passes ----------------------------------------------------------------------
    @property
    def precision(self) -> str:
        """The dtype the torch front end names for this arithmetic (stored, stored-fast)."""
        return STORED_PRECISION[self.arithmetic]

    @property
    def num_layers(self) -> int:
        return self.config.layers

    @property
    def context_length(self) -> int:
        return self.config.context_length

    @property
    def vocab_size(self) -> int:
        """The vocabulary the config names (config.json's vocab_size), else the LM head's rows."""
        return int(self.hf_config.get("vocab_size", self.vocab))

    def plan(self, text: str | os.PathLike | None = None) -> LayerPlan:
        """A plan (string or file) parsed against this model; None: the full model."""
        if text is None:
            return LayerPlan.full(self.num_layers, self.name)
        # (here: plan files' readers import yaml, and a start without a plan counts every import)
        from layerplan.plan.formats import load_plan

        plan = load_plan(text, self.num_layers, self.name)
        check_attached(plan, tuple(self.others))  # (PlanError in the torch front end's words)
        return plan

    def load_draft(self, path: str) -> tuple[LiteModel, LiteModel]:
        """A draft model (--draft model:PATH, -md) and its passes (itself): a GGUF in this model's
        arithmetic and threads, without a tokenizer (the target's tokenizes); TorchFrontEnd where
        it is not a GGUF the light front end runs (the torch front end loads it, or says why not)."""
        gguf = gguf_of(path)
        if gguf is None:
            raise TorchFrontEnd(f"{path}: not a GGUF file")
        draft = LiteModel(gguf, self.arithmetic, self.threads, with_tokenizer=False)
        return draft, draft

    def attach(self, other: LiteModel, label: str = "b") -> None:
        """Let plans take layers from `other` ("b:8-23"), as models/loading.py's LoadedModel.attach:
        its architecture and sizes this model's, its arithmetic too; its embedding, final norm and
        head are not used."""
        refusal = attach_refusal(label, self.hf_config.get, other.hf_config.get, self.name, other.name)
        if refusal is None and other.kernels.arithmetic != self.kernels.arithmetic:
            refusal = f"model '{label}' ({other.name}) runs in another arithmetic than {self.name}"
        if refusal is not None:
            raise PlanError(refusal)
        self.others[label] = other

    def model_of(self, label: str) -> LiteModel:
        """The model whose layers a step labelled so runs ("": this one)."""
        return self.others[label] if label else self

    def new_cache(self, plan: LayerPlan, capacity: int, stream_steps=()) -> LiteCache:
        return LiteCache(self, plan, capacity, stream_steps)

    def rope_tables(self, end: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(cos, sin): each rotary table's rows (position, rotary dims) over positions 0..end-1 at
        least, made as far as needed; table i is the one of layers whose rope_of_layer is i."""
        self._rope(end)
        return self._cos, self._sin

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

    def logits(self, ids: Sequence[int], cache: LiteCache, start_pos: int, last_only: bool = True,
               window: tuple[int, int] | None = None) -> np.ndarray:
        """float32 (1 or len(ids), vocab): the logits of a pass of `ids` at positions start_pos..,
        their keys and values written into the cache (lp_forward, as engine/native.py's whole
        pass); window: see _pass."""
        ids = np.asarray(ids, np.int64)
        if start_pos + len(ids) > cache.capacity:
            raise ValueError(f"positions up to {start_pos + len(ids)} do not fit a cache of {cache.capacity}")
        return self._pass(self.embed_rows(ids), cache, 0, start_pos, last_only, "a native pass", window)

    def run_from(self, cache: LiteCache, step: int, length: int) -> None:
        """Write the cache's slots (and kept streams) of its plan's active steps from `step` on, over
        positions [0, length), from the kept stream entering `step`: what a pass of the whole
        prompt writes there, without the steps before it (their slots the caller took over)."""
        self._pass(np.ascontiguousarray(cache.streams[step][:length]), cache, cache.entry_of[step], 0, True,
                   "a native pass from a kept stream")

    def _pass(self, rows: np.ndarray, cache: LiteCache, entry: int, start_pos: int, last_only: bool,
              what: str, window: tuple[int, int] | None = None) -> np.ndarray:
        """One lp_forward call: `rows` (float32 (n, hidden), the stream entering step table entry
        `entry`) at positions start_pos.. through the cache's steps from that entry on; the logits
        of the last row (or of every row), the cache's length its end. window (sink, recent): a
        one-token pass attends to the first `sink` and the `recent` latest positions only (a
        window draft's, as engine/native.py's pass reads KVCache.read_window)."""
        count = len(rows)
        order = np.arange(count, dtype=np.int64)
        hidden = np.empty((count, self.config.hidden), np.float32)
        logits = np.empty((1 if last_only else count, self.vocab), np.float32)
        self._rope(start_pos + count)
        tables = len(self._ropes)
        cos = (ctypes.c_void_p * tables)(*(table[start_pos:].ctypes.data for table in self._cos))
        sin = (ctypes.c_void_p * tables)(*(table[start_pos:].ctypes.data for table in self._sin))
        steps = ctypes.cast(ctypes.addressof(cache.table) + entry * ctypes.sizeof(_Step), ctypes.POINTER(_Step))
        sink, recent = window if window is not None and count == 1 else (0, 0)
        check(library().lp_forward(
            rows.ctypes.data, count, order.ctypes.data, count, hidden.ctypes.data, steps, len(cache.table) - entry,
            start_pos, cos, sin, sink, recent, None, ctypes.byref(self.final_norm), ctypes.byref(self.head),
            count - 1 if last_only else 0, logits.ctypes.data, ABI.LP_DTYPE_F32, self.threads), what)
        cache.length = start_pos + count
        return logits

    def last_logits(self, ids: Sequence[int], plan: LayerPlan, cache: LiteCache, start: int) -> np.ndarray:
        """decoding/loop.py's TokenPasses: the last token's logits (vocab,) of a pass (the cache,
        made for `plan`, carries its steps)."""
        return self.logits(ids, cache, start)[-1]

    def pass_logits(self, ids: Sequence[int], plan: LayerPlan, cache: LiteCache, start: int) -> np.ndarray:
        """decoding/rounds.py's VerifyPasses: the logits (len(ids), vocab) of a pass."""
        return self.logits(ids, cache, start, last_only=False)

    def with_room(self, cache: LiteCache, end: int) -> LiteCache:
        """decoding/drafters/model.py's DraftModelPasses (a draft model's cache, as its context
        grows): the cache, or a copy of it twice as large where positions up to `end` do not fit."""
        return cache if end <= cache.capacity else cache.grown(max(end, 2 * cache.capacity))

    def draft_logits(self, token: int, position: int, plan: LayerPlan, cache: LiteCache,
                     draft_head=None) -> np.ndarray:
        """decoding/drafters/proposal.py's DraftPasses: the logits (vocab,) of one token through
        `plan`, a draft of the cache's plan (LayerPlan.is_draft_of), in the slots of the cache's
        steps it runs (LiteCache.draft_view). A draft head is a torch module: the torch front
        end's."""
        if draft_head is not None:
            raise TorchFrontEnd("a draft read by a draft head runs on the torch front end")
        return self.logits([token], cache.draft_view(plan), position, window=cache.read_window)[-1]


class LiteCache:
    """A plan's KV cache: a slot (keys, values: (kv_heads, capacity, head_dim)) for each of its
    steps whose attention runs, and the step table lp_forward reads, pointing at them; `length`:
    the positions its last pass reached. stream_steps: the steps (indices into the plan's
    active_steps) whose entering residual stream each pass keeps, by position (float32 (capacity,
    hidden)): where a conversation runs again from when a new plan first differs there
    (LiteModel.run_from)."""

    def __init__(self, model: LiteModel, plan: LayerPlan, capacity: int, stream_steps=(),
                 shares: LiteCache | None = None) -> None:
        """shares: the cache whose slots this one's steps write (a draft view: draft_view)."""
        c = model.config
        self.model, self.plan = model, plan
        self.capacity = capacity
        self.length = 0  # the positions written (a pass's end)
        self.views: dict[LayerPlan, LiteCache] = {}  # draft plan -> its view of these slots
        # (sink, recent): a window draft's one-token passes read only those positions (set while it
        # drafts: drafters/plan.py WindowedDrafter)
        self.read_window: tuple[int, int] | None = None
        indices = [i for i, step in enumerate(plan.active_steps) if step.active]
        self.entry_of = {index: t for t, index in enumerate(indices)}  # active step -> step table entry
        self.slots: list[tuple[np.ndarray, np.ndarray]] = []
        self.slot_of: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # active step -> its slot
        self.streams: dict[int, np.ndarray] = {}  # active step -> the stream entering it
        self.table = (_Step * len(indices))()
        kv_code = ABI.LP_DTYPE_F16 if model.kv_dtype == np.float16 else ABI.LP_DTYPE_F32
        kept = set(stream_steps)
        for entry, index in zip(self.table, indices):
            step = plan.active_steps[index]
            source = model.model_of(step.model)  # (attach checked that its shapes are this model's)
            if step.attention:
                keys, values = (shares.slot_of[index] if shares is not None else
                                (np.zeros((c.kv_heads, capacity, c.head_dim), model.kv_dtype) for _ in range(2)))
                self.slots.append((keys, values))
                self.slot_of[index] = (keys, values)
                entry.attention = ctypes.pointer(source.attention[step.layer])
                entry.kv = _Kv(keys.ctypes.data, values.ctypes.data, capacity, 0, kv_code)
            if step.mlp:
                entry.mlp = ctypes.pointer(source.mlp[step.layer])
            entry.rope = source.rope_of_layer[step.layer]
            entry.scale = step.scale
            if index in kept:
                stream = self.streams[index] = np.zeros((capacity, c.hidden), np.float32)
                entry.stream, entry.stream_capacity = stream.ctypes.data, capacity

    def draft_view(self, plan: LayerPlan) -> LiteCache:
        """The cache a self-draft's `plan` (a draft of this cache's plan: the same steps, some
        sub-layers off, an earlier exit) runs through: its steps write this cache's slots, which
        the verify pass writes again over the drafted positions (as the torch front end's
        drafts share its cache); made once per plan."""
        view = self.views.get(plan)
        if view is None:
            view = self.views[plan] = LiteCache(self.model, plan, self.capacity, shares=self)
        return view

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (a later pass writes over the rest)."""
        self.length = min(self.length, length)

    def grown(self, capacity: int) -> LiteCache:
        """A cache of `capacity` positions for the same plan and kept streams, holding this one's."""
        bigger = LiteCache(self.model, self.plan, capacity, self.streams)
        bigger.take(self, len(self.plan.active_steps), self.length)
        return bigger

    def take(self, other: LiteCache, before: int, length: int) -> None:
        """The other cache's slots and kept streams of the active steps before `before` (the same
        steps in both plans), over positions [0, length)."""
        for index, (keys, values) in other.slot_of.items():
            if index < before and index in self.slot_of:
                self.slot_of[index][0][:, :length] = keys[:, :length]
                self.slot_of[index][1][:, :length] = values[:, :length]
        for index, stream in other.streams.items():
            if index <= before and index in self.streams:
                self.streams[index][:length] = stream[:length]
        self.length = length
