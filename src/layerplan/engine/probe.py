"""The hardware probe: what a k-token pass costs on this machine, per dtype and engine.

Speculative decoding pays only when verifying k tokens costs little more than one decoding step,
and whether it does depends on the CPU more than on anything else (a bf16 matrix product on 8 rows
costs one row's time with native bf16 instructions, eight rows' without). The probe times a pass
over k = 1..16 new tokens after a short cached context, per dtype and engine, and caches the
result per machine (CPU model and flags, torch version, threads) and model. bench, tune, serve and
generate take their default dtype from it, and the adaptive draft length starts from its costs.

Between its rounds the probe also measures what the machine allows at that moment: the rate of
the products' own kernels on weights already in cache (all threads, 8 rows, the row's dtype) and
the rate of reading memory. A pass's products need k times a step's arithmetic, and every pass
reads the step's weights, so the cost of a k-token pass cannot fall much below
max(weights ÷ read rate, k × arithmetic ÷ product rate) ÷ the same for k = 1: the table prints that
floor beside each row. (On a shared host both rates move with what the neighbours run: two threads
of bare FMAs on the AVX2 EPYC ran at 107-198 GFLOP/s within a minute.)
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from layerplan.engine.native import kernels_key, native_available, product_rate, read_rate
from layerplan.engine.runner import forward, new_cache
from layerplan.files import cache_dir, write_json_atomic
from layerplan.machine import cpu_info, read_cpuinfo

PASS_LENGTHS = tuple(range(1, 17))
CONTEXT = 100  # cached positions before the timed pass (a short chat turn)
READ_BYTES = 128 << 20  # at least this much, and 4x the last-level cache, read for the read rate


@dataclass
class ProbeRow:
    engine: str
    dtype: str
    step_ms: float  # one decoding step (k = 1), median
    relative: dict[int, float] = field(default_factory=dict)  # k -> cost of a k-token pass / a step
    # what the machine allowed while this row was timed (the best over its rounds; None: not measured)
    product_gflops: float | None = None  # 8-row products on weights in cache, all threads
    read_gbs: float | None = None  # reading memory on all threads
    weight_bytes: int | None = None  # the matrices a step reads (every layer's and the LM head)
    flops_per_token: float | None = None  # 2 x their elements

    def _least_seconds(self, k: int) -> float | None:
        """The least time of a k-token pass by the measured rates: its weights' reads or its
        products, whichever is longer (None when the rates were not measured)."""
        if not (self.product_gflops and self.read_gbs and self.weight_bytes and self.flops_per_token):
            return None
        return max(self.weight_bytes / (self.read_gbs * 1e9), k * self.flops_per_token / (self.product_gflops * 1e9))

    def floor(self, k: int) -> float | None:
        """The least cost of a k-token pass relative to a step that the measured rates allow (only
        the matrix products and the weights' reads counted), or None when they were not measured."""
        least = self._least_seconds(k)
        return None if least is None else least / self._least_seconds(1)

    def step_floor_ms(self) -> float | None:
        """The least ms of a step that the measured rates allow (reads and products only)."""
        least = self._least_seconds(1)
        return None if least is None else 1000 * least

    def cost(self, k: int) -> float:
        """Relative cost of a k-token pass (interpolated past the measured lengths)."""
        if k in self.relative:
            return self.relative[k]
        known = max(self.relative)
        return self.relative[known] * k / known if k > known else 1.0


@dataclass
class ProbeResult:
    machine: str  # the key: CPU model, flags, torch, threads
    cpu: str  # the CPU line, for people
    model: str
    rows: list[ProbeRow] = field(default_factory=list)

    def row(self, engine: str, dtype: str) -> ProbeRow | None:
        return next((r for r in self.rows if r.engine == engine and r.dtype == dtype), None)

    def fastest_dtype(self, engine: str) -> str | None:
        """The dtype with the cheapest step on this engine (None when none was measured)."""
        rows = [r for r in self.rows if r.engine == engine]
        return min(rows, key=lambda r: r.step_ms).dtype if rows else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ProbeResult:
        rows = [ProbeRow(r["engine"], r["dtype"], r["step_ms"], {int(k): v for k, v in r["relative"].items()},
                         r.get("product_gflops"), r.get("read_gbs"), r.get("weight_bytes"), r.get("flops_per_token"))
                for r in data["rows"]]
        return cls(data["machine"], data["cpu"], data["model"], rows)

    def table(self) -> str:
        ks = sorted({k for r in self.rows for k in r.relative})
        head = f"{'engine':<7} {'dtype':<9} {'ms/step':>7}  " + " ".join(f"{'k=' + str(k):>5}" for k in ks)
        lines = [head]
        notes = []
        for r in self.rows:
            lines.append(f"{r.engine:<7} {r.dtype:<9} {r.step_ms:>7.1f}  " + " ".join(f"{r.relative.get(k, float('nan')):>5.2f}" for k in ks))
            if r.floor(1) is not None:
                lines.append(f"{'':<7} {'floor':<9} {r.step_floor_ms():>7.1f}  " + " ".join(f"{r.floor(k):>5.2f}" for k in ks))
                notes.append(f"{r.engine} {r.dtype}: products {r.product_gflops:.0f} GFLOP/s, reads {r.read_gbs:.1f} GB/s")
                flops = r.flops_per_token
        if notes:
            lines.append("floor: what the best rates of products on weights in cache and of memory reads allow, "
                         "sampled between the rounds (not during the passes: where the host's speed drifts, a "
                         "pass can come out under it) ("
                         + "; ".join(notes) + f"; {flops / 1e9:.2f} GFLOP per token)")
        return "\n".join(lines)


def machine_key() -> str:
    """Changes when the CPU, its flags, torch, the thread count or the native kernels change: a
    stale probe is not reused."""
    model, flags = read_cpuinfo()
    info = cpu_info()
    text = "|".join([str(model), " ".join(sorted(flags or ())), info.torch, info.torch_capability, str(info.threads),
                     kernels_key()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def probe_path(folder: Path, model_name: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
    return folder / "probe" / f"{safe}-{machine_key()}.json"


def load_probe(folder: Path, model_name: str) -> ProbeResult | None:
    """The cached probe for this machine and model, or None (never measured, or measured on
    another machine, torch or thread count)."""
    path = probe_path(folder, model_name)
    try:
        result = ProbeResult.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return result if result.machine == machine_key() else None


def time_passes(model, lengths: Sequence[int] = PASS_LENGTHS, repeats: int = 5, context: int = CONTEXT,
                on_progress: Callable[[int, int], None] | None = None,
                between_rounds: Callable[[], None] | None = None) -> dict[int, float]:
    """Median seconds of a pass over k new tokens after `context` cached ones, per k; the
    lengths are interleaved so that drift in machine speed hits all alike. between_rounds runs
    after every timed round (the machine's rates are sampled there)."""
    plan = model.plan()
    generator = torch.Generator().manual_seed(0)
    vocab = model.hf.config.vocab_size
    ids = torch.randint(0, vocab, (1, context + max(lengths)), generator=generator, device=model.device)
    cache = new_cache(plan, capacity=context + max(lengths) + 1)
    forward(model, ids[:, :context], plan, cache, 0, last_only=True)
    samples: dict[int, list[float]] = {k: [] for k in lengths}
    total = (repeats + 1) * len(lengths)
    for rep in range(repeats + 1):  # the first round warms up
        for i, k in enumerate(lengths):
            cache.crop(context)
            start = time.perf_counter()
            forward(model, ids[:, context: context + k], plan, cache, context)
            if rep:
                samples[k].append(time.perf_counter() - start)
            if on_progress:
                on_progress(rep * len(lengths) + i + 1, total)
        if rep and between_rounds:
            between_rounds()
    return {k: statistics.median(v) for k, v in samples.items()}


def streamed_matrix_elements(model) -> int:
    """Elements of the matrices a decoding step reads whole: every 2-D weight but the input
    embedding, whose rows are only looked up (the LM head counts, also when it shares the
    embedding's tensor)."""
    embedding = model.hf.get_input_embeddings().weight
    head = model.hf.get_output_embeddings()
    head_ptr = head.weight.data_ptr() if head is not None else None
    seen, total = set(), 0
    for parameter in model.hf.parameters():
        ptr = parameter.data_ptr()
        if parameter.dim() != 2 or ptr in seen or (ptr == embedding.data_ptr() and ptr != head_ptr):
            continue
        seen.add(ptr)
        total += parameter.numel()
    return total


def _last_level_cache_bytes(path: str = "/sys/devices/system/cpu/cpu0/cache/index3/size") -> int:
    try:
        text = Path(path).read_text().strip().upper()
    except OSError:
        return 0
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text and text[-1] in units and text[:-1].isdigit() else 0


class RateSampler:
    """Samples the machine's product and read rates (native kernels; none where they cannot run)."""

    def __init__(self) -> None:
        self.dtype = torch.float32
        self.buffer = (torch.ones(max(READ_BYTES, 4 * _last_level_cache_bytes()), dtype=torch.uint8)
                       if native_available() is None else None)
        self.products: list[float] = []
        self.read: list[float] = []

    def __call__(self) -> None:
        if self.buffer is not None:
            self.products.append(product_rate(self.dtype))
            self.read.append(read_rate(self.buffer))

    def best(self) -> tuple[float | None, float | None]:
        """(GFLOP/s, GB/s): the best of the samples since the last call (a floor must not be
        raised by a moment the neighbours took the cores), then starts afresh."""
        products, read = self.products, self.read
        self.products, self.read = [], []
        return (max(products) if products else None, max(read) if read else None)


def probe(load: Callable[[str, str], object], model_name: str, dtypes: Sequence[str], engines: Sequence[str],
          lengths: Sequence[int] = PASS_LENGTHS, repeats: int = 5,
          on_progress: Callable[[str, int, int], None] | None = None) -> ProbeResult:
    """load(dtype, engine) -> LoadedModel; an engine that cannot run here is left out."""
    result = ProbeResult(machine_key(), cpu_info().line(), model_name)
    sampler = RateSampler()
    for dtype in dtypes:
        sampler.dtype = getattr(torch, dtype)
        for engine in engines:
            model = load(dtype, engine)
            if model is None:
                continue
            label = f"{engine} {dtype}"
            times = time_passes(model, lengths, repeats,
                                on_progress=(lambda d, t, label=label: on_progress(label, d, t)) if on_progress else None,
                                # the rates are the CPU's: a model on a GPU gets no floor from them
                                between_rounds=sampler if torch.device(model.device).type == "cpu" else None)
            step = times[min(times)]
            products, read = sampler.best()
            elements = streamed_matrix_elements(model)
            result.rows.append(ProbeRow(engine, dtype, step * 1000, {k: t / step for k, t in sorted(times.items())},
                                        products, read, elements * torch.finfo(getattr(torch, dtype)).bits // 8,
                                        2.0 * elements))
    return result


def save_probe(result: ProbeResult, folder: Path) -> Path:
    path = probe_path(folder, result.model)
    write_json_atomic(path, result.to_dict())
    return path


def default_dtype(folder: Path, model_name: str, engine: str, native_bf16: bool) -> str:
    """The dtype that decodes fastest here: the cached probe's answer for this machine, model and
    engine when there is one; otherwise bf16 where bf16 weights are read at full speed (the native
    kernels, or a CPU with native bf16 instructions), else float32."""
    cached = load_probe(folder, model_name)
    measured = cached.fastest_dtype(engine) if cached is not None else None
    if measured is not None:
        return measured
    return "bfloat16" if native_bf16 else "float32"


def pass_costs(folder: Path, model_name: str, engine: str, dtype: str) -> dict[int, float]:
    """k -> cost of a k-token pass relative to one step, from the cached probe (empty if none)."""
    cached = load_probe(folder, model_name)
    row = cached.row(engine, dtype) if cached is not None else None
    return dict(row.relative) if row is not None else {}


def model_pass_costs(model) -> dict[int, float]:
    """pass_costs for a loaded model as it runs now (its engine and dtype), from the default cache."""
    engine = "native" if model.native is not None else "eager"
    return pass_costs(cache_dir(), model.name, engine, str(model.dtype).replace("torch.", ""))
