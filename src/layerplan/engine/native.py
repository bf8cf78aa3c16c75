"""Native CPU kernels (engine/kernels/): the library built, picked and checked by kernel_library.py;
here, the descriptors the kernels read and the Python objects that own what they point into.

The kernels reproduce the sub-layers of the llama family (RMSNorm, RoPE, grouped-query attention
over the step's KV slot, gated MLP) from the layer's own weights, read in place: fp32
accumulation over fp32 or bf16 weights, each weight read once per pass whatever the number of
tokens, and batch-invariant (a token's result does not depend on the other tokens of the pass).
The model's modules are never changed, so transformers' own forward and generate stay the
reference; a sub-layer the kernels do not reproduce runs its module eagerly. A GGUF whose file
describes its model runs by the file's descriptors instead (engine/file_kernels.py), where its
modules, if built, compute what the file says (NativeEngine._agrees).

Descriptors (the ctypes structs of kernels.h) hold raw addresses; every Python object that builds
one keeps a reference to each tensor it points into for as long as the descriptor lives.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn

from layerplan.engine.kernel_library import (ABI, ACTIVATION_CODES, NORM_ROUNDING, AbiMismatch, NativeUnavailable,
                                             check, kernels_key, library, native_available)
from layerplan.engine.arena import WeightArena
from layerplan.engine.choices import ENGINES
from layerplan.engine.file_kernels import FileKernels, NotDescribed, activation_of, file_refusal
from layerplan.engine.file_model import DeferredCausalLM
from layerplan.engine.panel_cache import PanelCache
from layerplan.engine.stored_pack import PACK_ROWS, pack_stored, stack_format, v_apart
from layerplan.machine import read_cpuinfo
from layerplan.models.arch_table import ACTIVATIONS, CONFIG_ACTIVATIONS, NORM_EPSILONS, KernelLayout
from layerplan.models.architectures import arch_spec
from layerplan.models.gguf_place import index_folder
from layerplan.models.stored import StoredEmbedding, StoredTensor

__all__ = ["AbiMismatch", "NativeUnavailable", "kernels_key", "library", "native_available"]

# activation / cache / norm-weight dtypes, and the weight formats of kernels/formats.c, by torch dtype
_DTYPES = {torch.float32: ABI.LP_DTYPE_F32, torch.bfloat16: ABI.LP_DTYPE_BF16}
_KV_DTYPES = {**_DTYPES, torch.float16: ABI.LP_DTYPE_F16}  # a KV cache's (lp_kv.dtype)
_FORMATS = {torch.float32: ABI.LP_FORMAT_F32, torch.bfloat16: ABI.LP_FORMAT_BF16}
_MISSING = object()  # a dict lookup's "not there", where None is a value

# the structs of kernels.h, as read from it
_Norm = ABI.structs["lp_norm"]
_Matrix = ABI.structs["lp_matrix"]
_Kv = ABI.structs["lp_kv"]
_Attention = ABI.structs["lp_attention"]
_Mlp = ABI.structs["lp_mlp"]
_Step = ABI.structs["lp_step"]
_Segment = ABI.structs["lp_segment"]


_REPACKING = threading.Lock()


def _now(job: Callable[[], object], nbytes: int) -> None:
    job()


def _holding(descriptor: ctypes.Structure, *owners) -> ctypes.Structure:
    """The descriptor, keeping `owners` (what its addresses point into) alive as long as it is."""
    descriptor._owners = owners
    return descriptor


class BoundedCache(OrderedDict):
    """A dict of at most `bound` entries that drops the least recently used (get or set) first."""

    def __init__(self, bound: int) -> None:
        super().__init__()
        self.bound = bound

    def get(self, key, default=None):
        if key in self:
            self.move_to_end(key)
            return self[key]
        return default

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.bound:
            self.popitem(last=False)


# Step runs kept per engine: a generation asks for one or two (draft and target), a search for one
# per plan it tries; a run rebuilt costs about a millisecond.
RUNS_KEPT = 64


def product_rate(dtype: torch.dtype, rounds: int = 40) -> float:
    """GFLOP/s of 8-row products over `dtype` weights already in cache, on torch's threads now:
    the ceiling of a pass's arithmetic here."""
    rate = library().lp_product_rate(_FORMATS[dtype], torch.get_num_threads(), rounds)
    if rate < 0:
        raise MemoryError("the product rate's matrices could not be allocated")
    return rate


def read_rate(buffer: torch.Tensor) -> float:
    """GB/s of reading `buffer` (contiguous, far larger than the last-level cache) once on torch's
    threads now: the ceiling of streaming a step's weights here."""
    return library().lp_read_rate(buffer.data_ptr(), buffer.numel() * buffer.element_size(), torch.get_num_threads())


class PackedMatrix:
    """Weight matrices (out, in) stacked by rows and packed for the kernels (lp_pack; the layout is
    the weight format's row in kernels/formats.c): a copy made once, so the model's own weights stay
    as transformers left them. The format follows the weights' dtype (_FORMATS). Biases are kept in
    fp32 (zeros for a stacked part without one). The copy lives in `arena` (a model's weights) or
    in a tensor of its own (None: one-off products); the descriptor holds both it and the bias.
    `arithmetic` (LP_ARITH_) is how its products compute: LP_ARITH_INT8 takes integer products
    where the kernels have them for the format (kernels/formats.h), else the exact ones."""

    def __init__(self, weights: list[torch.Tensor | StoredTensor], biases: list[torch.Tensor | None],
                 arena: WeightArena | None = None, arithmetic: int = ABI.LP_ARITH_EXACT) -> None:
        self.arithmetic = arithmetic
        if any(isinstance(w, StoredTensor) for w in weights):
            self._pack_stored(weights, biases, arena)
            return
        dtype, k = weights[0].dtype, weights[0].shape[1]
        for weight in weights:
            if (weight.dtype != dtype or weight.dtype not in _FORMATS or weight.device.type != "cpu"
                    or weight.dim() != 2 or weight.shape[1] != k):
                raise Unsupported(f"a {weight.dtype} {tuple(weight.shape)} weight on {weight.device} is not a "
                                  "float32 or bfloat16 CPU matrix the kernels take")
        stacked = torch.cat([w.detach() for w in weights]).contiguous() if len(weights) > 1 else weights[0].detach().contiguous()
        n = stacked.shape[0]
        self.n, self.k, self.dtype, self.format = n, k, dtype, _FORMATS[dtype]
        nbytes = library().lp_packed_bytes(self.format, n, k)
        if nbytes < 0:
            raise Unsupported(f"a ({n}, {k}) matrix the {dtype} weight format cannot pack")
        numel = nbytes // dtype.itemsize
        self.packed = arena.empty(numel, dtype) if arena is not None else torch.empty(numel, dtype=dtype)
        check(library().lp_pack(stacked.data_ptr(), self.format, n, k, self.packed.data_ptr()), "packing a matrix")
        self._describe([w.shape[0] for w in weights], biases)

    @classmethod
    def described(cls, descriptor: ctypes.Structure, owner: object) -> PackedMatrix:
        """A matrix packed and described elsewhere (engine/file_kernels.py: fp32 rows in and out);
        `owner` holds what its descriptor points into."""
        matrix = cls.__new__(cls)
        matrix.arithmetic, matrix.format = descriptor.arithmetic, descriptor.format
        matrix.n, matrix.k, matrix.dtype = descriptor.n, descriptor.k, torch.float32
        matrix.packed = matrix.bias = None
        matrix.descriptor = _holding(descriptor, owner)
        return matrix

    def _pack_stored(self, weights: list[StoredTensor], biases: list[torch.Tensor | None],
                     arena: WeightArena | None) -> None:
        """Matrices as a GGUF stores them, packed in their block format where the kernels have
        its row (kernels/formats.c); else, and for a stack of several formats, dequantized to
        fp32 (the same values: gguf's dequantization)."""
        if not all(isinstance(w, StoredTensor) for w in weights) or len({w.columns for w in weights}) != 1:
            raise Unsupported("a stack of stored and dense matrices, or of different widths")
        n, k = sum(w.rows for w in weights), weights[0].columns
        self.format = stack_format(weights)
        nbytes = library().lp_packed_bytes(self.format, n, k) if self.format is not None else -1
        self.n, self.k, self.dtype = n, k, torch.float32  # products read and write fp32 rows
        if nbytes < 0:
            self.format = ABI.LP_FORMAT_F32
            rows = torch.cat([w.dequantize() for w in weights])
            nbytes = library().lp_packed_bytes(self.format, n, k)
            self.packed = arena.empty(nbytes, torch.uint8) if arena is not None else torch.empty(nbytes, dtype=torch.uint8)
            check(library().lp_pack(rows.data_ptr(), self.format, n, k, self.packed.data_ptr()), "packing a matrix")
        else:
            panels = arena.panels if arena is not None and arena.panels is not None and arena.panels.holds(weights) else None
            entry = panels.kept(weights, self.format, nbytes) if panels is not None else None
            self._fill(weights, nbytes, arena, panels, entry)
        self._describe([w.rows for w in weights], biases)

    def _fill(self, weights: list[StoredTensor], nbytes: int, arena: WeightArena | None, panels: PanelCache | None,
              entry) -> None:
        """self.packed from the kept entry, else packed from the file's rows (and kept), on the
        arena's fill threads."""
        self.packed = arena.empty(nbytes, torch.uint8) if arena is not None else torch.empty(nbytes, dtype=torch.uint8)
        fill = arena.fill if arena is not None else _now
        if entry is not None:
            PanelCache.read_parts(entry, self.packed, fill, short=partial(self._pack_again, weights))
        elif panels is not None:
            fill(lambda: self._pack_and_keep(weights, panels), nbytes)
        else:
            fill(lambda: self._pack_rows(weights), nbytes)

    def _pack_again(self, weights: list[StoredTensor]) -> None:
        """A kept entry changed under us while read: the rows are packed again (the same bytes)."""
        with _REPACKING:
            self._pack_rows(weights)

    def _pack_and_keep(self, weights: list[StoredTensor], panels: PanelCache) -> None:
        self._pack_rows(weights)
        panels.write(weights, self.format, self.packed)

    PACK_ROWS = PACK_ROWS  # (a class attribute: tests make the parts small)

    def _pack_rows(self, weights: list[StoredTensor]) -> None:
        pack_stored(weights, self.format, self.k, self.packed.data_ptr(), self.PACK_ROWS)

    def _describe(self, rows: list[int], biases: list[torch.Tensor | None]) -> None:
        """The bias (fp32, zeros for a stacked part without one) and the descriptor over both."""
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([b.detach().float() if b is not None else torch.zeros(r)
                                   for r, b in zip(rows, biases)]).contiguous()
        self.descriptor = _holding(
            _Matrix(self.packed.data_ptr(), self.bias.data_ptr() if self.bias is not None else None, self.n, self.k,
                    self.format, self.arithmetic),
            self.packed, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) in fp32 or bf16 -> (..., out) in x's dtype."""
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], self.n, dtype=x.dtype)
        check(library().lp_linear(x.data_ptr(), _DTYPES[x.dtype], ctypes.byref(self.descriptor), y.data_ptr(),
                                  _DTYPES[x.dtype], x.numel() // self.k, torch.get_num_threads()), "lp_linear")
        return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear by the kernel (packs the weight on every call: for tests and one-off products)."""
    return PackedMatrix([weight], [bias])(x)


# ----- decoder sub-layers ------------------------------------------------------------------------
# What a layer's modules compute (models/arch_table.py: KernelLayout, NORM_EPSILONS, ACTIVATIONS;
# kernel_library.py: their ABI codes); a module outside these runs eagerly.


class Unsupported(Exception):
    """A sub-layer whose modules the kernels do not reproduce (it runs eagerly); says why."""


def _stacked_rows(modules: list[nn.Module], dtype: torch.dtype) -> int:
    """The output rows of the linears stacked, once each is checked to be a `dtype` linear."""
    for module in modules:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dtype != dtype or weight.dim() != 2:
            raise Unsupported(f"{type(module).__name__} is not a {dtype} linear")
    return sum(m.weight.shape[0] for m in modules)


# a linear module -> the weight the kernels pack: its tensor, or the GGUF rows it stands for
WeightOf = Callable[[nn.Module], "torch.Tensor | StoredTensor"]


def _dense_weight(module: nn.Module) -> torch.Tensor:
    return module.weight


def _format_of(weight) -> str:
    """A weight's storage: its GGUF type, or its dtype."""
    return weight.type_name if isinstance(weight, StoredTensor) else str(weight.dtype)


def _packed(modules: list[nn.Module], arena: WeightArena, weight_of: WeightOf, arithmetic: int) -> PackedMatrix:
    """The linears' weights (checked by _stacked_rows) stacked by output rows and packed (their
    biases likewise), their products in `arithmetic` (LP_ARITH_)."""
    return PackedMatrix([weight_of(m) for m in modules], [getattr(m, "bias", None) for m in modules], arena,
                        arithmetic)


def _children(module: nn.Module, known: frozenset[str]) -> set[str]:
    """The module's child names, when they are the layout the kernels read it by."""
    children = {name for name, _ in module.named_children()}
    if children != known:
        raise Unsupported(f"{type(module).__name__} has modules {sorted(children)}")
    return children


def _norm(module: nn.Module | None, dtype: torch.dtype, offset: float, arithmetic: str = "llama") -> _Norm:
    """An RMSNorm module as a descriptor; `arithmetic` (KernelLayout.norm) says how it rounds."""
    if module is None:
        return _Norm(None, 0.0, 0.0, ABI.LP_NORM_ROUND_NORMALISED, _DTYPES[dtype])
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    if not name.endswith("RMSNorm") or weight is None or weight.dtype != dtype or not weight.is_contiguous():
        raise Unsupported(f"norm {name} is not an RMSNorm the kernels know")
    epsilon = getattr(module, NORM_EPSILONS[arithmetic], None)
    if epsilon is None:
        raise Unsupported(f"norm {name} has no {NORM_EPSILONS[arithmetic]}, the epsilon of {arithmetic}'s RMSNorm")
    return _holding(_Norm(weight.data_ptr(), float(epsilon), offset, NORM_ROUNDING[arithmetic], _DTYPES[dtype]),
                    weight)


class NativeLayer:
    """One decoder layer's sub-layers as kernel descriptors over the layer's own weights, read by
    its architecture's `layout`. `attention` / `mlp` is None where that sub-layer runs eagerly
    (`why` says why)."""

    def __init__(self, parts, dtype: torch.dtype, norm_offset: float, arena: WeightArena,
                 weight_of: WeightOf = _dense_weight, layout: KernelLayout = KernelLayout(),
                 arithmetic: int = ABI.LP_ARITH_EXACT) -> None:
        self.dtype = dtype
        self.attention: _Attention | None = None
        self.mlp: _Mlp | None = None
        self.matrices: tuple[PackedMatrix, ...] = ()  # keeps the packed weights the descriptors point to
        self.why: dict[str, str] = {}
        try:
            self.attention, matrices = self._attention(parts, dtype, norm_offset, arena, weight_of, layout, arithmetic)
            self.matrices += matrices
        except Unsupported as error:
            self.why["attention"] = str(error)
        try:
            self.mlp, matrices = self._mlp(parts, dtype, norm_offset, arena, weight_of, layout, arithmetic)
            self.matrices += matrices
        except Unsupported as error:
            self.why["mlp"] = str(error)

    @classmethod
    def described(cls, attention: _Attention, mlp: _Mlp, owner: object) -> NativeLayer:
        """A layer of a GGUF's model described from the file (engine/file_kernels.py: fp32
        activations); `owner` holds what its descriptors point into."""
        layer = cls.__new__(cls)
        layer.dtype, layer.matrices, layer.why = torch.float32, (), {}
        layer.attention, layer.mlp = _holding(attention, owner), _holding(mlp, owner)
        return layer

    @staticmethod
    def _attention(parts, dtype, offset, arena, weight_of, layout, arithmetic) -> tuple[_Attention, tuple[PackedMatrix, ...]]:
        module = parts.attention
        _children(module, layout.attention_children)
        config = module.config
        if getattr(config, "attn_logit_softcapping", None) or getattr(module, "sinks", None) is not None:
            raise Unsupported("attention logit soft-capping and attention sinks run eagerly")
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = module.head_dim
        if heads % kv_heads or head_dim > 512 or getattr(config, "partial_rotary_factor", 1.0) != 1.0:
            raise Unsupported("head layout or partial rotary embeddings the kernels do not handle")
        qkv_linears = [getattr(module, name) for name in layout.qkv]  # q, k and v rows, in that order
        qkv_rows = _stacked_rows(qkv_linears, dtype)
        _stacked_rows([module.o_proj], dtype)
        if qkv_rows != (heads + 2 * kv_heads) * head_dim:
            raise Unsupported(f"q, k and v projections with {qkv_rows} outputs, not {(heads + 2 * kv_heads) * head_dim}")
        rounding = layout.norm
        norms = dict(norm=_norm(parts.attention_norm, dtype, offset, rounding),
                     q_norm=_norm(module.q_norm if layout.qk_norms else None, dtype, offset, rounding),
                     k_norm=_norm(module.k_norm if layout.qk_norms else None, dtype, offset, rounding),
                     post_norm=_norm(parts.attention_post_norm, dtype, offset, rounding))
        # packed only once every check passed: the arena keeps what it holds. A v projection
        # stored in another block format than q and k (Q4_K_M's Q6_K attn_v) is a matrix apart.
        apart = v_apart([_format_of(weight_of(m)) for m in qkv_linears])
        qk_linears, v_linears = (qkv_linears[:2], qkv_linears[2:]) if apart else (qkv_linears, [])
        qkv, o = _packed(qk_linears, arena, weight_of, arithmetic), _packed([module.o_proj], arena, weight_of, arithmetic)
        v = _packed(v_linears, arena, weight_of, arithmetic) if apart else None
        descriptor = _Attention(
            hidden=config.hidden_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim, **norms,
            qkv=qkv.descriptor, v=v.descriptor if v is not None else _Matrix(), o=o.descriptor,
            scaling=float(module.scaling), window=parts.sliding_window or 0, rotary_dim=head_dim)
        matrices = (qkv, o) if v is None else (qkv, v, o)
        return _holding(descriptor, *matrices, *norms.values()), matrices

    @staticmethod
    def _mlp(parts, dtype, offset, arena, weight_of, layout, arithmetic) -> tuple[_Mlp, tuple[PackedMatrix, ...]]:
        module = parts.mlp
        _children(module, layout.mlp_children)
        act = getattr(module, layout.activation)
        if type(act).__name__ not in ACTIVATIONS:
            raise Unsupported(f"activation {type(act).__name__} runs eagerly")
        linears = [getattr(module, name) for name in layout.gate_up]  # gate rows, then up rows
        if any(getattr(m, "bias", None) is not None for m in linears + [module.down_proj]):
            raise Unsupported("MLP biases run eagerly")
        gate_up_rows = _stacked_rows(linears, dtype)
        _stacked_rows([module.down_proj], dtype)
        inner = module.down_proj.weight.shape[1]
        if gate_up_rows != 2 * inner:
            raise Unsupported(f"gate and up projections with {gate_up_rows} outputs for an inner size of {inner}")
        norm, post_norm = (_norm(parts.mlp_norm, dtype, offset, layout.norm),
                           _norm(parts.mlp_post_norm, dtype, offset, layout.norm))
        # packed only once every check passed: the arena keeps what it holds
        gate_up, down = (_packed(linears, arena, weight_of, arithmetic),
                         _packed([module.down_proj], arena, weight_of, arithmetic))
        descriptor = _Mlp(hidden=down.n, inner=inner, norm=norm, post_norm=post_norm, gate_up=gate_up.descriptor,
                          down=down.descriptor, activation=ACTIVATION_CODES[ACTIVATIONS[type(act).__name__]])
        return _holding(descriptor, gate_up, down, norm, post_norm), (gate_up, down)

    def run_attention(self, hidden: torch.Tensor, keys: torch.Tensor | None, values: torch.Tensor | None,
                      start_pos: int, rope: tuple[torch.Tensor, torch.Tensor], scale: float,
                      window: tuple[int, int] | None, tree: torch.Tensor | None = None,
                      kv_dtype: torch.dtype | None = None) -> torch.Tensor:
        """hidden (1, T, H) -> hidden after the sub-layer; writes the T new keys and values into
        the slot buffers (1, kv_heads, capacity, head_dim) at start_pos.. first. Without buffers
        (a pass with no KV cache) the tokens attend to each other only, their keys and values
        held in kv_dtype (None: the activations'), as a cache would hold them. tree: (T, T) uint8
        of which tokens of the pass each one attends to (a token tree), None for a chain."""
        kv_start = 0
        if keys is None:
            shape = (1, self.attention.kv_heads, hidden.shape[1], self.attention.head_dim)
            keys, values = (torch.empty(shape, dtype=kv_dtype or hidden.dtype) for _ in range(2))
            kv_start = start_pos
        hidden = hidden.contiguous()
        out = torch.empty_like(hidden)
        cos, sin = (t.contiguous() for t in rope)
        sink, recent = window if window is not None and hidden.shape[1] == 1 else (0, 0)
        slot = _Kv(keys.data_ptr(), values.data_ptr(), keys.shape[2], kv_start, _KV_DTYPES[keys.dtype])
        check(library().lp_attention_block(
            ctypes.byref(self.attention), hidden.data_ptr(), out.data_ptr(), hidden.shape[1], start_pos,
            cos.data_ptr(), sin.data_ptr(), ctypes.byref(slot), sink, recent,
            tree.data_ptr() if tree is not None else None, scale, _DTYPES[hidden.dtype], torch.get_num_threads()),
            "native attention")
        return out

    def run_mlp(self, hidden: torch.Tensor, scale: float) -> torch.Tensor:
        hidden = hidden.contiguous()
        out = torch.empty_like(hidden)
        check(library().lp_mlp_block(ctypes.byref(self.mlp), hidden.data_ptr(), out.data_ptr(), hidden.shape[1], scale,
                                     _DTYPES[hidden.dtype], torch.get_num_threads()), "native MLP")
        return out


class StepRun:
    """A run of plan steps whose switched-on sub-layers all have kernels, as one native call: the
    runner's loop without a Python round trip per sub-layer. Built once per (plan, steps). The
    step table points into the steps' descriptors (held by the pointers in it) and into the KV
    slot buffers of the cache of its latest call (held by that cache, which the call is given:
    the table is pointed at a call's cache before the call)."""

    def __init__(self, plan, steps: list[tuple[int, NativeLayer, bool, bool, float]], rope_layers: list, dtype: int,
                 kv_dtype: torch.dtype | None = None) -> None:
        # plan: the one whose steps these are; steps: (slot, layer kernels, attention on, mlp on,
        # scale); rope_layers[i]: a layer of rope table i; dtype: the activations' (LP_DTYPE_...);
        # kv_dtype: the cache's (None: the activations')
        self.plan = plan
        self.slots = [(slot, layer.attention if attention else None) for slot, layer, attention, _, _ in steps]
        self.kv_slots = [slot for slot, attention in self.slots if attention is not None]
        self.rope_layers, self.dtype, self.kv_dtype = rope_layers, dtype, kv_dtype
        self.table = (_Step * len(steps))()
        for entry, (slot, layer, attention, mlp, scale) in zip(self.table, steps):
            entry.attention = ctypes.pointer(layer.attention) if attention else None
            entry.mlp = ctypes.pointer(layer.mlp) if mlp else None
            entry.scale = scale
        self._table_slots: bytes | None = None  # the slot descriptors the table holds now
        self._table_streams = False  # whether the table points at streams now

    def _slots_and_tables(self, cache, start_pos: int, rows: int, width: int, dtype: torch.dtype,
                          device: torch.device, ropes: list[tuple[torch.Tensor, torch.Tensor]]):
        """Reserves the steps' cache positions and points the step table at the cache's slots (its
        kept descriptors: _slot_descriptors) and at the streams it keeps (width: the stream's);
        the rotary tables as the kernels take them."""
        kept = self._slot_descriptors(cache, start_pos, start_pos + rows, dtype, device)
        if kept is not self._table_slots:  # another cache, or one whose buffers moved
            size = ctypes.sizeof(_Kv)
            for i, (_, attention) in enumerate(self.slots):
                if attention is not None:
                    self.table[i].kv = _Kv.from_buffer_copy(kept, i * size)
            self._table_slots = kept
        streams = None
        if cache.stream_steps and cache.keeps_streams_of(self.plan):
            streams = tuple(cache.stream_buffer(slot, start_pos, start_pos + rows, width, dtype, device)
                            if slot in cache.stream_steps else None for slot, _ in self.slots)
        if streams is not None or self._table_streams:
            for entry, buffer in zip(self.table, streams or (None,) * len(self.slots)):
                entry.stream = buffer.data_ptr() if buffer is not None else None
                entry.stream_capacity = buffer.shape[0] if buffer is not None else 0
            self._table_streams = streams is not None  # (the cache holds the buffers)
        tables = [(cos.contiguous(), sin.contiguous()) for cos, sin in ropes]
        cos = (ctypes.c_void_p * len(tables))(*(c.data_ptr() for c, _ in tables))
        sin = (ctypes.c_void_p * len(tables))(*(s.data_ptr() for _, s in tables))
        return tables, cos, sin  # the tensors stay referenced until the call returns

    def _slot_descriptors(self, cache, start: int, end: int, dtype: torch.dtype, device: torch.device) -> bytes:
        """The steps' slot descriptors (lp_kv, one a step; zero where the attention is off) for a
        pass writing positions [start, end) of `cache`, those positions reserved. Built once per
        cache and kept in it (cache.descriptors) until one of its buffers is allocated anew."""
        cache.write_pos = start
        kept = cache.descriptors.get(self)
        if kept is not None and end <= kept[1] and not cache.fill_gaps:
            cache.mark_written(self.kv_slots, end)
            return kept[0]
        descriptors, capacity = (_Kv * len(self.slots))(), None
        for i, (slot, attention) in enumerate(self.slots):
            if attention is None:
                continue
            keys, values = cache.reserve(slot, end, 1, attention.kv_heads, attention.head_dim, attention.head_dim,
                                         self.kv_dtype or dtype, device)
            descriptors[i] = _Kv(keys.data_ptr(), values.data_ptr(), keys.shape[2], 0, _KV_DTYPES[keys.dtype])
            capacity = keys.shape[2] if capacity is None else min(capacity, keys.shape[2])
        blob = bytes(descriptors)
        cache.descriptors[self] = (blob, capacity if capacity is not None else end)
        return blob

    def __call__(self, hidden: torch.Tensor, cache, start_pos: int, ropes: list[tuple[torch.Tensor, torch.Tensor]],
                 window: tuple[int, int] | None, tree: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (1, T, H) after the steps; each step's new keys and values go to its cache slot.
        tree: as NativeLayer.run_attention's."""
        hidden = hidden.contiguous().clone()  # written in place
        tables, cos, sin = self._slots_and_tables(cache, start_pos, hidden.shape[1], hidden.shape[-1], hidden.dtype,
                                                  hidden.device, ropes)
        sink, recent = window if window is not None and hidden.shape[1] == 1 else (0, 0)
        check(library().lp_run_steps(self.table, len(self.table), hidden.data_ptr(), hidden.shape[1], start_pos,
                                     cos, sin, sink, recent, tree.data_ptr() if tree is not None else None,
                                     self.dtype, torch.get_num_threads()), "a native run of steps")
        return hidden

    def batch_logits(self, ends: PassEnds, sequences: list[tuple[torch.Tensor, object, int]],
                     ropes: list[tuple[torch.Tensor, torch.Tensor]], wanted: list[int]) -> list[torch.Tensor]:
        """The logits of several sequences' passes as one native call (continuous batching,
        lp_forward_batch): sequences[s] = (its token ids (1, T_s), its cache, its start position);
        ropes: each rope table's rows for every sequence in order. Each sequence's keys and values
        go to its own cache; its logits (wanted[s], vocab), of its last wanted[s] rows (0 to T_s),
        are those of its pass alone."""
        return self.batch_logits_and_stream(ends, sequences, ropes, wanted)[0]

    def batch_logits_and_stream(self, ends: PassEnds, sequences: list[tuple[torch.Tensor, object, int]],
                                ropes: list[tuple[torch.Tensor, torch.Tensor]],
                                wanted: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """batch_logits, and the residual stream (rows, hidden) after the steps."""
        ids = torch.cat([s[0].reshape(-1) for s in sequences]).to(torch.long).contiguous()
        table = ends.embedding
        if ends.lookup is not None:
            table = ends.lookup(ids[None]).reshape(ids.shape[0], -1).contiguous()
            ids = torch.arange(ids.shape[0])
        return self._batch(ends, table, ids, sequences, ropes, wanted)

    def batch_hidden(self, ends: PassEnds, hidden: torch.Tensor, sequences: list[tuple[torch.Tensor, object, int]],
                     ropes: list[tuple[torch.Tensor, torch.Tensor]],
                     wanted: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """batch_logits from the residual stream (rows, hidden) entering these steps instead of
        token ids (sequences[s][0] gives only its row count): each sequence's logits, and the
        stream after the steps."""
        return self._batch(ends, hidden.contiguous(), torch.arange(hidden.shape[0]), sequences, ropes, wanted)

    def _batch(self, ends: PassEnds, table: torch.Tensor, ids: torch.Tensor, sequences, ropes,
               wanted: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """lp_forward_batch over rows table[ids]: the logits each sequence wants, and the stream."""
        rows, dtype, nsegs = ids.shape[0], table.dtype, len(sequences)
        for s, (tokens, _, _) in enumerate(sequences):
            if not 0 <= wanted[s] <= tokens.shape[-1]:
                raise ValueError(f"the logits of {wanted[s]} rows of a {tokens.shape[-1]}-token pass")
        segments = (_Segment * nsegs)(*(_Segment(tokens.shape[-1], start, rows_wanted)
                                        for (tokens, _, start), rows_wanted in zip(sequences, wanted)))
        # kvs[step * nsegs + s]: step-major, as lp_forward_batch reads them (each cache's buffers
        # stay held by the cache until the call returns)
        per_sequence = [self._slot_descriptors(cache, start, start + tokens.shape[-1], dtype, table.device)
                        for tokens, cache, start in sequences]
        steps = np.frombuffer(b"".join(per_sequence), np.uint8).reshape(nsegs, len(self.slots), ctypes.sizeof(_Kv))
        kvs = (_Kv * (len(self.slots) * nsegs)).from_buffer_copy(np.ascontiguousarray(steps.transpose(1, 0, 2)))
        tables = [(cos.contiguous(), sin.contiguous()) for cos, sin in ropes]
        cos = (ctypes.c_void_p * len(tables))(*(c.data_ptr() for c, _ in tables))
        sin = (ctypes.c_void_p * len(tables))(*(s.data_ptr() for _, s in tables))
        hidden = torch.empty(rows, table.shape[1], dtype=dtype)
        logits = torch.empty(sum(wanted), ends.head.n, dtype=dtype)
        status = library().lp_forward_batch(
            table.data_ptr(), table.shape[0], ids.data_ptr(), rows, hidden.data_ptr(), self.table, len(self.table),
            kvs, segments, nsegs, cos, sin, ctypes.byref(ends.norm), ctypes.byref(ends.head.descriptor),
            logits.data_ptr(), self.dtype, torch.get_num_threads())
        if status == ABI.LP_E_TOKEN:
            bad = ids[(ids < 0) | (ids >= table.shape[0])][0].item()
            raise IndexError(f"token id {bad} is outside the vocabulary (0 to {table.shape[0] - 1})")
        check(status, "a native batched pass")
        return list(logits.split(wanted)), hidden

    def logits(self, ends: PassEnds, input_ids: torch.Tensor, cache, start_pos: int,
               ropes: list[tuple[torch.Tensor, torch.Tensor]], window: tuple[int, int] | None,
               tree: torch.Tensor | None, last_only: bool) -> torch.Tensor:
        """The logits (1, T or 1, vocab) of a pass of token ids (1, T) through the embedding, the
        steps and the LM head, in one native call (see lp_forward)."""
        ids = input_ids.to(torch.long).contiguous()
        rows = ids.shape[1]
        table = ends.embedding
        if ends.lookup is not None:  # a stored table: the pass's own rows, dequantized, are the table
            table = ends.lookup(ids).reshape(rows, -1).contiguous()
            ids = torch.arange(rows)[None]
        dtype = table.dtype
        hidden = torch.empty(1, rows, table.shape[1], dtype=dtype)
        logits = torch.empty(1, 1 if last_only else rows, ends.head.n, dtype=dtype)
        tables, cos, sin = self._slots_and_tables(cache, start_pos, rows, table.shape[1], dtype, hidden.device, ropes)
        sink, recent = window if window is not None and rows == 1 else (0, 0)
        status = library().lp_forward(
            table.data_ptr(), table.shape[0], ids.data_ptr(), rows, hidden.data_ptr(), self.table,
            len(self.table), start_pos, cos, sin, sink, recent, tree.data_ptr() if tree is not None else None,
            ctypes.byref(ends.norm), ctypes.byref(ends.head.descriptor), rows - 1 if last_only else 0,
            logits.data_ptr(), self.dtype, torch.get_num_threads())
        if status == ABI.LP_E_TOKEN:
            bad = ids[(ids < 0) | (ids >= table.shape[0])][0].item()
            raise IndexError(f"token id {bad} is outside the vocabulary (0 to {table.shape[0] - 1})")
        check(status, "a native pass")
        return logits


def row_decoder(table) -> Callable[[np.ndarray], torch.Tensor] | None:
    """Stored rows of `table` (a StoredTensor; uint8 (count, row_bytes)) -> float32 (count,
    columns) by the kernels' lp_dequantize_rows: gguf-py's values bit for bit
    (tests/test_quant_kernels.py), in a microsecond rather than gguf-py's ~50 us a call; None for
    a type the kernels do not hold."""
    code = getattr(ABI, f"LP_FORMAT_{table.type_name}", None)  # as PackedMatrix names its format
    if code is None:
        return None
    lib, columns = library(), table.columns

    def decode(rows: np.ndarray) -> torch.Tensor:
        rows = np.ascontiguousarray(rows)
        out = torch.empty(len(rows), columns)
        check(lib.lp_dequantize_rows(code, rows.ctypes.data, len(rows), columns, out.data_ptr()),
              f"dequantizing {table.type_name} rows")
        return out

    return decode


@dataclass(frozen=True)
class PassEnds:
    """What a whole pass in one native call needs besides the steps: the embedding's weight (read
    by token id), the final norm and the packed LM head."""

    embedding: torch.Tensor  # (vocab, hidden); (0, hidden) where `lookup` gives the rows
    norm: _Norm
    head: PackedMatrix
    lookup: Callable[[torch.Tensor], torch.Tensor] | None = None  # a stored embedding's: ids -> their rows


def _rows_limit(dtype: torch.dtype) -> int | None:
    """Longest pass the kernels take; longer ones (prefill) run PyTorch's own kernels where those
    are as fast or faster: MKL's fp32 GEMM from about 128 rows, oneDNN's bf16 GEMM on CPUs with
    native bf16 instructions (docs/lab/engine-rounds.md has the timings)."""
    _, flags = read_cpuinfo()
    if "avx512_bf16" in (flags or ()) or "amx_bf16" in (flags or ()):
        return 32
    if dtype == torch.float32:
        return 128
    return None


class NativeEngine:
    """The native kernels of one loaded model: a NativeLayer per decoder layer."""

    def __init__(self, model, on_filled: Callable[[int, int], None] | None = None,
                 file_kernels: FileKernels | None = None) -> None:
        """file_kernels: the GGUF's descriptors, their panels being filled (engine/load.py starts them
        while the modules are built); None: made here where the file describes its model.
        on_filled(bytes done, bytes to do): the progress of reading or packing the matrices."""
        library()  # fail here, with the reason, rather than inside a forward pass
        model_type = model.hf.config.model_type
        spec = arch_spec(model_type)
        offset = self.norm_offset = spec.norm_weight_offset
        self.layout = spec.kernels  # how the kernels read its layers (None: they are not checked for them)
        self.why_eager = None
        # a model run as stored (models/stored.py): its matrices come from the GGUF's rows
        self.stored = getattr(model, "stored", None)
        if self.layout is None:
            self.why_eager = f"the kernels are not checked for {model_type} layers"
        elif model.parts.rotary is None:
            self.why_eager = "the model has no rotary embedding module"
        self.weight_of: WeightOf = _dense_weight if self.stored is None else self._stored_weight
        # how the products over stored blocks compute (models/stored.py ARITHMETICS)
        self.arithmetic = (ABI.LP_ARITH_INT8 if self.stored is not None and self.stored.arithmetic == "fast"
                           else ABI.LP_ARITH_EXACT)
        # the KV cache's dtype (None: the activations'): llama.cpp's arithmetic keeps its keys and
        # values in f16, as llama.cpp does. A decode step reads every cached position of every
        # slot; at fp32, a long context or a batch of requests reads as much cache as weights
        self.kv_dtype = torch.float16 if self.arithmetic == ABI.LP_ARITH_INT8 else None
        # a GGUF's own matrices: its layers, final norm and LM head as the file describes them
        self.file = self._described_by_file(model, file_kernels, on_filled)
        # where the modules describe a GGUF's model: its packed matrices, as kept by an earlier load
        panels = (PanelCache.for_file(self.stored.path, kernels_key())
                  if self.file is None and self.stored is not None and self.stored.quantized is None else None)
        self.arena = WeightArena(panels, fillers=torch.get_num_threads())
        self.arena.on_filled = on_filled
        if self.why_eager:
            self.layers = tuple(None for _ in model.parts.layers)
        elif self.file is not None:
            self.layers = tuple(NativeLayer.described(attention, mlp, self.file)
                                for attention, mlp in zip(self.file.attention, self.file.mlp))
        else:
            self.layers = tuple(NativeLayer(layer, model.dtype, offset, self.arena, self.weight_of, self.layout,
                                            self.arithmetic)
                                for layer in model.parts.layers)
        self.arena.settle()
        if self.stored is not None:  # what the kernels do not run, its modules run: on dense weights
            for layer, kernels in zip(model.parts.layers, self.layers):
                for sub_layer in ("attention", "mlp"):
                    if kernels is None or getattr(kernels, sub_layer) is None:
                        self.stored.materialize(getattr(layer, sub_layer))
        self.model = model
        # stored matrices exist only in their blocks: every pass runs on the kernels, however long
        self.max_rows = _rows_limit(model.dtype) if self.stored is None else None
        # packed LM heads by id of their module (the module is held, so its id stays its own)
        self._heads: dict[int, tuple[nn.Module, PackedMatrix]] = {}
        # final norms as kernel descriptors (None: runs as the module), by id of their module
        self._norms: dict[int, tuple[nn.Module, _Norm | None]] = {}
        self._runs: BoundedCache = BoundedCache(RUNS_KEPT)  # (plan, first, end) -> its StepRun or None
        self._last_run: tuple | None = None  # (plan, first, end, its run): the last asked for
        # pass_ends by parts and whether the kernels take the pass (the parts are held: ids stay theirs)
        self._ends: dict[tuple[int, bool], tuple[object, PassEnds | None]] = {}
        if panels is not None:  # the LM head read or packed at load too, with the layers (and their progress)
            self._packed_head(model.parts.lm_head, model.dtype, 1)

    def _stored_weight(self, module: nn.Module):
        return self.stored.of(module) or module.weight

    def _described_by_file(self, model, started: FileKernels | None,
                           on_filled: Callable[[int, int], None] | None) -> FileKernels | None:
        """The GGUF's descriptors (engine/file_kernels.py), filled, where the file describes its
        model and its facts are the modules' (each layer's heads, widths, scaling, window and
        activation; the children the kernels read): the kernels then run what transformers'
        modules compute. None where the modules describe the model (a dense checkpoint, matrices
        quantized at load, an architecture or layout the file's descriptors do not cover)."""
        kernels = started
        if kernels is None:
            if self.why_eager or self.stored is None or self.stored.quantized is not None:
                return None
            index = index_folder(self.stored.path)
            if file_refusal(index) is not None:
                return None
            try:
                kernels = FileKernels(self.stored.path, index, self.arithmetic, torch.get_num_threads())
            except NotDescribed:
                return None
        kernels.finish(on_filled)  # (a started fill is waited for, used or not: its threads write its buffer)
        if self.why_eager or kernels.arithmetic != self.arithmetic:
            return None
        # (a model made from the file, engine/file_model.py, has no modules of its own to differ)
        return kernels if isinstance(model.hf, DeferredCausalLM) or self._agrees(model, kernels) else None

    def _agrees(self, model, kernels: FileKernels) -> bool:
        """Whether the file's facts are those of the model's modules, layer by layer."""
        c, layout = kernels.config, self.layout
        if len(model.parts.layers) != c.layers:
            return False
        for i, parts in enumerate(model.parts.layers):
            attention, mlp = parts.attention, parts.mlp
            try:
                _children(attention, layout.attention_children)
                _children(mlp, layout.mlp_children)
            except Unsupported:
                return False
            config = attention.config
            activation = ACTIVATIONS.get(type(getattr(mlp, layout.activation)).__name__)
            if (parts.parallel or getattr(attention, "sinks", None) is not None
                    or (config.num_attention_heads, config.num_key_value_heads, attention.head_dim)
                    != (c.heads, c.kv_heads, c.head_dim)
                    or float(attention.scaling) != c.scaling or (parts.sliding_window or 0) != c.windows[i]
                    or activation != CONFIG_ACTIVATIONS[activation_of(config.to_dict())]):
                return False
        return True

    def takes(self, rows: int) -> bool:
        return self.max_rows is None or rows <= self.max_rows

    def pass_ends(self, parts, rows: int) -> PassEnds | None:
        """The embedding, final norm and LM head for a pass of `rows` tokens in one native call
        (StepRun.logits), or None where one of them runs as its module: an embedding that is not a
        plain lookup (Gemma scales it), learned positions, a norm or head the kernels do not take."""
        key = (id(parts), self.takes(rows))
        if key not in self._ends:  # a step's Python runs cold: these checks cost it 0.1 ms each time
            self._ends[key] = (parts, self._find_pass_ends(parts, rows))
        return self._ends[key][1]

    def _find_pass_ends(self, parts, rows: int) -> PassEnds | None:
        embedding, dtype = parts.embed, self.model.dtype
        if isinstance(embedding, StoredEmbedding) and parts.position_embed is None:
            head = self._packed_head(parts.lm_head, dtype, rows)
            norm = self._final_norm(parts.final_norm, dtype) if head is not None else None
            if norm is None or head.k != embedding.table.columns:
                return None
            decode = row_decoder(embedding.table)
            lookup = embedding if decode is None else partial(embedding.lookup, decode=decode)
            return PassEnds(torch.empty(0, head.k, dtype=dtype), norm, head, lookup=lookup)
        weight = getattr(embedding, "weight", None)
        if (type(embedding) is not nn.Embedding or embedding.max_norm is not None or parts.position_embed is not None
                or weight.dtype != dtype or weight.device.type != "cpu" or not weight.is_contiguous()):
            return None
        head = self._packed_head(parts.lm_head, dtype, rows)
        norm = self._final_norm(parts.final_norm, dtype) if head is not None else None
        if norm is None or head.k != weight.shape[1]:
            return None
        return PassEnds(weight, norm, head)

    def head(self, final_norm: nn.Module, lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of hidden states before the final norm: norm and LM head in one kernel call where
        the kernels reproduce the norm and take the head, else the norm module, then the head (by
        the kernel for passes it takes)."""
        packed = self._packed_head(lm_head, hidden.dtype, hidden.numel() // hidden.shape[-1])
        norm = self._final_norm(final_norm, hidden.dtype) if packed is not None else None
        if norm is None:
            normed = final_norm(hidden)
            return packed(normed) if packed is not None and normed.dtype == hidden.dtype else lm_head(normed)
        x = hidden.contiguous()
        logits = torch.empty(*x.shape[:-1], packed.n, dtype=x.dtype)
        check(library().lp_norm_linear(ctypes.byref(norm), x.data_ptr(), ctypes.byref(packed.descriptor),
                                       logits.data_ptr(), x.numel() // x.shape[-1], _DTYPES[x.dtype],
                                       torch.get_num_threads()), "the native LM head")
        return logits

    def _packed_head(self, lm_head: nn.Module, dtype: torch.dtype, rows: int) -> PackedMatrix | None:
        weight = getattr(lm_head, "weight", None)
        stored = self.stored is not None and self.stored.of(lm_head) is not None
        if (type(lm_head) is not nn.Linear or weight.dtype not in _DTYPES or dtype != weight.dtype
                or (weight.device.type != "cpu" and not stored) or not self.takes(rows)):
            return None
        if id(lm_head) not in self._heads:
            self._heads[id(lm_head)] = (lm_head, self._file_head(lm_head) or PackedMatrix(
                [self.weight_of(lm_head)], [lm_head.bias], self.arena, self.arithmetic))
            self.arena.settle()
        return self._heads[id(lm_head)][1]

    def _file_head(self, lm_head: nn.Module) -> PackedMatrix | None:
        """The file's LM head, where `lm_head` is the module of that matrix (not a draft's head
        over part of the vocabulary, adopted after load)."""
        if self.file is None or lm_head.bias is not None:
            return None
        stored, own = self.stored.of(lm_head), self.file.head_weight()
        if stored is None or (stored.path, stored.offset, stored.rows) != (own.path, own.offset, own.rows):
            return None
        return PackedMatrix.described(self.file.head, self.file)

    def _final_norm(self, module: nn.Module, dtype: torch.dtype) -> _Norm | None:
        """The final norm as a kernel descriptor, or None where it runs as a module: a norm the
        kernels do not know, or a model type whose norms they are not checked for."""
        if self.why_eager is not None:
            return None
        if id(module) not in self._norms:
            try:
                descriptor = (_holding(self.file.final_norm, self.file)
                              if self.file is not None and module is self.model.parts.final_norm
                              else _norm(module, dtype, self.norm_offset, self.layout.norm))
            except Unsupported:
                descriptor = None
            self._norms[id(module)] = (module, descriptor)
        return self._norms[id(module)][1]

    def step_run(self, plan, first: int, end: int, rope_key) -> StepRun | None:
        """Steps [first, end) of the plan as one native call, or None when one of their switched-on
        sub-layers runs eagerly. rope_key(layer) names the layer's rotary table."""
        last = self._last_run  # the plan of every step of a generation: no hash of it (31 calls)
        if last is not None and last[0] is plan and last[1] == first and last[2] == end:
            return last[3]
        key = (plan, first, end)
        run = self._runs.get(key, _MISSING)
        if run is _MISSING:
            run = self._runs[key] = self._build_run(plan, first, end, rope_key)
        self._last_run = (plan, first, end, run)
        return run

    def _build_run(self, plan, first: int, end: int, rope_key) -> StepRun | None:
        steps, rope_of_step, rope_index, rope_layers = [], [], {}, []
        for index in range(first, end):
            step = plan.steps[index]
            if not step.attention and not step.mlp:
                continue
            layer = self.model.layers_of(step.model)[step.layer]
            fast = self.layer(step.model, step.layer)
            if (fast is None or (step.attention and fast.attention is None)
                    or (step.mlp and (fast.mlp is None or layer.parallel))):
                return None
            key = rope_key(layer)
            if step.attention and key not in rope_index:
                rope_index[key] = len(rope_layers)
                rope_layers.append(layer)
            steps.append((index, fast, step.attention, step.mlp, step.scale))
            rope_of_step.append(rope_index.get(key, 0))
        run = StepRun(plan, steps, rope_layers, int(self.model.dtype == torch.bfloat16), self.kv_dtype)
        for entry, rope in zip(run.table, rope_of_step):
            entry.rope = rope
        return run

    def layer(self, label: str, index: int) -> NativeLayer | None:
        if not label:
            return self.layers[index]
        other = self.model.others[label].native
        return other.layers[index] if other is not None else None

    def eager_sub_layers(self) -> dict[str, str]:
        """'layer N attention' -> why it runs eagerly (empty when every sub-layer is native)."""
        found = {}
        for i, layer in enumerate(self.layers):
            if layer is None:
                found[f"layer {i}"] = self.why_eager
                continue
            for part, why in layer.why.items():
                found[f"layer {i} {part}"] = why
        return found


def resolve_engine(engine: str, dtype: torch.dtype, device: torch.device | str) -> str:
    """'eager' or 'native' for a request of ENGINES; 'native' that cannot run here says why."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine '{engine}'; choose from {', '.join(ENGINES)}")
    if engine == "eager":
        return "eager"
    reason = None
    if torch.device(device).type != "cpu":
        reason = f"the native kernels run on the CPU, not {device}"
    elif dtype not in _DTYPES:
        reason = f"the native kernels take float32 or bfloat16, not {str(dtype).replace('torch.', '')}"
    else:
        reason = native_available()
    if reason is None:
        return "native"
    if engine == "native":
        raise NativeUnavailable(reason)
    return "eager"
